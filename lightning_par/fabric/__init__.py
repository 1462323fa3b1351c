"""Lightning Fabric front door (see :mod:`lightning_par.fabric.strategy`); flash snapshots for Fabric
loops in :mod:`lightning_par.fabric.flash`."""

from lightning_par.fabric.flash import FlashSnapshots
from lightning_par.fabric.strategy import HybridParallelStrategy

__all__ = ["FlashSnapshots", "HybridParallelStrategy"]
