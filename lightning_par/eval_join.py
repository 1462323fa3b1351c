"""Evaluation loops whose data-parallel ranks run different numbers of batches, in the Trainer.

Lightning's ``trainer.predict`` splits the samples over the ranks without padding, and an iterable
dataset may end sooner on one rank; under ``"ddp"`` that is harmless, at ZeRO-3 each forward all-gathers
over the dp group and the rank that ran out would leave the others waiting in their next gather. At the
start of each evaluation loop the strategy compares the ranks' batch counts per dataloader
(:func:`eval_count_table`, one all-gather of a few integers). Equal counts: nothing changes. Uneven ones:
every gather becomes a round in which all ranks gather what any of them needs, and each rank, after
the last batch of each dataloader, serves the others' gathers until all are done
(:mod:`lightning_par.zero.stage3_join`). Refused before any batch,
with the fix: a dataloader that gives some rank no batch at all while others get some (that rank's loop
would never reach the point where it serves), an unsized dataloader followed by another (its end cannot
be told in advance), and uneven counts under pipeline parallelism with ZeRO-3.

Under pipeline parallelism (any other stage) evaluation communicates within the pipeline group only, but
the token-exact loss (``pipeline_loss`` returning ``{"loss_sum", "tokens"}``) averages each step over the
dp ranks' tokens: one all-reduce per step, which uneven counts cannot match. There each rank logs its own
batches' token mean instead, and Lightning's ``sync_dist`` averages the steps over the ranks, as it
averages any logged value under ``"ddp"``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class EvalJoin:
    """This rank's batch count per dataloader of an uneven evaluation loop (``-1``: unknown)."""

    counts: tuple[int, ...]

    def ends_dataloader(self, batch_idx: int, dataloader_idx: int, *, last_batch: bool) -> bool:
        """Whether the step ``(batch_idx, dataloader_idx)`` was this rank's last of that dataloader
        (``last_batch``: the loop's word, for a dataloader without a length, which is the last one)."""
        count = self.counts[dataloader_idx]
        return last_batch if count < 0 else batch_idx == count - 1


def _gather_counts(counts: Sequence[int], *, group: ProcessGroup, device: torch.device) -> list[list[int]]:
    mine = torch.tensor(list(counts), dtype=torch.int64, device=device)
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(table, mine, group=group)
    return torch.stack(table).tolist()  # one host read, at the loop's start


def eval_count_table(
    max_batches: Sequence[int | float], *, group: ProcessGroup, device: torch.device
) -> list[list[int]]:
    """Every dp rank's batch count per dataloader of the evaluation loop starting now (``max_batches``:
    this rank's, ``inf`` when unknown, given as ``-1``): one all-gather over ``group``."""
    return _gather_counts([-1 if math.isinf(c) else int(c) for c in max_batches], group=group, device=device)


def loop_dataloaders(trainer: Any, loop_name: str) -> list[object]:
    """The dataloaders of the Trainer's loop ``loop_name`` (``"training"`` or an evaluation loop's), in
    the loop's order."""
    names = {"training": "train_dataloader", "validation": "val_dataloaders", "test": "test_dataloaders"}
    attribute = names.get(loop_name, "predict_dataloaders")
    loaders = getattr(trainer, attribute, None)
    if isinstance(loaders, dict):
        return list(loaders.values())
    return list(loaders) if isinstance(loaders, list | tuple) else [loaders]


def last_batch_sizes(dataloaders: Sequence[object], max_batches: Sequence[int | float]) -> list[int]:
    """The size of this rank's last batch in each dataloader of a loop (``-1``: unknown, e.g. an iterable
    dataset): the remainder of its sampler over the batch size, unless the loop stops earlier
    (``limit_*_batches``) or the batch sampler drops it."""
    sizes = []
    for dataloader, count in zip(dataloaders, max_batches, strict=False):
        batches = getattr(dataloader, "batch_sampler", None)
        size, inner = getattr(batches, "batch_size", None), getattr(batches, "sampler", None)
        if not isinstance(size, int) or size < 1 or inner is None or not hasattr(inner, "__len__"):
            sizes.append(-1)
            continue
        rest = len(inner) % size
        full = rest == 0 or getattr(batches, "drop_last", False) or count < math.ceil(len(inner) / size)
        sizes.append(size if full else rest)
    return sizes


def refuse_short_last_batches(table: Sequence[Sequence[int]], *, num_microbatches: int, loop: str) -> None:
    """Under pipeline parallelism every training batch is cut into ``num_microbatches`` (the schedules
    are built for it): refuse, on every rank and before the first batch, a loop whose last batch on some
    dp rank (``table``: each dp rank's :func:`last_batch_sizes`) is smaller. Raised at that batch instead,
    only its rank would stop, and at ZeRO-3 its dp peers would wait in their gathers."""
    for r, row in enumerate(table):
        for k, last in enumerate(row):
            if 0 < last < num_microbatches:
                raise ValueError(
                    f"The {loop} dataloader {k} ends with a batch of {last} samples on data-parallel rank"
                    f" {r}, which cannot fill num_microbatches={num_microbatches} pipeline micro-batches."
                    f" Use a batch size of at least {num_microbatches} (each batch is cut into the"
                    " micro-batches) and a dataset size that leaves every rank's last batch at least"
                    f" {num_microbatches} samples (or drop_last=True), e.g. a dataset size that is a"
                    " multiple of the data-parallel size times the batch size; or fewer micro-batches."
                )


def refuse_uneven_short_batches(table: Sequence[Sequence[int]], *, num_microbatches: int, loop: str) -> None:
    """An evaluation batch smaller than ``num_microbatches`` runs in fewer micro-batches (as many as its
    samples); at ZeRO-3 under a pipeline the dp ranks evaluate in lockstep (their gathers paired), so
    refuse, on every rank and before the first batch, last batches (``table``: each dp rank's
    :func:`last_batch_sizes`; empty rows: nothing to check) that differ between the dp ranks where one
    is that small."""
    for k, column in enumerate(zip(*table, strict=True)):
        if len(set(column)) > 1 and any(0 < last < num_microbatches for last in column):
            sizes = ", ".join(f"dp rank {r}: {last}" for r, last in enumerate(column))
            raise ValueError(
                f"The {loop} dataloader {k} ends with batches of different sizes on the data-parallel"
                f" ranks ({sizes}), some smaller than num_microbatches={num_microbatches}: such a batch"
                " runs in fewer micro-batches, and ZeRO-3 under pipeline parallelism evaluates the dp"
                " ranks in lockstep. Use a dataset size that is a multiple of the data-parallel size times"
                " the batch size, a sampler that pads as DistributedSampler does, or zero_stage 0-2."
            )


def counts_differ(table: Sequence[Sequence[int]]) -> bool:
    """Whether the ranks may run different numbers of batches (an unknown count may differ)."""
    return any(list(row) != list(table[0]) for row in table) or any(c < 0 for row in table for c in row)


def plan_eval_join(
    table: Sequence[Sequence[int]], *, rank: int, pipelined: bool, loop: str
) -> EvalJoin | None:
    """The ZeRO-3 join of rank ``rank`` for the counts ``table`` (:func:`eval_count_table`): ``None``
    when every rank runs the same known counts; else the join, or a ``ValueError`` (the same on every
    rank) naming what cannot be joined and the fix."""
    if not counts_differ(table):
        return None
    per_rank = "; ".join(f"dp rank {r}: {list(row)}" for r, row in enumerate(table))
    where = (
        f"The {loop} dataloaders give the data-parallel ranks different numbers of batches ({per_rank};"
        " -1: no length)"
    )
    if pipelined:
        # Lightning keeps a predict loader's last batch whatever drop_last says, and pads only through a
        # DistributedSampler of the dp coordinates
        fix = (
            "a dataset size that is a multiple of the dp size times the batch size, or"
            " DataLoader(ds, sampler=DistributedSampler(ds, shuffle=False,"
            " **trainer.strategy.distributed_sampler_kwargs)), which pads by repeating samples"
            if loop == "predict"
            else "a sampler that pads, as DistributedSampler does, or drop_last=True"
        )
        raise ValueError(
            f"{where}. ZeRO-3 under pipeline parallelism evaluates in lockstep over the dp group: give every"
            f" rank the same number of batches ({fix})."
        )
    for k, column in enumerate(zip(*table, strict=True)):
        if 0 in column and any(c != 0 for c in column):
            raise ValueError(
                f"{where}. Dataloader {k} gives some rank no batch at all, so that rank would not take part"
                " in the others' ZeRO-3 gathers. Give every rank at least one batch (at least as many"
                " samples as data-parallel ranks)."
            )
        if -1 in column and k < len(table[0]) - 1:
            raise ValueError(
                f"{where}. Dataloader {k} has no length and another follows it, so no rank can tell where"
                " it ends while the others still gather. Give it a __len__, or make it the last one."
            )
    return EvalJoin(counts=tuple(table[rank]))


def check_every_rank_has_batches(length: int | None, *, group: ProcessGroup, device: torch.device) -> None:
    """Refuse a dataloader that gives some dp rank no batch while others get some (``length``: this
    rank's number of batches, ``None`` when it has no length): that rank's loop is skipped outright, so
    it could neither plan a join nor serve the others' gathers. One all-gather of an integer."""
    lengths = [
        row[0] for row in _gather_counts([-1 if length is None else length], group=group, device=device)
    ]
    if 0 in lengths and any(n != 0 for n in lengths):
        per_rank = ", ".join(f"dp rank {r}: {n}" for r, n in enumerate(lengths))
        raise ValueError(
            f"A dataloader gives some data-parallel rank no batch at all ({per_rank}; -1: no length). At"
            " ZeRO-3 every rank takes part in every forward's parameter gathers, so that rank would leave"
            " the others waiting. Give every rank at least one batch (at least as many samples as"
            " data-parallel ranks)."
        )
