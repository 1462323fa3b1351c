"""What a plan must know of a model family beyond module names, checked or fitted when it is applied.

A plan swaps modules by name; four things about the model around them decide whether the swap still
computes the unsharded function. Each was silently wrong before on Hugging Face families the ``"llama"``
plan's names fit (tp2, one or two decoder layers, against the unsharded model):

* **Layers with their own forward.** Gemma 1/2/3 embed through ``GemmaTextScaledWordEmbedding``, an
  ``nn.Embedding`` whose forward multiplies the lookup by ``sqrt(hidden_size)``; the vocab-parallel
  embedding ran a plain lookup, so the embedding output was off by up to 0.30 and the logits by 0.15.
  :func:`check_forward` keeps such a scale (an ``embed_scale`` buffer, as those classes hold) and refuses
  any other subclass of ``nn.Linear`` / ``nn.Embedding`` that overrides ``forward``: the sharded layer
  would not run it. :func:`check_parent` refuses the other side of that: a layer whose parent applies
  its weight without calling it (torch's ``nn.TransformerEncoderLayer`` in its fused inference path,
  ``nn.MultiheadAttention``'s ``out_proj``): each tp rank validated torch's encoder with its half of the
  feed-forward, silently (val loss 1.17 and 1.16 on the two ranks, 1.157 unsharded).
* **Parameters inside the sliced heads.** Qwen 3 and Gemma 3 normalise each head's queries and keys
  (``q_norm`` / ``k_norm``, a weight of ``head_dim``) inside the attention, where each rank holds only
  its heads: the weight is replicated but each rank's gradient covers its heads only (Qwen 3's weights
  were 3e-4 apart from the unsharded model's after 3 SGD steps at lr 0.05, and apart on the two ranks).
  :func:`head_local` finds such weights (and refuses a parameter of another size there: a norm over all
  heads at once, as OLMo 2's, would see a slice); :func:`sum_head_local` all-reduces their gradients.
  A table with one column per head (T5's ``relative_attention_bias``) is cut by heads instead
  (:func:`head_tables`, :func:`cut_head_table`): before, refused, there being no per-head weight.
* **Where a region starts.** The plan makes ``post_attention_layernorm`` the MLP's region input. Gemma 2
  and 3 apply that norm to the attention output before the residual sum and feed the MLP through
  ``pre_feedforward_layernorm``: the residual stream's gradient was summed over the ranks and the MLP
  input's was not (losses 0.04 off after 3 steps). :func:`fit_layout` moves the region input to the
  pre-feed-forward norm for such models; under sequence parallelism the post-norms run on sequence
  shards (``sequence_local``: their gradients summed over the group).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed import ProcessGroup

from lightning_par.tensor_parallel.layers import TP_DIM_ATTR
from lightning_par.tensor_parallel.regions import sum_grad_over_group

__all__ = [
    "HEAD_TABLE_ATTR",
    "QUERY_HEADS",
    "check_alibi",
    "check_forward",
    "check_parent",
    "cut_head_table",
    "fit_layout",
    "head_local",
    "head_tables",
    "scale_of",
    "sum_head_local",
]

_PRE_FEEDFORWARD = "pre_feedforward_layernorm"
HEAD_TABLE_ATTR = "_lp_head_table"  # set on a table cut by heads (cut_head_table)
QUERY_HEADS = ("n_head", "n_heads", "num_heads", "num_attention_heads")  # an attention's head count


def scale_of(embedding: nn.Module) -> torch.Tensor | None:
    """The ``embed_scale`` buffer of a scaled word embedding (its forward: lookup times the scale), or
    None for a plain ``nn.Embedding``."""
    scale = getattr(embedding, "embed_scale", None)
    if type(embedding).forward is not nn.Embedding.forward and isinstance(scale, torch.Tensor):
        return scale
    return None


def check_forward(old: nn.Module, name: str, style: str) -> None:
    """Refuse a subclass of ``nn.Linear`` / ``nn.Embedding`` with its own forward (a scaled embedding
    excepted): its sharded replacement would not run that forward."""
    base = nn.Embedding if style == "vocab" else nn.Linear
    if type(old).forward is base.forward or (style == "vocab" and scale_of(old) is not None):
        return
    raise ValueError(
        f"tp_plan style {style!r} on {name!r}: {type(old).__name__} subclasses nn.{base.__name__} with a"
        f" forward of its own, which the sharded {base.__name__} would not run (the result would differ from"
        " the unsharded model). Leave it out of the plan (it then stays replicated)."
    )


# parents whose forward applies a child's weight itself instead of calling the child, so a sharded child's
# communication would never run: torch's encoder layer in its fused inference path (linear1, linear2) and
# multi-head attention (out_proj, always; its input projection is a bare parameter)
_BYPASSED = {
    nn.TransformerEncoderLayer: ("linear1", "linear2"),
    nn.MultiheadAttention: ("out_proj",),
}


def check_parent(modules: Mapping[str, nn.Module], name: str, style: str) -> None:
    """Refuse a plan entry on a layer whose parent applies its weight without calling it (``_BYPASSED``):
    the sharded layer's forward, and with it the gather or all-reduce, would not run there."""
    parent_name, _, child = name.rpartition(".")
    parent = modules.get(parent_name)
    for kind, children in _BYPASSED.items():
        if isinstance(parent, kind) and child in children:
            raise ValueError(
                f"tp_plan style {style!r} on {name!r}: its parent {type(parent).__name__} applies"
                f" {child}.weight itself (torch's fused path: the encoder layer's in evaluation,"
                " multi-head attention's always), without calling the layer, so the sharded layer's"
                " communication would not run and each rank would compute with its slice alone. Leave it"
                " out of the plan (it then stays replicated), or write the block with its own calls of"
                " nn.Linear layers."
            )


# Phi-3's fused projections, for the "llama" plan's separate ones (lightning_par.tensor_parallel.fused)
_FUSED = {
    "self_attn.qkv_proj": ("*.self_attn.q_proj", "*.self_attn.k_proj", "*.self_attn.v_proj"),
    "mlp.gate_up_proj": ("*.mlp.gate_proj", "*.mlp.up_proj"),
}


def fit_layout(
    resolved: dict[str, str], plan: str | Mapping[str, str], names: list[str], sp: bool
) -> dict[str, str]:
    """For the ``"llama"`` plans on a model with fused projections (Phi-3's ``qkv_proj`` and
    ``gate_up_proj``): those, column-parallel by segment, instead of the separate ones. For the ``"llama"``
    plan on a model with ``pre_feedforward_layernorm`` (Gemma 2 / 3): that norm is the MLP's region input,
    not ``post_attention_layernorm`` (see the module docstring)."""
    if plan not in ("llama", "llama_attention"):
        return resolved
    fitted = dict(resolved)
    for fused, separate in _FUSED.items():
        if separate[0] in fitted and any(n.endswith("." + fused) for n in names):
            fitted = {k: v for k, v in fitted.items() if k not in separate}
            fitted[f"*.{fused}"] = "colwise"
    if plan != "llama" or not any(n.rsplit(".", 1)[-1] == _PRE_FEEDFORWARD for n in names):
        return fitted
    fitted = {k: v for k, v in fitted.items() if k != "*.post_attention_layernorm"}
    fitted[f"*.{_PRE_FEEDFORWARD}"] = "region_input"
    if sp:  # the post-norms run on the row-parallel layers' sequence shards, before the residual sum
        fitted["*.post_attention_layernorm"] = "sequence_local"
        fitted["*.post_feedforward_layernorm"] = "sequence_local"
    return fitted


def head_tables(attention: nn.Module, *, styled: set[str]) -> list[nn.Embedding]:
    """The embeddings inside ``attention`` (none of ``styled``, its children the plan converts) with one
    column per head: T5's ``relative_attention_bias`` (buckets x heads), whose lookup is added to each
    head's scores and handed on to the later blocks. Split by heads, :func:`cut_head_table` keeps this
    rank's heads' columns, so every block's bias matches its heads."""
    counts = [getattr(attention, a, None) for a in QUERY_HEADS]
    heads = next((v for v in counts if type(v) is int), None)  # a bool is not a count
    return [
        sub
        for sub_name, sub in attention.named_modules()
        if sub_name
        and sub_name.split(".", 1)[0] not in styled
        and type(sub) is nn.Embedding
        and heads is not None
        and sub.embedding_dim == heads
    ]


def cut_head_table(table: nn.Embedding, *, rank: int, size: int) -> None:
    """Keep block ``rank`` of ``size`` of the columns (heads) of ``table`` (:func:`head_tables`), a
    tensor-parallel slice along dimension 1: checkpoints and ``consolidated_state_dict()`` join the
    blocks; its gradient is this rank's heads' alone, so it is not summed."""
    weight = table.weight
    local = weight.shape[1] // size
    piece = weight.detach()[:, rank * local : (rank + 1) * local].clone()
    cut = nn.Parameter(piece, requires_grad=weight.requires_grad)
    setattr(cut, TP_DIM_ATTR, 1)
    setattr(cut, HEAD_TABLE_ATTR, True)  # no full-size table is kept: ZeRO-3's meta init names this
    table.weight = cut
    table.embedding_dim = local


def head_local(attention: nn.Module, name: str, *, styled: set[str]) -> list[tuple[nn.Module, str]]:
    """The parameters inside ``attention`` (an attention module whose projections the plan splits by
    heads; ``styled``: the names of its children the plan converts) that act on this rank's heads only:
    ``(owner, parameter name)`` of each per-head weight (``head_dim`` elements), whose gradient must be
    summed over the group. The per-head tables of :func:`head_tables` are cut instead; any other
    parameter there is refused (module docstring); nothing is changed."""
    head_dim = getattr(attention, "head_dim", None)
    tables = {id(t) for t in head_tables(attention, styled=styled)}
    found: list[tuple[nn.Module, str]] = []
    for sub_name, sub in attention.named_modules():
        if sub_name.split(".", 1)[0] in styled or id(sub) in tables:
            continue
        for pname, p in sub.named_parameters(recurse=False):
            if not (isinstance(head_dim, int) and sub_name and p.dim() == 1 and p.numel() == head_dim):
                full = ".".join(part for part in (name, sub_name, pname) if part)
                size = f"head_dim ({head_dim})" if isinstance(head_dim, int) else "head_dim (it has none)"
                raise ValueError(
                    f"Tensor parallelism splits {name!r} by heads, but {full!r} (shape {tuple(p.shape)}) is"
                    f" applied inside it and is not a per-head weight of {size} elements: it"
                    " would see only this rank's heads. Leave this attention's projections out of the plan"
                    f" (every attention of {type(attention).__name__}'s kind, so the layers agree on the"
                    " heads): pass tp_plan as a dict without their entries (for a shipped plan from"
                    " lightning_par.tensor_parallel.plans.PLANS, its '*.self_attn.*' ones), or train with"
                    " tensor_parallel_size=1."
                )
            found.append((sub, pname))
    return found


def sum_head_local(found: list[tuple[nn.Module, str]], *, group: ProcessGroup) -> None:
    """Sum the gradients of :func:`head_local`'s parameters over ``group`` as they are computed."""
    for owner, pname in found:
        sum_grad_over_group(owner, pname, group=group)


def check_alibi(root: nn.Module, split: Mapping[str, object]) -> None:
    """Refuse splitting attention heads (``split``: the attention modules whose projections a plan makes
    column-parallel) of an ALiBi model: BLOOM, Falcon with ``alibi=True`` and MPT build the position bias
    for every head in the model's forward, outside the attention, so each rank's half of the heads met a
    bias for all of them (before: torch's "The expanded size of the tensor (4) must match the existing
    size (8)" in the first forward, after training had started)."""
    if not split:
        return
    for module in root.modules():
        config = getattr(module, "config", None)
        attn = getattr(config, "attn_config", None)
        alibi = getattr(config, "model_type", None) == "bloom" or getattr(config, "alibi", False) is True
        if alibi or getattr(attn, "alibi", False) is True:
            raise ValueError(
                f"tp_plan splits the attention heads of {sorted(split)[0]!r} (and others), but the model"
                f" ({type(module).__name__}) uses ALiBi, whose position bias its forward builds for all the"
                " heads outside the attention modules. Leave the attention projections out of the plan (the"
                " MLP can still be split) or use tensor_parallel_size=1 (ZeRO shards such a model)."
            )
