"""Refuse a state dict of a submodule whose parameters are not the model's weights.

Contract
--------
Users save models as training goes: ``pl_module.model.save_pretrained(dir)`` on rank 0 at an epoch's end,
PEFT's adapter export, ``torch.save(model.state_dict())``. Under ZeRO-3 a module's parameters are NaN
placeholders outside a forward, under tensor parallelism they are this rank's slices: such a save writes
no usable weights (NaN silently, or slices found out only when loading). :func:`guard_state_dicts` puts a
``state_dict`` pre-hook on each submodule of ``root`` that holds such parameters; when a traversal reaches
it, the hook asks ``reason(module)`` and raises with that reason and the fix (``consolidated_state_dict()``
on every rank, rank 0 saving its result).

A traversal that started at ``root`` passes the submodules' hooks: a module then receives its full name
under ``root`` as the prefix. With ``whole`` given, a hook on ``root`` itself refuses the traversal of the
whole model (``pl_module.state_dict()`` in a callback, ``torch.save(model.state_dict())`` at the end of a
Fabric loop) while ``whole()`` gives a reason, unless it is one of the strategies' own reads (buffers and
keys, beside the parameters they take from the shards), marked by :class:`OwnReads`.
Nothing is gathered: such saves run on rank 0 alone, where a collective would hang.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_par.owned_hooks import CopyHook, for_owner

__all__ = ["OwnReads", "guard_state_dicts", "reads_of"]
_READS_ATTR = "_lightning_par_own_reads"

FIX = (
    " Call strategy.consolidated_state_dict() on every rank (trainer.strategy or fabric.strategy; collective,"
    " the full state lands on rank 0, keyed from the whole model: for a submodule's own save strip its"
    " attribute prefix, e.g. full = strategy.consolidated_state_dict(), then on rank 0"
    " pl_module.model.save_pretrained(dir, state_dict={k.removeprefix('model.'): v for k, v in"
    " full.items()}))"
)


class OwnReads:
    """Marks the strategies' own traversals of the whole model: ``with own_reads(): module.state_dict()``
    (nested uses count)."""

    def __init__(self) -> None:
        self._depth = 0

    @contextmanager
    def __call__(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    @property
    def active(self) -> bool:
        return self._depth > 0

    def __deepcopy__(self, memo: dict[int, Any]) -> OwnReads:
        return OwnReads()  # a copy of the model (an EMA) is read by nobody's own traversal yet

    def __reduce__(self) -> tuple[type[OwnReads], tuple[()]]:
        return OwnReads, ()


def reads_of(module: nn.Module) -> OwnReads:
    """The one :class:`OwnReads` of the model ``module`` (kept on it): the engine's, the tensor-parallel
    and pipeline guards' and the front doors' marks of their own reads all count on the same object, also
    in runs that build no engine (evaluation below ZeRO-3)."""
    reads = module.__dict__.get(_READS_ATTR)
    if not isinstance(reads, OwnReads):
        reads = module.__dict__[_READS_ATTR] = OwnReads()
    return reads


def guard_state_dicts(
    root: nn.Module,
    *,
    holds: Callable[[nn.Module], bool],
    reason: Callable[[nn.Module], str | None],
    whole: Callable[[], str | None] | None = None,
    own: OwnReads | None = None,
    on_copy: Callable[[nn.Module], None] | None = None,
) -> list[RemovableHandle]:
    """Hook every submodule of ``root`` (not ``root``) for which ``holds(module)``; a traversal below
    ``root`` raises where ``reason(module)`` gives one. With ``whole``: also a traversal of ``root``
    outside ``own()`` while ``whole()`` gives a reason (see the module docstring); that one holds for
    ``root`` itself (the model's own reads: ``own``, else :func:`reads_of`), and a copy of it carrying the
    hook gets ``on_copy(copy)`` instead (by default the same check, for a ``whole()`` that holds for
    copies too: tensor-parallel slices, other pipeline stages' placeholders)."""
    found: dict[int, tuple[nn.Module, set[str]]] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        if module is not root and holds(module):
            found.setdefault(id(module), (module, set()))[1].add(name + ".")
    handles = [
        module.register_state_dict_pre_hook(_RefuseBelow(module, prefixes, reason, root))
        for module, prefixes in found.values()
    ]
    if whole is not None:
        check = _refuse_whole(whole, own or reads_of(root))
        top = weakref.ref(root)
        refuse = for_owner(
            root,
            check,
            on_copy=on_copy if on_copy is not None else lambda copy: check(copy, "", False),
            on_pickle=lambda: check(top(), "", False, pickled=True),
        )
        handles.append(root.register_state_dict_pre_hook(refuse))
    return handles


def _refuse_whole(whole: Callable[[], str | None], own: OwnReads) -> Callable[..., None]:
    def hook(module: nn.Module, prefix: str, keep_vars: bool, *, pickled: bool = False) -> None:
        # a copy of the model (an EMA, a teacher) is marked by its own reads
        why = None if own.active or reads_of(module).active else whole()
        if why is not None:
            # code that calls state_dict() itself on every rank (litgpt's save_lora_checkpoint) can run
            # inside the gather as it is
            gather = (
                ", enter `with strategy.gathered_params():` on every rank around the call (whole parameters"
                " inside; code of yours or a library's that calls model.state_dict() runs unchanged)"
                if "ZeRO-3" in why
                else ""
            )
            name = type(module).__name__
            subject = (
                f"The whole model ({name}) was pickled (torch.save(model), pickle.dumps)"
                if pickled
                else f"state_dict() of the whole model ({name}) was asked for"
            )
            raise RuntimeError(
                f"{subject} while its parameters are {why}, so it would not hold the model's weights"
                " (torch.save of it, a copy for later)." + FIX + gather + ", or save a checkpoint:"
                " trainer.save_checkpoint / fabric.save."
            )

    return hook


class _RefuseBelow:
    """The ``state_dict`` pre-hook of a submodule holding such parameters (module docstring). Pickled
    with its module (``torch.save(model)``), it refuses while ``reason`` gives one for the module, and
    is inert in the unpickled copy; a ``copy.deepcopy`` of the module gets one asking about the copy."""

    __slots__ = ("module", "name", "prefixes", "reason", "top")  # as owned_hooks.CopyHook

    def __init__(
        self,
        module: nn.Module,
        prefixes: set[str],
        reason: Callable[[nn.Module], str | None],
        root: nn.Module,
    ) -> None:
        self.name = min(prefixes).rstrip(".")
        self.prefixes, self.reason = prefixes, reason
        self.module, self.top = weakref.ref(module), weakref.ref(root)

    def __call__(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if prefix in self.prefixes:
            return
        why = self.reason(module)
        if why is not None and not _from_root(self.top(), module, prefix):
            raise RuntimeError(self._message(module, why, pickled=False))

    def _message(self, module: nn.Module, why: str, *, pickled: bool) -> str:
        start, what = (
            ("Pickling (torch.save(model), pickle.dumps)", "the pickle")
            if pickled
            else (
                "state_dict()",
                "this state dict (Hugging Face's save_pretrained, PEFT's adapter export, torch.save)",
            )
        )
        return (
            f"{start} reached {self.name!r} ({type(module).__name__}), whose parameters are {why}, so {what}"
            " would not hold the model's weights." + FIX
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> _RefuseBelow:
        # a deep copy of the module (memoised before its hook dictionaries are copied) gets the hook
        # for itself: its pickling asks about its own parameters, not the original's
        copied = memo.get(id(self.module()))
        if not isinstance(copied, nn.Module):
            return self
        top = self.top()
        return _RefuseBelow(copied, self.prefixes, self.reason, copied if top is None else top)

    def __reduce__(self) -> tuple[type[CopyHook], tuple[None]]:
        module = self.module()
        why = None if module is None else self.reason(module)
        if module is not None and why is not None:
            raise RuntimeError(self._message(module, why, pickled=True))
        return CopyHook, (None,)


def _from_root(root: nn.Module | None, module: nn.Module, prefix: str) -> bool:
    """Whether a traversal of ``root`` reached ``module`` under ``prefix``: a deep copy of a guarded
    module (an EMA attached to the model after setup) carries the hook under a path the hook was not
    registered for; its root's own traversal (the strategies' checkpoints) passes it too. One walk of
    the root's modules, for such copies only."""
    if root is None:
        return False
    return any(m is module and prefix == f"{n}." for n, m in root.named_modules(remove_duplicate=False))
