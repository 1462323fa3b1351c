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

from lightning_par.collectives import comm_device


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
    gradient of the global token mean (see the module docstring).

    The count lives on ``device`` (the communication device) and the factor ``N / (c T)`` is computed
    there, so a window costs one small all-reduce and no host synchronisation. A window without a valid
    token on any rank has a zero gradient (its loss is a sum over no tokens); ``T`` is clamped to 1 there,
    so the factor stays finite and the gradient stays zero instead of becoming NaN."""

    def __init__(self, *, group: ProcessGroup | None, device: torch.device | None = None) -> None:
        self.group = group
        self.device = device if device is not None else comm_device(group)  # where the count is reduced
        self._count: Tensor | None = None
        self._host_count = 0  # counts given as Python ints

    def add(self, n_tokens: int | Tensor) -> None:
        if isinstance(n_tokens, Tensor):
            n = n_tokens.detach().reshape(()).to(self.device, torch.int64, non_blocking=True)
            self._count = n if self._count is None else self._count + n
        else:
            self._host_count += int(n_tokens)

    def _local(self) -> Tensor:
        local = torch.full((), self._host_count, dtype=torch.int64, device=self.device)
        return local if self._count is None else local + self._count

    def global_count(self) -> Tensor:
        """``T`` over the window and the group (an int64 scalar on the device); resets the window."""
        total = self._local()
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(total, group=self.group)
        self._count, self._host_count = None, 0
        return total

    def grad_scale(self, *, loss_scale: float, dp_size: int) -> Tensor:
        """The factor ``N / (c T)`` for gradients reduced as ``(c/N) Σ ∇S`` (an fp32 scalar on the device,
        rounded once from fp64 as a Python float would be); resets the window."""
        tokens = self.global_count().clamp(min=1).to(torch.float64)
        return ((dp_size / loss_scale) / tokens).to(torch.float32)
