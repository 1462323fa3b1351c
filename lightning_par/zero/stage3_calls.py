"""ZeRO-3: a module of one unit called from outside that unit's forward is refused (first forward only).

Why
---
A unit's parameters are whole only around its own forward and backward (and, under a pipeline, across a
step's micro-batches); in between they are NaN placeholders. A model whose layer calls a submodule of
another layer (``self.peer.fc(x)``: layers sharing a projection by calling it, not by tying weights)
computed with those placeholders: NaN losses, and no error saying why. FSDP2 refuses such a call
through its DTensor parameters; here a guard names it.

How
---
During the engine's first forward (train or eval), a forward pre-hook sits on every module that holds a
non-root unit's parameters directly (the unit's own module excluded: calling it gathers the unit), and
the units' forwards are tracked as they run. A call while its unit's forward is not running and its
parameters are not gathered raises ``RuntimeError`` naming the module, its unit and the calling unit,
with the fix. The guard is removed when that forward completes, so later steps pay nothing; a call that
appears only in a later step is not caught. The root unit needs no guard: it is gathered for the whole
step, and outside a step its modules borrow it (``Stage3Engine._borrow_root``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_par.zero.unit import Unit

__all__ = ["CrossUnitGuard"]


class CrossUnitGuard:
    """The first-forward guard of a ZeRO-3 engine (module docstring); :meth:`remove` ends it."""

    def __init__(self, units: Sequence[Unit], root: Unit | None) -> None:
        self._running: list[Unit] = []  # units whose forward is running, innermost last
        self._handles: list[RemovableHandle] = []
        eager = torch.compiler.disable  # Python state a compiled graph would not replay
        for unit in units:
            if unit is root:
                continue
            module = unit.module
            self._handles.append(module.register_forward_pre_hook(eager(partial(self._enter, unit))))
            self._handles.append(
                module.register_forward_hook(eager(partial(self._leave, unit)), always_call=True)
            )
            mine = {id(p) for part in unit.parts for p in part.params}
            for name, m in module.named_modules():
                if m is not module and any(id(p) in mine for p in m.parameters(recurse=False)):
                    where = f"{unit.name}.{name}" if unit.name else name
                    hook = eager(partial(self._check, unit, where))
                    self._handles.append(m.register_forward_pre_hook(hook))

    def _enter(self, unit: Unit, module: nn.Module, args: Any) -> None:
        self._running.append(unit)

    def _leave(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        if self._running and self._running[-1] is unit:
            self._running.pop()

    def _check(self, unit: Unit, name: str, module: nn.Module, args: Any) -> None:
        if unit in self._running or unit.state == "gathered":
            return
        caller = f" from the forward of unit {self._running[-1].name!r}" if self._running else ""
        raise RuntimeError(
            f"ZeRO-3: {name!r}, a module of unit {unit.name!r}, was called{caller} outside that unit's"
            " forward. A unit's parameters are whole only around the forward and backward of its own"
            " module (NaN placeholders elsewhere), so this call would compute NaN. Choose units whose"
            " module's forward runs and contains every call of their parameters: zero3_units=[...] naming"
            " such modules (parameters of modules no unit contains stay in the root unit, whole for the"
            " whole step; an nn.ModuleList is no such unit, its forward never runs), or use zero_stage 0-2."
        )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._running = []
