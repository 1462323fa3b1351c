"""The process side of the Fabric strategy: its precision plugin, ``torch.distributed`` and the mesh.

:class:`FabricProcesses` is a base of :class:`lightning_par.fabric.HybridParallelStrategy` over Fabric's
``DDPStrategy``, whose process launch it keeps: the process group is initialised as Lightning's DDP does,
with a store of the launch attempt under torchrun (:mod:`lightning_par.rendezvous`: a restart never reads
a dead attempt's keys); the backend is checked against the root device before any group exists; one
:class:`~lightning_par.mesh.ParallelMesh` is built per launch; Fabric's distributed sampler splits the
data over the data-parallel ranks only (the ranks of a tensor-parallel group compute on the same samples).
Whatever precision plugin Fabric's connector hands over becomes
:class:`~lightning_par.precision.ParallelPrecision`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities.distributed import _init_dist_connection
from typing_extensions import override

from lightning_par.device_checks import resolve_backend
from lightning_par.fabric.mixin import FabricMixin
from lightning_par.fabric.precision import to_parallel_precision
from lightning_par.mesh import ParallelMesh
from lightning_par.precision import ParallelPrecision
from lightning_par.rendezvous import launch_store


class FabricProcesses(FabricMixin, DDPStrategy):
    """Precision plugin, process group and mesh of the Fabric strategy (see the module docstring)."""

    # set by HybridParallelStrategy.__init__
    zero_stage: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    _mesh: ParallelMesh | None
    _launch_store: torch.distributed.TCPStore | None  # rank 0 hosts it

    @property
    def precision(self) -> ParallelPrecision:
        if self._precision is None:  # before Fabric's connector hands over the chosen plugin
            self._precision = ParallelPrecision("32-true")
        assert isinstance(self._precision, ParallelPrecision)
        return self._precision

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        self._precision = to_parallel_precision(precision) if precision is not None else None

    @override
    def _setup_distributed(self) -> None:
        # Lightning's DDP initialisation, with a store of this attempt under torchrun (see
        # lightning_par.rendezvous: a restart never reads the dead attempt's keys)
        self._set_world_ranks()
        assert self.cluster_environment is not None and self._process_group_backend is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        if not torch.distributed.is_initialized():
            timeout = self._timeout or timedelta(minutes=30)
            self._launch_store = launch_store(self.cluster_environment, timeout=timeout)
            if self._launch_store is not None:
                kwargs["store"] = self._launch_store
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)

    @override
    def setup_environment(self) -> None:
        # checked before any process group exists; DDPStrategy then uses the resolved name
        self._process_group_backend = resolve_backend(self._process_group_backend, self.root_device)
        super().setup_environment()
        if self._mesh is None:
            self._mesh = ParallelMesh(
                tensor_parallel_size=self.tensor_parallel_size,
                pipeline_parallel_size=self.pipeline_parallel_size,
                timeout=self._timeout,
            )
        self.precision.configure(zero_stage=self.zero_stage, device=self.root_device)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data is split over the data-parallel ranks only: the ranks of a tensor-parallel group compute
        on the same samples."""
        return {"num_replicas": self.mesh.dp_size, "rank": self.mesh.dp_rank}

    @property
    def mesh(self) -> ParallelMesh:
        if self._mesh is None:
            raise RuntimeError("The parallel mesh exists only after fabric.launch().")
        return self._mesh
