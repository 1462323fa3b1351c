"""The replicas of a tensor-parallel group must take the same steps: a one-time check of their gradients.

Every rank of a tensor-parallel group holds the *replicated* parameters (norm weights, biases of
row-parallel layers, layers a plan leaves whole) in full, and their gradients are equal on every rank
(summed over the group where each rank saw part of the computation), so the replicas stay equal. Code
that rescales gradients by what one rank sees breaks that silently: the usual case is
``torch.nn.utils.clip_grad_norm_(self.parameters(), ...)`` in a hook or a Fabric loop, which measures this
rank's slices only, so each rank clips by another factor and the replicated weights drift apart (0.0017
apart after 3 AdamW steps on a small Llama at tp2, measured). Lightning's clipping (``gradient_clip_val``,
``self.clip_gradients``, ``fabric.clip_gradients``) measures the whole model and is unaffected.

:func:`replicated_grad_mismatch` compares, over the group, the 2-norm of each replicated parameter's
gradient: one all-reduce of two numbers per parameter and one host read of the verdict, run at the
first optimizer step (where parameters sit in ZeRO 1-3 shards, ``param.grad`` is refused before any
such code sees it, so the check runs at stage 0). A per-rank clip changes a norm by its factor; the
tolerance (``rtol``) leaves room for non-deterministic kernels, whose differences are rounding-sized.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

# relative spread of a gradient norm over the group above which replicas disagree: replicated gradients are
# computed alike on every rank (bitwise on the CPU; non-deterministic GPU kernels differ by rounding, far
# below this), while a per-rank clip by two halves' norms can differ by well under 1% (0.8% in a probe)
RTOL = 1e-4


def replicated_grad_mismatch(
    module: nn.Module,
    *,
    sharded: Collection[str],
    group: ProcessGroup,
    device: torch.device,
    rtol: float = RTOL,
) -> list[tuple[str, float, float]]:
    """``(name, smallest, largest)`` gradient norm over the group of each replicated parameter (trainable,
    not in ``sharded``, not on the meta device) whose norms differ by more than ``rtol`` of the largest;
    ``[]`` when they agree. Collective over ``group``: every rank holds the same replicated names."""
    named = [
        (n, p) for n, p in module.named_parameters() if p.requires_grad and n not in sharded and not p.is_meta
    ]
    if not named:
        return []
    norms = torch.stack(
        [
            torch.linalg.vector_norm(p.grad.detach().float()).to(device)
            if p.grad is not None and not p.grad.is_sparse
            else torch.zeros((), device=device)
            for _, p in named
        ]
    )
    bounds = torch.cat([norms, -norms])
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
    high, low = bounds[: len(named)], -bounds[len(named) :]
    apart = (high - low) > rtol * high
    if not bool(apart.any()):  # the verdict reaches the host once, at the first step
        return []
    rows = torch.stack([apart.to(low.dtype), low, high], dim=1).tolist()  # the failure's one host read
    return [(name, lo, hi) for (name, _), (flag, lo, hi) in zip(named, rows, strict=True) if flag]


def mismatch_message(mismatch: list[tuple[str, float, float]], *, fabric: bool) -> str:
    """The error for :func:`replicated_grad_mismatch`'s findings, naming the fix for either front door."""
    name, low, high = mismatch[0]
    fix = (
        "fabric.clip_gradients(model, optimizer, max_norm=...)"
        if fabric
        else "Trainer(gradient_clip_val=...) or self.clip_gradients(optimizer, gradient_clip_val=...)"
    )
    return (
        f"Tensor parallelism: at the first optimizer step the gradient of {name!r}, which every rank of a"
        f" tensor-parallel group holds whole, differs across the group (norms {low:.6g} to {high:.6g};"
        f" {len(mismatch)} such parameter(s)), so the replicas would drift apart. Something rescaled each"
        " rank's gradients by what that rank sees alone: usually torch.nn.utils.clip_grad_norm_ over the"
        " model's parameters, which measures this rank's slices only. Clip with"
        f" {fix}, which measures the whole model. (Or the ranks' dropout masks differed: random numbers"
        " drawn on some tensor-parallel ranks only, after the strategy gave them one random state at"
        " setup; draw those from a generator of their own.)"
    )
