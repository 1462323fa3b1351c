"""Tensor-parallel plans: ``{module-name pattern: style}``, and the function that applies them.

Patterns are ``fnmatch`` patterns matched against module names relative to the module the plan is
applied to (a leading ``*.`` also matches at the top level: ``"*.attn.q_proj"`` matches ``attn.q_proj``
and ``model.blocks.3.attn.q_proj``). Styles:

================== ==================================================================================
``colwise``        ``nn.Linear`` -> :class:`ColumnParallelLinear` (output stays sharded)
``colwise_gather`` ``nn.Linear`` -> :class:`ColumnParallelLinear` with the output all-gathered
``rowwise``        ``nn.Linear`` -> :class:`RowParallelLinear` (input is the column-parallel shard)
``vocab``          ``nn.Embedding`` -> :class:`VocabParallelEmbedding`
``region_input``   any module (the norm before a region) -> its output enters a tensor-parallel region:
                   ``copy_to`` (one gradient all-reduce for all the column-parallel layers that read it);
                   with SP the module runs on sequence shards and its output is all-gathered
``sequence_output`` any module (a final norm before a replicated head) -> runs on sequence shards, its
                   output all-gathered, the backward keeping this rank's slice (SP only: where SP ends)
``sequence_local``  any module (a norm on the residual stream between regions) -> runs on sequence
                   shards, its parameters' gradients summed over the group (SP only)
``scatter_sequence`` any module -> output split along the sequence (SP only: where SP starts)
``scatter_sequence_input`` any module -> its input split along the sequence (SP only: where SP starts,
                   for models that compute positions and masks from the embedding's output length)
================== ==================================================================================

Styles combine with ``+`` and apply left to right (``"vocab+scatter_sequence"``).

Shipped plans (``"gpt"`` for :class:`lightning_par.models.GPT`, ``"llama"`` for Llama-style decoders with
``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, ``embed_tokens``, ``lm_head``;
``"llama_attention"`` the same without the MLP, for mixture-of-experts decoders such as Mixtral and
Qwen-MoE, whose experts stay replicated, no sequence parallelism) keep the
model's outputs those of the unsharded model: full logits. With ``sequence_parallel=True`` their SP
entries are added. Weights are sliced from the existing modules, so a seeded or pretrained model keeps
its function; tied weights (embedding and head) stay tied when both sides shard the vocabulary alike.
Attention modules whose projections become column-parallel get their head-count attributes divided.
The Llama plan's SP starts at the first decoder layer's input, so it also fits Hugging Face's
``LlamaForCausalLM``. PEFT LoRA layers (``lora.Linear``: ``base_layer`` + ``lora_A``/``lora_B``) matched by
a linear style are sharded inside their wrapper (:mod:`lightning_par.tensor_parallel.lora`), and so are
PEFT's ``modules_to_save`` copies. A model without the shipped plan's LM head (a classification or
reward head, a bare ``LlamaModel``) keeps its head replicated (:func:`_fit_head`). Parameters keep their
``requires_grad``. A model is converted once (see :func:`apply_tensor_parallel`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Literal

import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from lightning_par.tensor_parallel.family import (
    check_forward,
    check_parent,
    fit_layout,
    head_local,
    scale_of,
    sum_head_local,
)
from lightning_par.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from lightning_par.tensor_parallel.lora import (
    PARALLEL_TYPES,
    check_lora,
    convert_lora_linear,
    is_lora_wrapper,
    saved_copies,
)
from lightning_par.tensor_parallel.regions import (
    make_region_input,
    make_scatter_sequence,
    make_sequence_local,
    make_sequence_output,
)

Style = Literal[
    "colwise",
    "colwise_gather",
    "rowwise",
    "vocab",
    "region_input",
    "sequence_output",
    "sequence_local",
    "scatter_sequence",
    "scatter_sequence_input",
]
STYLES: tuple[str, ...] = (
    "colwise",
    "colwise_gather",
    "rowwise",
    "vocab",
    "region_input",
    "sequence_output",
    "sequence_local",
    "scatter_sequence",
    "scatter_sequence_input",
)

GPT_PLAN: dict[str, Style] = {
    "*.embed.tok": "vocab",
    "*.ln_1": "region_input",
    "*.ln_2": "region_input",
    "*.head.norm": "region_input",
    "*.attn.q_proj": "colwise",
    "*.attn.k_proj": "colwise",
    "*.attn.v_proj": "colwise",
    "*.attn.out_proj": "rowwise",
    "*.mlp.fc_in": "colwise",
    "*.mlp.fc_out": "rowwise",
    "*.head.lm_head": "colwise_gather",
}
GPT_SP: dict[str, str] = {"*.embed": "scatter_sequence"}
LLAMA_PLAN: dict[str, Style] = {
    "*.embed_tokens": "vocab",
    "*.input_layernorm": "region_input",
    "*.post_attention_layernorm": "region_input",
    "*.norm": "region_input",
    "*.self_attn.q_proj": "colwise",
    "*.self_attn.k_proj": "colwise",
    "*.self_attn.v_proj": "colwise",
    "*.self_attn.o_proj": "rowwise",
    "*.mlp.gate_proj": "colwise",
    "*.mlp.up_proj": "colwise",
    "*.mlp.down_proj": "rowwise",
    "*.lm_head": "colwise_gather",
}
# SP starts at the first decoder layer's input, not at the embedding's output: Hugging Face's LlamaModel
# builds position ids, rotary tables and the causal mask from the embedding output's length, which must
# stay the full sequence (the attention sees the full sequence, gathered by input_layernorm)
LLAMA_SP: dict[str, str] = {"*.layers.0": "scatter_sequence_input"}
# attention and embedding sharded, the MLP replicated (a mixture of experts, whose experts no shipped plan
# shards): its input norm is no region input, since a replicated consumer's input gradient, equal on every
# rank, would be summed over the group (t times; measured on Mixtral: embedding gradients 0.02 apart)
LLAMA_ATTENTION_PLAN: dict[str, Style] = {
    k: v for k, v in LLAMA_PLAN.items() if ".mlp." not in k and k != "*.post_attention_layernorm"
}
PLANS: dict[str, tuple[dict[str, Style], dict[str, str]]] = {
    "gpt": (GPT_PLAN, GPT_SP),
    "llama": (LLAMA_PLAN, LLAMA_SP),
    "llama_attention": (LLAMA_ATTENTION_PLAN, {}),
}
# set on the root module by apply_tensor_parallel: {"plan", "resolved", "size", "sequence_parallel",
# "applied"}; a second application compares against it (the conversion is in place and not repeatable)
TP_STATE_ATTR = "_lp_tensor_parallel"
# set on every module a style was applied to (the root record does not see a sub-model converted alone)
_STYLE_ATTR = "_lp_tp_style"
_LINEAR_STYLES = ("colwise", "colwise_gather", "rowwise")
_HEAD_ATTRS = (
    "n_head",
    "n_heads",
    "num_heads",
    "num_attention_heads",
    "n_kv_heads",
    "num_key_value_heads",
    "num_kv_heads",
)


def resolve_plan(plan: str | Mapping[str, str], *, sequence_parallel: bool = False) -> dict[str, str]:
    """A plan name or dict -> a checked ``{pattern: style}`` dict (SP entries added for shipped plans)."""
    if isinstance(plan, str):
        if plan not in PLANS:
            raise ValueError(f"Unknown tp_plan {plan!r}; shipped plans are {sorted(PLANS)}, or pass a dict.")
        base, sp = PLANS[plan]
        if sequence_parallel and not sp:
            raise ValueError(
                f"tp_plan={plan!r} has no sequence-parallel form (its replicated MLP would need whole"
                " sequences); use sequence_parallel=False."
            )
        resolved: dict[str, str] = dict(base)
        if sequence_parallel:
            resolved.update(sp)
        return resolved
    for pattern, style in plan.items():
        for part in style.split("+"):
            if part not in STYLES:
                raise ValueError(
                    f"tp_plan[{pattern!r}] = {style!r}: {part!r} is not a style; use one of {STYLES}"
                    " (several joined by '+', e.g. 'vocab+scatter_sequence')."
                )
    return dict(plan)


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase("." + name, pattern)


# A shipped plan's (LM head, final norm) entries: the norm is a region input for the column-parallel head
_HEADS: dict[str, tuple[str, str]] = {
    "llama": ("*.lm_head", "*.norm"),
    "llama_attention": ("*.lm_head", "*.norm"),
}


def _fit_head(
    resolved: dict[str, str], plan: str | Mapping[str, str], names: list[str], sp: bool
) -> dict[str, str]:
    """A model without the shipped plan's LM head (a sequence-classification or reward head, a bare base
    model) keeps its head replicated, and its final norm is no region input: ``copy_to`` (or, with
    sequence parallelism, the gather's reduce-scatter) would sum the replicated head's equal input
    gradients over the group (``t`` times the gradient). Under SP the norm ends it: ``sequence_output``."""
    head = _HEADS.get(plan) if isinstance(plan, str) else None
    if head is None or any(_matches(n, head[0]) for n in names):
        return resolved
    fitted = {k: v for k, v in resolved.items() if k not in head}
    if sp:
        fitted[head[1]] = "sequence_output"
    return fitted


def _experts_hint(plan: str | Mapping[str, str], pattern: str, names: list[str]) -> str:
    """For a shipped plan's MLP entry on a mixture-of-experts model: the plan to pass instead."""
    experts = next((n for n in names if n.rsplit(".", 1)[-1] == "experts"), None)
    if plan != "llama" or ".mlp." not in pattern or experts is None:
        return ""
    return (
        f" The model's MLP is a mixture of experts ({experts!r}), which the 'llama' plan does not shard:"
        " tp_plan='llama_attention' shards attention and embedding and keeps the MLP replicated."
    )


def apply_tensor_parallel(
    module: nn.Module, *, group: ProcessGroup, plan: str | Mapping[str, str], sequence_parallel: bool = False
) -> dict[str, str]:
    """Replace the modules ``plan`` names by their tensor-parallel versions over ``group``, in place.

    Returns ``{module name: style}`` of what was applied (a module matched by several patterns gets their
    styles joined by ``+``, in plan order). PEFT-style LoRA layers keep their wrapper and are sharded as
    described in :mod:`lightning_par.tensor_parallel.lora`; every parameter keeps its ``requires_grad``.
    Raises a ``ValueError`` for a pattern that matches nothing, a style applied to the wrong kind of
    module, a LoRA layer that cannot be sharded exactly, or sizes not divisible by the group. The
    conversion is in place: applying the same plan, group size and ``sequence_parallel`` again is a no-op
    that returns the same dict; another layout is a ``ValueError`` (build a fresh model for it).
    """
    resolved = resolve_plan(plan, sequence_parallel=sequence_parallel)
    t = dist.get_world_size(group)
    done = getattr(module, TP_STATE_ATTR, None)
    if isinstance(done, dict):
        if (done["resolved"], done["size"], done["sequence_parallel"]) == (resolved, t, sequence_parallel):
            return dict(done["applied"])
        raise ValueError(
            f"The model is already tensor-parallel with tp_plan={done['plan']!r},"
            f" tensor_parallel_size={done['size']}, sequence_parallel={done['sequence_parallel']}; asked"
            f" for tp_plan={plan!r}, tensor_parallel_size={t}, sequence_parallel={sequence_parallel}. Its"
            " layers were sharded in place: build a fresh model for another layout."
        )
    # column-parallel layers read a region input (copy_to or SP gather already applied) when the plan
    # has such entries; otherwise each applies copy_to to its own input
    in_region = sequence_parallel or any("region_input" in s.split("+") for s in resolved.values())
    modules = dict(module.named_modules())
    tied: dict[int, list[tuple[str, str]]] = {}
    for name, m in modules.items():
        for pname, p in m.named_parameters(recurse=False):
            tied.setdefault(id(p), []).append((name, pname))
    hit_styles: dict[str, list[str]] = {}
    names = [n for n in modules if n]
    fitted = fit_layout(_fit_head(resolved, plan, names, sequence_parallel), plan, names, sequence_parallel)
    for pattern, style in fitted.items():
        hits = [n for n in modules if n and _matches(n, pattern)]
        if not hits:
            examples = [n for n in modules if n][:6]
            raise ValueError(
                f"tp_plan pattern {pattern!r} ({style}) matches no module; module names look like {examples}."
                + _experts_hint(plan, pattern, names)
            )
        for n in hits:
            hit_styles.setdefault(n, []).append(style)
    # deepest first: a module is converted after the modules inside it
    targets = sorted(
        ((n, "+".join(styles)) for n, styles in hit_styles.items()),
        key=lambda item: item[0].count("."),
        reverse=True,
    )
    # refusals before any change, so a refused model is left as it was
    for name, style in targets:
        _refuse_parallel(modules[name], name)
        check_parent(modules, name, style)
        if is_lora_wrapper(modules[name]):
            for part in style.split("+"):
                check_lora(modules[name], name=name, style=part)
        copies = saved_copies(modules[name])
        for path, layer in (copies or {}).items():
            for part in style.split("+"):
                _refuse_parallel(layer, f"{name}.{path}")
                _check_kind(layer, f"{name}.{path}", part)
        if copies is None and not is_lora_wrapper(modules[name]):
            for part in style.split("+"):
                _check_kind(modules[name], name, part)
    # attention modules split by heads: the parameters applied to this rank's heads (refused if not per head)
    head_local_params = [
        found
        for parent_name, children in _split_by_heads(targets, modules).items()
        for found in head_local(modules[parent_name], parent_name, styled=children)
    ]
    applied: dict[str, str] = {}
    for name, style in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        new = getattr(parent, attr)
        for part in style.split("+"):
            new = _convert(new, name, part, group, sequence_parallel, in_region)
            if part in ("colwise", "colwise_gather") and t > 1:
                # the parent of a projection (a LoRA wrapper included) is the attention module
                _divide_heads(parent, t, name)
        setattr(new, _STYLE_ATTR, style)
        setattr(parent, attr, new)
        applied[name] = style
    if t > 1:
        sum_head_local(head_local_params, group=group)
    _retie(module, tied)
    record = {
        "plan": plan if isinstance(plan, str) else dict(plan),
        "resolved": resolved,
        "size": t,
        "sequence_parallel": sequence_parallel,
        "applied": dict(applied),
    }
    setattr(module, TP_STATE_ATTR, record)
    return applied


def _refuse_parallel(old: nn.Module, name: str) -> None:
    style = getattr(old, _STYLE_ATTR, None)
    if style is not None or isinstance(old, PARALLEL_TYPES):
        what = f"style {style!r}" if style is not None else type(old).__name__
        raise ValueError(
            f"{name!r} is already tensor-parallel ({what}); a model is converted once: build a fresh"
            " model for another layout."
        )


def _convert(
    old: nn.Module, name: str, style: str, group: ProcessGroup, sp: bool, in_region: bool
) -> nn.Module:
    if style in _LINEAR_STYLES or style == "vocab":
        _refuse_parallel(old, name)
        if is_lora_wrapper(old):
            return convert_lora_linear(
                old, name=name, style=style, group=group, sequence_parallel=sp, in_region=in_region
            )
        copies = saved_copies(old)
        if copies is not None:  # PEFT's modules_to_save: the original and each trained copy alike
            for path, layer in copies.items():
                holder, _, attr = path.rpartition(".")
                owner = old.get_submodule(holder) if holder else old
                setattr(owner, attr, _convert(layer, f"{name}.{path}", style, group, sp, in_region))
            return old
        _check_kind(old, name, style)
    if style in _LINEAR_STYLES:
        assert isinstance(old, nn.Linear)  # _check_kind
        if style == "rowwise":
            return RowParallelLinear.from_linear(old, group=group, name=name, sequence_parallel=sp)
        return ColumnParallelLinear.from_linear(
            old, group=group, name=name, gather_output=style == "colwise_gather", copy_input=not in_region
        )
    if style == "vocab":
        assert isinstance(old, nn.Embedding)  # _check_kind
        return VocabParallelEmbedding.from_embedding(old, group=group, name=name, scale=scale_of(old))
    if style == "region_input":
        return make_region_input(old, group=group, sequence_parallel=sp)
    if not sp:
        raise ValueError(f"tp_plan style {style!r} on {name!r} needs sequence_parallel=True.")
    if style == "sequence_output":
        return make_sequence_output(old, group=group)
    if style == "sequence_local":
        return make_sequence_local(old, group=group)
    return make_scatter_sequence(old, group=group, at_input=style == "scatter_sequence_input")


def _check_kind(old: nn.Module, name: str, style: str) -> None:
    if style in _LINEAR_STYLES and not isinstance(old, nn.Linear):
        raise ValueError(f"tp_plan style {style!r} needs an nn.Linear, but {name!r} is {type(old).__name__}.")
    if style == "vocab" and not isinstance(old, nn.Embedding):
        raise ValueError(
            f"tp_plan style 'vocab' needs an nn.Embedding, but {name!r} is {type(old).__name__}."
        )
    if style in _LINEAR_STYLES or style == "vocab":
        check_forward(old, name, style)


def _split_by_heads(targets: list[tuple[str, str]], modules: dict[str, nn.Module]) -> dict[str, set[str]]:
    """The attention modules whose projections become column-parallel (parents that count heads or name
    a ``head_dim``), each with the names of its children the plan converts."""
    children: dict[str, set[str]] = {}
    sliced: set[str] = set()  # parents of a column-parallel layer whose output stays sharded
    for name, style in targets:
        parent, _, attr = name.rpartition(".")
        children.setdefault(parent, set()).add(attr)
        if style.split("+")[0] == "colwise":
            sliced.add(parent)
    return {
        parent: children[parent]
        for parent in sliced
        if any(isinstance(getattr(modules[parent], a, None), int) for a in (*_HEAD_ATTRS, "head_dim"))
    }


def _divide_heads(attention: nn.Module, t: int, name: str) -> None:
    """The projections of ``attention`` now produce 1/t of the heads: say so where it counts them."""
    if getattr(attention, "_lp_heads_divided", False):
        return
    for attr in _HEAD_ATTRS:
        value = getattr(attention, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            if value % t != 0:
                raise ValueError(
                    f"{name}: the attention has {attr}={value}, not divisible by tensor_parallel_size={t};"
                    f" choose a head count divisible by {t}."
                )
            setattr(attention, attr, value // t)
    attention._lp_heads_divided = True  # type: ignore[assignment]


def _retie(module: nn.Module, tied: dict[int, list[tuple[str, str]]]) -> None:
    """Parameters registered under several names before the conversion are one Parameter again."""
    for places in tied.values():
        if len(places) < 2:
            continue
        found = []
        for mod_name, pname in places:
            owner = module.get_submodule(mod_name) if mod_name else module
            found.append((owner, pname, getattr(owner, pname)))
        if len({id(p) for _, _, p in found}) <= 1:
            continue
        first = found[0][2]
        for owner, pname, p in found[1:]:
            if p.shape != first.shape:
                raise ValueError(
                    f"Tied parameter {places} is sharded differently by the tp_plan ({tuple(first.shape)} vs"
                    f" {tuple(p.shape)}); shard both sides alike (e.g. 'vocab' and 'colwise_gather')."
                )
            setattr(owner, pname, first)
