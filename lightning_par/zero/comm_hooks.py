"""DDP-compatible communication hooks on our gradient buckets (ZeRO stages 0-2 with an all-reduce).

A hook has DDP's signature, ``hook(state, bucket) -> torch.futures.Future[Tensor]``, and replaces the
bucket's all-reduce: it receives the bucket's *local* flat gradient (the sum of this rank's accumulation
window) and returns a future of the data-parallel *average*, as DDP's default ``allreduce_hook`` does.
So torch's own hooks run unchanged: ``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``
(state: the process group) and ``powerSGD_hook.powerSGD_hook`` (state: a ``PowerSGDState``).

:class:`CommHookBucket` offers what those hooks read of ``torch.distributed.GradBucket``: ``buffer()``
(the flat gradient, which hooks may change in place), ``gradients()`` (per-parameter views of it),
``parameters()``, ``index()``, ``is_last()`` and ``set_buffer()``. Hooks run only at the window's
boundary (the final backward of an accumulation window), so PowerSGD compresses the accumulated gradient
once per optimizer step and its iteration count is the number of steps; clipping, unscaling and the
optimizer see the decompressed average.

Names for the strategies' ``comm_hook``: ``"fp16"`` and ``"bf16"`` (every gradient reduction in that
dtype, pre-divided by N as torch's compress hooks do; any stage, all-reduce or reduce-scatter) and
``"powersgd"`` (our flat-bucket PowerSGD, :mod:`lightning_par.zero.powersgd`, rank ``powersgd_rank``).
Where a hook cannot apply (a reduce-scatter, gradients reduced after every micro-batch, ZeRO-3) the
strategy refuses it at setup.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

HookName = Literal["fp16", "bf16", "powersgd"]
HOOK_NAMES: tuple[str, ...] = get_args(HookName)
CommHook = Callable[[Any, "CommHookBucket"], "torch.futures.Future[Tensor]"]


class CommHookBucket:
    """One bucket, as a DDP communication hook sees it (see the module docstring)."""

    def __init__(
        self,
        *,
        index: int,
        buffer: Tensor,
        params: Sequence[nn.Parameter],
        spans: Sequence[tuple[int, int, tuple[int, ...]]],
        is_last: bool,
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._params = list(params)
        self._spans = list(spans)  # (start, end, shape) of each parameter in the flat buffer
        self._is_last = is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> Tensor:
        return self._buffer

    def set_buffer(self, buffer: Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> list[Tensor]:
        """Per-parameter views of the (current) flat buffer, in bucket order."""
        return [self._buffer[lo:hi].view(shape) for lo, hi, shape in self._spans]

    def parameters(self) -> list[nn.Parameter]:
        return list(self._params)

    def is_last(self) -> bool:
        return self._is_last


@dataclass(frozen=True)
class Compression:
    """What a strategy's ``comm_hook`` option resolves to: a hook with its state, or a reduction dtype."""

    hook: CommHook | None = None
    state: Any = None
    dtype: torch.dtype | None = None


LOW_PRECISION = {"fp16": torch.float16, "bf16": torch.bfloat16}
GatherDtype = Literal["fp16", "bf16", "int8"]
GATHER_DTYPES = {**LOW_PRECISION, "int8": torch.int8}  # ZeRO-3's parameter all-gather


def resolve_comm_hook(
    comm_hook: HookName | CommHook | None,
    state: Any,
    *,
    group: ProcessGroup,
    powersgd_rank: int,
) -> Compression:
    """The :class:`Compression` of a strategy's ``comm_hook`` option over ``group``:

    * ``"fp16"``/``"bf16"``: every gradient reduction in that dtype, pre-divided by N (what torch's
      ``fp16_compress_hook`` does, at every stage and for reduce-scatters too);
    * ``"powersgd"``: our :mod:`lightning_par.zero.powersgd` of rank ``powersgd_rank``; ``state`` may be a
      ``PowerSGDState`` or a mapping of its other fields (``{"start_iter": 100}``);
    * a callable: used as it is, with ``state`` (default: ``group``, what torch's simple hooks expect).
    """
    if comm_hook is None:
        return Compression()
    if callable(comm_hook):
        return Compression(hook=comm_hook, state=group if state is None else state)
    if comm_hook in LOW_PRECISION:
        return Compression(dtype=LOW_PRECISION[comm_hook])
    from lightning_par.zero.powersgd import PowerSGDState, powersgd_hook

    if state is None or isinstance(state, Mapping):
        state = PowerSGDState(group=group, rank=powersgd_rank, **dict(state or {}))
    return Compression(hook=cast(CommHook, powersgd_hook), state=state)


def check_comm_hook(
    comm_hook: Any,
    *,
    powersgd_rank: Any,
    comm_hook_state: Any = None,
    gather_dtype: Any = None,
    zero_stage: int = 0,
    reduce_op: str = "auto",
    grad_sync: str | None = None,
) -> None:
    """Raise a ``ValueError`` for an unknown hook name, a bad ``powersgd_rank`` or PowerSGD field, or a
    hook the chosen stage cannot apply (checked when a strategy is constructed, before any process
    starts). ``"fp16"``/``"bf16"`` apply everywhere; a hook needs an all-reduced bucket."""
    if comm_hook is not None and not callable(comm_hook) and comm_hook not in HOOK_NAMES:
        raise ValueError(
            f"comm_hook must be one of {HOOK_NAMES}, a callable hook(state, bucket) -> Future, or None;"
            f" got {comm_hook!r}."
        )
    if isinstance(powersgd_rank, bool) or not isinstance(powersgd_rank, int) or powersgd_rank <= 0:
        raise ValueError(f"powersgd_rank must be a positive integer, got {powersgd_rank!r}.")
    if comm_hook == "powersgd":
        from lightning_par.zero.powersgd import PowerSGDState  # imports this module: not at the top

        allowed = set(inspect.signature(PowerSGDState).parameters) - {"group", "rank"}
        if comm_hook_state is not None and not isinstance(comm_hook_state, Mapping):
            raise ValueError(
                f"comm_hook_state for comm_hook='powersgd' is a mapping of its fields {sorted(allowed)},"
                f" got {type(comm_hook_state).__name__}. torch's own PowerSGD goes as a callable:"
                " comm_hook=powerSGD_hook, comm_hook_state=PowerSGDState(...)."
            )
        fields = dict(comm_hook_state or {})
        unknown = sorted(set(fields) - allowed)
        if unknown:
            raise ValueError(
                f"comm_hook_state for 'powersgd' has unknown field(s) {unknown}; the fields are"
                f" {sorted(allowed)} (the rank is powersgd_rank)."
            )
        check_powersgd_fields(fields)
    elif not callable(comm_hook) and (comm_hook_state is not None or powersgd_rank != 1):
        # accepted (a sweep over comm_hook keeps the others), but said: it would train uncompressed
        warnings.warn(
            f"comm_hook={comm_hook!r} uses neither comm_hook_state nor powersgd_rank (given:"
            f" comm_hook_state={comm_hook_state!r}, powersgd_rank={powersgd_rank!r}); they apply with"
            " comm_hook='powersgd' (or comm_hook_state with a callable hook).",
            stacklevel=3,
        )
    if gather_dtype is not None and gather_dtype not in GATHER_DTYPES:
        raise ValueError(
            f"gather_dtype must be one of {sorted(GATHER_DTYPES)} or None, got {gather_dtype!r}."
        )
    if gather_dtype is not None and zero_stage != 3:
        raise ValueError(
            f"gather_dtype={gather_dtype!r} applies at zero_stage=3 only: stages 1/2 all-gather the updated"
            " weights themselves (rounding them would lose updates). Under bf16-mixed they already move as"
            " bf16; use zero_stage=3 for a low-precision parameter gather."
        )
    if comm_hook is None or comm_hook in LOW_PRECISION:
        return
    if zero_stage == 3:
        raise ValueError(
            f"comm_hook={comm_hook!r} cannot apply at zero_stage=3: ZeRO-3 reduce-scatters each unit's"
            " gradients, with no all-reduced bucket to hand a DDP hook. Use comm_hook='bf16' or 'fp16'"
            " (a low-precision reduce-scatter), or zero_stage 0, 1 or 2."
        )
    if zero_stage in (1, 2) and (reduce_op == "reduce_scatter" or grad_sync == "every"):
        raise ValueError(
            f"comm_hook replaces the all-reduce of the accumulated gradient; at zero_stage={zero_stage} it"
            f" needs reduce_op 'auto' or 'all_reduce' and grad_sync 'boundary' or None (got reduce_op="
            f"{reduce_op!r}, grad_sync={grad_sync!r}); comm_hook='bf16' or 'fp16' works with both."
        )


_POWERSGD_INTEGERS = {"start_iter": 0, "min_bucket_numel": 0, "seed": None}  # name -> minimum
_POWERSGD_FLAGS = ("error_feedback", "warm_start", "compress_embeddings")


def check_powersgd_fields(fields: Mapping[str, Any]) -> None:
    """Raise a ``ValueError`` naming a PowerSGD field of the wrong type or range (``start_iter``,
    ``min_bucket_numel`` integers >= 0, ``seed`` an integer, ``min_compression_rate`` a number >= 1, the
    switches booleans); fields not given keep their defaults."""
    for name, minimum in _POWERSGD_INTEGERS.items():
        if name not in fields:
            continue
        value = fields[name]
        if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
            wanted = "an integer" + (f" >= {minimum}" if minimum is not None else "")
            raise ValueError(f"PowerSGD {name} must be {wanted}, got {value!r}.")
    if "min_compression_rate" in fields:
        rate = fields["min_compression_rate"]
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate >= 1:
            raise ValueError(f"PowerSGD min_compression_rate must be a number >= 1, got {rate!r}.")
    for name in _POWERSGD_FLAGS:
        if name in fields and not isinstance(fields[name], bool):
            raise ValueError(f"PowerSGD {name} must be True or False, got {fields[name]!r}.")


def hook_result(value: Any) -> Tensor:
    """The tensor a hook's future resolved to (torch's ``all_reduce`` futures hold a list of one)."""
    if isinstance(value, list | tuple):
        value = value[0]
    if not isinstance(value, Tensor):
        raise TypeError(f"A communication hook's future must hold a tensor, got {type(value).__name__}.")
    return value
