"""Unsharded single-process references that add per-rank gradients in the order an all-reduce does.

Mathematically the gradient of a global batch does not depend on how it is split. In fp32 it does, at
the level of round-off, and Adam turns round-off into visible differences: its first updates are
``lr * g / (|g| + eps)``, so an element whose gradient is near zero moves by ±lr depending on the sign
of the noise. The reference below therefore computes the same partial sums the ranks compute (each
rank's micro-batches accumulated in order, then the ranks' totals added) and averages them exactly
(the scale is a power of two). For two ranks this is bit-for-bit the all-reduce; for more, Gloo's
summation order is its own, which is why the 4-rank checks use SGD, where round-off is not amplified.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

LossFn = Callable[[nn.Module, Tensor, Tensor], Tensor]


def _rank_sum(grads: list[Tensor | None]) -> Tensor | None:
    present = [g for g in grads if g is not None]
    if not present:
        return None
    acc = present[0]
    for g in present[1:]:
        acc = acc + g
    return acc


def data_parallel_backward(
    model: nn.Module,
    loss_fn: LossFn,
    x: Tensor,
    y: Tensor,
    *,
    world: int,
    micro: int,
    reduce_every_micro_batch: bool = False,
) -> list[float]:
    """Set every ``p.grad`` to the data-parallel average of the gradient of ``(x, y)`` split over ``world``
    ranks and ``micro`` micro-batches each; return each rank's summed (micro-batch-averaged) loss.

    Default order (``grad_sync="boundary"``): each rank accumulates its micro-batches, then the ranks'
    totals are added. ``reduce_every_micro_batch`` (``"every"``, ZeRO-3): the ranks' gradients of each
    micro-batch are added and halved into the running sum."""
    params = list(model.parameters())
    per = len(x) // world
    chunks = [
        list(
            zip(x[r * per : (r + 1) * per].chunk(micro), y[r * per : (r + 1) * per].chunk(micro), strict=True)
        )
        for r in range(world)
    ]
    totals = [torch.zeros(()) for _ in range(world)]

    def grads_of(r: int, ks: range) -> list[Tensor | None]:
        model.zero_grad(set_to_none=True)
        for k in ks:
            loss = loss_fn(model, *chunks[r][k]) / micro
            loss.backward()
            totals[r] += loss.detach()
        return [None if p.grad is None else p.grad.clone() for p in params]

    if reduce_every_micro_batch:
        result: list[Tensor | None] = [None] * len(params)
        for k in range(micro):
            per_rank = [grads_of(r, range(k, k + 1)) for r in range(world)]
            for i in range(len(params)):
                s = _rank_sum([g[i] for g in per_rank])
                if s is not None:
                    zero = torch.zeros_like(s) if result[i] is None else result[i]
                    result[i] = zero.add(s, alpha=1.0 / world)
    else:
        per_rank = [grads_of(r, range(micro)) for r in range(world)]
        result = [None] * len(params)
        for i in range(len(params)):
            s = _rank_sum([g[i] for g in per_rank])
            result[i] = None if s is None else s * (1.0 / world)
    for p, g in zip(params, result, strict=True):
        p.grad = g
    return [float(t) for t in totals]
