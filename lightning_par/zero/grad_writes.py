"""Gradients user code writes into ``param.grad`` are refused at ZeRO 1-3, before the update they would miss.

Why
---
At ZeRO 1-3 the optimizer steps this rank's master fragments, whose ``.grad`` are slices of the engine's
reduced gradient shard; ``param.grad`` of the module's parameters is not read by the update. Code that
makes the gradient itself and assigns it (DP-SGD: per-sample gradients with ``torch.func``, clipped and
averaged, then ``p.grad = g``; any gradient of one's own) had no effect, silently: the step applied the
engine's gradient of the window's last backward, or nothing (a written gradient of ones moved the weights
by 0.0 where ``"ddp"`` moved them by ``-lr``). Torch's DDP, and stage 0 here, step with the written
gradient.

How
---
Each rebuilt optimizer's step pre-hook calls :func:`refuse_written_grads`: a trainable parameter whose
``.grad`` is set at the update and is not the engine's own view (stages 1/2 point ``param.grad`` into
their flat buffer while a window accumulates) raises ``RuntimeError`` naming it and the fixes, before
anything is updated. Host work only (one attribute read per parameter, no device sync), at every step:
a write may start in any step. The reads bypass torch function modes, so the first step's
``param.grad`` watch (:mod:`lightning_par.grad_reads`) does not count them as the user's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

__all__ = ["refuse_written_grads"]


def refuse_written_grads(
    params: Iterable[nn.Parameter], *, names: Mapping[int, str], engine_buffer: Tensor | None = None
) -> None:
    """Raise if a parameter in ``params`` holds a gradient the update would not use (module docstring).
    ``names``: parameter names by id; ``engine_buffer``: the engine's flat gradient buffer, whose views
    in ``param.grad`` are its own."""
    own = engine_buffer.untyped_storage().data_ptr() if engine_buffer is not None else None
    with torch._C.DisableTorchFunction():
        written = [
            p
            for p in params
            if p.grad is not None and (own is None or p.grad.untyped_storage().data_ptr() != own)
        ]
    if not written:
        return
    labels = sorted(repr(names.get(id(p), tuple(p.shape))) for p in written)  # one order at every stage
    shown = ", ".join(labels[:3])
    more = f" and {len(written) - 3} more" if len(written) > 3 else ""
    raise RuntimeError(
        f"The gradients of {shown}{more} were written into param.grad, which the optimizer does not read at"
        " ZeRO stages 1-3: it steps this rank's shard of the gradients the engine reduced in backward, and"
        " the written values would be lost without effect (nothing was updated). Use zero_stage=0, where"
        " param.grad is the gradient the optimizer steps with, as under DDP (then reduce the written"
        " gradients over the data-parallel ranks yourself, as DDP requires), or hand them to a backward the"
        " engine reduces (averaged over the data-parallel ranks, as DDP averages):"
        " torch.autograd.backward(params, grad_tensors=grads)."
    )
