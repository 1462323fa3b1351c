"""Making the ranks of a group hold equal tensors: one rank's values broadcast to all.

Contract: after :func:`broadcast_module_states` (or :func:`broadcast_tensors`) every rank of ``group``
holds, in place, the values of the group's ``src_index``-th rank. Tensors are coalesced per (dtype,
device) into one flat broadcast each and copied back in the order they were given, so the cost is one
collective per (dtype, device) and every rank must pass the same tensors in the same order. Empty and
meta tensors (layers of other pipeline stages) are skipped; a group of one does nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

__all__ = ["broadcast_module_states", "broadcast_tensors"]


def broadcast_module_states(
    module: nn.Module, *, group: ProcessGroup, src_index: int = 0, params: bool = True, buffers: bool = True
) -> None:
    """Make every rank of ``group`` hold the parameters and/or buffers of its ``src_index``-th rank
    (meta tensors, such as layers of other pipeline stages, are skipped).

    Tensors are coalesced per dtype into one flat broadcast each, so this costs one collective per dtype.
    """
    if dist.get_world_size(group) == 1:
        return
    chosen = [*(module.parameters() if params else ()), *(module.buffers() if buffers else ())]
    broadcast_tensors(chosen, group=group, src_index=src_index)


def broadcast_tensors(tensors: Sequence[Tensor], *, group: ProcessGroup, src_index: int = 0) -> None:
    """Overwrite ``tensors`` in place with the ``src_index``-th rank's values, one flat broadcast per
    (dtype, device)."""
    if dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, src_index)
    by_key: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        if t.numel() > 0 and not t.is_meta:
            by_key.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for items in by_key.values():
            flat = torch.cat([t.detach().reshape(-1) for t in items])
            dist.broadcast(flat, src=src, group=group)
            offset = 0
            for t in items:
                # through .data, as DDP's broadcast: no version bump, so a buffer an earlier forward saved
                # for its backward (a BatchNorm's running statistics, with a second forward before the
                # backward in a Fabric loop) does not fail that backward
                t.data.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
