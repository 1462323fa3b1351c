"""lightning_par: ZeRO, tensor and pipeline parallelism and fault tolerance inside PyTorch Lightning.

Importing the package registers the strategy names ``"zero1"``, ``"zero2"`` and ``"zero3"`` with
Lightning (Lightning has no entry points for third-party strategies), so ``Trainer(strategy="zero2")``
works after ``import lightning_par``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_par.mesh import MeshLayout, ParallelMesh
from lightning_par.strategy import HybridParallelStrategy

HybridParallelStrategy.register_strategies(StrategyRegistry)

__all__ = ["HybridParallelStrategy", "MeshLayout", "ParallelMesh"]
__version__ = "0.1.0"
