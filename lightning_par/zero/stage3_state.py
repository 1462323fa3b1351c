"""The state side of a ZeRO-3 engine: what a checkpoint, a snapshot or an export reads and writes.

:class:`Stage3State` is the base of :class:`~lightning_par.zero.stage3.Stage3Engine`; it holds no state of
its own and works on the engine's units (see :mod:`lightning_par.zero.unit`): the fragments the
optimizer owns (trainable parts), every piece this rank holds (trainable and frozen parts), loading them,
gathering the whole model one unit at a time, and the bytes held.

:func:`guard_unit_state_dicts` refuses a state dict taken from a submodule whose parameters are
placeholders (Hugging Face's ``save_pretrained`` or PEFT's adapter export in a callback during training
would write NaN weights without a word; :mod:`lightning_par.state_guard`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from lightning_par.collectives import all_gather_flat
from lightning_par.state_guard import OwnReads, guard_state_dicts
from lightning_par.zero.compressor_state import load_compressor_state
from lightning_par.zero.layout import Fragment
from lightning_par.zero.unit import Unit


class Stage3State:
    """Checkpoint/export access to a ZeRO-3 engine's shards (see the module docstring)."""

    module: nn.Module
    group: ProcessGroup
    rank: int
    world: int
    units: list[Unit]
    _holding: bool = False  # inside gathered() (stage3_join)
    _whole: bool = False  # unshard_all() left the model whole (after fit): the shards are history
    _masters: list[tuple[Unit, Fragment, Tensor]]
    _pool_bytes: int
    unused: frozenset[int]

    def absorb_gathered_writes(self) -> None:
        """In-place writes to the units gathered now go into the shards (:meth:`Unit.absorb_writes`):
        before an optimizer update (a root kept whole through a manual-optimization step), which then
        reads them, as under DDP, and before a state read. Inside ``gathered()`` they are left to its
        exit."""
        if not self._holding and not self._whole:
            for unit in self.units:
                unit.absorb_writes(self.rank, self.world)

    def fragment_table(self) -> list[tuple[str, int, int, Tensor]]:
        """``(param name, lo, hi, shard view)`` for every trainable fragment this rank owns; the views are
        the optimizer's parameters (optimizer state is keyed by them) once optimizers are sharded."""
        if self._masters:
            return [(unit.names[f.slot], f.param_lo, f.param_hi, view) for unit, f, view in self._masters]
        return [row for u in self.units if u.train is not None for row in u.train.fragments(self.rank)]

    def stepped_tensors(self) -> list[Tensor]:
        """The tensors the rebuilt optimizers step (this rank's fragment views; none before they are)."""
        return [view for _, _, view in self._masters]

    @property
    def shards_params(self) -> bool:
        """Parameters live as shards, until :meth:`unshard_all` (after fit) leaves the model whole on every
        rank: from then on exports and checkpoints read the model itself, as at stages 0-2, so what the
        user does to it after fit (in-place edits, a merge that replaces modules, a resized embedding)
        is what they save, as under DDP."""
        return not self._whole

    def bucket_order(self) -> list[str]:
        """Empty: units follow the module structure, not a recorded flat order."""
        return []

    @property
    def sharded_param_ids(self) -> frozenset[int]:
        """Ids of the parameters the units hold, trainable and frozen. A parameter attached to the model
        after setup (an EMA copy made in ``on_fit_start``) is not among them: it is whole on every rank,
        and checkpoints take it whole."""
        return frozenset(id(p) for u in self.units for part in u.parts for p in part.params)

    @property
    def unused_param_ids(self) -> frozenset[int]:
        """Ids of the parameters no rank used in the last synchronised window (``find_unused_parameters``:
        their ``grad`` stays None, as under DDP)."""
        return self.unused

    def param_shards(self) -> list[tuple[str, int, int, Tensor]]:
        """The engine protocol's name for :meth:`shard_table`."""
        return self.shard_table()

    def load_param_shards(self, values: Callable[[str, int, int], Tensor | None]) -> None:
        """The engine protocol's name for :meth:`load_fragments`."""
        self.load_fragments(values)

    def shard_table(self) -> list[tuple[str, int, int, Tensor]]:
        """``(param name, lo, hi, shard view)`` for every parameter piece this rank holds, trainable and
        frozen: the model's share of a checkpoint or snapshot."""
        self.absorb_gathered_writes()
        return [row for u in self.units for part in u.parts for row in part.fragments(self.rank)]

    @torch.no_grad()
    def load_fragments(self, values: Callable[[str, int, int], Tensor | None]) -> None:
        """Overwrite this rank's shards (trainable and frozen) from ``values(name, lo, hi)`` (flattened
        elements; None = keep)."""
        for name, lo, hi, view in self.shard_table():
            value = values(name, lo, hi)
            if value is not None:
                view.copy_(value.reshape(-1))

    @torch.no_grad()
    def full_state_dict(self, *, to_rank: int = 0) -> dict[str, Tensor]:
        """All parameters, trainable at master precision and frozen in their shard dtype (gathered from
        the shards one unit at a time: bounded memory), as CPU tensors on ``to_rank`` (other ranks get an
        empty dict); every name under which a tied parameter is registered is filled."""
        self.absorb_gathered_writes()
        aliases: dict[int, list[str]] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        out: dict[str, Tensor] = {}
        for unit in self.units:
            for part in unit.parts:
                full = torch.empty(part.layout.numel, dtype=part.shard.dtype, device=part.shard.device)
                all_gather_flat(full, part.shard, group=self.group)
                if self.rank == to_rank:
                    for p, s in zip(part.params, part.layout.slots, strict=True):
                        value = full[s.offset : s.end].view(s.shape).cpu().clone()
                        for name in aliases[id(p)]:
                            out[name] = value
        return out

    def memory_bytes(self) -> dict[str, int]:
        parts = [part for u in self.units for part in u.parts]
        shard = sum(part.shard.numel() * part.shard.element_size() for part in parts)
        frozen = sum(part.shard.numel() * part.shard.element_size() for part in parts if not part.trainable)
        live = sum(u.full_bytes for u in self.units if u.state != "sharded")
        grads = sum(
            u.grad_shard.numel() * u.grad_shard.element_size() for u in self.units if u.grad_shard is not None
        )
        largest = max(u.full_bytes for u in self.units)
        return {
            "param_shard": shard,
            "parameters": shard,
            "frozen_shard": frozen,
            "live_units": live,
            "grad_shard": grads,
            "gradients": grads,
            "comm": self._pool_bytes,
            "largest_unit": largest,
        }

    @torch.no_grad()
    def unshard_all(self) -> None:
        """Leave every parameter whole, trainable ones at master precision (e.g. after training, for use
        without the engine); the gathered buffers are released. Once: a second call (a second teardown)
        would gather the end-of-fit shards over what the model holds by then, the user's edits lost."""
        if self._whole:
            return
        self.absorb_gathered_writes()
        for unit in self.units:
            unit.free()
            for part in unit.parts:
                full = torch.empty(part.layout.numel, dtype=part.shard.dtype, device=part.shard.device)
                all_gather_flat(full, part.shard, group=self.group)
                for p, s in zip(part.params, part.layout.slots, strict=True):
                    p.data = full[s.offset : s.end].view(s.shape)
        self._whole = True

    def comm_state(self, *, average: bool = False) -> dict[str, Any] | None:
        """ZeRO-3 compresses without state (low-precision reduce-scatter at most): nothing to save."""
        return None

    def load_comm_state(self, saved: Mapping[str, Any] | None) -> None:
        """A checkpoint's PowerSGD residuals cannot continue at stage 3: dropped with a warning."""
        load_compressor_state(None, saved, {})

    def step_skipped(self) -> None:
        """Nothing to restart: stage 3's compression (``"fp16"`` / ``"bf16"``) keeps no state."""


def guard_unit_state_dicts(
    root: nn.Module, units: list[Unit], own: OwnReads, *, on_copy: Callable[[nn.Module], None] | None = None
) -> list[RemovableHandle]:
    """:func:`lightning_par.state_guard.guard_state_dicts` for the modules holding unit parameters: refused
    while a unit the module draws on is not gathered, and for ``root`` (outside ``own()``) while any unit
    is not (after ``fit`` the model is whole again). A copy of ``root`` (an EMA) holds parameters of its
    own: the root's check does not apply to it, ``on_copy(copy)`` does (see owned_hooks.py)."""
    owner = {id(p): u for u in units for part in u.parts for p in part.params}

    def holders(module: nn.Module) -> list[Unit]:
        found = {id(owner[id(p)]): owner[id(p)] for p in module.parameters(recurse=False) if id(p) in owner}
        return list(found.values())

    def reason(module: nn.Module) -> str | None:
        if all(u.state == "gathered" for u in holders(module)):
            return None
        return "ZeRO-3 shards here (NaN placeholders outside a forward; saving after fit also works)"

    def whole() -> str | None:
        if all(u.state == "gathered" for u in units):
            return None
        return "ZeRO-3 shards (NaN placeholders outside a forward)"

    return guard_state_dicts(
        root, holds=lambda m: bool(holders(m)), reason=reason, whole=whole, own=own, on_copy=on_copy
    )
