"""Token-exact loss normalisation for gradient accumulation with variable-length (masked) batches.

The loss of one optimizer step over micro-batches ``k`` on data-parallel ranks ``r`` should be

    L = Σ_{r,k} Σ_t l_{r,k,t}  /  T,        T = Σ_{r,k} n_{r,k}   (valid, unmasked tokens)

Averaging per-micro-batch means instead, ``(1/NK) Σ_{r,k} (Σ_t l_{r,k,t} / n_{r,k})``, weights tokens of
short micro-batches more: the gradient-accumulation bug many trainers shipped until late 2024. ``T`` is
known only after the last micro-batch of the window on every rank, but gradients are linear in the loss,
so the exact gradient is recovered after the fact:

* each micro-batch back-propagates its token-loss **sum** ``S_{r,k}`` (scaled by any constant ``c``:
  Lightning divides by ``K``, the data-parallel average divides by ``N``) and records ``n_{r,k}``;
* at the window's end, ``T`` is all-reduced and the reduced gradient ``(c/N) Σ ∇S`` is multiplied by
  ``N / (c T)``, giving ``∇L`` exactly (up to fp32 round-off).

:class:`TokenNormalizer` does the bookkeeping; ``HybridParallelStrategy.token_normalized`` wires it into
Lightning, see its docstring.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup


def token_loss_sum(logits: Tensor, targets: Tensor, *, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """``(Σ_t l_t, n)``: the summed cross-entropy over valid tokens and their count (targets equal to
    ``ignore_index`` are masked out)."""
    flat_targets = targets.reshape(-1)
    loss = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), flat_targets, ignore_index=ignore_index, reduction="sum"
    )
    return loss, (flat_targets != ignore_index).sum()


class TokenNormalizer:
    """Counts valid tokens over an accumulation window and turns summed-loss gradients into the
    gradient of the global token mean (see the module docstring)."""

    def __init__(self, *, group: ProcessGroup | None) -> None:
        self.group = group
        self._count = 0

    def add(self, n_tokens: int | Tensor) -> None:
        self._count += int(n_tokens)

    @property
    def local_count(self) -> int:
        return self._count

    def global_count(self) -> int:
        """``T`` over the window and the group; resets the window."""
        total = torch.tensor([self._count], dtype=torch.int64)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(total, group=self.group)
        self._count = 0
        return int(total.item())

    def grad_scale(self, *, loss_scale: float, dp_size: int) -> float:
        """The factor ``N / (c T)`` for gradients reduced as ``(c/N) Σ ∇S``; resets the window."""
        tokens = self.global_count()
        if tokens == 0:
            raise ValueError(
                "No valid tokens in this optimizer step on any rank: every target is ignore_index. Check"
                " the masking of the batch."
            )
        return dp_size / (loss_scale * tokens)
