"""What the user's checkpoint hooks change in ``checkpoint["state_dict"]``, and how a load honours it.

Lightning hands ``on_save_checkpoint`` the checkpoint before it is written and ``on_load_checkpoint`` the
loaded one before the model takes its ``state_dict``: under ``"ddp"`` what a hook leaves there is what is
saved or loaded (zeroed or post-processed weights, a fresh head left out, keys renamed after a refactor).
Our checkpoints also keep the model in records beside ``state_dict``: per-rank parameter pieces (ZeRO-3,
tensor and pipeline parallelism, which the hooks do not see) and the fp32 masters of ZeRO 1-3 optimizers,
which would override the hook's values. A :class:`StateSnapshot` taken when a hook receives the dict tells
afterwards what it changed (:class:`StateEdits`), and the load applies the records through those edits:

* an entry **written** (a new value, or the same tensor changed in place) is loaded from ``state_dict``,
  over any record of that name, and the optimizer's fp32 master of it follows the loaded value;
* an entry **removed** is not loaded from the records either (with ``strict_loading=False`` the model's
  own value stays; the optimizer's moments still load, as torch's positional load does under ``"ddp"``);
* an entry **renamed** (the same object under another key) takes its records, optimizer state included,
  under the new name.

A save records its hooks' edits in the checkpoint's metadata (renames as removed and written), so the
load of a directory applies them too. Identity and in-place versions are compared, never values: no copy
and no device read. Where the parameters are in pieces the hooks get a :class:`PartialStateDict` (buffers
and other entries; reading a parameter's entry names the fixes), and a load hook that replaces it by
another dict is warned that the parameters it did not see load as saved. With whole files
(``save_distributed_checkpoint=False``) the state is gathered on global rank 0, the only writer; the other
ranks' hooks get :func:`rank_zero_view`'s zeros of the same names, shapes and dtypes, so a hook
that reads, rescales, removes or renames entries runs on every rank as under ``"ddp"`` (before, a plain
``{}`` there: ``KeyError`` on rank 1 while rank 0 went on alone).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import torch
from torch import Tensor

from lightning_par.checkpoint.optimizer_state import MASTER_KEY, Piece

EDITS_KEY = "state_dict_edits"  # in a checkpoint's metadata: the save hooks' edits

V = TypeVar("V")


def _version(value: Any) -> int:
    """A tensor's in-place write counter (one that does not track it, an inference tensor: -1)."""
    if not isinstance(value, Tensor):
        return -1
    try:
        return int(value._version)
    except RuntimeError:
        return -1


@dataclass(frozen=True)
class StateEdits:
    """Keys of a ``state_dict`` a hook wrote, removed, and renamed (old name -> new name)."""

    written: frozenset[str] = frozenset()
    removed: frozenset[str] = frozenset()
    renamed: Mapping[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.written or self.removed or self.renamed)

    def to_meta(self) -> dict[str, list[str]]:
        """For a checkpoint's metadata; a rename is its old key removed and its new key written (the
        saved ``state_dict`` holds the value under the new key)."""
        return {
            "written": sorted(self.written | set(self.renamed.values())),
            "removed": sorted(self.removed | set(self.renamed)),
        }

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any] | None) -> StateEdits:
        saved = (meta or {}).get(EDITS_KEY) or {}
        return cls(frozenset(saved.get("written", ())), frozenset(saved.get("removed", ())))

    def after(self, saved: StateEdits, state: Mapping[str, Any]) -> StateEdits:
        """These (a load hook's) edits on top of ``saved`` (the save hooks'), over the final ``state``."""
        written = {self.renamed.get(k, k) for k in saved.written if k not in self.removed}
        return StateEdits(
            frozenset({k for k in written if k in state} | self.written),
            frozenset(self.removed | {k for k in saved.removed if k not in state}),
            dict(self.renamed),
        )

    def name(self, key: str) -> str | None:
        """A record's name after the edits (None: removed)."""
        return None if key in self.removed else self.renamed.get(key, key)

    def records(self, records: Mapping[str, V]) -> dict[str, V]:
        """``records`` by name, renamed, without the removed ones."""
        out: dict[str, V] = {}
        for key, value in records.items():
            name = self.name(key)
            if name is not None:
                out[name] = value
        return out

    def over(self, records: Mapping[str, Any], state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` (the hook's), with the records under their names after the edits, and the written
        entries taken from ``state`` over any record."""
        out = {**state, **self.records(records)}
        for key in self.written:
            out[key] = state[key]
        return out

    def optimizer_pieces(self, pieces: Mapping[str, list[Piece]]) -> dict[str, list[Piece]]:
        """An optimizer's state pieces by name after the edits; the written and removed parameters' moments
        kept but not their fp32 masters, which follow the value the model loaded (or kept)."""
        out: dict[str, list[Piece]] = {}
        for key, parts in pieces.items():
            name = self.renamed.get(key, key)
            if key in self.removed or name in self.written:
                parts = [(lo, hi, {k: v for k, v in s.items() if k != MASTER_KEY}) for lo, hi, s in parts]
            out[name] = parts
        return out

    def shapes(self, saved: Mapping[str, Any], state: Mapping[str, Any]) -> dict[str, Any]:
        """The recorded parameter shapes ``saved`` (name -> shape) after the edits: renamed, the removed
        left out, the written ones at the shape of their value."""
        out = self.records(saved)
        for key in self.written:
            value = state.get(key)
            if isinstance(value, Tensor):
                out[key] = tuple(value.shape)
        return out


class StateSnapshot:
    """The entries of a ``state_dict`` as a hook receives it: each value (held, compared by identity) and
    its in-place version; :meth:`edits` compares a later state with it."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.source = state  # the object the hook receives (a replaced one is another)
        self._entries = {k: (v, _version(v)) for k, v in state.items()}

    def unchanged_sources(self, state: Mapping[str, Any]) -> dict[str, str]:
        """For each key of ``state`` whose value is one of the received tensors, unchanged (the same object
        at the same in-place version), the key it was received under: itself, the old name of a rename
        (a new dict of the same tensors), or the original of an alias the hook added."""
        source_of = {id(v): k for k, (v, _) in self._entries.items() if isinstance(v, Tensor)}
        found = {}
        for key, value in state.items():
            source = source_of.get(id(value))
            if source is not None and _version(value) == self._entries[source][1]:
                found[key] = source
        return found

    def edits(self, state: Mapping[str, Any]) -> StateEdits:
        source_of = {id(v): k for k, (v, _) in self._entries.items() if isinstance(v, Tensor)}
        written: set[str] = set()
        renamed: dict[str, str] = {}
        for key, value in state.items():
            before = self._entries.get(key)
            if before is None:
                source = source_of.get(id(value))
                if source is not None and source not in state and source not in renamed:
                    renamed[source] = key  # moved: the same object under a new name
                    before = self._entries[source]
                else:
                    written.add(key)
                    continue
            if before[0] is not value or _version(value) != before[1]:
                written.add(key)
        removed = {k for k in self._entries if k not in state and k not in renamed}
        return StateEdits(frozenset(written), frozenset(removed), renamed)


class PartialStateDict(dict[str, Any]):
    """The ``state_dict`` of a checkpoint directory whose parameters are in per-rank pieces (ZeRO-3,
    tensor or pipeline parallelism), as the hooks see it: buffers and other entries only. Reading a
    parameter's entry, or removing it (``del``, ``pop`` without a default), raises a ``KeyError`` that says
    so and names the fix (before, a bare one). A plain ``dict`` in the written file."""

    def __init__(self, state: Mapping[str, Any], *, elsewhere: frozenset[str]) -> None:
        super().__init__(state)
        self.elsewhere = elsewhere

    def _absent(self, key: str) -> KeyError:
        if key in self.elsewhere:
            return KeyError(
                f"checkpoint['state_dict'] has no {key!r}: this checkpoint is a directory whose parameters"
                " are in per-rank pieces (ZeRO-3, tensor or pipeline parallelism), so the checkpoint hooks"
                " see its buffers and other entries only. To read, change or remove weights in"
                " on_save_checkpoint / on_load_checkpoint, save whole files"
                " (HybridParallelStrategy(save_distributed_checkpoint=False)), or consolidate the directory"
                " into one file (lightning_par.checkpoint.consolidate) and load that; an entry a save hook"
                " writes under a parameter's name is saved and loaded over the pieces."
            )
        return KeyError(key)

    def __missing__(self, key: str) -> Any:
        raise self._absent(key)

    def __delitem__(self, key: str) -> None:  # `del sd[name]` of a parameter: said as a read is
        if key not in self:
            raise self._absent(key)
        super().__delitem__(key)

    _NO_DEFAULT: Any = object()

    def pop(self, key: str, default: Any = _NO_DEFAULT) -> Any:
        if key not in self and default is PartialStateDict._NO_DEFAULT:
            raise self._absent(key)
        return super().pop(key) if key in self else default


HIDDEN = (
    "checkpoint['state_dict'] of a checkpoint directory whose parameters are in per-rank pieces (ZeRO-3,"
    " tensor or pipeline parallelism), which the hook does not see (its buffers and other entries only)"
)
FIXES = (
    "To rename, drop or replace parameters in a hook, save whole files"
    " (HybridParallelStrategy(save_distributed_checkpoint=False)) or consolidate the directory into one file"
    " (lightning_par.checkpoint.consolidate) and load that."
)


# on_load_checkpoint replaced a PartialStateDict by another dict (a comprehension that filters or renames
# keys): the parameters it did not see load as saved, where a filter may have meant to drop some; a changed
# name that leaves the model without its parameters is refused by the load's check, with the reason
HIDDEN_LOAD = (
    f"on_load_checkpoint replaced {HIDDEN}: the parameters it did not see load from the pieces as saved."
    f" {FIXES}"
)


class _Shape(NamedTuple):
    """A tensor entry's description, broadcast from rank 0 by :func:`rank_zero_view`."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def rank_zero_view(
    state: dict[str, Any], *, is_global_zero: bool, broadcast: Callable[[Any], Any]
) -> dict[str, Any]:
    """``state`` (the whole state dict, on global rank 0; ``{}`` elsewhere) as the save hooks get it: on
    rank 0 itself, elsewhere the same keys with host tensors of the same shapes and dtypes holding zeros
    (one element each, expanded: no memory), other values as they are, from one object ``broadcast``
    (collective, every rank; the names and shapes only). A hook runs there as on rank 0 (copies, ``.cpu()``,
    a finiteness check, ``.item()``), on zeros; what it writes is not saved, rank 0 writes the file."""
    described = (
        {k: _Shape(tuple(v.shape), v.dtype) if isinstance(v, Tensor) else v for k, v in state.items()}
        if is_global_zero
        else None
    )
    described = broadcast(described)
    if is_global_zero:
        return state
    return {
        k: torch.zeros((), dtype=v.dtype).expand(v.shape) if isinstance(v, _Shape) else v
        for k, v in described.items()
    }


ZERO_VIEWS = (
    "on_save_checkpoint wrote in place into an entry of checkpoint['state_dict'] on a rank other than 0: with"
    " save_distributed_checkpoint=False the whole state is gathered on global rank 0, which writes the file,"
    " and the other ranks' hooks see its entries as zeros expanded to their shapes (no memory; .cpu() and"
    " .detach() return the same view), which take no in-place write. Assign a new value"
    " (sd[k] = sd[k] * 0.5) or clone first (sd[k].clone().mul_(0.5)); what a hook does on the other ranks is"
    " not saved"
)


def state_of(checkpoint: Mapping[str, Any]) -> Mapping[str, Any]:
    """The checkpoint's ``state_dict`` itself (an empty one included: the object the hooks receive), or
    an empty dict without one."""
    state = checkpoint.get("state_dict")
    return state if isinstance(state, Mapping) else {}
