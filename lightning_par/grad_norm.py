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

from lightning_par.collectives import comm_device


def group_size(group: ProcessGroup | None) -> int:
    """The ranks of ``group``; ``None`` is the default group, of 1 rank where none was initialised (the
    precision plugin under Lightning's own single-device strategy)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def by_device_dtype(tensors: Iterable[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    """Non-empty ``tensors`` (detached views, same storage) grouped for the fused foreach kernels, which
    take one device and dtype per call."""
    out: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        if t.numel():
            out.setdefault((t.device, t.dtype), []).append(t.detach())
    return out


def _local_sum(
    grads: Iterable[Tensor], norm_type: float, device: torch.device, dtype: torch.dtype = torch.float32
) -> Tensor:
    """``Σ |g_i|^p`` (``max |g_i|`` for p = inf) over ``grads`` as a ``dtype`` scalar on ``device``: one
    fused per-tensor norm kernel per (device, dtype), accumulated in ``dtype`` (fp32 by default, fp64
    for ``"64-true"``: every rank passes the same, the all-reduce needs it), and no host synchronisation."""
    is_inf = math.isinf(norm_type)
    total = torch.zeros((), dtype=dtype, device=device)
    for (_, grad_dtype), tensors in by_device_dtype(grads).items():
        # each tensor's norm in at least its own precision (the kernel refuses a narrowing dtype); this
        # rank's part of a global norm, which the first step's watch of local norms must not refuse
        with torch._C.DisableTorchFunction():
            norms = torch._foreach_norm(tensors, norm_type, dtype=torch.promote_types(grad_dtype, dtype))
        stacked = torch.stack(norms).to(device=device, dtype=dtype)
        part = stacked.max() if is_inf else stacked.pow(norm_type).sum()
        total = torch.maximum(total, part) if is_inf else total + part
    return total


def global_grad_norm(
    grads: Sequence[Tensor],
    *,
    groups: Sequence[ProcessGroup] = (),
    norm_type: float = 2.0,
    replicated: Sequence[tuple[Sequence[Tensor], ProcessGroup]] = (),
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The p-norm of all gradient elements held by the ranks of ``groups`` (see the module docstring), a
    ``dtype`` scalar on ``device`` (the communication device; default: the first gradient's, else the
    first group's communication device, :func:`~lightning_par.collectives.comm_device`: a rank without
    gradients must reduce where the others do)."""
    if norm_type <= 0:
        raise ValueError(f"norm_type must be > 0 (or inf), got {norm_type}.")
    if device is None:
        first = next((g for g in (*grads, *(t for ts, _ in replicated for t in ts))), None)
        device = first.device if first is not None else comm_device(groups[0] if groups else None)
    total = _local_sum(grads, norm_type, device, dtype)
    is_inf = math.isinf(norm_type)
    for tensors, group in replicated:
        part = _local_sum(tensors, norm_type, device, dtype)
        total = torch.maximum(total, part) if is_inf else total + part / group_size(group)
    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    for group in groups:
        if group_size(group) > 1:
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
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Scale ``grads`` (and the ``replicated`` ones, and ``extra`` ones that the norm does not count, such
    as second copies of tied parameters) in place so that the global norm is at most ``max_norm``; return
    the norm. Same coefficient as ``torch.nn.utils.clip_grad_norm_``: ``min(1, max_norm / (norm + eps))``."""
    norm = global_grad_norm(
        grads, groups=groups, norm_type=norm_type, replicated=replicated, device=device, dtype=dtype
    )
    coef = torch.clamp(max_norm / (norm + eps), max=1.0)  # on the device: no host read of the norm
    everything = [*grads, *(t for tensors, _ in replicated for t in tensors), *extra]
    for (dev, _), tensors in by_device_dtype(everything).items():
        torch._foreach_mul_(tensors, coef.to(dev))
    return norm


def param_grad_norms(
    pieces: Iterable[tuple[str, Tensor]],
    names: Sequence[str],
    *,
    groups: Sequence[ProcessGroup | None],
    norm_type: float,
    device: torch.device,
) -> dict[str, Tensor]:
    """Each parameter's gradient p-norm when its gradient lies in disjoint ``(name, piece)`` pieces over
    the ranks of ``groups`` (a rank may hold several pieces of a parameter, or none; the caller leaves out
    copies, so that each element is in one piece across those ranks): ``Σ |g_i|^p`` per name here, an
    all-reduce of that vector (with a count of the pieces) over each group in turn, then the p-th root
    (``max |g_i|`` for p = inf). A name no rank holds a gradient of is left out, as Lightning's
    ``grad_norm`` leaves out parameters whose ``grad`` is None; telling which requires one host read."""
    index = {n: i for i, n in enumerate(names)}
    is_inf = math.isinf(norm_type)
    acc = torch.zeros(2, len(names), dtype=torch.float32, device=device)  # partial sums; pieces held
    rows = [(index[name], grad.detach()) for name, grad in pieces]
    if rows:
        # one norm per piece, then one scatter into the per-name vector (no per-piece scalar updates)
        slots = torch.tensor([i for i, _ in rows], dtype=torch.int64, device=device)
        with torch._C.DisableTorchFunction():  # parts of global norms (see _local_sum)
            values = torch.stack([torch.linalg.vector_norm(g.float(), norm_type) for _, g in rows])
        values = values.to(device)
        if is_inf:
            acc[0].scatter_reduce_(0, slots, values, reduce="amax")
        else:
            acc[0].index_add_(0, slots, values.pow(norm_type))
        acc[1].index_add_(0, slots, torch.ones_like(values))
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(acc, op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM, group=group)
    norms = acc[0] if is_inf else acc[0].pow(1.0 / norm_type)
    held = acc[1].tolist()  # the one host read: which names the dict has
    return {n: norms[i] for i, n in enumerate(names) if held[i]}
