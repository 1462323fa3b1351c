"""Apply a tensor-parallel plan (:mod:`~lightning_par.tensor_parallel.plans`: the styles and the shipped
plans) to a model: each matched module is replaced by its sharded version, in place, after every check
that could refuse it has passed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from lightning_par.peft_checks import refuse_prefix_tuning
from lightning_par.tensor_parallel.family import (
    QUERY_HEADS,
    check_alibi,
    check_forward,
    check_parent,
    cut_head_table,
    fit_layout,
    head_local,
    head_tables,
    scale_of,
    sum_head_local,
)
from lightning_par.tensor_parallel.fused import check_heads, divide_config_heads, fused_segments
from lightning_par.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from lightning_par.tensor_parallel.litgpt_family import fit_litgpt, head_shared
from lightning_par.tensor_parallel.lora import (
    PARALLEL_TYPES,
    check_lora,
    convert_lora_linear,
    is_lora_wrapper,
    saved_copies,
)
from lightning_par.tensor_parallel.plans import experts_hint, fit_head, matches, resolve_plan, whole_blocks
from lightning_par.tensor_parallel.region_check import check_regions
from lightning_par.tensor_parallel.regions import (
    make_region_input,
    make_scatter_sequence,
    make_sequence_local,
    make_sequence_output,
)

_log = logging.getLogger(__name__)

# set on the root module by apply_tensor_parallel: {"plan", "resolved", "size", "sequence_parallel",
# "applied"}; a second application compares against it (the conversion is in place and not repeatable)
TP_STATE_ATTR = "_lp_tensor_parallel"
# set on every module a style was applied to (the root record does not see a sub-model converted alone)
_STYLE_ATTR = "_lp_tp_style"
_LINEAR_STYLES = ("colwise", "colwise_gather", "rowwise")
_HEAD_ATTRS = (*QUERY_HEADS, "n_kv_heads", "num_key_value_heads", "num_kv_heads")


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
    refuse_prefix_tuning(module, tp_size=t)
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
    fitted = fit_layout(fit_head(resolved, plan, names, sequence_parallel), plan, names, sequence_parallel)
    if plan == "litgpt":
        fitted = fit_litgpt(fitted, modules, sequence_parallel)
    for pattern, style in fitted.items():
        hits = [n for n in modules if n and matches(n, pattern)]
        if not hits:
            examples = [n for n in modules if n][:6]
            raise ValueError(
                f"tp_plan pattern {pattern!r} ({style}) matches no module; module names look like {examples}."
                + experts_hint(plan, pattern, names)
            )
        for n in hits:
            hit_styles.setdefault(n, []).append(style)
    hit_styles, partial = whole_blocks(hit_styles, plan)
    if partial and dist.get_rank(group) == 0:
        _log.info(
            "tp_plan=%r: %d blocks of another family (matched only in part, or beside no norm the plan makes"
            " a region input) stay replicated (first: %s)",
            plan,
            len(partial),
            partial[0],
        )
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
        _check_fused(modules, name, style, t)
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
    split = _split_by_heads(targets, modules)
    check_alibi(module, split)
    head_local_params = [
        found
        for parent_name, children in split.items()
        for found in head_local(modules[parent_name], parent_name, styled=children)
    ]
    tables = [t for parent, children in split.items() for t in head_tables(modules[parent], styled=children)]
    applied: dict[str, str] = {}
    for name, style in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        new = getattr(parent, attr)
        segments = fused_segments(parent, attr) if t > 1 else None
        for part in style.split("+"):
            new = _convert(new, name, part, group, sequence_parallel, in_region, segments)
            if part in ("colwise", "colwise_gather") and t > 1:
                # the parent of a projection (a LoRA wrapper included) is the attention module
                _divide_heads(parent, t, name)
        setattr(new, _STYLE_ATTR, style)
        setattr(parent, attr, new)
        applied[name] = style
    if t > 1:
        for table in tables:  # T5's relative position bias: this rank's heads' columns
            cut_head_table(table, rank=dist.get_rank(group), size=t)
        shared = [
            found
            for parent_name in {n.rpartition(".")[0] for n, _ in targets}
            for found in head_shared(modules[parent_name] if parent_name else module)
        ]
        sum_head_local([*head_local_params, *shared], group=group)
    _retie(module, tied)
    record = {
        "plan": plan if isinstance(plan, str) else dict(plan),
        "resolved": resolved,
        "size": t,
        "sequence_parallel": sequence_parallel,
        "applied": dict(applied),
    }
    setattr(module, TP_STATE_ATTR, record)
    if t > 1:
        _check_regions(module, applied, size=t)
    return applied


def _check_regions(module: nn.Module, applied: Mapping[str, str], *, size: int) -> None:
    """The check that every column-parallel layer reads a region input, and the gradient correction of a
    region input whose output other modules read too (:mod:`~lightning_par.tensor_parallel.region_check`)."""
    regions = {n: module.get_submodule(n) for n, s in applied.items() if "region_input" in s.split("+")}
    readers: dict[str, nn.Module] = {}
    for name, style in applied.items():
        if not {"colwise", "colwise_gather"} & set(style.split("+")):
            continue
        for sub_name, sub in module.get_submodule(name).named_modules(prefix=name):
            if _in_region(sub) and ".lora_B." not in sub_name:
                readers[sub_name] = sub
            elif is_lora_wrapper(sub) and _in_region(sub.base_layer):
                # LoRA A reads the region input for a column-parallel B
                readers.update((f"{sub_name}.lora_A.{k}", a) for k, a in sub.lora_A.items())
    check_regions(regions, readers, size=size)


def _in_region(layer: object) -> bool:
    return isinstance(layer, ColumnParallelLinear) and not layer.copy_input


def _refuse_parallel(old: nn.Module, name: str) -> None:
    style = getattr(old, _STYLE_ATTR, None)
    if style is not None or isinstance(old, PARALLEL_TYPES):
        what = f"style {style!r}" if style is not None else type(old).__name__
        raise ValueError(
            f"{name!r} is already tensor-parallel ({what}); a model is converted once: build a fresh"
            " model for another layout."
        )


def _convert(
    old: nn.Module,
    name: str,
    style: str,
    group: ProcessGroup,
    sp: bool,
    in_region: bool,
    segments: list[int] | None = None,
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
            old,
            group=group,
            name=name,
            segments=segments,
            gather_output=style == "colwise_gather",
            copy_input=not in_region,
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
        where = type(old).__module__
        hint = ""
        if where.startswith("litgpt."):
            hint = (
                " litgpt's own LoRA and adapter layers are not sharded by tensor parallelism: fine-tune"
                " litgpt.lora / litgpt.adapter models with tensor_parallel_size=1 (ZeRO shards them), or put"
                " PEFT LoRA on a plain litgpt GPT's non-fused layers (attn.proj, mlp.*)."
            )
        elif where.startswith("peft."):  # IA3, LoKr, LoHa, ...: their own Linear wrappers
            hint = (
                f" It is PEFT's {where}.{type(old).__name__}, an adapter layer tensor parallelism does not"
                " split: of PEFT's methods it supports plain LoRA (with modules_to_save) only. Train this"
                " adapter with tensor_parallel_size=1 (ZeRO shards it), or use LoraConfig."
            )
        raise ValueError(
            f"tp_plan style {style!r} needs an nn.Linear, but {name!r} is {type(old).__name__}"
            f" ({where}.{type(old).__qualname__})." + hint
        )
    if style == "vocab" and not isinstance(old, nn.Embedding):
        raise ValueError(
            f"tp_plan style 'vocab' needs an nn.Embedding, but {name!r} is {type(old).__name__}; leave it"
            " out of the tp_plan (it then stays replicated, and ZeRO shards it over the data-parallel group)."
        )
    if style in _LINEAR_STYLES or style == "vocab":
        check_forward(old, name, style)


def _check_fused(modules: dict[str, nn.Module], name: str, style: str, t: int) -> None:
    """A fused projection (litgpt's ``attn.qkv``, Phi-3's ``qkv_proj`` / ``gate_up_proj``, see
    :mod:`~.fused`): only a plain ``nn.Linear`` split by rows, and an attention whose heads divide by
    ``t``."""
    parent_name, _, attr = name.rpartition(".")
    parent = modules.get(parent_name)
    if parent is None or t == 1 or fused_segments(parent, attr) is None:
        return
    layer = modules[name]
    if style.split("+")[0] != "colwise" or is_lora_wrapper(layer) or saved_copies(layer) is not None:
        raise ValueError(
            f"tp_plan style {style!r} on {name!r}: a fused projection (query/key/value or gate/up) is"
            " sharded only as a plain nn.Linear with style 'colwise' (each of its segments cut alike); a"
            " LoRA wrapper or another style would cut across the segments. Leave it out of the adapters"
            f" (PEFT's target_modules without {attr!r}), or the block's projections out of the plan (they"
            " then stay replicated)."
        )
    check_heads(parent, parent_name, t)


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
    # inner_dim: T5's width of all heads together, which LongT5's local attention reshapes its output to
    for attr in (*_HEAD_ATTRS, "inner_dim"):
        value = getattr(attention, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            if value % t != 0:
                raise ValueError(
                    f"{name}: the attention has {attr}={value}, not divisible by tensor_parallel_size={t};"
                    f" choose a head count divisible by {t}."
                )
            setattr(attention, attr, value // t)
    divide_config_heads(attention, t)
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
