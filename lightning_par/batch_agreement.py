"""The ranks of one tensor- or pipeline-parallel group must be fed the same batch: checked on the first
batch of each loop.

Why
---
Tensor-parallel layers split one computation over the tp ranks, and pipeline stages pass one batch's
activations on (the last stage reads the labels of its own copy of the batch), so the ranks that share a
data-parallel rank must read the same samples. Lightning's ``DistributedSampler`` is built over the dp
ranks (the strategies' ``distributed_sampler_kwargs``), but data split by the *global* rank is not: an
``IterableDataset`` sharded by ``trainer.global_rank`` / ``torch.distributed.get_rank()`` (Hugging Face's
``split_dataset_by_node``, streaming datasets that read the process group), a sampler of the user's own
with ``use_distributed_sampler=False``, or random augmentation in loader workers seeded by the global
rank (``seed_everything(workers=True)``). Nothing failed before: tp layers summed activations of other
samples, the last stage paired the first stage's inputs with other labels, and training went on,
silently wrong (measured: a pp2 run on an iterable dataset split by global rank trained to another
model than one process on the same samples).

How
---
:func:`batch_fingerprint` reduces a batch's tensors to six float64 numbers (how many, their elements,
and position-weighted sums of shapes and values), and :class:`BatchAgreement` all-gathers them over the
tp group and the pp group at the first batch of each loop (training, validation, test, predict: the
front door names the loop when it starts); a group whose ranks disagree raises on all of its ranks,
naming the ranks and the fix. One small all-gather per group and one host read, once per loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_par.zero.autograd_state import tensors_in

if TYPE_CHECKING:
    from lightning_par.mesh import ParallelMesh

__all__ = ["BatchAgreement", "batch_fingerprint"]

_FIX = (
    " Every rank of a tensor- or pipeline-parallel group computes one model on one batch (the last"
    " pipeline stage reads the labels of its own copy), so they must read the same samples; different"
    " ones would train a wrong model without an error. Split the data over the data-parallel ranks only:"
    " Lightning's DistributedSampler does so (use_distributed_sampler=True, the default, for a map-style"
    " dataset); an IterableDataset or a sampler of your own should use"
    " trainer.strategy.distributed_sampler_kwargs ({'num_replicas': dp size, 'rank': dp rank}) instead of"
    " trainer.global_rank / world_size (e.g. split_dataset_by_node(ds, rank=..., world_size=...) with"
    " those), and random augmentation in loader workers must not be seeded by the global rank"
    " (seed_everything(workers=True) seeds them so), nor noise drawn in a Lightning hook"
    " (on_after_batch_transfer) after a seed of the global rank (torch.manual_seed(seed + global_rank)):"
    " seed by the data-parallel rank there."
)


def batch_fingerprint(batch: Any, *, device: torch.device) -> Tensor:
    """Six float64 numbers that differ, but for a negligible chance, between batches with other tensors:
    the number of tensors, their elements, and sums over tensor ``i`` (weighted by ``i + 1``) of its
    number of dimensions, its sum, and its sum weighted by position (``1`` to ``2`` along the flattened
    tensor, so a permutation shows). Non-tensor leaves are left out; a sparse tensor counts as its
    indices and values, a nested tensor as its components (before, their reshape failed in torch).
    Computed where the tensors are, returned on ``device``."""
    leaves = [p for t in tensors_in(batch) if not t.is_meta for p in _dense_parts(t)]  # BatchEncoding etc.
    out = torch.zeros(6, dtype=torch.float64, device=device)
    for i, tensor in enumerate(leaves):
        flat = tensor.detach().reshape(-1)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        values = flat.to(torch.float64)
        weights = torch.linspace(1.0, 2.0, values.numel(), dtype=torch.float64, device=values.device)
        k = float(i + 1)
        row = torch.stack(
            [
                torch.ones((), dtype=torch.float64, device=values.device),
                torch.full((), float(values.numel()), dtype=torch.float64, device=values.device),
                torch.full((), k * tensor.dim(), dtype=torch.float64, device=values.device),
                k * values.sum(),
                k * (values * weights).sum(),
                torch.full((), k * sum(tensor.shape), dtype=torch.float64, device=values.device),
            ]
        )
        out += row.to(device)
    return out


def _dense_parts(tensor: Tensor) -> list[Tensor]:
    """The strided tensors holding ``tensor``'s values: itself, a sparse tensor's indices and values, or a
    nested tensor's components."""
    if tensor.is_nested:
        return list(tensor.unbind())
    if tensor.layout == torch.sparse_coo:
        coalesced = tensor.coalesce()
        return [coalesced.indices(), coalesced.values()]
    if tensor.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [tensor.crow_indices(), tensor.col_indices(), tensor.values()]
    if tensor.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [tensor.ccol_indices(), tensor.row_indices(), tensor.values()]
    return [tensor]


class BatchAgreement:
    """The first-batch check of each loop over ``groups`` (the tp and pp groups of size > 1; empty: never
    checks). ``expect(loop)`` when a loop starts, ``check(loop, batch)`` at each of its batches (only the
    first one after ``expect`` communicates)."""

    def __init__(self, groups: Sequence[tuple[str, ProcessGroup]], *, device: torch.device) -> None:
        self._groups = [(kind, g) for kind, g in groups if dist.get_world_size(g) > 1]
        self._device = device
        self._pending: set[str] = set()

    @classmethod
    def of_mesh(cls, mesh: ParallelMesh, *, device: torch.device) -> BatchAgreement:
        """The check over ``mesh``'s tensor- and pipeline-parallel groups."""
        return cls([("tensor-parallel", mesh.tp_group), ("pipeline", mesh.pp_group)], device=device)

    def expect(self, loop: str) -> None:
        if self._groups:
            self._pending.add(loop)

    def check(self, loop: str, batch: Any) -> None:
        if loop not in self._pending:
            return
        self._pending.discard(loop)
        mine = batch_fingerprint(batch, device=self._device)
        for kind, group in self._groups:
            gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, mine, group=group)
            table = torch.stack(gathered).cpu()  # the verdict reaches the host: one read, once per loop
            first = table[0]
            same = torch.isclose(table, first.expand_as(table), rtol=1e-9, atol=0.0).all(dim=1)
            if bool(same.all()):
                continue
            ranks = dist.get_process_group_ranks(group)
            apart = [r for r, ok in zip(ranks, same.tolist(), strict=True) if not ok]
            raise RuntimeError(
                f"The ranks of one {kind} group were given different {loop} batches: the first batch of"
                f" global rank(s) {apart} differs from that of rank {ranks[0]} (group {ranks})." + _FIX
            )
