"""Writes made to whole parameters inside ``gathered_params(writeback=True)``, kept by sharded state.

Inside the context every rank holds the whole parameters in their stored precision (the fp32 masters of
ZeRO 1-3, ZeRO-3's frozen shards); at the exit each rank copies its own slice back into its shard. That
is right only if every rank wrote the same values: a write made on one rank alone (under
``if trainer.is_global_zero``) would reach that rank's slice only, and the shards would hold a mix. So the
ranks first compare an exact checksum of each buffer, the integer sum of its bit patterns (independent of
the summation order, so equal tensors give equal sums on any device), in one all-gather, and refuse
before any shard changes if they differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_sum(values: Tensor) -> Tensor:
    """The sum of ``values``' bit patterns as integers (int64): equal tensors give equal sums whatever the
    order of summation, unlike a floating-point sum."""
    return values.reshape(-1).view(_BITS[values.element_size()]).sum(dtype=torch.int64)


def refuse_unequal_writes(buffers: Sequence[tuple[str, Tensor]], *, group: ProcessGroup) -> None:
    """Raise, on every rank, if some ``(name, buffer)`` differs between the ranks of ``group`` (module
    docstring); one all-gather and one host read of the verdict."""
    if not buffers or dist.get_world_size(group) == 1:
        return
    sums = torch.stack([bit_sum(buffer) for _, buffer in buffers])
    table = [torch.empty_like(sums) for _ in range(dist.get_world_size(group))]
    dist.all_gather(table, sums, group=group)
    differ = (torch.stack(table) != sums).any(dim=0).tolist()
    names = sorted({name for (name, _), bad in zip(buffers, differ, strict=True) if bad})
    if names:
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        raise RuntimeError(
            f"gathered_params(writeback=True): the ranks wrote different values into {shown}. Each rank"
            " keeps its own slice of the sharded state, so every rank must make the same writes: run the"
            " update on every rank (not under `if trainer.is_global_zero`), from values equal on every"
            " rank. Nothing was written back."
        )
