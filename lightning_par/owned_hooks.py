"""Engine hooks act on the modules they were registered on, not on copies of them.

Why
---
``copy.deepcopy`` of a module copies its hook dictionaries, so a copy made after setup (an EMA or teacher
model: ``copy.deepcopy(model.module)``, ``torch.optim.swa_utils.AveragedModel``) carried the engine's
hooks. At ZeRO-3 its forward gathered and freed the *original's* units, and ``state_dict()`` of the copy
was refused as if its parameters were shards, although a copy made inside ``gathered_params()`` holds
whole weights of its own. A copy made while the parameters were ZeRO-3 placeholders (outside a step and
outside ``gathered_params()``) holds NaN copies of them, and computed NaN without a word.

How
---
:func:`for_owner` wraps a hook so that it runs for the module it was registered on only; called for
another module (a copy) it does nothing, or runs an ``on_copy`` check. :class:`PlaceholderCopies` is
that check for ZeRO-3: the first forward or ``state_dict()`` of a copy whose parameters are all NaN
(what a placeholder's copy holds) is refused, naming the fix; a copy passes the check once and is not
looked at again (one host read per copy, outside any step of the original).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["PlaceholderCopies", "for_owner"]


def for_owner(
    owner: nn.Module, hook: Callable[..., Any], *, on_copy: Callable[[nn.Module], None] | None = None
) -> Callable[..., Any]:
    """``hook`` for ``owner`` only (any torch module hook: the module comes first); for another module,
    a copy of ``owner`` that carries the hook, ``on_copy(module)`` runs instead and the hook returns None
    (no change to the call)."""
    ref = weakref.ref(owner)  # no cycle through the module's own hook dictionary

    def run(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if module is ref():
            return hook(module, *args, **kwargs)
        if on_copy is not None:
            on_copy(module)
        return None

    return run


class PlaceholderCopies:
    """Refuses a module whose floating-point parameters include one that is entirely NaN: a copy made
    while ZeRO-3 parameters were placeholders. Each module is checked once."""

    def __init__(self) -> None:
        self._checked: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def __call__(self, module: nn.Module) -> None:
        if module in self._checked:
            return
        params = [p for p in module.parameters() if p.is_floating_point() and p.numel() > 0 and not p.is_meta]
        with torch.no_grad():
            copied = bool(torch.stack([p.isnan().all() for p in params]).any()) if params else False
        if copied:
            raise RuntimeError(
                f"This {type(module).__name__} is a copy (copy.deepcopy, AveragedModel) of a ZeRO-3 module"
                " made while its parameters were sharded: it holds NaN copies of their placeholders, so it"
                " would compute NaN. Make the copy inside `with strategy.gathered_params():`"
                " (trainer.strategy or fabric.strategy), on every rank, or before the strategy's setup."
            )
        self._checked.add(module)
