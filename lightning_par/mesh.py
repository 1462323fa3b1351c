"""The (pp, dp, tp) layout of ranks and the process groups that go with it.

Ranks are laid out with the tensor-parallel dimension fastest and the pipeline dimension slowest::

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

so tensor-parallel peers are adjacent (on one node they share the fastest links) and the pipeline
dimension, which moves the least data, spans nodes first. :class:`MeshLayout` is the pure arithmetic
(usable before launch, e.g. by the memory estimator); :class:`ParallelMesh` adds the process groups.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, NamedTuple

import torch.distributed as dist
from torch.distributed import ProcessGroup

# live process groups past which a new mesh warns (ten meshes of three groups): a loop of Trainers that
# never destroys them runs out of file descriptors (Gloo's sockets) after a few dozen, in torch's words
# ("Cannot resolve 127.0.0.1 to a (local) address", "Too many open files")
_MANY_GROUPS = 30

Dim = Literal["pp", "dp", "tp"]


class MeshCoords(NamedTuple):
    """A rank's position in the mesh."""

    pp: int
    dp: int
    tp: int


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class MeshLayout:
    """Validated sizes of a (pp, dp, tp) mesh over ``world_size`` ranks.

    The data-parallel size is derived: ``dp = world_size / (tp * pp)``. Construction raises a
    ``ValueError`` naming the sizes and the values that would work when the layout is impossible.
    """

    world_size: int
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        tp, pp, world = self.tensor_parallel_size, self.pipeline_parallel_size, self.world_size
        if world % (tp * pp) != 0:
            raise ValueError(
                f"Impossible parallel layout: tensor_parallel_size={tp} x pipeline_parallel_size={pp}"
                f" = {tp * pp} does not divide the world size {world}. tp * pp must be one of"
                f" {_divisors(world)} (data-parallel size = world size / (tp * pp)); change the sizes or"
                " the number of processes."
            )

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_parallel_size * self.pipeline_parallel_size)

    def size(self, dim: Dim) -> int:
        return {
            "pp": self.pipeline_parallel_size,
            "dp": self.data_parallel_size,
            "tp": self.tensor_parallel_size,
        }[dim]

    def coords(self, rank: int) -> MeshCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of size {self.world_size}.")
        tp, dp = self.tensor_parallel_size, self.data_parallel_size
        return MeshCoords(pp=rank // (dp * tp), dp=(rank // tp) % dp, tp=rank % tp)

    def rank_of(self, coords: MeshCoords) -> int:
        tp, dp = self.tensor_parallel_size, self.data_parallel_size
        return coords.pp * dp * tp + coords.dp * tp + coords.tp

    def groups(self, dim: Dim) -> list[list[int]]:
        """All rank lists of the groups along ``dim``, in a fixed order (every rank enumerates the same)."""
        sizes = {
            "pp": self.pipeline_parallel_size,
            "dp": self.data_parallel_size,
            "tp": self.tensor_parallel_size,
        }
        seen: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)._asdict()
            key = tuple(v for k, v in c.items() if k != dim)
            if key not in seen:
                seen[key] = [self.rank_of(MeshCoords(**{**c, dim: i})) for i in range(sizes[dim])]
        return list(seen.values())


class ParallelMesh:
    """A :class:`MeshLayout` bound to this process, with one process group per dimension.

    Every rank must construct the mesh (group creation is collective). Mechanisms take the groups they
    need from here explicitly; none of them uses the default world group.
    """

    def __init__(
        self,
        *,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        timeout: timedelta | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ParallelMesh needs an initialized torch.distributed default group; call"
                " torch.distributed.init_process_group(...) first (the strategy does this for you)."
            )
        self.layout = MeshLayout(
            world_size=dist.get_world_size(),
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
        )
        self.rank = dist.get_rank()
        self.coords = self.layout.coords(self.rank)
        self._groups: dict[str, ProcessGroup] = {}
        _warn_if_many_groups(rank=self.rank)
        dims: tuple[Dim, ...] = ("tp", "dp", "pp")
        for dim in dims:
            for ranks in self.layout.groups(dim):
                # new_group is collective over the whole world: every rank creates every group.
                group = dist.new_group(ranks=ranks, timeout=timeout, use_local_synchronization=False)
                if self.rank in ranks:
                    self._groups[dim] = group

    def group(self, dim: Dim) -> ProcessGroup:
        return self._groups[dim]

    def destroy(self) -> None:
        """Destroy this rank's groups; every rank calls it at the same point (NCCL shuts its groups
        down), and the mesh is unusable after. torch never frees a group on its own, and every live group
        makes the creation of the next ones and their first collectives slower: a process that builds
        mesh after mesh (a Hydra sweep's jobs, a loop of Trainers) slows down quadratically without this
        (measured: 120 meshes of a world of 4, the last 20 took 13x as long as the first 20)."""
        for group in {id(g): g for g in self._groups.values()}.values():
            dist.destroy_process_group(group)
        self._groups = {}

    @property
    def dp_group(self) -> ProcessGroup:
        return self._groups["dp"]

    @property
    def tp_group(self) -> ProcessGroup:
        return self._groups["tp"]

    @property
    def pp_group(self) -> ProcessGroup:
        return self._groups["pp"]

    @property
    def dp_size(self) -> int:
        return self.layout.data_parallel_size

    @property
    def tp_size(self) -> int:
        return self.layout.tensor_parallel_size

    @property
    def pp_size(self) -> int:
        return self.layout.pipeline_parallel_size

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    def __repr__(self) -> str:
        return (
            f"ParallelMesh(world={self.layout.world_size}, pp={self.pp_size}, dp={self.dp_size},"
            f" tp={self.tp_size}, rank={self.rank}, coords={tuple(self.coords)})"
        )


def _warn_if_many_groups(*, rank: int) -> None:
    """Warn (rank 0; once per process by Python's filter, the text being constant) when many process
    groups are alive: earlier strategies' meshes that nobody destroyed (an in-process sweep of Trainers,
    Optuna's trials)."""
    live = len(getattr(dist.distributed_c10d._world, "pg_map", ()))
    if rank == 0 and live > _MANY_GROUPS:
        warnings.warn(
            f"lightning_par: more than {_MANY_GROUPS} process groups are alive in this process, most of"
            " them earlier strategies' meshes (a loop of Trainers or Fabrics, an in-process sweep). torch"
            " never frees a group: each holds sockets and slows the creation of the next, and a few dozen"
            " meshes run out"
            " of file descriptors (Gloo: 'Cannot resolve ... address' or 'Too many open files'). Call"
            " trainer.strategy.destroy_process_groups() (fabric.strategy's) on every rank when done with"
            " a strategy.",
            stacklevel=3,
        )
