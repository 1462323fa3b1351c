"""Reductions over the samples, not over the ranks: ``sync_dist`` logging and torchmetrics.

The ranks of a tensor-parallel group run the same samples, and under a pipeline every stage logs the
values the last stage broadcast, so each logged value has ``tp * pp`` identical copies. Lightning's and
torchmetrics' reductions default to the whole world: at tp2 on 2 ranks ``self.log(..., reduce_fx="sum",
sync_dist=True)`` counted each sample twice (16 samples where one process counts 8), a torchmetrics
``SumMetric`` doubled and a ``CatMetric`` held each value twice. Means, maxima and ratios of counts came
out right only because identical copies leave them unchanged.

Contract
--------
* :func:`data_group`: the Trainer strategy's ``reduce`` asked for ``group=None`` (``sync_dist`` logging,
  whose ``sync_dist_group`` defaults to None, and ``trainer.strategy.reduce(x)``) runs over the
  data-parallel group, so each sample counts once, as under ``"ddp"`` on ``dp`` ranks. A group the caller
  names is used as given. Without tensor or pipeline parallelism the data-parallel group is the world:
  nothing changes. ``self.all_gather``, ``fabric.all_gather`` and ``fabric.all_reduce`` name the world
  themselves (Lightning documents it) and keep it: pass ``group=strategy.mesh.dp_group`` to take each
  sample once.
* :func:`world_decision`: ``reduce_boolean_decision`` (early stopping, checkpointing verdicts) stays over
  the world, since every rank, whatever its coordinates, must take the same decision.
* :class:`MetricSync`: torchmetrics ``Metric`` objects inside the module that sync the default way (no
  ``process_group``, no ``dist_sync_fn`` of their own) gather over the data-parallel group for the run
  (Trainer and Fabric), through a ``dist_sync_fn`` set at setup and removed at teardown (the user's metric
  is left as it was). Only without a pipeline: under one, the user's steps do not run, and a metric that
  a ``pipeline_eval`` updates is updated on the last stage only, so the other stages' reset states must
  take part in a world gather (their zeros add nothing); a tensor-parallel pipeline therefore still
  counts its tp copies in such a metric.

A ``dist_sync_fn`` holds a process group, which cannot be copied or pickled: a metric deep-copied during
the run shares it, and a pickled copy gathers over the world, torchmetrics' default.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from torch import nn
from torch.distributed import ProcessGroup
from torchmetrics import Metric
from torchmetrics.utilities.distributed import gather_all_tensors

from lightning_par.mesh import ParallelMesh

__all__ = ["DataGather", "MetricSync", "data_group", "world_decision"]


def data_group(group: Any | None, *, dp_group: ProcessGroup | None, dp_size: int, world_size: int) -> Any:
    """``group`` if the caller named one, else the data-parallel group when it is smaller than the world
    (``dp_group`` is None before the mesh exists: the world then)."""
    if group is not None or dp_group is None or dp_size == world_size:
        return group
    return dp_group


def world_decision(decision: bool, *, all: bool, world_size: int, device: torch.device) -> bool:
    """``all`` (or ``any``) of every rank's ``decision``, over the whole world; one host read."""
    votes = torch.tensor(int(decision), device=device)
    votes = _sync_ddp_if_available(votes, None, reduce_op="sum")
    return bool(votes == world_size) if all else bool(votes)


class DataGather:
    """A torchmetrics ``dist_sync_fn``: torchmetrics' own gather, over ``group`` unless the caller names
    one. ``group=None`` (a pickled copy) is the world."""

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group

    def __call__(self, result: torch.Tensor, group: Any | None = None) -> list[torch.Tensor]:
        return gather_all_tensors(result, group=group if group is not None else self.group)

    def __deepcopy__(self, memo: dict[int, Any]) -> DataGather:
        return self  # a process group cannot be copied; the copy syncs over the same ranks

    def __reduce__(self) -> tuple[type[DataGather], tuple[None]]:
        return DataGather, (None,)


class MetricSync:
    """The ``dist_sync_fn`` set on the metrics of one run, and its removal."""

    def __init__(self) -> None:
        self._set: list[tuple[Metric, DataGather]] = []

    def assign(self, module: nn.Module, *, mesh: ParallelMesh, pipelined: bool) -> None:
        """Point the default-syncing metrics inside ``module`` at the data-parallel group, where it is
        smaller than the world and there is no pipeline (module docstring), after :meth:`restore` of any
        earlier run."""
        self.restore()
        self.add(list(module.modules()), mesh=mesh, pipelined=pipelined)

    def add(self, metrics: Sequence[object], *, mesh: ParallelMesh, pipelined: bool) -> None:
        """The same for ``metrics`` themselves (those of them that are torchmetrics ``Metric`` objects
        syncing over the default group), kept beside the module's until :meth:`restore`."""
        if pipelined or mesh.dp_size == mesh.layout.world_size:
            return
        group = mesh.dp_group
        for metric in metrics:
            if isinstance(metric, Metric) and metric.process_group is None and metric.dist_sync_fn is None:
                gather = DataGather(group)
                metric.dist_sync_fn = gather
                self._set.append((metric, gather))

    def restore(self) -> None:
        """Remove the ``dist_sync_fn`` this object set (one the user set since is kept)."""
        for metric, gather in self._set:
            if metric.dist_sync_fn is gather:
                metric.dist_sync_fn = None
        self._set = []
