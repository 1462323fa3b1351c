"""What the Fabric strategy's mixins (:mod:`.steps`, :mod:`.optimizers`, :mod:`.processes`, :mod:`.session`)
read of the strategy, declared once for the type checker; nothing here exists at run time but the class."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from lightning.fabric.plugins.precision import Precision
    from torch.optim import Optimizer

    from lightning_par.fabric.pipeline import FabricPipeline
    from lightning_par.mesh import ParallelMesh
    from lightning_par.precision import ParallelPrecision
    from lightning_par.zero.engine_api import Engine


class FabricMixin:
    """Base of the mixins of :class:`lightning_par.fabric.HybridParallelStrategy`."""

    engine: Engine | None
    module: nn.Module | None
    _pipeline: FabricPipeline | None  # under pipeline parallelism: its steps run every backward

    if TYPE_CHECKING:

        @property
        def precision(self) -> ParallelPrecision: ...

        @precision.setter
        def precision(self, precision: Precision | None) -> None: ...

        @property
        def mesh(self) -> ParallelMesh: ...

        @property
        def root_device(self) -> torch.device: ...

        @property
        def optimizers(self) -> list[Optimizer]: ...
