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
  sample once. Such a gather of the world where samples have copies warns (once per calling line, on
  rank 0): a contrastive loss over it meets each sample's copies as negatives, silently.
* :func:`world_decision`: ``reduce_boolean_decision`` (early stopping, checkpointing verdicts) stays over
  the world, since every rank, whatever its coordinates, must take the same decision.
* :class:`MetricSync`: torchmetrics ``Metric`` objects inside the module (submodules, and metrics kept in
  a module's plain dict / list / tuple attributes, nested too) and in the Trainer's callbacks and
  datamodule that sync the default way (no ``process_group``, no ``dist_sync_fn`` of their own) gather
  over the data-parallel group, through a ``dist_sync_fn`` set at setup, on metrics made later when each
  loop (and each training epoch) begins its first step and after that step (one made inside it), and
  removed with the strategy's process groups (``destroy_process_groups()``) or at the next setup; so a
  metric read in ``on_fit_end``, a ``teardown`` hook or after ``trainer.fit`` counts each sample once
  (Lightning tears the strategy down before those; before, they gathered over the world: a sum doubled
  at tp2). Under a pipeline (:class:`StageGather`) each stage gathers over its data-parallel group and
  takes the last stage's result: a metric a ``pipeline_eval`` updates (on the last stage only; the other
  stages hold reset states) and one every stage updates alike (in ``on_train_batch_end``, from the
  broadcast loss) both count each sample once (before, the latter counted each sample once per stage,
  and a tensor-parallel pipeline its tp copies).

A ``dist_sync_fn`` holds a process group, which cannot be copied or pickled: a metric deep-copied during
the run shares it, and a pickled copy gathers over the world, torchmetrics' default.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import is_dataclass
from types import SimpleNamespace
from typing import Any, cast

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torchmetrics import Metric
from torchmetrics.utilities.distributed import gather_all_tensors

from lightning_par.mesh import ParallelMesh
from lightning_par.zero.meta_build import MODULE_OWN  # not entered: parameters, hooks

__all__ = [
    "DataGather",
    "MetricSync",
    "StageGather",
    "data_group",
    "front_door_gather",
    "gather_stacked",
    "world_decision",
]


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


def gather_stacked(
    tensor: Tensor, *, group: Any | None, sync_grads: bool, copies: int = 1, stacklevel: int = 4
) -> Tensor:
    """Every rank's ``tensor`` of ``group`` (None: the world), stacked: shape ``(group size, *shape)``, as
    Lightning's ``all_gather`` returns. With ``sync_grads`` the result is differentiable: the gradient of
    a rank's input is the sum over the group's ranks of the gradient each computed for that rank's slot
    (what torch's ``torch.distributed.nn.all_gather`` gives). Ours, because torch's backward on a Gloo (or
    a mixed ``"cpu:gloo,cuda:nccl"``) group scatters from the group-local index as if it were a global
    rank: any group not made of ranks ``0..n-1``, such as the data-parallel groups under tensor
    parallelism, failed in the first backward ("Global rank 0 is not part of group"). ``copies``: how
    many ranks hold each sample (tp x pp); a gather of the world with copies warns (module docstring),
    naming the line ``stacklevel`` frames up (Lightning's warning helpers count; 4 is the caller's)."""
    if not (dist.is_available() and dist.is_initialized()):
        return tensor
    world = group is None or group is dist.group.WORLD  # the LightningModule's all_gather names WORLD itself
    if world and copies > 1:
        rank_zero_warn(
            f"all_gather without a group gathers the world, where each sample is held by {copies} ranks"
            " (tensor x pipeline parallel): every sample appears that many times in the result, so a"
            " contrastive loss over it (SimCLR, CLIP) meets each sample's copies as negatives and a logged"
            " gather counts them. Pass group=strategy.mesh.dp_group (trainer.strategy or fabric.strategy) to"
            " take each sample once.",
            stacklevel=stacklevel,
        )
    group = group if group is not None else dist.group.WORLD
    if not sync_grads:
        with torch.no_grad():
            return _GroupGather.apply(tensor, group)
    return _GroupGather.apply(tensor, group)


def front_door_gather(
    tensor: Tensor, *, group: Any | None, sync_grads: bool, mesh: ParallelMesh | None
) -> Tensor:
    """:func:`gather_stacked` for the strategies' ``all_gather`` (Trainer and Fabric), reached from the
    user's line through the front door's ``all_gather`` and ``apply_to_collection``, which the world
    gather's warning names; ``mesh``: the run's (its tp x pp copies of each sample), None before setup."""
    copies = mesh.tp_size * mesh.pp_size if mesh is not None else 1
    return gather_stacked(tensor, group=group, sync_grads=sync_grads, copies=copies, stacklevel=9)


class _GroupGather(torch.autograd.Function):
    """All-gather into a stacked tensor; backward: all-reduce (sum) of the stacked gradient, this rank's
    slot taken. Created on ``tensor``'s device: NCCL and Gloo alike."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Any) -> Tensor:
        tensor = tensor.contiguous()
        pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, tensor, group=group)
        ctx.group, ctx.index = group, dist.get_rank(group)
        return torch.stack(pieces)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        total = grad.contiguous().clone()  # the gradient autograd hands in is not ours to write
        dist.all_reduce(total, group=ctx.group)
        return total[ctx.index], None


class DataGather:
    """A torchmetrics ``dist_sync_fn``: torchmetrics' own gather, over ``group`` unless the caller names
    one. ``group=None`` (a pickled copy) is the world."""

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group

    def __call__(self, result: torch.Tensor, group: Any | None = None) -> list[torch.Tensor]:
        return gather_all_tensors(result, group=group if group is not None else self.group)

    def retire(self) -> None:
        """Gather as torchmetrics does without a ``dist_sync_fn`` from now on: the group is being
        destroyed, and a copy of the metric made during the run (which shares this object) keeps it."""
        self.group = None

    def __deepcopy__(self, memo: dict[int, Any]) -> DataGather:
        return self  # a process group cannot be copied; the copy syncs over the same ranks

    def __reduce__(self) -> tuple[type[DataGather], tuple[None]]:
        return DataGather, (None,)


class StageGather(DataGather):
    """A torchmetrics ``dist_sync_fn`` under a pipeline: gather over this stage's data-parallel ``group``,
    then every stage takes the last stage's gathered list (one object broadcast over ``pp_group`` from
    the global rank ``last``; host copies, at a metric's compute, outside any step)."""

    def __init__(
        self, group: ProcessGroup | None, *, pp_group: ProcessGroup, last: int, is_last: bool
    ) -> None:
        super().__init__(group)
        self.pp_group, self.last, self.is_last = pp_group, last, is_last
        self.retired = False

    def retire(self) -> None:
        super().retire()
        self.retired = True

    def __call__(self, result: torch.Tensor, group: Any | None = None) -> list[torch.Tensor]:
        if group is not None or self.retired:
            return gather_all_tensors(result, group=group)
        pieces = gather_all_tensors(result, group=self.group) if self.group is not None else [result]
        # the stages' states may differ in shape and dtype (a reset cat state is an empty float tensor)
        box: list[Any] = [[p.detach().cpu() for p in pieces] if self.is_last else None]
        dist.broadcast_object_list(box, src=self.last, group=self.pp_group, device=result.device)
        return [p.to(result.device) for p in box[0]]


def _stage_gather(mesh: ParallelMesh) -> StageGather:
    """This rank's :class:`StageGather`: its stage's dp group (none to gather over at dp 1) and the global
    rank of the last stage in its pipeline."""
    last = mesh.layout.rank_of(mesh.coords._replace(pp=mesh.pp_size - 1))
    return StageGather(
        mesh.dp_group if mesh.dp_size > 1 else None,
        pp_group=mesh.pp_group,
        last=last,
        is_last=mesh.pp_rank == mesh.pp_size - 1,
    )


_WIDEST = 4096  # containers with more items are not entered (a vocabulary, a cache): the scan stays cheap

Watched = list[tuple[object, object]]  # what a scan walked, with its _signature then


def _signature(held: object) -> object:
    """What changes when a metric is put in ``held``: a dict's or list's length, another object's (a
    callback's) attribute values (``self.metric = SumMetric()`` in place of ``None``)."""
    if isinstance(held, dict | list):
        return len(held)
    return tuple(map(id, vars(held).values()))


class _Walk:
    """One scan's walk for torchmetrics metrics (see :func:`_metrics_in`)."""

    def __init__(self) -> None:
        self.found: dict[int, Metric] = {}
        self.walked: set[int] = set()
        self.watched: Watched = []

    def held(self, value: object, depth: int) -> None:
        if id(value) in self.walked or depth > 4:
            return
        if isinstance(value, Metric):
            self.found.setdefault(id(value), value)
        if isinstance(value, nn.Module):
            self.walked.add(id(value))
            for m in value.modules():
                if isinstance(m, Metric):
                    self.found.setdefault(id(m), m)
                for name, attr in vars(m).items():
                    if name not in MODULE_OWN and (isinstance(attr, dict | list | tuple) or _is_holder(attr)):
                        self.held(attr, depth + 1)
        elif isinstance(value, dict | list | tuple) and len(value) <= _WIDEST:
            self.walked.add(id(value))
            if not isinstance(value, tuple):  # a tuple (a conv's kernel_size) never grows
                self.watched.append((value, len(value)))
            for item in value.values() if isinstance(value, dict) else value:
                self.held(item, depth + 1)
        elif _is_holder(value):
            self.walked.add(id(value))
            for item in vars(value).values():
                self.held(item, depth + 1)


def _metrics_in(*roots: object) -> tuple[list[Metric], Watched]:
    """The torchmetrics metrics held by ``roots`` (the LightningModule; the Trainer's callbacks and
    datamodule), each once: a module's submodules, and inside the plain dict / list / tuple attributes of
    its modules and of the other roots, nested ones too (``self.metrics = {"train": MetricCollection(...)}``,
    ``[{"acc": Accuracy()}]`` per dataloader), dataclass and ``SimpleNamespace`` holders among them, the
    metrics of any module found there. Other objects an attribute refers to are not entered (a callback's
    reference to the trainer), nor containers of more than ``_WIDEST`` items. Also the containers walked
    and the roots' submodule tables, with their lengths (see :meth:`MetricSync.refresh`)."""
    walk = _Walk()
    for root in roots:
        if isinstance(root, nn.Module):
            walk.watched.append((root._modules, len(root._modules)))  # self.acc = Accuracy() in a step
            walk.held(root, 0)
        else:
            walk.watched.append((root, _signature(root)))  # a callback's metric made lazily
            for attr in vars(root).values():
                walk.held(attr, 1)
    return list(walk.found.values()), walk.watched


def _added(held: object, since: object) -> list[object]:
    """What ``held`` may have been given since its signature was ``since``: the items appended to a
    list or inserted into a dict after its first ``since``, else every attribute value."""
    if not isinstance(held, dict | list):
        return list(vars(held).values())
    items: Iterable[object] = held.values() if isinstance(held, dict) else held
    return list(itertools.islice(items, cast(int, since), None))


def _is_holder(value: object) -> bool:
    """A plain record of values: a dataclass instance or a ``SimpleNamespace``."""
    return isinstance(value, SimpleNamespace) or (is_dataclass(value) and not isinstance(value, type))


class MetricSync:
    """The ``dist_sync_fn`` set on the metrics of one run, and its removal."""

    def __init__(self) -> None:
        self._set: list[tuple[Metric, DataGather]] = []
        self._watched: Watched = []

    def assign(self, module: nn.Module, *, mesh: ParallelMesh, pipelined: bool) -> None:
        """Point the default-syncing metrics inside ``module`` at the data-parallel group, where it is
        smaller than the world (module docstring), after :meth:`restore` of any earlier run."""
        self.restore()
        self.rescan(module, mesh=mesh, pipelined=pipelined)

    def rescan(self, *roots: object, mesh: ParallelMesh, pipelined: bool) -> None:
        """The same for metrics made inside ``roots`` since (in a hook, a step), or held by a callback or
        datamodule (``roots``: the module and those), keeping those set already. Nothing to walk where
        the data-parallel group is the world."""
        if mesh.dp_size == mesh.layout.world_size:
            return
        metrics, self._watched = _metrics_in(*roots)
        self.add(metrics, mesh=mesh, pipelined=pipelined)

    def refresh(self, *, mesh: ParallelMesh, pipelined: bool) -> None:
        """The same for metrics added since the last scan to a container it walked (a per-label dict
        filled by ``setdefault`` at batch 5, ``self.acc = Accuracy()`` in a later step, a callback's
        ``self.metric`` made at its first batch): a length read per container (the attribute values'
        ids of a callback or datamodule), and only the added items walked (a list of outputs appended to
        every step costs its new item), so it runs before and after every step."""
        if not any(_signature(held) != then for held, then in self._watched):
            return
        walk, kept = _Walk(), []
        walk.walked.update(id(held) for held, _ in self._watched)  # each watched for its own growth
        for held, then in self._watched:
            now = _signature(held)
            if now != then and (not isinstance(now, int) or now > cast(int, then)):
                for item in _added(held, then):
                    walk.held(item, 1)
            if not isinstance(now, int) or now <= _WIDEST:  # a list of outputs past it: no longer read
                kept.append((held, now))
        # what the added items hold is not watched: a list of per-step output dicts would grow the watch
        # (and keep the outputs alive) at every step
        self._watched = kept
        self.add(list(walk.found.values()), mesh=mesh, pipelined=pipelined)

    def add(self, metrics: Sequence[object], *, mesh: ParallelMesh, pipelined: bool) -> None:
        """The same for ``metrics`` themselves (those of them that are torchmetrics ``Metric`` objects
        syncing over the default group), kept beside the module's until :meth:`restore`."""
        if mesh.dp_size == mesh.layout.world_size:
            return
        for metric in metrics:
            if isinstance(metric, Metric) and metric.process_group is None and metric.dist_sync_fn is None:
                gather = _stage_gather(mesh) if pipelined else DataGather(mesh.dp_group)
                metric.dist_sync_fn = gather
                self._set.append((metric, gather))

    def restore(self) -> None:
        """Remove the ``dist_sync_fn`` this object set (one the user set since is kept), and retire it
        (:meth:`DataGather.retire`) for the metric's copies."""
        for metric, gather in self._set:
            gather.retire()
            if metric.dist_sync_fn is gather:
                metric.dist_sync_fn = None
        self._set, self._watched = [], []
