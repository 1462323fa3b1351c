"""One Lightning (or Fabric) file from a sharded checkpoint directory: ``consolidate``, behind the
``lightning-par-consolidate`` command and ``LightningModule.load_from_checkpoint`` after it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning_par.checkpoint.averages import CHECKPOINT_ENTRY, averaged_state_dict, pieces_from_entries
from lightning_par.checkpoint.dcp_import import is_dcp_checkpoint, read_dcp_checkpoint
from lightning_par.checkpoint.full import torch_optimizer_state
from lightning_par.checkpoint.model_state import full_state_dict_of
from lightning_par.checkpoint.sharded import (
    FABRIC_KEYS,
    METADATA_KEY,
    _payloads,
    read_meta,
    read_optimizer_records,
    read_rank_entries,
    resolve_checkpoint_dir,
)


def consolidate(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A single-file Lightning checkpoint from a sharded directory, for export or for tools that expect
    one file (``LightningModule.load_from_checkpoint``): the full ``state_dict`` (trainable parameters at
    their fp32 master values, frozen ones, buffers) and the full ``optimizer_states`` in torch's own
    format. Reads rank files one at a time (mmap). A ``torch.distributed.checkpoint`` directory of
    Lightning's FSDP strategies is read whole (:mod:`lightning_par.checkpoint.dcp_import`)."""
    if is_dcp_checkpoint(path):
        converted = read_dcp_checkpoint(path)
        converted[METADATA_KEY]["format"] = "full"
        return converted
    source = resolve_checkpoint_dir(path)
    checkpoint = read_meta(source)
    meta = checkpoint[METADATA_KEY]
    checkpoint["state_dict"] = full_state_dict_of(checkpoint, source)
    averages = read_rank_entries(source, CHECKPOINT_ENTRY)
    if averages:  # Lightning's WeightAveraging layout: the averaged model is the state_dict
        pieces, buffers = pieces_from_entries(averages, meta["params"])
        current = checkpoint["state_dict"]
        checkpoint["state_dict"] = averaged_state_dict(current, pieces, buffers, meta)
        checkpoint["current_model_state"] = current
    elif "averaging_state" in checkpoint:
        # saved after fit, when the model holds the averages: Lightning's layout has them twice
        checkpoint["current_model_state"] = checkpoint["state_dict"]
    states = [
        torch_optimizer_state(hyper, pieces, meta["params"])
        for hyper, pieces in read_optimizer_records(source)
    ]
    if states or "optimizer_states" in checkpoint:
        checkpoint["optimizer_states"] = states
    checkpoint[METADATA_KEY] = {**meta, "format": "full"}
    if FABRIC_KEYS in checkpoint:
        return _fabric_file(checkpoint, source)
    return checkpoint


def _fabric_file(checkpoint: dict[str, Any], source: Path) -> dict[str, Any]:
    """A consolidated ``fabric.save`` directory in the layout ``fabric.save`` writes as one file
    (``{module key: state dict, optimizer key: torch's state, averages key: {"state_dict", "n_averaged"},
    ...extras}``), which Fabric's own strategies and litgpt's ``load_checkpoint`` read (before, the
    Trainer's layout: ``fabric.load`` on one device failed with ``KeyError: 'model'``)."""
    keys = checkpoint[FABRIC_KEYS]
    meta = checkpoint[METADATA_KEY]
    out: dict[str, Any] = dict(checkpoint.get("extras", {}))
    if keys.get("module") is not None:
        out[keys["module"]] = checkpoint["state_dict"]
    out.update(zip(keys.get("optimizers", []), checkpoint.get("optimizer_states", []), strict=False))
    for key in sorted({k for payload in _payloads(source) for k in payload.get("entries", {})}):
        entries = read_rank_entries(source, key)  # weight averages (strategy.weight_averages())
        pieces, buffers = pieces_from_entries(entries, meta["params"])
        averaged = averaged_state_dict(checkpoint["state_dict"], pieces, buffers, meta)
        out[key] = {"state_dict": averaged, "n_averaged": entries[0][1]["n_averaged"]}
    out[FABRIC_KEYS], out[METADATA_KEY] = keys, meta
    return out
