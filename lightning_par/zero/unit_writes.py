"""Writes into a ZeRO-3 unit's gathered parameters, kept in its shards as torch's DDP keeps a write in its
module.

:class:`UnitWrites` is a base of :class:`~lightning_par.zero.unit.Unit` and declares the attributes it
works on. Two ways in:

* gathered for compute (a forward that renormalises its weight, ``nn.Embedding(max_norm=...)``, a frozen
  statistic updated in place, a momentum update inside a step): :meth:`UnitWrites.absorb_writes` while the
  gathered values are the shards' own (``fresh``);
* gathered in the stored precision for ``gathered_params(writeback=True)``: :meth:`UnitWrites.keep_stored`
  at its exit, after :meth:`UnitWrites.take_back_stored`.

A parameter whose ``.data`` was replaced (torch's ``prune.remove``) is taken back into its slot of the
gathered buffer first (:func:`take_back`); another shape is refused.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_par.zero.param_writes import point_back

if TYPE_CHECKING:
    from lightning_par.zero.unit import Part


class UnitWrites:
    """Writes into the gathered parameters of a unit (see the module docstring)."""

    parts: list[Part]
    state: str
    fresh: bool
    gather_dtype: torch.dtype | None

    def written(self) -> list[str]:
        """Names of the parameters written in place through themselves (a bumped version counter) or
        pointed elsewhere (``.data`` replaced) since they were made whole or their writes last absorbed.
        Host-side only: writes through ``param.data`` are not counted here (:meth:`absorb_writes` finds
        them by value)."""
        return [part.names[i] for part in self.parts for i in self._written_slots(part)]

    def _written_slots(self, part: Part) -> list[int]:
        if self.state != "gathered" or part.stored is not None or not part.gathered_versions:
            return []
        base, size = part.full.data_ptr(), part.full.element_size()
        return [
            i
            for i, (p, s, version) in enumerate(
                zip(part.params, part.layout.slots, part.gathered_versions, strict=True)
            )
            if p._version != version or (s.numel and p.data_ptr() != base + s.offset * size)
        ]

    def absorb_writes(self, rank: int, world: int) -> None:
        """Keep what was written into the gathered parameters (a forward that renormalises its weight,
        ``nn.Embedding(max_norm=...)``, a frozen statistic updated in place), as torch's DDP keeps a write
        in its module: this rank's slice of the gathered buffer goes into its shard (the fp32 master of a
        trainable part, only where the values differ from the shard's compute copy, so an unwritten
        master keeps its low bits; the only copy of a frozen part). No host sync: element-wise ops. Ranks
        that write differently each keep their own values on the slice they hold (under DDP their
        replicas would drift apart).

        Only while :attr:`fresh`: after an optimizer update the gathered values are older than the
        shards, and copying them would undo the update. With a low-precision or quantized gather the
        slice is not the shard's compute copy, so only writes through the parameters themselves (not
        through ``.data``) are seen, by their version counters."""
        if self.state != "gathered" or not self.fresh:
            return
        for part in self.parts:
            if part.stored is not None or not part.gathered_versions:
                continue
            changed = self._written_slots(part)
            for i in changed:  # replaced .data (or shape): into the gathered buffer first
                take_back(part, i, part.full)
            # a frozen part (a teacher) written in a narrower gathered copy: said (a trainable one is
            # written by its forward, a renorm, whose rounding is the compute dtype's anyway)
            if changed and not part.trainable and part.full.dtype.itemsize < part.shard.dtype.itemsize:
                _rounded_writes([part.names[i] for i in changed], part.full.dtype)
            lo, hi = part.layout.buckets[0].shard_range(rank, world)
            own = part.full[lo:hi]
            if self.gather_dtype not in (None, part.full.dtype) and world > 1:
                slots = set(changed)
                for f in part.layout.fragments(rank):
                    if f.slot in slots:
                        source = part.full[lo + f.shard_lo : lo + f.shard_lo + f.numel]
                        part.shard[f.shard_lo : f.shard_lo + f.numel].copy_(source)
            elif part.shard.dtype == own.dtype:
                part.shard.copy_(own)  # bitwise equal where nothing was written
            elif torch.promote_types(own.dtype, part.shard.dtype) == part.shard.dtype:
                # as ZeRO 1/2 absorb writes to their compute copy (ShardedOptimizer.absorb_param_writes)
                torch.where(own != part.shard.to(own.dtype), own, part.shard, out=part.shard)
            else:  # a shard narrower than its gather (frozen_dtype below the compute dtype): rounded
                part.shard.copy_(torch.where(own != part.shard.to(own.dtype), own, part.shard.to(own.dtype)))
            part.gathered_versions = [p._version for p in part.params]

    def take_back_stored(self) -> None:
        """Inside :meth:`gather_stored`, before :meth:`keep_stored`: a parameter whose ``.data`` was
        replaced (torch's ``prune.remove`` sets ``orig.data`` to the pruned weight) has its new values put
        into ``stored`` and points there again; before, the replacement was dropped at the exit, silently
        (the unpruned weight came back)."""
        for part in self.parts:
            assert part.stored is not None, "take_back_stored() without gather_stored()"
            for i in range(len(part.params)):
                take_back(part, i, part.stored)

    def keep_stored(self, group: ProcessGroup) -> None:
        """This rank's slice of each ``stored`` buffer (:meth:`gather_stored`) back into its shard:
        written elements change, the others are the shard's own values, bitwise."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        for part in self.parts:
            assert part.stored is not None, "keep_stored() without gather_stored()"
            lo, hi = part.layout.buckets[0].shard_range(rank, world)
            part.shard.copy_(part.stored[lo:hi])


def take_back(part: Part, i: int, buffer: Tensor) -> None:
    """Parameter ``i`` of ``part`` into its slot of ``buffer`` (the gathered ``full`` or ``stored``) where
    its ``.data`` was pointed elsewhere, and back onto that slot (:func:`point_back`)."""
    s = part.layout.slots[i]
    if s.numel:
        point_back(part.params[i], buffer[s.offset : s.end].view(s.shape), name=part.names[i], stage="ZeRO-3")


def _rounded_writes(names: list[str], dtype: torch.dtype) -> None:
    """Say that writes made in a narrower gathered copy keep its precision (a host-side verdict: the
    version counters found them). An EMA teacher moved inside a training step at ZeRO-3 in ``bf16-mixed``
    stayed where it was (its fp32 shards took bf16-rounded values whose small steps rounded away: 1.07e-3
    off ``"ddp"``, all of its movement), without a word."""
    shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
    warnings.warn(
        f"ZeRO-3: parameters were written in place inside a training step ({shown}), where they are gathered"
        f" in {dtype}: the write reaches their fp32 shards at that precision, so small steps (an EMA's or"
        " a momentum update's) round away, where 'ddp' adds them up in fp32. Make such updates inside"
        " `with trainer.strategy.gathered_params(writeback=True):` (fabric.strategy in Fabric) on every rank,"
        " which writes the fp32 shards.",
        stacklevel=3,
    )
