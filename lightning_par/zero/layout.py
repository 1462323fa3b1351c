"""Flat-buffer layout of a parameter list: offsets, buckets and per-rank shards.

Parameters are packed, in a given order, into one flat buffer that is cut into buckets of about
``bucket_numel`` elements (a parameter never straddles two buckets). Each bucket is padded to a
multiple of ``shard_count`` so that it splits into ``shard_count`` equal, contiguous slices: rank ``r``
owns slice ``r`` of every bucket. A per-bucket reduce-scatter therefore lands exactly in the owner's
slice, and a per-bucket all-gather restores the full bucket. A rank's shard is the concatenation of its
slices, ``shard_numel = sum(bucket.numel) / shard_count`` elements.

The layout is pure arithmetic (no tensors, no communication), so it is unit-testable and the same on
every rank given the same parameter order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in the flat buffer."""

    index: int
    name: str
    shape: tuple[int, ...]
    offset: int
    bucket: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Bucket:
    """A contiguous, padded range ``[start, start + numel)`` of the flat buffer."""

    index: int
    start: int
    numel: int
    slots: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + self.numel

    def shard_range(self, rank: int, shard_count: int) -> tuple[int, int]:
        """Flat-buffer range ``[lo, hi)`` of this bucket owned by ``rank``."""
        size = self.numel // shard_count
        lo = self.start + rank * size
        return lo, lo + size


@dataclass(frozen=True)
class Fragment:
    """The part ``[param_lo, param_hi)`` (flattened indices) of one parameter that lies in a rank's shard,
    stored at ``[shard_lo, shard_lo + param_hi - param_lo)`` of that rank's shard buffer."""

    slot: int
    param_lo: int
    param_hi: int
    shard_lo: int

    @property
    def numel(self) -> int:
        return self.param_hi - self.param_lo


class FlatLayout:
    """Offsets of ``shapes`` (in that order) in a bucketed flat buffer, sharded ``shard_count`` ways."""

    def __init__(
        self,
        *,
        names: Sequence[str],
        shapes: Sequence[Sequence[int]],
        bucket_numel: int,
        shard_count: int = 1,
    ) -> None:
        if len(names) != len(shapes):
            raise ValueError(f"{len(names)} names for {len(shapes)} shapes.")
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}.")
        if shard_count < 1:
            raise ValueError(f"shard_count must be >= 1, got {shard_count}.")
        self.shard_count = shard_count
        slots: list[Slot] = []
        buckets: list[Bucket] = []
        current: list[int] = []
        start = offset = 0

        def close_bucket() -> None:
            nonlocal start, offset, current
            used = offset - start
            padded = -(-used // shard_count) * shard_count
            buckets.append(Bucket(index=len(buckets), start=start, numel=padded, slots=tuple(current)))
            start = offset = start + padded
            current = []

        for i, (name, shape) in enumerate(zip(names, shapes, strict=True)):
            slot = Slot(
                index=i, name=name, shape=tuple(int(s) for s in shape), offset=offset, bucket=len(buckets)
            )
            if current and offset - start + slot.numel > bucket_numel:
                close_bucket()
                slot = Slot(index=i, name=name, shape=slot.shape, offset=offset, bucket=len(buckets))
            slots.append(slot)
            current.append(i)
            offset += slot.numel
        if current:
            close_bucket()
        self.slots: tuple[Slot, ...] = tuple(slots)
        self.buckets: tuple[Bucket, ...] = tuple(buckets)
        self.numel = start
        self.shard_numel = self.numel // shard_count
        self.largest_bucket = max((b.numel for b in self.buckets), default=0)  # the pool's buffer size

    def fragments(self, rank: int) -> list[Fragment]:
        """The pieces of parameters that fall in ``rank``'s shard, in shard order."""
        out: list[Fragment] = []
        shard_lo = 0
        for bucket in self.buckets:
            lo, hi = bucket.shard_range(rank, self.shard_count)
            for i in bucket.slots:
                slot = self.slots[i]
                a, b = max(lo, slot.offset), min(hi, slot.end)
                if a < b:
                    out.append(
                        Fragment(
                            slot=i,
                            param_lo=a - slot.offset,
                            param_hi=b - slot.offset,
                            shard_lo=shard_lo + a - lo,
                        )
                    )
            shard_lo += hi - lo
        return out

    def describe(self) -> dict[str, object]:
        """Metadata that identifies this layout (saved with sharded checkpoints)."""
        return {
            "names": [s.name for s in self.slots],
            "shapes": [list(s.shape) for s in self.slots],
            "bucket_numel": [b.numel for b in self.buckets],
            "shard_count": self.shard_count,
        }
