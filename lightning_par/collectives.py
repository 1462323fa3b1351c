"""Flat-tensor collectives under one name across torch versions.

torch 2.13 renamed ``all_gather_into_tensor``/``reduce_scatter_tensor`` to ``all_gather_single``/
``reduce_scatter_single`` and deprecated the old names; older releases (such as the GPU machines'
2.11) only have the old ones. Mechanisms call these two functions instead.
"""

from __future__ import annotations

from typing import Any

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
