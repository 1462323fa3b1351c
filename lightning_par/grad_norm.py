"""Global gradient norms and clipping when gradients are spread over process groups.

The norm of the whole model's gradient is

    ||g||_p = ( sum over every element of the model of |g_i|^p )^(1/p)      (max |g_i| for p = inf)

Each rank holds some elements. :func:`global_grad_norm` sums ``|g_i|^p`` over the local tensors, then
all-reduces the partial sum over each group in ``groups`` in turn (``SUM``, or ``MAX`` for p = inf).
The caller passes groups across which the local tensors are *disjoint* pieces of the model: the dp group
for ZeRO shards, and later the tp group for tensor-parallel shards and the pp group for stages. Elements
replicated across a group must be counted on one member only; pass them in ``replicated`` with that
group's rank so they are weighted ``1/size`` there (exact for a sum, harmless for a max).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


def _local_sum(grads: Iterable[Tensor], norm_type: float) -> Tensor:
    total = torch.zeros((), dtype=torch.float32)
    for g in grads:
        g32 = g.detach().float()
        if math.isinf(norm_type):
            part = g32.abs().max() if g32.numel() else torch.zeros((), device=g.device)
            total = torch.maximum(total.to(part.device), part)
        else:
            total = total.to(g.device) + g32.abs().pow(norm_type).sum()
    return total


def global_grad_norm(
    grads: Sequence[Tensor],
    *,
    groups: Sequence[ProcessGroup] = (),
    norm_type: float = 2.0,
    replicated: Sequence[tuple[Sequence[Tensor], ProcessGroup]] = (),
) -> Tensor:
    """The p-norm of all gradient elements held by the ranks of ``groups`` (see the module docstring)."""
    if norm_type <= 0:
        raise ValueError(f"norm_type must be > 0 (or inf), got {norm_type}.")
    total = _local_sum(grads, norm_type)
    is_inf = math.isinf(norm_type)
    for tensors, group in replicated:
        part = _local_sum(tensors, norm_type).to(total.device)
        total = torch.maximum(total, part) if is_inf else total + part / dist.get_world_size(group)
    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(total, op=op, group=group)
    return total if is_inf else total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(
    grads: Sequence[Tensor],
    max_norm: float,
    *,
    groups: Sequence[ProcessGroup] = (),
    norm_type: float = 2.0,
    eps: float = 1e-6,
    replicated: Sequence[tuple[Sequence[Tensor], ProcessGroup]] = (),
    extra: Sequence[Tensor] = (),
) -> Tensor:
    """Scale ``grads`` (and the ``replicated`` ones, and ``extra`` ones that the norm does not count, such
    as second copies of tied parameters) in place so that the global norm is at most ``max_norm``; return
    the norm. Same coefficient as ``torch.nn.utils.clip_grad_norm_``: ``min(1, max_norm / (norm + eps))``."""
    norm = global_grad_norm(grads, groups=groups, norm_type=norm_type, replicated=replicated)
    coef = torch.clamp(max_norm / (norm + eps), max=1.0)
    for g in [*grads, *(t for tensors, _ in replicated for t in tensors), *extra]:
        g.mul_(coef.to(g.device, g.dtype))
    return norm
