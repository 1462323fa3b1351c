"""Sharded checkpoints with layout metadata, resharding on load, and consolidation for export."""

from lightning_par.checkpoint.export import consolidate
from lightning_par.checkpoint.sharded import (
    METADATA_KEY,
    check_params_match,
    is_sharded_checkpoint,
    read_meta,
    read_optimizer_records,
)

__all__ = [
    "METADATA_KEY",
    "check_params_match",
    "consolidate",
    "is_sharded_checkpoint",
    "read_meta",
    "read_optimizer_records",
]
