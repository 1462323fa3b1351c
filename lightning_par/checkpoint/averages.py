"""Weight averages in checkpoints (:mod:`lightning_par.averaging`): the per-rank entry's name and the
averaged state dict Lightning's ``WeightAveraging`` layout puts under ``"state_dict"``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from lightning_par.checkpoint.optimizer_state import Pieces
from lightning_par.checkpoint.sharded import assemble_state_dict

CHECKPOINT_ENTRY = "weight_averages"  # the averages' per-rank entry in a sharded checkpoint


def averaged_state_dict(
    current: Mapping[str, Any], pieces: Pieces, buffers: Mapping[str, Tensor], meta: Mapping[str, Any]
) -> dict[str, Any]:
    """``current`` (a whole state dict) with the averages in place: every parameter with ``pieces`` (full
    shapes and tied names from ``meta``, as in a checkpoint's layout metadata) and the averaged buffers;
    what was not averaged (frozen parameters at ZeRO 1-3, integer buffers) keeps its current value, and
    every value keeps its current dtype."""
    averaged = {**assemble_state_dict(pieces, meta, require_all=False), **buffers}
    return {
        key: averaged[key].to(value.dtype) if key in averaged else value for key, value in current.items()
    }
