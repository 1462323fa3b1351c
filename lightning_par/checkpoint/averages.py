"""Weight averages in checkpoints (:mod:`lightning_par.averaging`): the per-rank entry's name and the
averaged state dict Lightning's ``WeightAveraging`` layout puts under ``"state_dict"``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from lightning_par.checkpoint.optimizer_state import Pieces, cut

CHECKPOINT_ENTRY = "weight_averages"  # the averages' per-rank entry in a sharded checkpoint


def averaged_state_dict(
    current: Mapping[str, Any],
    pieces: Pieces,
    buffers: Mapping[str, Tensor],
    aliases: Mapping[str, str],
) -> dict[str, Any]:
    """``current`` (a whole state dict) with the averages in place: each parameter key whose owner
    (``aliases``: key -> the name it is averaged under) has full ``pieces``, and the averaged buffers;
    what was not averaged (frozen parameters at ZeRO 1-3, integer buffers) keeps its current value."""
    out = dict(current)
    for key, value in current.items():
        owner = aliases.get(key)
        piece = None if owner is None else cut(pieces.get(owner, []), 0, value.numel())
        if piece is not None:
            out[key] = piece["param"].view(value.shape).to(value.dtype)
        elif key in buffers:
            out[key] = buffers[key].to(value.dtype)
    return out
