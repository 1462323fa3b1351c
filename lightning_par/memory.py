"""Model-state memory per rank: measured (:func:`measure_memory`) and predicted (:func:`estimate_memory`).

The prediction is the ZeRO accounting, with ``Ψ`` the parameters held by one tensor/pipeline rank
(``total / (tp * pp)``), ``N`` the data-parallel size, ``P``/``G`` the bytes of a compute parameter and
gradient element, ``M`` the bytes of a separate fp32 master copy (0 in fp32 training, where the
parameters are the masters) and ``S`` the optimizer's state bytes per element (AdamW: 8). Gradients are
accumulated and reduced in ``reduce_dtype``, so in the 16-bit modes ``G`` is 4 by default (fp32, the
accurate choice) and 2 with ``reduce_dtype="bf16"`` / ``"fp16"``, where the optimizer then reads an fp32
copy of the gradient shard (``4Ψ/N`` more at stages 1/2). At stage 0 the mixed modes keep no masters:
fp32 parameters and gradients under autocast (``P = G = 4``, ``M = 0``), as Lightning's::

    stage 0:  params PΨ   grads GΨ             optimizer (M+S)Ψ
    stage 1:  params PΨ   grads GΨ + GΨ/N       optimizer (M+S)Ψ/N     (full local buffer + reduced shard)
    stage 2:  params PΨ   grads GΨ/N + buckets  optimizer (M+S)Ψ/N     (grad_sync="every")
    stage 3:  params (M or P)Ψ/N + live units   grads GΨ/N   optimizer SΨ/N   (one copy per shard)

Frozen parameters (``requires_grad=False``, e.g. a LoRA model's base) add ``F Φ`` to the parameters
(``F Φ/N`` at stage 3, ``Φ`` the frozen count per tensor/pipeline rank) and nothing to gradients or
optimizer state: they have no gradient, no master and no optimizer state. ``F`` is the bytes they are
stored in: their own dtype's under ``"32-true"`` and under ``"bf16-mixed"`` / ``"16-mixed"`` (as Lightning
keeps them: ParallelPrecision's ``frozen_dtype="auto"``), read from the model where one is given (a LoRA
base cast to bf16 counts 2 bytes; ZeRO-3 also gathers it in bf16 under ``"32-true"``) and taken as 4 for
a count; ``P`` otherwise or with ``frozen_dtype="compute"``.

where the live units are the root unit (gathered for the whole step) plus a block and its prefetched
successor; under pipeline parallelism (``pp > 1``) every unit of the stage stays gathered for the step
(``PΨ`` live) and the gradient sums wait unsharded for the step's one reduce-scatter (``GΨ`` of
communication buffers), about ZeRO-1's peak, with stage 3's ``1/N`` between steps.
E.g. bf16-mixed AdamW (P=2, M=4, S=8) with the default fp32 reduction (G=4): stage 1 ≈ 6Ψ + 16Ψ/N,
stage 2 ≈ 2Ψ + 16Ψ/N, stage 3 ≈ 16Ψ/N (its shard holds the fp32 master only); with
``reduce_dtype="bf16"`` (G=2) the ZeRO paper's 4Ψ + 12Ψ/N and 2Ψ + 14Ψ/N plus the fp32 gradient copy
(4Ψ/N), and 14Ψ/N (measured on 2 ranks with a 4.7M Llama: stage 1 in bf16-mixed holds 63.0 MiB, as
predicted now; the earlier G=2 prediction was 1.27x short). With
``grad_sync="boundary"`` stage 2 keeps the full local buffer like stage 1.
Communication buffers are bounded: at most ``max_inflight + 1`` pooled buckets (never more than there
are buckets), each the size of the largest bucket (at most the larger of ``bucket_size_mb`` and the
largest parameter) plus its ``1/N`` reduce-scatter output; ``comm_buffers`` of the estimate is that
bound, computed from the real bucket layout when a model is given.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, TypedDict

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_par.zero.engine import default_grad_sync
from lightning_par.zero.engine_api import Engine
from lightning_par.zero.grad_sync import bucket_numel_for
from lightning_par.zero.layout import FlatLayout
from lightning_par.zero.units import plan_units

OptimizerKind = Literal["adamw", "adam", "sgd", "sgd_momentum", "adagrad", "rmsprop"]
_STATE_BYTES: dict[str, int] = {
    "adamw": 8,
    "adam": 8,
    "sgd": 0,
    "sgd_momentum": 4,
    "adagrad": 4,
    "rmsprop": 4,
}
_PRECISION_BYTES: dict[str, tuple[int, int, int]] = {  # (param, grad, separate master)
    "32-true": (4, 4, 0),
    "64-true": (8, 8, 0),
    "bf16-mixed": (2, 2, 4),
    "16-mixed": (2, 2, 4),
    "bf16-true": (2, 2, 4),
}
_REDUCE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


class MemoryReport(TypedDict):
    parameters: int
    live_units: int
    gradients: int
    optimizer_state: int
    buffers: int
    comm_buffers: int
    total: int


def _bytes(tensors: Sequence[Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t.is_meta:
            continue  # e.g. layers of other pipeline stages
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def measure_memory(module: nn.Module, engine: Engine | None, optimizers: Sequence[Optimizer]) -> MemoryReport:
    """Bytes this rank holds now, by category (storages counted once)."""
    held = engine.memory_bytes() if engine is not None else {}
    # what the engine reports is what it holds; only the rest is counted here
    params = held["parameters"] if "parameters" in held else _bytes(list(module.parameters()))
    buffers = _bytes([b for b in module.buffers()])
    live = held.get("live_units", 0)
    grads = (
        held["gradients"]
        if "gradients" in held
        else _bytes([p.grad for p in module.parameters() if p.grad is not None])
    )
    comm = held.get("comm", 0)
    opt_state = (
        held["optimizer_state"]
        if "optimizer_state" in held
        else sum(
            v.numel() * v.element_size()
            for opt in optimizers
            for state in opt.state.values()
            for v in state.values()
            if isinstance(v, Tensor)
        )
    )
    total = params + live + grads + opt_state + buffers + comm
    return MemoryReport(
        parameters=params,
        live_units=live,
        gradients=grads,
        optimizer_state=opt_state,
        buffers=buffers,
        comm_buffers=comm,
        total=total,
    )


def _bucket_shape(model: nn.Module, bucket_size_mb: float, g_bytes: int) -> tuple[int, int]:
    """(bucket count, largest bucket numel) of the gradient layout, taking the worse of the two likely
    parameter orders (registration, and its reverse, which is roughly when gradients become ready)."""
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        return 0, 0
    numel = bucket_numel_for(bucket_size_mb, g_bytes)
    worst = (0, 0)
    for order in (named, named[::-1]):
        layout = FlatLayout(names=[n for n, _ in order], shapes=[s for _, s in order], bucket_numel=numel)
        shape = (len(layout.buckets), max(b.numel for b in layout.buckets))
        worst = max(worst, shape, key=lambda cb: cb[0] * cb[1])
    return worst


def estimate_memory(
    model_or_param_count: nn.Module | int,
    *,
    zero_stage: int = 0,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    precision: str = "32-true",
    optimizer: OptimizerKind = "adamw",
    grad_sync: Literal["boundary", "every"] | None = None,
    bucket_size_mb: float = 25.0,
    max_inflight: int = 4,
    stage3_inflight: int = 2,
    frozen_params: int = 0,
    frozen_dtype: Literal["auto", "compute"] = "auto",
    reduce_dtype: Literal["fp32", "bf16", "fp16"] = "fp32",
) -> MemoryReport:
    """Predicted bytes per rank of model states (see the module docstring for the formulas). Given a
    parameter count, ``frozen_params`` is the number of frozen parameters besides it; given a model, its
    parameters with ``requires_grad=False`` are. ``frozen_dtype`` and ``reduce_dtype`` as
    ParallelPrecision's."""
    largest = 0
    frozen_own: float | None = None  # bytes of the frozen parameters in their own dtypes (a model given)
    if isinstance(model_or_param_count, nn.Module):
        trainable = [p for p in model_or_param_count.parameters() if p.requires_grad]
        frozen = [p for p in model_or_param_count.parameters() if not p.requires_grad]
        total_params = sum(p.numel() for p in trainable)
        frozen_params = sum(p.numel() for p in frozen)
        frozen_own = float(sum(p.numel() * p.element_size() for p in frozen))
        largest = max((p.numel() for p in trainable), default=0)
    else:
        total_params = int(model_or_param_count)
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}.")
    if precision not in _PRECISION_BYTES:
        raise ValueError(f"precision must be one of {sorted(_PRECISION_BYTES)}, got {precision!r}.")
    if reduce_dtype not in _REDUCE_BYTES:
        raise ValueError(f"reduce_dtype must be one of {sorted(_REDUCE_BYTES)}, got {reduce_dtype!r}.")
    if optimizer not in _STATE_BYTES:
        raise ValueError(f"optimizer must be one of {sorted(_STATE_BYTES)}, got {optimizer!r}.")
    for name, size in (("dp", dp), ("tp", tp), ("pp", pp)):
        if size < 1:
            raise ValueError(f"{name} must be >= 1, got {size}.")
    psi = total_params / (tp * pp)
    phi = frozen_params / (tp * pp)
    p_bytes, g_bytes, m_bytes = _PRECISION_BYTES[precision]
    s_bytes = _STATE_BYTES[optimizer] * (2 if precision == "64-true" else 1)  # state in the params' dtype
    mixed = precision in ("bf16-mixed", "16-mixed")
    f_bytes = 4 if mixed and frozen_dtype == "auto" else p_bytes
    # frozen parameters kept in their own dtype (32-true; mixed with frozen_dtype="auto"): a model's own
    # (a frozen bf16 base beside fp32 adapters); a count is taken as fp32. ZeRO-3 gathers them so too
    # under 32-true (zero/unit.py); the other precisions convert or cast them
    own = precision == "32-true" or (mixed and frozen_dtype == "auto")
    frozen_bytes = frozen_own / (tp * pp) if own and frozen_own is not None else f_bytes * phi
    grad_copy = 0.0  # the optimizer's fp32 copy of a 16-bit gradient shard (stages 1/2)
    if mixed and zero_stage == 0:  # no masters: fp32 parameters and gradients under autocast
        p_bytes, g_bytes, m_bytes = 4, 4, 0
    elif m_bytes and zero_stage > 0:  # 16-bit parameters with fp32 masters: gradients in the reduction dtype
        g_bytes = _REDUCE_BYTES[reduce_dtype]
        grad_copy = 4.0 if g_bytes != 4 and zero_stage in (1, 2) else 0.0
    params = p_bytes * psi + frozen_bytes
    # stage 3 keeps one copy of each parameter in its shard: the fp32 master where there is one (the
    # 16-bit compute copy is made by the gather), so the master counts as parameters there
    stage3_shard = (m_bytes or p_bytes) * psi + frozen_bytes
    comm = live = 0.0
    if zero_stage == 3 and pp > 1:
        # under a pipeline every unit stays gathered for the step and its gradients are summed unsharded
        # until the one reduce-scatter after the last micro-batch (zero/stage3.py, deferred reduction)
        params, grads, opt = stage3_shard / dp, g_bytes * psi / dp, s_bytes * psi / dp
        live, comm = p_bytes * (psi + phi), g_bytes * psi
    elif zero_stage == 3:
        params, grads, opt = stage3_shard / dp, g_bytes * psi / dp, s_bytes * psi / dp
        if isinstance(model_or_param_count, nn.Module):
            units = plan_units(model_or_param_count).units

            # gathered bytes: the compute dtype, or under 32-true a frozen parameter's own dtype
            def gathered(p: nn.Parameter) -> int:
                return p.element_size() if precision == "32-true" and not p.requires_grad else p_bytes

            sizes = [sum(p.numel() * gathered(p) for _, p in named) for _, _, named in units]
            root, blocks = sizes[-1], sizes[:-1] or [0]
            # the root unit stays gathered for the step; a block and its prefetched successor
            live = (root + 2 * max(blocks)) / (tp * pp)
            # gradient buffers (trainable parameters only) are pooled by size (each unit padded to a
            # multiple of N): per distinct size at most as many as units of that size, and at most
            # stage3_inflight + 1 in flight
            trainable_sizes = [sum(p.numel() for _, p in named if p.requires_grad) for _, _, named in units]
            padded = [-(-n // dp) * dp for n in trainable_sizes if n]
            comm = sum(
                min(padded.count(n), stage3_inflight + 1) * n * g_bytes * (1 + 1 / dp) for n in set(padded)
            ) / (tp * pp)
    elif zero_stage == 0:
        grads, opt = g_bytes * psi, (m_bytes + s_bytes) * psi
    else:
        policy = grad_sync or default_grad_sync(zero_stage)
        opt = (m_bytes + s_bytes) * psi / dp
        grads = (g_bytes + grad_copy) * psi / dp + (g_bytes * psi if policy == "boundary" else 0.0)
        if policy == "every":
            # pooled buffers all have the largest bucket's size (plus a 1/N reduce-scatter output each);
            # there are at most as many as buckets and at most max_inflight + 1 at once
            if isinstance(model_or_param_count, nn.Module):
                count, biggest = _bucket_shape(model_or_param_count, bucket_size_mb, g_bytes)
                per_rank = 1 / (tp * pp)
            else:
                biggest = int(min(max(bucket_numel_for(bucket_size_mb, g_bytes), largest), psi))
                count, per_rank = (math.ceil(psi / biggest) if biggest else 0), 1.0
            comm = min(max_inflight + 1, count) * biggest * g_bytes * (1 + 1 / dp) * per_rank
    total = params + live + grads + opt + comm
    return MemoryReport(
        parameters=int(params),
        live_units=int(live),
        gradients=int(grads),
        optimizer_state=int(opt),
        buffers=0,
        comm_buffers=int(comm),
        total=int(total),
    )
