"""ZeRO engine: flat gradient buckets (stage 0 = data parallel), sharded optimizer state and gradients
(stages 1/2), over an explicit data-parallel process group."""

from lightning_par.optimizer_checks import ELEMENTWISE_OPTIMIZERS, check_shardable
from lightning_par.zero.engine import ZeroEngine, apply_data_parallel, apply_zero
from lightning_par.zero.grad_sync import GradSync, UnusedParametersError, broadcast_module_states
from lightning_par.zero.layout import Bucket, FlatLayout, Fragment, Slot
from lightning_par.zero.powersgd import PowerSGDState, powersgd_hook
from lightning_par.zero.sharded_optimizer import ShardedOptimizer

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "Bucket",
    "FlatLayout",
    "Fragment",
    "GradSync",
    "PowerSGDState",
    "ShardedOptimizer",
    "Slot",
    "UnusedParametersError",
    "ZeroEngine",
    "apply_data_parallel",
    "apply_zero",
    "broadcast_module_states",
    "check_shardable",
    "powersgd_hook",
]
