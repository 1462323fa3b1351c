"""The order of the parameters in a gradient layout, and the parameters it holds.

Contract
--------
:class:`GradOrder` sits between :class:`~lightning_par.zero.grad_buckets.GradBuckets` and
:class:`~lightning_par.zero.grad_sync.GradSync`. The layout's order decides which bucket fills first in
backward, so it should be the order gradients become ready:

* the first backward pass only records that order (``_ready_order``); at its end the layout is rebuilt
  in it, rank 0's order broadcast so every rank has the same layout (a data-dependent graph may differ
  per rank), and the pass's hooks are replayed on the new buckets;
* :meth:`GradOrder.set_order` adopts a given order instead (a checkpoint's) and stops that rebuild;
* at stage 0, parameters made trainable since the last step are appended (and the order learnt again in
  the next backward); stages 1/2 refuse them (:mod:`lightning_par.zero.trainable`).

Every change of layout calls the ``on_relayout`` listeners (:mod:`lightning_par.zero.sync_events`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from lightning_par.zero.grad_buckets import GradBuckets
from lightning_par.zero.sync_events import Listener
from lightning_par.zero.trainable import TrainableSet, name_list, refuse_unmanaged


class GradOrder(GradBuckets):
    """The layout's parameter order (see the module docstring)."""

    _order_pending: bool  # the first backward's order is still to be learnt
    _rebuild_order: bool
    _ready_order: list[int]
    _ready_in_backward: list[bool]
    _pending: list[int]
    _callback_queued: bool
    _grad_hooks: list[RemovableHandle]
    _trainable: TrainableSet
    _relayout_listeners: list[Listener]
    _on_grad_ready: Callable[[Tensor], None]
    _emit: Callable[[list[Listener]], None]

    def set_order(self, names: Sequence[str]) -> None:
        """Adopt a parameter order (e.g. a checkpoint's) and stop the first-backward rebuild."""
        index = {n: i for i, n in enumerate(self._names)}
        if sorted(names) != sorted(self._names):
            raise ValueError("set_order: the names are not this engine's parameters.")
        self._order_pending = False
        order = [index[n] for n in names]
        if order != list(range(len(order))):
            self._build(order)
            self._emit(self._relayout_listeners)

    def _rebuild_from_ready_order(self) -> None:
        self._order_pending = False
        seen = set(self._ready_order)
        order = self._ready_order + [i for i in range(len(self._params)) if i not in seen]
        self._ready_order = []
        if self.world > 1:
            # Autograd's order is deterministic for one graph, but a data-dependent graph could differ per
            # rank; the layout must be identical everywhere, so rank 0's order wins.
            agreed = torch.tensor(order, dtype=torch.int64, device=self.device)
            dist.broadcast(agreed, src=dist.get_global_rank(self.group, 0), group=self.group)
            order = agreed.tolist()
        ready = [self._ready_in_backward[i] for i in order]
        touched = [self._touched[i] for i in order]
        if order != list(range(len(self._params))):
            self._build(order)
            self._emit(self._relayout_listeners)
        self._touched = touched
        for slot, was_ready in enumerate(ready):
            # replay this pass's hooks on the new layout (transient buckets are filled at launch)
            if was_ready:
                self._pending[self.layout.slots[slot].bucket] -= 1

    def _follow_trainable(self) -> None:
        """Stage 0: take in the parameters made trainable since the last step (appended after the others;
        the order is learnt again in the next backward). Stages 1/2 refuse them
        (:mod:`lightning_par.zero.trainable`)."""
        new = self._trainable.unmanaged()
        if not new:
            return
        names = [n for n, _ in new]
        if self.shard:
            refuse_unmanaged(names, stages="1/2")
        if any(self._touched) or self._callback_queued:
            raise RuntimeError(
                f"requires_grad was set inside a gradient accumulation window on {name_list(names)}: set it"
                " between optimizer steps, e.g. in on_train_epoch_start."
            )
        for handle in self._grad_hooks:
            handle.remove()
        self._names += [n for n, _ in reversed(new)]  # reversed: the order gradients likely arrive in
        self._params += [p for _, p in reversed(new)]
        self._grad_hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._params]
        self._trainable.manage(self._params)
        self.buffer, self._touched = None, [False] * len(self._params)  # the window is empty: no carry
        self._order_pending, self._ready_order = self._rebuild_order, []
        self._build(list(range(len(self._params))))
        self._emit(self._relayout_listeners)


__all__ = ["GradOrder"]
