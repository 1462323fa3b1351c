"""Buffers kept equal across the data-parallel group, the way ``DistributedDataParallel`` keeps them.

Buffers (BatchNorm running statistics, step counters) are not reduced like gradients: each rank updates
its own in forward. DDP with ``broadcast_buffers=True`` overwrites every rank's buffers with the first
rank's before a forward, when the previous forward was a synchronising training forward (gradients
enabled and not inside ``no_sync``); the very first forward syncs too. (Lightning's ``"ddp"`` in manual
optimization turns the gradient sync off after each training step's forward, so only that first forward
syncs there: the front door then reports no forward as synchronising.) :class:`BufferSync` reproduces
that rule exactly, so a model with BatchNorm trained by our strategy ends with the buffers Lightning's
``"ddp"`` gives it: once per optimizer step (at the first forward of the next accumulation window), not
after evaluation forwards, and never in a run that only validates or tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from lightning_par.owned_hooks import for_owner
from lightning_par.zero.grad_sync import broadcast_module_states


class BufferSync:
    """Call :meth:`before_forward` / :meth:`after_forward` around each step's forward."""

    def __init__(self, module: nn.Module, *, group: ProcessGroup, enabled: bool = True) -> None:
        self.module = module
        self.group = group
        self.enabled = enabled and any(b.numel() > 0 for b in module.buffers())
        self._pending = True  # DDP syncs before its first forward

    def before_forward(self) -> None:
        if self.enabled and self._pending:
            broadcast_module_states(self.module, group=self.group, params=False)

    def after_forward(self, *, synchronising: bool) -> None:
        """``synchronising``: this step's backward reduces gradients (not a ``no_sync`` micro-batch)."""
        self._pending = torch.is_grad_enabled() and synchronising


def sync_around_forward(
    module: nn.Module, sync: BufferSync, *, synchronising: Callable[[], bool]
) -> list[RemovableHandle]:
    """Run ``sync`` around each training forward of ``module`` through module hooks (a Fabric loop, whose
    forwards no step wraps; DDP does it inside its own forward), ``synchronising()`` read at the forward's
    end (not inside ``no_backward_sync``). Forwards without gradients neither synchronise nor count: code
    may run them on one rank (generation on rank 0, through the module or the wrapper), where a broadcast
    would wait for the others forever; DDP, called only through its wrapper, syncs before those too, so
    ranks other than the first evaluate with their own statistics of the last step until the next
    training forward takes the first rank's. Not traced by ``torch.compile`` (a collective and Python
    state). The handles, for the teardown."""
    if not sync.enabled:
        return []

    def before(owner: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            sync.before_forward()

    def after(owner: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            sync.after_forward(synchronising=synchronising())

    return [
        module.register_forward_pre_hook(for_owner(module, before, eager=True)),
        module.register_forward_hook(for_owner(module, after, eager=True)),
    ]
