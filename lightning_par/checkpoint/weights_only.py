"""Weights-only checkpoints of a model every rank holds whole (ZeRO 1/2 without tensor or pipeline
parallelism), written as one Lightning file by global rank 0, as ``"ddp"`` writes them, so that
``LightningModule.load_from_checkpoint`` reads them in a plain process (``ModelCheckpoint(
save_weights_only=True)``, ``trainer.save_checkpoint(path, weights_only=True)``). Before, such a checkpoint
was a directory of rank files holding no optimizer state, which Lightning's loader cannot open.

The values are the exact weights. Where the parameters are the masters (fp32 training) the module's state
dict is exact as it is. In mixed precision the module's parameters are 16-bit compute copies while
training, the fp32 masters lie in the ranks' shards: :func:`put_masters` gathers them (the strategy's
``consolidated_state_dict()``, collective) and puts them in place of every entry that still holds a
tensor the save hooks received unchanged, under whatever name the hooks left it (a rename into a new
dict, an alias); an entry a hook computed or changed in place keeps the hook's value, computed from the
16-bit copies it was handed (the strategy cannot know the fp32 equivalent). Before, a weights-only
checkpoint taken during a ``bf16-mixed`` fit held the bf16 copies (2e-3 off the masters on a Llama's norm
weights), silently, where ``"ddp"`` saves its fp32 parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from lightning_par.checkpoint.hook_edits import StateSnapshot
from lightning_par.zero.engine_api import Engine

__all__ = ["put_masters"]


def put_masters(
    checkpoint: dict[str, Any],
    saving: StateSnapshot | None,
    engine: Engine | None,
    *,
    gather: Callable[[], Mapping[str, Tensor]],
) -> None:
    """Put the fp32 master values (``gather()``: the whole state on global rank 0, collective) in place of
    the entries of ``checkpoint["state_dict"]`` that hold a tensor the save hooks received (``saving``)
    unchanged, where ``engine`` keeps masters apart from the parameters; otherwise nothing to do."""
    sharded = engine.sharded_state if engine is not None else None
    if sharded is None or sharded.master_key is None:  # the parameters are the masters
        return
    whole = gather()
    state = checkpoint.get("state_dict")
    if not isinstance(state, dict):
        return
    sources = saving.unchanged_sources(state) if saving is not None else {k: k for k in state}
    for key, source in sources.items():
        if source in whole:
            state[key] = whole[source]
