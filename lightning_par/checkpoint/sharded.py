"""The sharded checkpoint format: a directory written by every rank, readable by any layout.

Layout of ``<path>/``::

    meta.pt              rank 0: the Lightning checkpoint without optimizer states (model weights,
                         loops, callbacks, LR schedulers, hyper-parameters) plus ``"lightning_par"``
                         layout metadata: format, zero_stage, world/dp/tp/pp sizes, parameter names and
                         shapes, bucket order, and for each optimizer its class and parameter names
    optim_rank00000.pt   each rank: for each optimizer, the param groups' hyper-parameters and the
    optim_rank00001.pt   rank's state records (name, lo, hi, {key: slice or scalar}), see
    ...                  :mod:`lightning_par.checkpoint.optimizer_state`
    COMPLETE             written by rank 0 last, after a barrier: a directory without it is partial

Loading reads the records of all ranks (memory-mapped) and cuts out what the current layout owns, so the
data-parallel size and the ZeRO stage may differ between saving and loading.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_par.checkpoint.optimizer_state import MASTER_KEY, Pieces, cut
from lightning_par.checkpoint.tp_reshard import globalize

META_FILE = "meta.pt"
COMPLETE_FILE = "COMPLETE"
METADATA_KEY = "lightning_par"


def rank_file(rank: int) -> str:
    return f"optim_rank{rank:05d}.pt"


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    return Path(path).is_dir() and (Path(path) / META_FILE).is_file()


def write_rank_file(path: Path, rank: int, payload: Mapping[str, Any]) -> None:
    tmp = path / (rank_file(rank) + ".tmp")
    torch.save(dict(payload), tmp)
    os.replace(tmp, path / rank_file(rank))


def write_meta(path: Path, checkpoint: Mapping[str, Any]) -> None:
    tmp = path / (META_FILE + ".tmp")
    torch.save(dict(checkpoint), tmp)
    os.replace(tmp, path / META_FILE)


def mark_complete(path: Path, world_size: int) -> None:
    (path / COMPLETE_FILE).write_text(f"{world_size}\n")


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint dict (without optimizer states) of a complete sharded checkpoint."""
    p = Path(path)
    if not (p / COMPLETE_FILE).is_file():
        raise ValueError(
            f"{p} is an incomplete sharded checkpoint (no {COMPLETE_FILE} marker: a save was interrupted);"
            " load an earlier checkpoint."
        )
    meta: dict[str, Any] = torch.load(p / META_FILE, map_location="cpu", weights_only=False)
    return meta


def _payloads(path: Path) -> list[dict[str, Any]]:
    world = int((path / COMPLETE_FILE).read_text().split()[0])
    out = []
    for rank in range(world):
        file = path / rank_file(rank)
        if not file.is_file():
            raise ValueError(
                f"Sharded checkpoint {path} lacks {file.name} although it was saved by {world} ranks."
            )
        out.append(torch.load(file, map_location="cpu", weights_only=False, mmap=True))
    return out


_NO_TP = {"rank": 0, "size": 1, "dims": {}}


def read_optimizer_records(path: str | os.PathLike[str]) -> list[tuple[list[dict[str, Any]], Pieces]]:
    """For each optimizer: (param-group hyper-parameters with ``param_names``, pieces of the *full*
    parameters' state, assembled from all ranks whatever their data- and tensor-parallel layout)."""
    p = Path(path)
    shapes = read_meta(p)[METADATA_KEY]["params"]
    payloads = _payloads(p)
    out = []
    for k, opt in enumerate(payloads[0]["optimizers"]):
        per_rank = [(pl.get("tp", _NO_TP), pl["optimizers"][k]["records"]) for pl in payloads]
        out.append((opt["param_groups"], globalize(per_rank, shapes)))
    return out


def read_model_records(path: str | os.PathLike[str]) -> Pieces | None:
    """Pieces ``{"param": values}`` of the full parameters when the ranks saved their pieces (ZeRO-3, or
    tensor parallelism at any stage); None when the model was saved whole in ``meta.pt``."""
    p = Path(path)
    payloads = _payloads(p)
    if any("model" not in pl for pl in payloads):
        return None
    shapes = read_meta(p)[METADATA_KEY]["params"]
    return globalize([(pl.get("tp", _NO_TP), pl["model"]) for pl in payloads], shapes)


def assemble_state_dict(
    pieces: Pieces, meta: Mapping[str, Any], *, require_all: bool = True
) -> dict[str, torch.Tensor]:
    """Full parameters from ``{"param": ...}`` pieces, under every name a tied parameter is registered."""
    out: dict[str, torch.Tensor] = {}
    for name, shape in meta["params"].items():
        if not require_all and not pieces.get(name):
            continue
        numel = 1
        for s in shape:
            numel *= s
        piece = cut(pieces.get(name, []), 0, numel)
        if piece is None:
            raise ValueError(f"The sharded checkpoint has no values for parameter {name!r}.")
        value = piece["param"].view(shape)
        for alias in meta.get("aliases", {}).get(name, [name]):
            out[alias] = value
    return out


def check_params_match(saved: Mapping[str, Any], current: Mapping[str, tuple[int, ...]]) -> None:
    """Raise a ``ValueError`` naming every parameter that is missing, unexpected or of another shape."""
    saved_shapes = {k: tuple(v) for k, v in saved.items()}
    missing = sorted(set(current) - set(saved_shapes))
    unexpected = sorted(set(saved_shapes) - set(current))
    reshaped = sorted(
        f"{k}: checkpoint {saved_shapes[k]} vs model {current[k]}"
        for k in set(current) & set(saved_shapes)
        if saved_shapes[k] != tuple(current[k])
    )
    if missing or unexpected or reshaped:
        parts = []
        if missing:
            parts.append(f"missing in the checkpoint: {missing[:8]}")
        if unexpected:
            parts.append(f"not in the model: {unexpected[:8]}")
        if reshaped:
            parts.append(f"different shapes: {reshaped[:8]}")
        raise ValueError(
            "The checkpoint does not match the model (" + "; ".join(parts) + "). Load it into the model"
            " configuration it was saved from."
        )


def consolidate(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A single-file Lightning checkpoint (full ``optimizer_states`` in torch's own format) from a sharded
    directory, for export or for tools that expect one file. Reads rank files one at a time (mmap)."""
    checkpoint = read_meta(path)
    model = read_model_records(path)
    if model is not None:
        checkpoint["state_dict"] = {
            **checkpoint.get("state_dict", {}),
            **assemble_state_dict(model, checkpoint[METADATA_KEY]),
        }
    states = []
    for hyper, pieces in read_optimizer_records(path):
        state: dict[int, dict[str, Any]] = {}
        groups = []
        index = 0
        shapes = checkpoint[METADATA_KEY]["params"]
        for group in hyper:
            ids = []
            for name in group["param_names"]:
                numel = 1
                for s in shapes[name]:
                    numel *= s
                piece = cut(pieces.get(name, []), 0, numel)
                if piece is not None:
                    state[index] = {
                        k: v.view(shapes[name]) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                        for k, v in piece.items()
                        if k != MASTER_KEY
                    }
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in group.items() if k != "param_names"}, "params": ids})
        states.append({"state": state, "param_groups": groups})
    checkpoint["optimizer_states"] = states
    checkpoint[METADATA_KEY] = {**checkpoint[METADATA_KEY], "format": "full"}
    return checkpoint
