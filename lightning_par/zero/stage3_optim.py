"""The optimizer side of a ZeRO-3 engine: the user's optimizers over this rank's shards.

Contract
--------
:class:`Stage3Optim` is a base of :class:`~lightning_par.zero.stage3.Stage3Engine` and declares the engine
attributes it works on. :meth:`~Stage3Optim.shard_optimizers` rebuilds each optimizer over this rank's
fragments of every unit's trainable shard: views of the shard itself, so the shard is the fp32 master and
an optimizer step updates exactly what the next gather reads (frozen parameters get no fragment and no
state). After a window's final backward the reduced gradient shard is attached to the masters: a view
when the dtypes agree, else a copy in the master's dtype, and ``None`` for parameters no rank used.
:meth:`~Stage3Optim.scale_grads` multiplies wherever the optimizer reads: the shards, and the copies.
The accumulation window (which gradients an update uses, what ``zero_grad()`` drops) follows
:mod:`lightning_par.zero.grad_window`'s contract: :meth:`~Stage3Optim._mark_window`,
:meth:`~Stage3Optim._before_pass`, :meth:`~Stage3Optim.open_window`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_par.zero.grad_window import Drop, leave_window
from lightning_par.zero.grad_writes import refuse_written_grads
from lightning_par.zero.optimizer_rebuild import (
    inherit_param_attrs,
    optimizer_group_params,
    optimizer_of,
    rebuild_optimizer,
)
from lightning_par.zero.stage3_state import Stage3State


class Stage3Optim(Stage3State):
    """Optimizer sharding and gradient attachment of a ZeRO-3 engine (see the module docstring)."""

    allow_untested_optimizer: bool
    optimizers: list[Optimizer]
    _group_params: list[list[list[nn.Parameter]]]
    _grad_views: list[Tensor | None]
    _handles: list[RemovableHandle]
    unused: frozenset[int]
    _touched: dict[int, bool]
    _master_owners: list[int]  # per master fragment, its optimizer's id
    _stepped_in_window: set[int]  # ids of the optimizers that stepped since the window opened
    _window_params: set[int]  # ids of the parameters with gradients in this window

    # ------------------------------------------------------------------ optimizer
    def shard_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Rebuild ``optimizers`` over this rank's fragments of every unit's trainable shard (the fp32
        masters); frozen parameters the optimizers hold get no fragment and no state."""
        names = {p: n for n, p in self.module.named_parameters()}
        trainable = [p for u in self.units for p in u.params]
        self.optimizers = list(optimizers)
        self._group_params = optimizer_group_params(
            self.optimizers, trainable, names, allow_untested=self.allow_untested_optimizer
        )
        masters: dict[int, list[Tensor]] = {}
        self._masters = []
        self._grad_copies: list[Tensor] = []  # gradient shards cast to the masters' dtype, this step
        # per master fragment, its view of the unit's gradient shard (which lives as long as the unit), made
        # once instead of sliced every step; None where the shard's dtype differs (a copy is sliced then)
        self._grad_views: list[Tensor | None] = []
        for unit in self.units:
            if unit.train is None:
                continue
            for f in unit.train.layout.fragments(self.rank):
                view = unit.train.shard[f.shard_lo : f.shard_lo + f.numel]
                inherit_param_attrs(view, unit.params[f.slot])
                masters.setdefault(id(unit.params[f.slot]), []).append(view)
                self._masters.append((unit, f, view))
                g = unit.grad_shard
                if g is not None and g.dtype == view.dtype:
                    self._grad_views.append(g[f.shard_lo : f.shard_lo + f.numel])
                else:
                    self._grad_views.append(None)
        owner_of = optimizer_of(self.optimizers, self._group_params)
        # the optimizer (its id) of each master fragment, for open_window; what stepped this window
        self._master_owners = [owner_of.get(id(unit.params[f.slot]), 0) for unit, f, _ in self._masters]
        self._stepped_in_window: set[int] = set()
        self._window_params: set[int] = set()  # ids of the parameters with gradients in this window
        ids = {id(p): n for p, n in names.items()}
        for opt, groups in zip(self.optimizers, self._group_params, strict=True):
            # its guards (groups added later, torch's state dicts) go with the engine's other hooks
            self._handles += rebuild_optimizer(opt, groups, masters, names=ids)
            # gradients written into param.grad refused; writes to parameters gathered now (a root kept
            # through a manual-optimization step) first
            self._handles.append(opt.register_step_pre_hook(lambda *_: self._before_update(trainable, ids)))

    def _before_update(self, trainable: list[nn.Parameter], names: dict[int, str]) -> None:
        refuse_written_grads(trainable, names=names)
        self.absorb_gathered_writes()

    def _attach_grads(self) -> None:
        """Point each master fragment's ``.grad`` at its slice of its unit's gradient shard, or of one
        copy of that shard in the masters' dtype (a reduction dtype other than the masters'): one cast
        kernel per unit instead of one per fragment."""
        copies: dict[int, Tensor] = {}
        window = self._window_params
        for (unit, f, master), view in zip(self._masters, self._grad_views, strict=True):
            param = id(unit.params[f.slot])
            # unused in this pass: what earlier passes of the window reduced stays (see ShardedOptimizer)
            if param not in self.unused:
                window.add(param)
            elif param not in window:
                master.grad = None
                continue
            if view is not None:
                master.grad = view
            else:
                assert unit.grad_shard is not None
                if id(unit) not in copies:
                    copies[id(unit)] = unit.grad_shard.to(master.dtype)
                master.grad = copies[id(unit)][f.shard_lo : f.shard_lo + f.numel]
        self._grad_copies = list(copies.values())

    def _mark_window(self) -> None:
        """The end of a non-final pass (``no_sync``): each master fragment whose parameter the window's
        passes gave a gradient points its ``.grad`` at its slice of its unit's gradient shard (what the
        window reduced so far), so that a ``zero_grad()`` before the window ends shows as None and the
        next pass's start drops it (``_before_pass``; see ``GradWindow._mark_window``). Not where the
        shard's dtype is not the masters'."""
        window = self._window_params
        for (unit, f, master), view in zip(self._masters, self._grad_views, strict=True):
            param = id(unit.params[f.slot])
            if view is not None and self._touched[param]:
                master.grad = view
                window.add(param)

    _window_done = False  # an update has used this window's gradients

    def _before_pass(self) -> None:
        """The first gradient of a backward pass: after an update the window opens; otherwise the
        gradients ``zero_grad()`` dropped since they were attached leave the units' shards (see
        ``GradWindow._before_pass`` in :mod:`lightning_par.zero.grad_window`)."""
        if self._window_done:
            self.open_window()
            return
        window = self._window_params
        self._leave_shard(lambda master, param, owner: master.grad is None and param in window)

    def open_window(self) -> None:
        """After an update: drop the window's gradients (the masters' and every unit's gradient shard);
        nothing before one (a later backward of the same window). Another optimizer's parameters keep
        theirs until it steps (see ``GradWindow.open_window``)."""
        if not self._window_done:
            return
        self._window_done = False
        stepped, self._stepped_in_window = self._stepped_in_window, set()
        self._grad_copies = []
        if all(id(opt) in stepped for opt in self.optimizers):
            for _, _, master in self._masters:
                master.grad = None
            for unit in self.units:
                if unit.grad_shard is not None:
                    unit.grad_shard.zero_()
            self._window_params = set()
            return
        # stepped, or zeroed by the user (zero_grad(): grad None)
        self._leave_shard(lambda master, param, owner: owner in stepped or master.grad is None)

    def _leave_shard(self, drop: Drop) -> None:
        """Take the master fragments ``drop`` selects out of the window (``leave_window``, as stages
        1/2), each from its own unit's gradient shard."""
        fragments = zip(self._masters, self._master_owners, strict=True)
        entries = (
            (m, id(u.params[f.slot]), o, u.grad_shard, f.shard_lo, f.numel) for (u, f, m), o in fragments
        )
        leave_window(entries, drop, self._window_params)

    def group_params(self, index: int) -> list[list[nn.Parameter]]:
        return self._group_params[index]

    @torch.no_grad()
    def scale_grads(self, factor: float | Tensor) -> None:
        """Multiply the window's reduced gradients by ``factor``, wherever the optimizer reads them: the
        gradient shards, and master gradients that are copies of them (another dtype)."""
        for unit in self.units:
            if unit.grad_shard is not None:
                unit.grad_shard.mul_(factor)
        for copy in self._grad_copies:
            copy.mul_(factor)
