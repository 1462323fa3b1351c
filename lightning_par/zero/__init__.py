"""ZeRO engine: flat gradient buffers and buckets (stage 0 = data parallel)."""

from lightning_par.zero.grad_sync import (
    GradSync,
    UnusedParametersError,
    apply_data_parallel,
    broadcast_module_states,
)
from lightning_par.zero.layout import Bucket, FlatLayout, Fragment, Slot

__all__ = [
    "Bucket",
    "FlatLayout",
    "Fragment",
    "GradSync",
    "Slot",
    "UnusedParametersError",
    "apply_data_parallel",
    "broadcast_module_states",
]
