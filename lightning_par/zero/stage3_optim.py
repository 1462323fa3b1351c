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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_par.zero.sharded_optimizer import (
    inherit_param_attrs,
    optimizer_group_params,
    rebuild_optimizer,
)
from lightning_par.zero.stage3_state import Stage3State


class Stage3Optim(Stage3State):
    """Optimizer sharding and gradient attachment of a ZeRO-3 engine (see the module docstring)."""

    allow_untested_optimizer: bool
    optimizers: list[Optimizer]
    _group_params: list[list[list[nn.Parameter]]]
    _grad_views: list[tuple[Tensor, Tensor] | None]
    unused: frozenset[int]

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
        # per master fragment: (its unit's gradient shard, the fragment's view of it), made on first use
        self._grad_views: list[tuple[Tensor, Tensor] | None] = []
        for unit in self.units:
            if unit.train is None:
                continue
            for f in unit.train.layout.fragments(self.rank):
                view = unit.train.shard[f.shard_lo : f.shard_lo + f.numel]
                inherit_param_attrs(view, unit.params[f.slot])
                masters.setdefault(id(unit.params[f.slot]), []).append(view)
                self._masters.append((unit, f, view))
        for opt, groups in zip(self.optimizers, self._group_params, strict=True):
            rebuild_optimizer(opt, groups, masters)

    def _attach_grads(self) -> None:
        """Point each master fragment's ``.grad`` at its slice of its unit's gradient shard, or of one
        copy of that shard in the masters' dtype (a reduction dtype other than the masters'): one cast
        kernel per unit instead of one per fragment."""
        copies: dict[int, Tensor] = {}
        if len(self._grad_views) != len(self._masters):
            self._grad_views = [None] * len(self._masters)
        for i, (unit, f, master) in enumerate(self._masters):
            if id(unit.params[f.slot]) in self.unused:
                master.grad = None
                continue
            source = unit.grad_shard
            assert source is not None
            if source.dtype != master.dtype:
                if id(unit) not in copies:
                    copies[id(unit)] = source.to(master.dtype)
                master.grad = copies[id(unit)][f.shard_lo : f.shard_lo + f.numel]
                continue
            # the shard lives as long as its unit: its views are made once, not sliced every step (host
            # time that a GPU waits for, hundreds of fragments)
            cached = self._grad_views[i]
            if cached is None or cached[0] is not source:
                cached = self._grad_views[i] = (source, source[f.shard_lo : f.shard_lo + f.numel])
            master.grad = cached[1]
        self._grad_copies = list(copies.values())

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
