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

from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_par.owned_hooks import for_owner

__all__ = ["OwnReads", "guard_state_dicts"]

FIX = (
    " Call strategy.consolidated_state_dict() on every rank (trainer.strategy or fabric.strategy; collective,"
    " the full state lands on rank 0: e.g. model.save_pretrained(dir, state_dict=...))"
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
    ``root`` itself, and a copy of it carrying the hook gets ``on_copy(copy)`` instead."""
    found: dict[int, tuple[nn.Module, set[str]]] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        if module is not root and holds(module):
            found.setdefault(id(module), (module, set()))[1].add(name + ".")
    handles = [
        module.register_state_dict_pre_hook(_refuse(prefixes, reason, root))
        for module, prefixes in found.values()
    ]
    if whole is not None:
        refuse = for_owner(root, _refuse_whole(whole, own or OwnReads()), on_copy=on_copy)
        handles.append(root.register_state_dict_pre_hook(refuse))
    return handles


def _refuse_whole(whole: Callable[[], str | None], own: OwnReads) -> Callable[..., None]:
    def hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        why = None if own.active else whole()
        if why is not None:
            # code that calls state_dict() itself on every rank (litgpt's save_lora_checkpoint) can run
            # inside the gather as it is
            gather = (
                ", enter `with strategy.gathered_params():` on every rank around the call (whole parameters"
                " inside; code of yours or a library's that calls model.state_dict() runs unchanged)"
                if "ZeRO-3" in why
                else ""
            )
            raise RuntimeError(
                f"state_dict() of the whole model ({type(module).__name__}) was asked for while its"
                f" parameters are {why}, so it would not hold the model's weights (torch.save of it, a"
                " copy for later)." + FIX + gather + ", or save a checkpoint: trainer.save_checkpoint /"
                " fabric.save."
            )

    return hook


def _refuse(
    prefixes: set[str], reason: Callable[[nn.Module], str | None], root: nn.Module
) -> Callable[..., None]:
    name = min(prefixes).rstrip(".")
    top = weakref.ref(root)

    def hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if prefix in prefixes:
            return
        why = reason(module)
        if why is not None and not _from_root(top(), module, prefix):
            raise RuntimeError(
                f"state_dict() reached {name!r} ({type(module).__name__}), whose parameters are {why}, so"
                " this state dict (Hugging Face's save_pretrained, PEFT's adapter export, torch.save) would"
                " not hold the model's weights." + FIX
            )

    return hook


def _from_root(root: nn.Module | None, module: nn.Module, prefix: str) -> bool:
    """Whether a traversal of ``root`` reached ``module`` under ``prefix``: a deep copy of a guarded
    module (an EMA attached to the model after setup) carries the hook under a path the hook was not
    registered for; its root's own traversal (the strategies' checkpoints) passes it too. One walk of
    the root's modules, for such copies only."""
    if root is None:
        return False
    return any(m is module and prefix == f"{n}." for n, m in root.named_modules(remove_duplicate=False))
