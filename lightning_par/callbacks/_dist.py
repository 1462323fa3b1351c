"""The few world-level collectives the callbacks agree through (no-ops without torch.distributed).

Callbacks are Lightning adapters at the level of the whole job, so they use the default (world) group;
every rank must call each of these at the same point of its program.
"""

from __future__ import annotations

import socket
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

HOST = socket.gethostname()


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def gather_objects(obj: T) -> list[T]:
    """``obj`` of every rank, by rank."""
    if not initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: T, *, src: int = 0) -> T:
    if not initialized():
        return obj
    box: list[Any] = [obj]
    dist.broadcast_object_list(box, src=src)
    result: T = box[0]
    return result


def all_reduce(values: list[float] | torch.Tensor, *, op: str, device: torch.device) -> list[float]:
    """Element-wise ``"sum"``, ``"min"`` or ``"max"`` of ``values`` over all ranks (one collective), read
    back to the host once. A tensor already on ``device`` is reduced as it is (no host round trip first,
    which on a GPU would be a second sync)."""
    ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    if op not in ops:
        raise ValueError(f"op must be one of {sorted(ops)}, got {op!r}.")
    if isinstance(values, torch.Tensor):
        t = values.to(device=device, dtype=torch.float64).flatten()
    else:
        t = torch.tensor(values, dtype=torch.float64, device=device)
    if initialized():
        dist.all_reduce(t, op=ops[op])
    return [float(v) for v in t.tolist()]
