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
``scatter_sequence`` any module -> output split along the sequence (SP only: where SP starts)
================== ==================================================================================

Styles combine with ``+`` and apply left to right (``"vocab+scatter_sequence"``).

Shipped plans (``"gpt"`` for :class:`lightning_par.models.GPT`, ``"llama"`` for Llama-style decoders with
``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, ``embed_tokens``, ``lm_head``) keep the
model's outputs those of the unsharded model: full logits. With ``sequence_parallel=True`` their SP
entries are added. Weights are sliced from the existing modules, so a seeded or pretrained model keeps
its function; tied weights (embedding and head) stay tied when both sides shard the vocabulary alike.
Attention modules whose projections become column-parallel get their head-count attributes divided.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Literal

import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from lightning_par.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    make_region_input,
    make_scatter_sequence,
)

Style = Literal["colwise", "colwise_gather", "rowwise", "vocab", "region_input", "scatter_sequence"]
STYLES: tuple[str, ...] = (
    "colwise",
    "colwise_gather",
    "rowwise",
    "vocab",
    "region_input",
    "scatter_sequence",
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
LLAMA_SP: dict[str, str] = {"*.embed_tokens": "vocab+scatter_sequence"}
PLANS: dict[str, tuple[dict[str, Style], dict[str, str]]] = {
    "gpt": (GPT_PLAN, GPT_SP),
    "llama": (LLAMA_PLAN, LLAMA_SP),
}
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


def apply_tensor_parallel(
    module: nn.Module, *, group: ProcessGroup, plan: str | Mapping[str, str], sequence_parallel: bool = False
) -> dict[str, str]:
    """Replace the modules ``plan`` names by their tensor-parallel versions over ``group``, in place.

    Returns ``{module name: style}`` of what was applied. Raises a ``ValueError`` for a pattern that
    matches nothing, a style applied to the wrong kind of module, or sizes not divisible by the group.
    """
    resolved = resolve_plan(plan, sequence_parallel=sequence_parallel)
    t = dist.get_world_size(group)
    # column-parallel layers read a region input (copy_to or SP gather already applied) when the plan
    # has such entries; otherwise each applies copy_to to its own input
    in_region = sequence_parallel or any("region_input" in s.split("+") for s in resolved.values())
    modules = dict(module.named_modules())
    tied: dict[int, list[tuple[str, str]]] = {}
    for name, m in modules.items():
        for pname, p in m.named_parameters(recurse=False):
            tied.setdefault(id(p), []).append((name, pname))
    applied: dict[str, str] = {}
    # deepest first: a module is converted after the modules inside it
    targets: list[tuple[str, str]] = []
    for pattern, style in resolved.items():
        hits = [n for n in modules if n and _matches(n, pattern)]
        if not hits:
            examples = [n for n in modules if n][:6]
            raise ValueError(
                f"tp_plan pattern {pattern!r} ({style}) matches no module; module names look like {examples}."
            )
        targets.extend((n, style) for n in hits)
    targets.sort(key=lambda item: item[0].count("."), reverse=True)
    for name, style in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        new = getattr(parent, attr)
        for part in style.split("+"):
            new = _convert(new, name, part, group, sequence_parallel, in_region)
            if part in ("colwise", "colwise_gather") and t > 1:
                _divide_heads(parent, t, name)
        setattr(parent, attr, new)
        applied[name] = style
    _retie(module, tied)
    return applied


def _convert(
    old: nn.Module, name: str, style: str, group: ProcessGroup, sp: bool, in_region: bool
) -> nn.Module:
    if style in ("colwise", "colwise_gather", "rowwise"):
        if not isinstance(old, nn.Linear):
            raise ValueError(
                f"tp_plan style {style!r} needs an nn.Linear, but {name!r} is {type(old).__name__}."
            )
        if style == "rowwise":
            return RowParallelLinear.from_linear(old, group=group, name=name, sequence_parallel=sp)
        return ColumnParallelLinear.from_linear(
            old, group=group, name=name, gather_output=style == "colwise_gather", copy_input=not in_region
        )
    if style == "vocab":
        if not isinstance(old, nn.Embedding):
            raise ValueError(
                f"tp_plan style 'vocab' needs an nn.Embedding, but {name!r} is {type(old).__name__}."
            )
        return VocabParallelEmbedding.from_embedding(old, group=group, name=name)
    if style == "region_input":
        return make_region_input(old, group=group, sequence_parallel=sp)
    if not sp:
        raise ValueError(f"tp_plan style {style!r} on {name!r} needs sequence_parallel=True.")
    return make_scatter_sequence(old, group=group)


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
