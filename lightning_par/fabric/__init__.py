"""Lightning Fabric front door (see :mod:`lightning_par.fabric.strategy`)."""

from lightning_par.fabric.strategy import HybridParallelStrategy

__all__ = ["HybridParallelStrategy"]
