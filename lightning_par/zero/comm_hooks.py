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

Names for the strategies' ``comm_hook``: ``"fp16"`` and ``"bf16"`` (torch's compress hooks over the dp
group) and ``"powersgd"`` (torch's PowerSGD with error feedback and warm start, rank ``powersgd_rank``).
Where a hook cannot apply (a reduce-scatter, gradients reduced after every micro-batch, ZeRO-3) the
strategy refuses it at setup.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


def resolve_comm_hook(
    comm_hook: HookName | CommHook | None,
    state: Any,
    *,
    group: ProcessGroup,
    powersgd_rank: int,
) -> tuple[CommHook | None, Any]:
    """``(hook, state)`` for a strategy's ``comm_hook`` option: a name is mapped to torch's hook and a
    default state over ``group`` (a given ``state`` wins); a callable is used as it is, with ``state``
    (default: ``group``, what torch's simple hooks expect)."""
    if comm_hook is None:
        return None, None
    if callable(comm_hook):
        return comm_hook, group if state is None else state
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if comm_hook == "powersgd":
        if state is None:
            state = powerSGD_hook.PowerSGDState(
                process_group=group, matrix_approximation_rank=powersgd_rank, start_powerSGD_iter=2
            )
        # torch types its hooks with its GradBucket; CommHookBucket offers the same methods
        return cast(CommHook, powerSGD_hook.powerSGD_hook), state
    hook = default_hooks.fp16_compress_hook if comm_hook == "fp16" else default_hooks.bf16_compress_hook
    return cast(CommHook, hook), group if state is None else state


def check_comm_hook(
    comm_hook: Any,
    *,
    powersgd_rank: Any,
    zero_stage: int = 0,
    reduce_op: str = "auto",
    grad_sync: str | None = None,
) -> None:
    """Raise a ``ValueError`` for an unknown hook name, a bad ``powersgd_rank``, or a hook the chosen
    stage cannot apply (checked when a strategy is constructed, before any process starts)."""
    if comm_hook is not None and not callable(comm_hook) and comm_hook not in HOOK_NAMES:
        raise ValueError(
            f"comm_hook must be one of {HOOK_NAMES}, a callable hook(state, bucket) -> Future, or None;"
            f" got {comm_hook!r}."
        )
    if isinstance(powersgd_rank, bool) or not isinstance(powersgd_rank, int) or powersgd_rank <= 0:
        raise ValueError(f"powersgd_rank must be a positive integer, got {powersgd_rank!r}.")
    if comm_hook is None:
        return
    if zero_stage == 3:
        raise ValueError(
            "comm_hook cannot apply at zero_stage=3: ZeRO-3 reduce-scatters each unit's gradients and"
            " gathers parameters, with no all-reduced bucket to hand a DDP hook. Use zero_stage 0, 1 or 2."
        )
    if zero_stage in (1, 2) and (reduce_op == "reduce_scatter" or grad_sync == "every"):
        raise ValueError(
            f"comm_hook replaces the all-reduce of the accumulated gradient; at zero_stage={zero_stage} it"
            f" needs reduce_op 'auto' or 'all_reduce' and grad_sync 'boundary' or None (got reduce_op="
            f"{reduce_op!r}, grad_sync={grad_sync!r})."
        )


def hook_result(value: Any) -> Tensor:
    """The tensor a hook's future resolved to (torch's ``all_reduce`` futures hold a list of one)."""
    if isinstance(value, list | tuple):
        value = value[0]
    if not isinstance(value, Tensor):
        raise TypeError(f"A communication hook's future must hold a tensor, got {type(value).__name__}.")
    return value
