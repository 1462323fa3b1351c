"""Tensor-parallel communication as autograd functions (Megatron-LM's conjugate pairs).

Each function names what it does in forward and what its gradient does in backward; forward and
backward are conjugate so that the composite layers compute exactly the unsharded function and its
gradient. ``group`` is the tensor-parallel group, passed explicitly.

=====================  ==============================  ==============================
function               forward                         backward
=====================  ==============================  ==============================
``copy_to``            identity ("f")                  all-reduce (sum)
``reduce_from``        all-reduce (sum) ("g")          identity
``gather_last``        all-gather along the last dim   keep this rank's slice
``scatter_last``       keep this rank's slice          all-gather along the last dim
``gather_seq``         all-gather along dim 1 (seq)    reduce-scatter along dim 1
``reduce_scatter_seq`` reduce-scatter along dim 1      all-gather along dim 1
``scatter_seq``        keep this rank's seq slice      all-gather along dim 1
=====================  ==============================  ==============================

Gloo and NCCL concatenate along dim 0; the sequence functions move dim 1 to the front and back.

Second derivatives (``torch.autograd.grad(..., create_graph=True)``: a gradient penalty, a PINN): a
backward run with grad mode on records what it computes, so each backward then applies its conjugate
*function* (``copy_to``'s all-reduce is ``reduce_from``, ``gather_seq``'s reduce-scatter is
``reduce_scatter_seq``, ...), whose own backward is the first function's forward again: the graph of
the gradient communicates as the forward does. With grad mode off (every ordinary backward) the
collectives run directly, as before. Raw collectives inside a recorded backward are invisible to
autograd: the second backward took an all-reduce for the identity (a Llama's gradient penalty at tp 2
ended 2.2e-5 from one process, where the penalty's whole effect is 5.0e-5) or failed on the all-gather's views
under sequence parallelism.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_par.collectives import all_gather_flat, reduce_scatter_flat


def _size(group: ProcessGroup) -> int:
    return dist.get_world_size(group)


def _all_reduce(x: Tensor, group: ProcessGroup) -> Tensor:
    if _size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _gather_dim(x: Tensor, dim: int, group: ProcessGroup) -> Tensor:
    n = _size(group)
    if n == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * front.shape[0], *front.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_flat(out, front, group=group)
    return out.movedim(0, dim)


def _split_dim(x: Tensor, dim: int, group: ProcessGroup) -> Tensor:
    n = _size(group)
    if n == 1:
        return x
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


def _reduce_scatter_dim(x: Tensor, dim: int, group: ProcessGroup) -> Tensor:
    n = _size(group)
    if n == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((front.shape[0] // n, *front.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out, front, group=group)
    return out.movedim(0, dim)


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        if torch.is_grad_enabled():  # create_graph: recorded, see the module docstring
            return _ReduceFrom.apply(grad, ctx.group), None
        return _all_reduce(grad, ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        if torch.is_grad_enabled():
            return _CopyTo.apply(grad, ctx.group), None
        return grad, None


class _GatherDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: ProcessGroup, reduce_back: bool) -> Tensor:
        ctx.dim, ctx.group, ctx.reduce_back = dim, group, reduce_back
        return _gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        if torch.is_grad_enabled():
            back = _ReduceScatterDim if ctx.reduce_back else _SplitDim
            return back.apply(grad, ctx.dim, ctx.group), None, None, None
        if ctx.reduce_back:
            return _reduce_scatter_dim(grad, ctx.dim, ctx.group), None, None, None
        return _split_dim(grad, ctx.dim, ctx.group), None, None, None


class _SplitDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: ProcessGroup) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _split_dim(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        if torch.is_grad_enabled():
            return _GatherDim.apply(grad, ctx.dim, ctx.group, False), None, None
        return _gather_dim(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: ProcessGroup) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter_dim(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        if torch.is_grad_enabled():
            return _GatherDim.apply(grad, ctx.dim, ctx.group, True), None, None
        return _gather_dim(grad, ctx.dim, ctx.group), None, None


def copy_to(x: Tensor, group: ProcessGroup) -> Tensor:
    """Forward identity, backward all-reduce: enters a tensor-parallel region with a replicated input."""
    return _CopyTo.apply(x, group)


def reduce_from(x: Tensor, group: ProcessGroup) -> Tensor:
    """Forward all-reduce, backward identity: leaves a region whose ranks hold partial sums."""
    return _ReduceFrom.apply(x, group)


def gather_last(x: Tensor, group: ProcessGroup) -> Tensor:
    """Forward all-gather along the last dim, backward keep this rank's slice."""
    return _GatherDim.apply(x, x.dim() - 1, group, False)


def scatter_last(x: Tensor, group: ProcessGroup) -> Tensor:
    """Forward keep this rank's slice of the last dim, backward all-gather."""
    return _SplitDim.apply(x, x.dim() - 1, group)


def gather_seq(x: Tensor, group: ProcessGroup) -> Tensor:
    """Forward all-gather along the sequence dim (1), backward reduce-scatter: sequence-parallel entry
    of a tensor-parallel region (its backward also sums the region's partial input gradients)."""
    return _GatherDim.apply(x, 1, group, True)


def gather_seq_replicated(x: Tensor, group: ProcessGroup) -> Tensor:
    """Forward all-gather along the sequence dim (1), backward keep this rank's slice: sequence
    parallelism ends before a replicated consumer, whose output gradient is the same on every rank."""
    return _GatherDim.apply(x, 1, group, False)


def reduce_scatter_seq(x: Tensor, group: ProcessGroup) -> Tensor:
    """Forward reduce-scatter along the sequence dim, backward all-gather: sequence-parallel exit."""
    return _ReduceScatterDim.apply(x, 1, group)


def scatter_seq(x: Tensor, group: ProcessGroup) -> Tensor:
    """Forward keep this rank's sequence slice, backward all-gather: enters the sequence-parallel regime
    from a replicated tensor."""
    return _SplitDim.apply(x, 1, group)
