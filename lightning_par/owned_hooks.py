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

Pickling
--------
``torch.save(module)`` / ``pickle.dumps`` of the module during the run (a callback logging the whole model
in ``on_train_end``, as ``"ddp"`` allows) failed on the engine's hooks, local functions ("Can't pickle
local object 'for_owner.<locals>.run'"). A hook from :func:`for_owner` is an object that pickles as
:class:`CopyHook`, the hook a copy sees anyway (nothing, or ``on_copy``): the unpickled module is a copy,
outside the run. ``on_pickle`` may refuse the pickling first (ZeRO-3: placeholders would be saved).
``copy.deepcopy`` gives the copy that :class:`CopyHook` too (before: the same hook, acting as one), so a
copy neither reaches the engine nor keeps it alive.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

_T = TypeVar("_T")

__all__ = ["CopyHook", "OwnedHook", "PlaceholderCopies", "copy_or_share", "for_owner"]


class CopyHook:
    """The hook a copy of the owner sees: ``on_copy(module)`` where given, else nothing (returns None)."""

    # no instance __dict__: torch's _WrappedHook (load_state_dict hooks) copies a hook's __dict__ onto
    # itself with functools.update_wrapper, where a `hook` attribute would replace its own
    __slots__ = ("on_copy",)

    def __init__(self, on_copy: Callable[[nn.Module], None] | None) -> None:
        self.on_copy = on_copy

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        if self.on_copy is not None:
            self.on_copy(module)


class OwnedHook(CopyHook):
    """``hook`` for ``owner`` only; :class:`CopyHook` for any other module (module docstring)."""

    __slots__ = ("hook", "on_pickle", "owner")

    def __init__(
        self,
        owner: nn.Module,
        hook: Callable[..., Any],
        *,
        on_copy: Callable[[nn.Module], None] | None,
        on_pickle: Callable[[], None] | None,
    ) -> None:
        super().__init__(on_copy)
        self.owner = weakref.ref(owner)  # no cycle through the module's own hook dictionary
        self.hook, self.on_pickle = hook, on_pickle

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if module is self.owner():
            return self.hook(module, *args, **kwargs)
        return super().__call__(module)

    def __deepcopy__(self, memo: dict[int, Any]) -> CopyHook:
        return CopyHook(copy.deepcopy(self.on_copy, memo))  # what this hook does for the copy anyway

    def __reduce__(self) -> tuple[type[CopyHook], tuple[Callable[[nn.Module], None] | None]]:
        if self.on_pickle is not None:
            self.on_pickle()
        return CopyHook, (self.on_copy,)


class _EagerOwnedHook(OwnedHook):
    __slots__ = ()
    # run eagerly inside a torch.compile'd model (a graph break): Python state a graph would not replay
    __call__ = torch.compiler.disable(OwnedHook.__call__)


def for_owner(
    owner: nn.Module,
    hook: Callable[..., Any],
    *,
    on_copy: Callable[[nn.Module], None] | None = None,
    on_pickle: Callable[[], None] | None = None,
    eager: bool = False,
) -> OwnedHook:
    """``hook`` for ``owner`` only (any torch module hook: the module comes first); for another module,
    a copy of ``owner`` that carries the hook, ``on_copy(module)`` runs instead and the hook returns None
    (no change to the call). Pickled with its module, the hook is such a copy's (``on_pickle()`` first,
    which may refuse). ``eager``: not traced by ``torch.compile`` (``torch.compiler.disable``)."""
    kind = _EagerOwnedHook if eager else OwnedHook
    return kind(owner, hook, on_copy=on_copy, on_pickle=on_pickle)


class PlaceholderCopies:
    """Refuses a module whose floating-point parameters include one that is entirely NaN: a copy made
    while ZeRO-3 parameters were placeholders. Each module is checked once."""

    def __init__(self) -> None:
        self._checked: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def __reduce__(self) -> tuple[type[PlaceholderCopies], tuple[()]]:
        return PlaceholderCopies, ()  # the modules unpickled are checked afresh

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


def copy_or_share(obj: _T, memo: dict[int, Any], *, share: bool) -> _T:
    """``copy.deepcopy``'s result for ``obj`` (a strategy or precision plugin, reached by copying a
    module that holds it): ``obj`` itself when ``share`` (it holds the run's process groups, which cannot
    be copied: the copy computes beside the original, over the same ranks), else a copy of its attributes,
    as ``copy.deepcopy`` makes one by default."""
    if share:
        return obj
    new = object.__new__(type(obj))
    memo[id(obj)] = new
    new.__dict__.update(copy.deepcopy(obj.__dict__, memo))
    return new
