"""Weight averages (:mod:`lightning_par.averaging`) in checkpoints, for both front doors.

* Sharded checkpoints: each rank's entry (:func:`rank_entry`: its records ``(name, lo, hi, {"param":
  values})`` in local tensor-parallel coordinates, the averaged buffers from one rank per stage, the update
  count) in its own file; :func:`pieces_from_entries` joins every writer's entries into pieces of the
  full parameters, which any layout cuts to its own fragments.
* One file: Lightning's ``WeightAveraging`` layout, the averaged model as a whole state dict
  (:func:`gather_averaged_state`: every rank's records to rank 0, collective) beside the current one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from lightning_par.checkpoint.full import collect
from lightning_par.checkpoint.optimizer_state import Pieces
from lightning_par.checkpoint.sharded import assemble_state_dict
from lightning_par.checkpoint.tp_reshard import TPInfo, global_shapes, globalize

if TYPE_CHECKING:
    from lightning_par.averaging import WeightAverages

CHECKPOINT_ENTRY = "weight_averages"  # the averages' per-rank entry in a sharded checkpoint


def rank_entry(averages: WeightAverages, *, dp_rank: int, tp_rank: int) -> dict[str, Any]:
    """This rank's share of ``averages`` for its checkpoint file (CPU copies)."""
    buffers = averages.buffer_values() if dp_rank == 0 and tp_rank == 0 else {}
    return {
        "params": averages.records(dp_rank=dp_rank),
        "buffers": buffers,
        "n_averaged": averages.n_averaged,
    }


def pieces_from_entries(
    entries: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]], shapes: Mapping[str, Sequence[int]]
) -> tuple[Pieces, dict[str, Tensor]]:
    """Pieces of the full parameters and the averaged buffers from every writer's ``(tp coordinates,
    entry)``."""
    pieces = globalize([(info, entry["params"]) for info, entry in entries], shapes)  # type: ignore[misc]
    buffers: dict[str, Tensor] = {}
    for _, entry in entries:
        for name, value in entry["buffers"].items():
            buffers.setdefault(name, value)
    return pieces, buffers


def averaged_state_dict(
    current: Mapping[str, Any], pieces: Pieces, buffers: Mapping[str, Tensor], meta: Mapping[str, Any]
) -> dict[str, Any]:
    """``current`` (a whole state dict) with the averages in place: every parameter with ``pieces`` (full
    shapes and tied names from ``meta``, as in a checkpoint's layout metadata) and the averaged buffers;
    what was not averaged (frozen parameters at ZeRO 1-3, integer buffers) keeps its current value, and
    every value keeps its current dtype."""
    averaged = {**assemble_state_dict(pieces, meta, require_all=False), **buffers}
    return {k: averaged[k].to(v.dtype) if k in averaged else v for k, v in current.items()}


def gather_averaged_state(
    averages: WeightAverages,
    current: Mapping[str, Any],
    module: nn.Module,
    *,
    tp: TPInfo,
    dp_rank: int,
    gather: bool,
) -> dict[str, Any] | None:
    """The averaged model as a whole state dict shaped like ``current`` (the whole current one) on global
    rank 0, every rank's records collected there when ``gather`` (collective); None elsewhere. Without
    ``gather`` (Lightning's strategies: every rank holds the whole model) on every rank."""
    share = (tp, rank_entry(averages, dp_rank=dp_rank, tp_rank=int(tp["rank"])))
    shares = collect(share, dst=0, group=None) if gather else [share]
    if shares is None:
        return None
    shapes = global_shapes(module, tp)
    pieces, buffers = pieces_from_entries(shares, shapes)
    canonical = {id(p): n for n, p in module.named_parameters()}
    aliases: dict[str, list[str]] = {}
    for alias, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(canonical[id(p)], []).append(alias)
    return averaged_state_dict(current, pieces, buffers, {"params": shapes, "aliases": aliases})
