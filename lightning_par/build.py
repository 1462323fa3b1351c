"""The per-run part of the composition, shared by both front doors: the ZeRO engine over the
data-parallel group, built from one options record.

The model-changing steps (tensor parallel, pipeline split, activation checkpointing) are
:func:`lightning_par.compose.compose`'s, applied once per model; the engine, the precision groups and the
optimizers are built again for every run by :func:`build_engine` and :func:`set_precision_groups`, so the
Trainer strategy (``lightning_par.strategy``) and the Fabric strategy (``lightning_par.fabric.strategy``)
compose the same mechanisms in the same order. Lightning-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from lightning_par.mesh import ParallelMesh
from lightning_par.precision import ParallelPrecision
from lightning_par.zero.comm_hooks import GATHER_DTYPES, CommHook, GatherDtype, HookName, resolve_comm_hook
from lightning_par.zero.engine import ReduceChoice, apply_zero, resolve_reduce_op
from lightning_par.zero.engine_api import Engine
from lightning_par.zero.grad_sync import GradSyncPolicy, broadcast_module_states
from lightning_par.zero.meta_init import ValuesFn
from lightning_par.zero.stage3 import Stage3Engine
from lightning_par.zero.units import UnitPolicy


@dataclass(frozen=True)
class ZeroOptions:
    """How the engine shards and reduces (the strategies' constructor arguments of the same names)."""

    stage: int
    bucket_size_mb: float = 25.0
    grad_sync: GradSyncPolicy | None = None
    reduce_op: ReduceChoice = "auto"
    find_unused_parameters: bool = False
    zero3_units: UnitPolicy = None
    reshard_after_forward: bool | None = None  # None: True, False under a pipeline
    prefetch: bool = True
    allow_untested_optimizer: bool = False
    comm_hook: HookName | CommHook | None = None
    comm_hook_state: Any = None
    powersgd_rank: int = 1
    gather_dtype: GatherDtype | None = None

    @classmethod
    def of(cls, strategy: Any) -> ZeroOptions:
        """The options of a strategy that keeps them as attributes of the same names (``zero_stage`` for
        ``stage``), as both front doors do."""
        values = {f.name: getattr(strategy, f.name) for f in fields(cls) if f.name != "stage"}
        return cls(stage=strategy.zero_stage, **values)


def check_params(module: nn.Module, *, compute_dtype: torch.dtype | None = None) -> None:
    """Refuse, naming them, parameters the flat buffers cannot hold: lazy ones not initialised yet
    (``nn.LazyLinear`` before its first forward; torch's DDP refuses them too), and trainable parameters of
    more than one dtype (every gradient bucket, ZeRO-3 unit and sharded master is one flat tensor of one
    dtype; torch's DDP buckets per dtype instead). Without this, stages 0-2 stopped with a message that
    blamed the precision plugin and stage 3 packed the odd parameters into the unit's dtype, silently
    changing the model. Complex parameters with a real ``compute_dtype`` (fp32 masters apart from bf16 /
    fp16 compute copies) are refused too: the cast dropped their imaginary part, silently."""
    lazy = [name for name, p in module.named_parameters() if nn.parameter.is_lazy(p)]
    if lazy:
        raise ValueError(
            f"{len(lazy)} parameter(s) are not initialised yet (lazy modules: {', '.join(lazy[:4])}"
            f"{' ...' if len(lazy) > 4 else ''}); their shapes are unknown until a first forward. Run one"
            " forward on a sample batch before fit (in the LightningModule's __init__)."
        )
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, p in module.named_parameters():
        if p.requires_grad:
            by_dtype.setdefault(p.dtype, []).append(name)
    if len(by_dtype) < 2:
        _refuse_complex_copies(by_dtype, compute_dtype)
        return
    ranked = sorted(by_dtype.items(), key=lambda item: -len(item[1]))
    odd = ", ".join(
        f"{dtype}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''} ({len(names)})"
        for dtype, names in ranked[1:]
    )
    # a cast cannot join complex and real parameters: a complex one trains as a real pair instead
    complex_fix = (
        " Complex parameters beside real ones: store each as a real tensor of pairs"
        " (torch.view_as_real) and take torch.view_as_complex of it in forward, or make every trainable"
        " parameter complex."
        if any(dtype.is_complex for dtype in by_dtype) and not all(dtype.is_complex for dtype in by_dtype)
        else ""
    )
    raise TypeError(
        f"Trainable parameters of {len(ranked)} dtypes: most are {ranked[0][0]} ({len(ranked[0][1])}), the"
        f" others {odd}. ZeRO's gradient buckets and shards hold one dtype: cast the model to one"
        " (model.to(dtype) before fit), or freeze the odd ones or make them buffers (Lightning's own"
        f' "ddp" buckets by dtype, if they must train in theirs).{complex_fix}'
    )


def _refuse_complex_copies(by_dtype: dict[torch.dtype, list[str]], compute_dtype: torch.dtype | None) -> None:
    """Trainable parameters all of one complex dtype, with a real ``compute_dtype``: refused (the compute
    copies would be real). Checked after the one-dtype rule, whose message names the real-pair form for a
    complex parameter beside real ones (which this one's fix would not have helped)."""
    complex_names = [n for dtype, names in by_dtype.items() if dtype.is_complex for n in names]
    if complex_names and compute_dtype is not None and not compute_dtype.is_complex:
        raise TypeError(
            f"Complex parameters ({', '.join(complex_names[:4])}{' ...' if len(complex_names) > 4 else ''})"
            f" in a mixed precision with fp32 master weights: the model would compute with {compute_dtype}"
            " copies of them, and that cast drops the imaginary part. Keep the parameters in their dtype,"
            " as 'ddp' does under autocast: plugins=[ParallelPrecision(precision, master_weights=False)], or"
            " train in precision='32-true'."
        )


def build_engine(
    module: nn.Module,
    *,
    options: ZeroOptions,
    group: ProcessGroup,
    device: torch.device,
    compute_dtype: torch.dtype | None,
    grad_dtype: torch.dtype | None,
    frozen_dtype: torch.dtype | None = None,
    fitting: bool = True,
    values: ValuesFn | None = None,
    pipelined: bool = False,
    seed_groups: Sequence[ProcessGroup] = (),
) -> Engine | None:
    """The ZeRO engine of ``module`` over ``group`` (``None`` when evaluating below stage 3, after the
    module states were broadcast so every rank evaluates the same weights).

    Stage 3 is built for evaluation too, because a meta-initialised model exists only as shards; it
    materialises meta parameters from ``values(name)`` (pretrained weights) or their initialisers on
    ``device``. Under a pipeline (``pipelined``) a step's micro-batches are its accumulation window, so
    stages 1/2 reduce once at the window's end, and stage 3 keeps its units gathered across the
    micro-batches (``reshard_after_forward`` unset) and reduce-scatters once, at ``flush()``.
    ``frozen_dtype``: the dtype of ZeRO-3's frozen floating shards (None: the parameters' own).
    ``seed_groups`` (the tensor- and pipeline-parallel groups) agree with ``group`` on the seed of that
    init, so every rank of the mesh draws it alike.
    """
    check_params(module, compute_dtype=compute_dtype)
    compression = resolve_comm_hook(
        options.comm_hook, options.comm_hook_state, group=group, powersgd_rank=options.powersgd_rank
    )
    if options.stage == 3:
        return Stage3Engine(
            module,
            group=group,
            units=options.zero3_units,
            reshard_after_forward=(
                options.reshard_after_forward if options.reshard_after_forward is not None else not pipelined
            ),
            prefetch=options.prefetch,
            reduce_op=resolve_reduce_op(options.reduce_op, group),
            find_unused_parameters=options.find_unused_parameters,
            compute_dtype=compute_dtype,
            grad_dtype=grad_dtype,
            frozen_dtype=frozen_dtype,
            values=values,
            allow_untested_optimizer=options.allow_untested_optimizer,
            device=device,
            comm_dtype=compression.dtype,
            gather_dtype=GATHER_DTYPES[options.gather_dtype] if options.gather_dtype else None,
            defer_reduction=pipelined,
            seed_groups=seed_groups,
        )
    if not fitting:
        broadcast_module_states(module, group=group)
        return None
    return apply_zero(
        module,
        group=group,
        stage=options.stage,
        bucket_size_mb=options.bucket_size_mb,
        grad_sync="boundary" if pipelined else options.grad_sync,
        reduce_op=options.reduce_op,
        find_unused_parameters=options.find_unused_parameters,
        compute_dtype=compute_dtype,
        grad_dtype=grad_dtype,
        allow_untested_optimizer=options.allow_untested_optimizer,
        comm_hook=compression.hook,
        comm_hook_state=compression.state,
        comm_dtype=compression.dtype,
        device=device,
        marks_passes=not pipelined,
    )


def set_precision_groups(plugin: ParallelPrecision, mesh: ParallelMesh, *, zero_stage: int) -> None:
    """Give ``plugin`` the groups a clip norm (and an fp16 overflow verdict) must sum over to be the
    global one, and the tensor-parallel group whose replicated parameters it counts once.

    From stage 1 on, each dp rank holds disjoint gradient pieces; each pipeline stage holds other layers;
    each tp rank its own tensor shards.
    """
    groups = [mesh.dp_group] if zero_stage > 0 else []
    if mesh.pp_size > 1:
        groups.append(mesh.pp_group)
    if mesh.tp_size > 1:
        groups.append(mesh.tp_group)
    plugin.grad_norm_groups = tuple(groups)
    plugin.tp_group = mesh.tp_group if mesh.tp_size > 1 else None
