"""Flat-tensor collectives under one name across torch versions.

torch 2.13 renamed ``all_gather_into_tensor``/``reduce_scatter_tensor`` to ``all_gather_single``/
``reduce_scatter_single`` and deprecated the old names; older releases (such as the GPU machines'
2.11) only have the old ones. Mechanisms call these two functions instead.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(
    output: Tensor, input: Tensor, *, group: ProcessGroup | None, async_op: bool = False
) -> Any:
    """``output`` = concatenation over the ranks of ``group`` of each rank's ``input``."""
    return _all_gather(output, input, group=group, async_op=async_op)


def reduce_scatter_flat(
    output: Tensor, input: Tensor, *, group: ProcessGroup | None, async_op: bool = False
) -> Any:
    """``output`` on rank ``r`` = slice ``r`` of the element-wise SUM over ranks of ``input``."""
    return _reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def low_precision_mean(
    flat: Tensor, *, dtype: torch.dtype, group: ProcessGroup, scatter: bool
) -> tuple[Any, Tensor]:
    """Start averaging ``flat`` over ``group`` in ``dtype`` (fp16/bf16: half the bytes of fp32).

    ``flat`` is cast to ``dtype`` and divided by the group size *before* the SUM, so an fp16 sum cannot
    overflow where the mean would not (the order torch's ``fp16_compress_hook`` uses). Returns the work
    handle and the tensor that holds the mean once it completes: the whole mean (``scatter=False``, an
    all-reduce) or this rank's slice of it (``scatter=True``, a reduce-scatter; ``flat.numel()`` must
    divide by the group size). ``flat`` itself is not changed.
    """
    world = dist.get_world_size(group)
    send = flat.to(dtype, copy=True).div_(world)
    if not scatter:
        return dist.all_reduce(send, group=group, async_op=True), send
    out = torch.empty(flat.numel() // world, dtype=dtype, device=flat.device)
    return reduce_scatter_flat(out, send, group=group, async_op=True), out


def comm_device(group: ProcessGroup | None) -> torch.device:
    """Where tensors for collectives on ``group`` live when nothing else says: this process's CUDA device
    under NCCL (which moves CUDA tensors only; a CPU tensor on one rank and CUDA on another would go to
    different backends of a ``"cpu:gloo,cuda:nccl"`` group and never meet), else the CPU."""
    if group is not None and dist.is_initialized() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
