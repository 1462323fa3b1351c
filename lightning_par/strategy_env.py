"""The process side of the Trainer strategy: launching, ``torch.distributed`` initialisation, the
(pp, dp, tp) mesh, and the collectives Lightning asks a strategy for.

:class:`MeshStrategy` starts processes and initialises the default group the way Lightning's DDP does
(``popen``/``spawn``/``fork`` launchers, or processes created externally by ``torchrun`` or SLURM via
Lightning's cluster environments) and builds one :class:`~lightning_par.mesh.ParallelMesh`, reused by
every later run of the same strategy. It knows nothing of the model; :class:`HybridParallelStrategy`
adds the composition on top.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_par.checkpoint.strategy_io import ZeroCheckpointIO
from lightning_par.data_reduce import data_group, front_door_gather, world_decision
from lightning_par.device_checks import resolve_backend
from lightning_par.mesh import MeshLayout, ParallelMesh
from lightning_par.rendezvous import launch_store
from lightning_par.strategy_options import StartMethod

if TYPE_CHECKING:
    from lightning.pytorch.accelerators import Accelerator

log = logging.getLogger(__name__)


class MeshStrategy(ZeroCheckpointIO):
    """Processes, the default process group and the parallel mesh (see the module docstring)."""

    def __init__(
        self,
        *,
        tensor_parallel_size: int,
        pipeline_parallel_size: int,
        process_group_backend: str | None,
        timeout_s: float,
        start_method: StartMethod,
        accelerator: Accelerator | None,
        parallel_devices: list[torch.device] | None,
        cluster_environment: ClusterEnvironment | None,
        checkpoint_io: CheckpointIO | None,
        precision_plugin: Precision | None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.tensor_parallel_size = tensor_parallel_size
        self.pipeline_parallel_size = pipeline_parallel_size
        self._process_group_backend = process_group_backend
        self._timeout = timedelta(seconds=timeout_s)
        self._start_method: StartMethod = start_method
        self._num_nodes = 1
        self._mesh: ParallelMesh | None = None
        self._launch_store: dist.TCPStore | None = None  # rank 0 hosts it: kept as long as the strategy

    # ------------------------------------------------------------------ topology
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        # Lightning asks custom strategies this to decide on distributed samplers.
        return True

    @property
    def mesh(self) -> ParallelMesh:
        if self._mesh is None:
            raise RuntimeError("The parallel mesh exists only after the strategy's setup_environment().")
        return self._mesh

    @property
    def layout(self) -> MeshLayout:
        """Mesh sizes; available before process groups exist (validated against the world size)."""
        return MeshLayout(
            world_size=self.num_nodes * self.num_processes,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
        )

    @override
    def tp_coordinates(self) -> tuple[int, int]:
        return (self._mesh.tp_rank if self._mesh is not None else 0), self.tensor_parallel_size

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Ranks of one tensor/pipeline group consume the same samples: split the data over dp only.
        if self._mesh is not None:
            return {"num_replicas": self._mesh.dp_size, "rank": self._mesh.dp_rank}
        coords = self.layout.coords(self.global_rank)
        return {"num_replicas": self.layout.data_parallel_size, "rank": coords.dp}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    # ------------------------------------------------------------------ launch and init
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def setup_environment(self) -> None:
        # Validate the layout and the backend before any process group exists: a bad size or a backend
        # that cannot move this device's tensors fails fast on every rank.
        _ = self.layout
        self._process_group_backend = resolve_backend(self._process_group_backend, self.root_device)
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        if not _distributed_is_initialized():
            # under torchrun, a store of this attempt: a restart never reads the dead attempt's keys
            self._launch_store = launch_store(self.cluster_environment, timeout=self._timeout)
            if self._launch_store is not None:
                kwargs["store"] = self._launch_store
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        if self._mesh is None or self._mesh.layout != self.layout:
            # the groups of a mesh live as long as the strategy (a second fit reuses them), or until
            # destroy_process_groups(); a mesh of another layout is replaced, its groups destroyed
            if self._mesh is not None:
                self._mesh.destroy()
            self._mesh = ParallelMesh(
                tensor_parallel_size=self.tensor_parallel_size,
                pipeline_parallel_size=self.pipeline_parallel_size,
                timeout=self._timeout,
            )
        log.info("lightning_par: %r", self._mesh)

    # ------------------------------------------------------------------ collectives
    def _teardown_with_meta(self, module: torch.nn.Module) -> None:
        """Lightning's teardown for a module with meta placeholders (layers of other pipeline stages):
        Lightning's moves the whole module to the CPU, which meta tensors cannot do; move only the real
        tensors, then release the rest as it does."""
        _optimizers_to_device(self.optimizers, torch.device("cpu"))
        with torch.no_grad():
            for t in (*module.parameters(), *module.buffers()):
                if not t.is_meta:
                    t.data = t.data.cpu()
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if "nccl" in str(dist.get_backend()) and self.root_device.type == "cuda":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(
        self,
        tensor: Tensor | Any,
        group: Any | None = None,
        reduce_op: ReduceOp | str | None = "mean",
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):  # over the samples: tp / pp copies count once (data_reduce)
            return _sync_ddp_if_available(tensor, self._data_group(group), reduce_op=reduce_op)
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        # over the group the caller names (the world by default, as Lightning documents), differentiable
        # over any group (torch's own gather fails in backward on a Gloo group not made of ranks 0..n-1)
        return front_door_gather(tensor, group=group, sync_grads=sync_grads, mesh=self._mesh)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return world_decision(decision, all=all, world_size=self.world_size, device=self.root_device)

    def _data_group(self, group: Any | None) -> Any:
        mesh = self._mesh
        dp_group = mesh.dp_group if mesh is not None else None
        dp_size = mesh.dp_size if mesh is not None else self.world_size
        return data_group(group, dp_group=dp_group, dp_size=dp_size, world_size=self.world_size)
