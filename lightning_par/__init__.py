"""lightning_par: ZeRO, tensor and pipeline parallelism and fault tolerance inside PyTorch Lightning.

Importing the package registers the strategy names ``"zero0"`` ... ``"zero3"`` with Lightning's Trainer
and with Fabric (Lightning has no entry points for third-party strategies), so ``Trainer(strategy="zero2")``
and ``Fabric(strategy="zero2")`` work after ``import lightning_par``. The Fabric strategy class is
``lightning_par.fabric.HybridParallelStrategy``.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_par.fabric import HybridParallelStrategy as FabricHybridParallelStrategy
from lightning_par.mesh import MeshLayout, ParallelMesh
from lightning_par.precision import ParallelPrecision
from lightning_par.strategy import HybridParallelStrategy

HybridParallelStrategy.register_strategies(StrategyRegistry)
FabricHybridParallelStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__all__ = ["HybridParallelStrategy", "MeshLayout", "ParallelMesh", "ParallelPrecision"]
__version__ = "0.1.0"
