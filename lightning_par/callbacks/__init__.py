"""Fault tolerance for the Lightning ``Trainer``: flash checkpoints, node health checks and guards.

* :class:`FlashCheckpoint`: snapshots in shared memory every few steps, persisted in the background,
  automatic resume from the newest snapshot complete on all ranks (``flash.py``).
* :class:`NodeHealthCheck`: a matmul and collective-bandwidth probe before training; slow or failing ranks
  are named (``health.py``).
* :class:`ShardedEMA`, :class:`ShardedWeightAveraging`: Lightning's ``EMAWeightAveraging`` and
  ``WeightAveraging`` at every layout, each rank averaging the fp32 values it owns (``averaging.py``).
* :class:`HangWatchdog`, :class:`StragglerDetector`, :class:`LossGuard`: exit on a hang so the launcher
  restarts, log slow ranks, skip or roll back steps with a non-finite or spiking loss (``guards.py``).
"""

from lightning_par.callbacks.averaging import ShardedEMA, ShardedWeightAveraging
from lightning_par.callbacks.flash import FlashCheckpoint
from lightning_par.callbacks.guards import LossGuard, StragglerDetector
from lightning_par.callbacks.health import NodeHealthCheck
from lightning_par.callbacks.watchdog import HangWatchdog

__all__ = [
    "FlashCheckpoint",
    "HangWatchdog",
    "LossGuard",
    "NodeHealthCheck",
    "ShardedEMA",
    "ShardedWeightAveraging",
    "StragglerDetector",
]
