"""Cross-entropy of vocab-sharded logits without gathering them (Megatron-LM style), over an explicit
tensor-parallel group of size ``t`` where rank ``r`` holds the logits of vocabulary ``[r V/t, (r+1) V/t)``
(a :class:`~lightning_par.tensor_parallel.layers.VocabParallelEmbedding`'s rows, or a column-parallel
head's): ``loss = log Σ_v exp(z_v - m) + m - z_target`` with the max ``m``, the sum and ``z_target`` each
all-reduced (MAX, SUM, SUM); the gradient is ``softmax - onehot`` on the local slice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, target: Tensor, group: ProcessGroup, start: int, ignore: int
    ) -> Tensor:
        logits = logits.float()
        m = logits.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - m.unsqueeze(-1)
        end = start + logits.shape[-1]
        outside = (target < start) | (target >= end)
        local = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(picked, group=group)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=group)
        loss = total.log() - picked
        ignored = target == ignore
        loss = loss.masked_fill(ignored, 0.0)
        ctx.save_for_backward(exp / total.unsqueeze(-1), local, outside, ignored)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        if torch.is_grad_enabled():  # the saved softmax is a constant: its second derivative would be lost
            raise RuntimeError(
                "vocab_parallel_cross_entropy has no second derivative: a backward with create_graph=True"
                " (a gradient penalty, torch.autograd.grad(loss, ..., create_graph=True)) cannot pass"
                " through it. Compute that loss with F.cross_entropy on gathered logits instead."
            )
        softmax, local, outside, ignored = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -(~outside).to(g.dtype).unsqueeze(-1))
        g = g * grad.masked_fill(ignored, 0.0).unsqueeze(-1)
        return g, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor, target: Tensor, *, group: ProcessGroup, ignore_index: int = -100
) -> Tensor:
    """Mean cross-entropy over non-ignored targets of vocab-sharded ``logits`` (``(..., V/t)``, rank ``r``
    holding vocabulary ``[r V/t, (r+1) V/t)``), without gathering the logits."""
    start = dist.get_rank(group) * logits.shape[-1]
    flat_t = target.reshape(-1)
    losses = _VocabParallelCE.apply(logits.reshape(-1, logits.shape[-1]), flat_t, group, start, ignore_index)
    valid = (flat_t != ignore_index).sum().clamp(min=1)
    return losses.sum() / valid
