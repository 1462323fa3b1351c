"""The ``"litgpt"`` tensor-parallel plan: what litgpt's ``GPT`` needs beyond module names.

litgpt's attention needs two things a name-by-name plan cannot express (both done in
:mod:`~lightning_par.tensor_parallel.fused`, as for Phi-3's fused projections):

* **One fused projection.** ``attn.qkv`` produces the rows of all ``n_head`` query heads, then the
  ``n_query_groups`` key groups, then the value groups; the forward splits its output by those sizes. A
  column-parallel cut into ``t`` equal blocks would hand rank 0 the queries and rank 1 the keys and
  values. The plan cuts each of the three segments (:mod:`lightning_par.tensor_parallel.slices`), so
  rank ``r`` holds heads ``[r n_head/t, (r+1) n_head/t)`` and the key/value groups those heads use
  (head ``i`` reads group ``i // (n_head / n_query_groups)``), in the fused layout the forward expects.
* **Head counts in a shared config.** The forward reads ``self.config.n_head`` and
  ``self.config.n_query_groups``, one ``Config`` object that the model and every block share. Each
  converted attention gets its own shallow copy with both counts divided by ``t``; the model's and the
  blocks' config (which size the rotary tables and the residual stream) keep the full values.

Refused at apply, before anything changes: ``n_head`` or ``n_query_groups`` not divisible by ``t``
(multi-query attention with one key/value group would need the group replicated), ``norm_qk_type``
``"olmo2"`` (a norm over all heads at once, which a rank's slice of heads cannot compute), and a
mixture-of-experts MLP (``LLaMAMoE``), whose experts no plan shards. The default ``norm_qk`` (Qwen 3,
Gemma 3: one norm of ``head_size`` applied to every head) is kept, its gradients summed over the group
(:func:`head_shared`).

The MLP entries cover litgpt's three MLP classes (``GptNeoxMLP``: ``fc``, ``proj``; ``LLaMAMLP`` and
``GemmaMLP``: ``fc_1``, ``fc_2``, ``proj``); entries a model lacks are dropped, as is ``norm_2`` where the
block shares ``norm_1``'s output (``shared_attention_norm``). Parallel-residual blocks (GPT-NeoX, Pythia)
need nothing else: both branches read region inputs. Under sequence parallelism the blocks' extra
``post_attention_norm`` / ``post_mlp_norm`` (Gemma 2 / 3), when they are norms, run on the row-parallel
layers' sequence shards (``sequence_local``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = [
    "LITGPT_PLAN",
    "LITGPT_SP",
    "check_attention",
    "fit_litgpt",
    "head_shared",
    "is_litgpt_attention",
]

LITGPT_PLAN: dict[str, str] = {
    "*.transformer.wte": "vocab",
    "*.norm_1": "region_input",
    "*.norm_2": "region_input",
    "*.transformer.ln_f": "region_input",
    "*.attn.qkv": "colwise",
    "*.attn.proj": "rowwise",
    "*.mlp.fc": "colwise",
    "*.mlp.fc_1": "colwise",
    "*.mlp.fc_2": "colwise",
    "*.mlp.proj": "rowwise",
    "*.lm_head": "colwise_gather",
}
# SP from the first block's input: GPT.forward builds the rotary tables and mask from the embedding's
# output length, which stays the full sequence
LITGPT_SP: dict[str, str] = {"*.transformer.h.0": "scatter_sequence_input"}
# entries only some litgpt configurations have modules for
_OPTIONAL = ("*.mlp.fc", "*.mlp.fc_1", "*.mlp.fc_2", "*.norm_2")
_POST_NORMS = ("post_attention_norm", "post_mlp_norm")
_HEAD_COUNTS = ("n_head", "n_query_groups")


def _hits(modules: Mapping[str, nn.Module], pattern: str) -> list[str]:
    return [
        n for n in modules if n and (fnmatch.fnmatchcase(n, pattern) or fnmatch.fnmatchcase("." + n, pattern))
    ]


def fit_litgpt(resolved: dict[str, str], modules: Mapping[str, nn.Module], sp: bool) -> dict[str, str]:
    """The plan's entries this litgpt model has modules for (module docstring); a mixture-of-experts MLP
    is refused."""
    experts = next((n for n in modules if n.endswith(".mlp.experts")), None)
    if experts is not None:
        raise ValueError(
            f"tp_plan='litgpt' does not shard a mixture-of-experts MLP ({experts!r}, litgpt's LLaMAMoE):"
            " its experts would stay whole on every rank while their inputs are sliced. Use"
            " tensor_parallel_size=1 (ZeRO shards such a model over the data-parallel ranks)."
        )
    fitted = {k: v for k, v in resolved.items() if k not in _OPTIONAL or _hits(modules, k)}
    if sp:
        for post in _POST_NORMS:
            pattern = f"*.{post}"
            if any(not isinstance(modules[n], nn.Identity) for n in _hits(modules, pattern)):
                fitted[pattern] = "sequence_local"
    return fitted


def is_litgpt_attention(module: nn.Module) -> bool:
    """litgpt's ``CausalSelfAttention``: a fused ``qkv`` layer (any module: a LoRA wrapper is one too) and
    its head counts in ``config``."""
    config = getattr(module, "config", None)
    return isinstance(getattr(module, "qkv", None), nn.Module) and all(
        isinstance(getattr(config, a, None), int) for a in (*_HEAD_COUNTS, "head_size")
    )


def check_attention(attention: nn.Module, name: str) -> None:
    """Refuse a query/key norm the sliced attention could not compute (module docstring; the head counts
    are checked with every fused attention's, :func:`~lightning_par.tensor_parallel.fused.check_heads`);
    nothing is changed."""
    config: Any = attention.config
    if getattr(config, "norm_qk", False) and getattr(config, "norm_qk_type", "default") != "default":
        raise ValueError(
            f"{name}: litgpt's norm_qk_type={config.norm_qk_type!r} normalises the queries and keys over"
            " all heads at once, which a rank holding a slice of the heads cannot compute alone;"
            " tp_plan='litgpt' does not shard such a model (OLMo 2). Use tensor_parallel_size=1."
        )


def head_shared(attention: nn.Module) -> list[tuple[nn.Module, str]]:
    """``(module, parameter name)`` of the weights a litgpt attention applies to every head alike (the
    default ``norm_qk``: one norm of ``head_size`` over each query and key head): each rank's gradient
    covers its heads only, so they are summed over the tensor-parallel group, as for Hugging Face's
    per-head ``q_norm`` / ``k_norm``."""
    config: Any = getattr(attention, "config", None)
    if not is_litgpt_attention(attention) or not getattr(config, "norm_qk", False):
        return []
    return [
        (norm, pname)
        for norm in (attention.norm_q, attention.norm_k)
        if isinstance(norm, nn.Module)
        for pname, _ in norm.named_parameters(recurse=False)
    ]
