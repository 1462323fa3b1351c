"""Which gradients the rebuilt optimizers of ZeRO stages 1/2 see: the accumulation window.

Contract
--------
:class:`GradWindow` is a base of :class:`~lightning_par.zero.sharded_optimizer.ShardedOptimizer` and
declares the attributes it works on. A *window* is the run of backward passes whose gradients one
update uses. Per master fragment ``f`` of parameter ``p`` on this rank:

* at the window's synchronising end, ``f.grad`` is ``f``'s slice of the reduced gradient shard (or of a
  copy of it in the masters' dtype), ``(1/N) sum_r sum_k g_{r,k}`` (see :mod:`~lightning_par.zero.grad_sync`);
  a parameter no pass of the window used keeps ``None``;
* after an update of ``p``'s optimizer (or its ``zero_grad()``), the next pass's first gradient opens a new
  window: the gradients of the optimizers that stepped leave the shard, the others keep accumulating
  (a GAN whose generator steps before the discriminator's last backward);
* without an update, a fragment whose ``.grad`` the user set to None (``zero_grad()`` between two
  backwards) leaves the shard at the next pass's first gradient, so the update uses the later passes only,
  as under DDP.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_par.zero.grad_sync import GradSync
from lightning_par.zero.layout import Fragment

# drop(master fragment, id of its parameter, id of its optimizer): whether it leaves the window
Drop = Callable[[Tensor, int, int], bool]


@torch.no_grad()
def leave_window(
    fragments: Iterable[tuple[Tensor, int, int, Tensor | None, int, int]], drop: Drop, window: set[int]
) -> None:
    """For each ``(master, param, owner, grad_shard, lo, numel)`` that ``drop(master, param, owner)``
    selects: the master's ``.grad`` becomes None, its slice ``grad_shard[lo : lo + numel]`` of the
    reduced gradient shard zeros, and its parameter (``param``, an id) leaves ``window``. Shared by the
    windows of stages 1/2 (:class:`GradWindow`) and 3 (``Stage3Optim``)."""
    for master, param, owner, grad_shard, lo, numel in fragments:
        if drop(master, param, owner):
            master.grad = None
            assert grad_shard is not None
            grad_shard[lo : lo + numel].zero_()
            window.discard(param)


class GradWindow:
    """The master fragments' gradients over an accumulation window (see the module docstring)."""

    sync: GradSync
    optimizers: list[Optimizer]
    fragments: list[Fragment]
    master_flat: Tensor | None
    param_flat: Tensor
    _master_slots: list[tuple[Tensor, Tensor, int]]
    _grad_views: list[Tensor]
    _owners: list[int]
    _grad_copy: Tensor | None
    _window_params: set[int]
    _stepped_in_window: set[int]
    _slot_owners: list[int]  # per parameter (layout order): its optimizer's id, -1 for none
    _seen_everywhere: set[int]  # ids of the optimizers with a fragment on every rank (_drop_zeroed)

    def _attach_grads(self) -> None:
        """Point each master fragment's ``.grad`` at its slice of the reduced gradient shard, or of one
        copy of the whole shard in the masters' dtype (a reduction dtype other than the masters'): one
        cast kernel per step instead of one per fragment, which on a GPU is launch time the step waits
        for (hundreds of parameters)."""
        grad_shard = self.sync.grad_shard
        assert grad_shard is not None
        dtype = (self.master_flat if self.master_flat is not None else self.param_flat).dtype
        if grad_shard.dtype == dtype:
            self._grad_copy = None
            views = self._grad_views
        else:
            self._grad_copy = grad_shard.to(dtype)
            views = [self._grad_copy[f.shard_lo : f.shard_lo + f.numel] for f in self.fragments]
        unused, params, window = self.sync.unused, self.sync.params, self._window_params
        for (master, _, slot), view in zip(self._master_slots, views, strict=True):
            # a parameter unused in this pass keeps what earlier passes of the window reduced, as under
            # DDP; None only if it has had nothing (so None afterwards means the user's zero_grad())
            if slot not in unused:
                master.grad = view
                window.add(id(params[slot]))
            else:
                master.grad = view if id(params[slot]) in window else None

    @torch.no_grad()
    def scale_attached(self, factor: float | Tensor) -> None:
        """Multiply the master gradients when they are a copy (a reduction dtype other than the
        masters'); views of the gradient shard are scaled with it (:meth:`GradSync.scale_grads`)."""
        if self._grad_copy is not None:
            self._grad_copy.mul_(factor)

    def _mark_window(self) -> None:
        """The end of a non-final pass (``no_sync``): each fragment a pass of the window gave a gradient
        points its ``.grad`` at its slice of the gradient shard (what the window reduced so far at
        ``grad_sync="every"``, zeros at ``"boundary"``), so that a ``zero_grad()`` before the window ends
        shows as None, as at a window's end (:meth:`_before_pass`, :meth:`_drop_zeroed`). Before, a
        backward under ``no_backward_sync`` that the loop then dropped with ``optimizer.zero_grad()`` (a
        skipped micro-batch) was still in the update. Not where the shard's dtype is not the masters'."""
        grad_shard = self.sync.grad_shard
        dtype = (self.master_flat if self.master_flat is not None else self.param_flat).dtype
        if grad_shard is None or grad_shard.dtype != dtype:
            return
        touched, params, window = self.sync.touched, self.sync.params, self._window_params
        for (master, _, slot), view in zip(self._master_slots, self._grad_views, strict=True):
            if touched[slot]:
                master.grad = view
                window.add(id(params[slot]))

    def _drop_zeroed(self) -> None:
        """Before gradients accumulate (a forward, the start of a backward): at ``grad_sync="boundary"``
        the window's gradients are still whole in each rank's local buffer, so an optimizer whose marked
        fragments (:meth:`_mark_window`) ``zero_grad()`` set to None since has its parameters' local
        gradients dropped, on every rank alike (every rank calls ``zero_grad()``; an optimizer counts only
        where it has a fragment on every rank, so that all ranks see it)."""
        if self.sync.buffer is None or self._window_done or not self._window_params:
            return
        params, window = self.sync.params, self._window_params
        gone: dict[int, bool] = {}
        for (master, _, slot), owner in zip(self._master_slots, self._owners, strict=True):
            if id(params[slot]) in window and owner in self._seen_everywhere:
                gone[owner] = gone.get(owner, True) and master.grad is None
        dropped = {owner for owner, none in gone.items() if none}
        if not dropped:
            return
        self.sync.drop_local([s for s, owner in enumerate(self._slot_owners) if owner in dropped])
        # and what earlier windows' ends reduced of them, as _before_pass does
        self._leave_shard(lambda master, param, owner: owner in dropped)

    _window_done = False  # an update has used this window's gradients

    def _before_pass(self) -> None:
        """The first gradient of a backward pass, whoever started it (the front doors open the window
        before their own backward; a pass user code starts, ``loss.backward()`` in manual optimization or
        a callback, added its reduced gradients to the stepped window's): after an update the window
        opens (:meth:`open_window`); otherwise the gradients ``zero_grad()`` dropped since they were
        attached leave the shard. Before, a backward, ``zero_grad()``, another backward and a step (a
        skipped batch, a backward in a callback or a validation step between steps) stepped with both
        backwards' gradients, where DDP steps with the last one's."""
        if self._window_done:
            self.open_window()
            return
        self._drop_zeroed()  # a backward the strategy did not start: its first gradient is in already
        # only inside the window: at grad_sync="every" a fragment this rank did not touch in a
        # non-final pass may hold other ranks' reduced gradients already, with its .grad None
        window = self._window_params
        self._leave_shard(lambda master, param, owner: master.grad is None and param in window)

    def open_window(self) -> None:
        """After an update: drop the window's gradients (the masters' and the reduced gradient shard);
        nothing before one (a later backward of the same window). Only those of the optimizers that
        stepped or were zeroed (``zero_grad()``): another optimizer's parameters keep accumulating until
        it steps, as ``param.grad`` does under DDP (a GAN in manual optimization with accumulation steps
        the generator before the discriminator's last backward of the window; the shard accumulates
        reduced passes, so what is kept and what comes add up to the window's gradient)."""
        if not self._window_done:
            return
        self._window_done = False
        stepped, self._stepped_in_window = self._stepped_in_window, set()
        self._grad_copy = None
        if all(id(opt) in stepped for opt in self.optimizers):
            for master, _, _ in self._master_slots:
                master.grad = None
            self.sync.zero_grad_shard()
            self._window_params = set()
            return
        # dropped when its optimizer stepped or the user zeroed it (zero_grad(): grad None)
        self._leave_shard(lambda master, param, owner: owner in stepped or master.grad is None)

    def _leave_shard(self, drop: Drop) -> None:
        """Take the fragments ``drop`` selects out of the window (:func:`leave_window`)."""
        grad_shard, params = self.sync.grad_shard, self.sync.params
        fragments = zip(self._master_slots, self.fragments, self._owners, strict=True)
        entries = ((m, id(params[s]), o, grad_shard, f.shard_lo, f.numel) for (m, _, s), f, o in fragments)
        leave_window(entries, drop, self._window_params)


__all__ = ["Drop", "GradWindow", "leave_window"]
