"""The sharded checkpoint format: a directory written by every rank, readable by any layout.

Layout of ``<path>/``::

    meta.pt              rank 0: the Lightning checkpoint without optimizer states (model weights,
                         loops, callbacks, LR schedulers, hyper-parameters) plus ``"lightning_par"``
                         layout metadata: format, zero_stage, world/dp/tp/pp sizes, parameter names and
                         shapes, bucket order, and for each optimizer its class and parameter names
    optim_rank00000.pt   each rank: for each optimizer, the param groups' hyper-parameters and the
    optim_rank00001.pt   rank's state records (name, lo, hi, {key: slice or scalar}), see
    ...                  :mod:`lightning_par.checkpoint.optimizer_state`; no optimizer records in a
                         weights-only checkpoint (Lightning's ``save_weights_only``)
    COMPLETE             written by rank 0 last, after a barrier: a directory without it is partial

``COMPLETE`` is the manifest. Its first line is the world size (all an older reader parses); the second
is JSON ``{"manifest": 1, "files": {"meta.pt": {"size": bytes, "crc32": int}, "optim_rank00000.pt":
...}}``. Every file is written through :func:`lightning_par.checkpoint.files.save_with_digest` (CRC-32
computed while writing, fsync, rename) and its writer leaves ``<file>.crc``; rank 0 collects those into
``COMPLETE`` and removes them. Readers check each file's size and CRC-32 before unpickling it and raise a
``ValueError`` naming the damaged file; a ``COMPLETE`` holding only the world size (written before the
manifest existed) is read without checks.

Saving is atomic at the directory level. All ranks write into the staging directory
``<path>.partial-step<global step>`` (a name every rank derives from the broadcast path and the step);
rank 0 marks it complete, then swaps it in: ``<path>`` (a directory, or a single-file checkpoint of the
same name) is renamed to ``<path>.previous``, the staging directory to ``<path>``, and ``.previous`` is
deleted. A crash therefore leaves ``<path>`` holding either the previous or the new complete checkpoint;
a crash between the two renames leaves only ``<path>.previous``, which :func:`resolve_checkpoint_dir`
falls back to with a warning. The next save of ``<path>`` removes the staging directories of crashed
saves and a stale ``.previous``.

Loading reads the records of all ranks (memory-mapped) and cuts out what the current layout owns, so the
data-parallel size and the ZeRO stage may differ between saving and loading.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_par.checkpoint.files import (
    DAMAGED_HINT,
    FileDigest,
    fsync_dir,
    read_digest,
    remove_path,
    save_with_digest,
    verify_file,
    write_digest,
    write_text_atomic,
)
from lightning_par.checkpoint.optimizer_state import Pieces, cut
from lightning_par.checkpoint.tp_reshard import globalize

META_FILE = "meta.pt"
COMPLETE_FILE = "COMPLETE"
METADATA_KEY = "lightning_par"
MANIFEST_VERSION = 1
PREVIOUS_SUFFIX = ".previous"


RANK_FILES = "optim_rank*.pt"  # every rank's file, as a glob pattern


def rank_file(rank: int) -> str:
    return f"optim_rank{rank:05d}.pt"


# ---------------------------------------------------------------------------------------------- naming
def staging_dir(path: Path, *, step: int) -> Path:
    """Where the save of ``path`` at global step ``step`` is written before it is swapped in: a sibling,
    so the final rename stays within one file system, named without Lightning's ``.ckpt`` suffix, so
    ``ModelCheckpoint`` never takes it for a checkpoint."""
    return path.with_name(f"{path.name}.partial-step{step:09d}")


def previous_dir(path: Path) -> Path:
    """Where the checkpoint being replaced at ``path`` waits while the new one is renamed in."""
    return path.with_name(path.name + PREVIOUS_SUFFIX)


def resolve_checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    """``path``, or ``<path>.previous`` when ``path`` is missing and that is a sharded checkpoint (a save
    crashed between its two renames, see the module docstring); the fallback is announced with a
    warning naming both."""
    p = Path(path)
    if p.exists():
        return p
    previous = previous_dir(p)
    if previous.is_dir() and (previous / META_FILE).is_file():
        warnings.warn(
            f"Sharded checkpoint {p} is missing but {previous} exists: a save was interrupted while"
            f" swapping the new checkpoint in, so {previous} (the previous checkpoint) is read instead.",
            stacklevel=3,
        )
        return previous
    return p


DCP_INDEX = ".metadata"  # torch.distributed.checkpoint's index: Lightning's FSDP strategies' directories


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    """A directory of ours (``meta.pt``, ``COMPLETE`` or a rank's file, without DCP's index, which
    Lightning's FSDP strategies write beside their own ``meta.pt``: :mod:`lightning_par.checkpoint.dcp_import`
    reads those). A damaged one counts too, so its reader names what is missing (:func:`read_meta`: "lacks
    meta.pt"), where Lightning's single-file loader said only ``IsADirectoryError``."""
    p = resolve_checkpoint_dir(path)
    if not p.is_dir() or (p / DCP_INDEX).is_file():
        return False
    ours = (p / META_FILE).is_file() or (p / COMPLETE_FILE).is_file()
    return ours or next(p.glob(RANK_FILES), None) is not None


# ---------------------------------------------------------------------------------------------- writing
def write_rank_file(path: Path, rank: int, payload: Mapping[str, Any]) -> FileDigest:
    """Write this rank's records into the directory ``path`` and its ``.crc`` record; return the digest."""
    file = path / rank_file(rank)
    digest = save_with_digest(dict(payload), file)
    write_digest(file, digest)
    return digest


def write_meta(path: Path, checkpoint: Mapping[str, Any]) -> FileDigest:
    """Write ``meta.pt`` (rank 0) into the directory ``path`` and its ``.crc`` record; return the digest."""
    file = path / META_FILE
    digest = save_with_digest(dict(checkpoint), file)
    write_digest(file, digest)
    return digest


def mark_complete(path: Path, world_size: int) -> None:
    """Rank 0, after a barrier that follows every rank's writes: collect the ``.crc`` records into the
    ``COMPLETE`` manifest (written atomically, last), then drop them.

    Raises:
        ValueError: a rank's ``.crc`` record is missing (that rank did not finish its file).
    """
    names = [META_FILE] + [rank_file(r) for r in range(world_size)]
    files = {name: read_digest(path / name) for name in names}
    manifest = {"manifest": MANIFEST_VERSION, "files": files}
    write_text_atomic(path / COMPLETE_FILE, f"{world_size}\n{json.dumps(manifest, sort_keys=True)}\n")
    for name in names:
        (path / (name + ".crc")).unlink(missing_ok=True)
    fsync_dir(path)


def prepare_staging(path: Path, *, staging: Path) -> None:
    """Rank 0, before any rank writes: delete what crashed saves of ``path`` left (staging directories,
    ``staging`` itself included) and create ``staging`` empty. ``path`` and ``<path>.previous`` are left
    alone: one of them is the newest complete checkpoint until the new one is swapped in."""
    leftover = re.compile(re.escape(path.name) + r"\.partial-step\d+")
    if path.parent.is_dir():
        for entry in path.parent.iterdir():
            if leftover.fullmatch(entry.name):
                remove_path(entry)
    staging.mkdir(parents=True)


def swap_into_place(staging: Path, *, path: Path) -> None:
    """Rank 0, after ``staging`` is marked complete: make it ``path`` (see the module docstring).

    Between the steps a crash leaves ``path`` complete (old or new) or, between the two renames, only a
    complete ``<path>.previous`` (the reader's fallback). Whatever sits at ``path`` (a directory, a
    single-file checkpoint, a symlink) is moved aside, never deleted before the new one is in place.
    """
    previous = previous_dir(path)
    if path.exists() or path.is_symlink():
        # <path> is complete, so an existing .previous is older still (a crash after an earlier swap)
        remove_path(previous)
        os.replace(path, previous)
    os.replace(staging, path)
    fsync_dir(path.parent)  # both renames are durable before the old checkpoint goes
    remove_path(previous)


# ---------------------------------------------------------------------------------------------- reading
def _read_complete(p: Path) -> tuple[int, dict[str, FileDigest] | None]:
    """(world size, manifest or None for a checkpoint written before manifests) from ``COMPLETE``."""
    marker = p / COMPLETE_FILE
    if not marker.is_file():
        raise ValueError(
            f"{p} is an incomplete sharded checkpoint (no {COMPLETE_FILE} marker: a save was interrupted);"
            " load an earlier checkpoint."
        )
    try:
        first, _, rest = marker.read_text(encoding="utf-8").partition("\n")
        world = int(first.split()[0])
        if not rest.strip():
            return world, None
        files = json.loads(rest)["files"]
        return world, {n: {"size": int(d["size"]), "crc32": int(d["crc32"])} for n, d in files.items()}
    except (ValueError, IndexError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"Sharded checkpoint {p}: {COMPLETE_FILE} is unreadable ({exc}). {DAMAGED_HINT}"
        ) from exc


def _load_checked(p: Path, name: str, manifest: dict[str, FileDigest] | None, *, mmap: bool) -> Any:
    """``torch.load`` of ``p / name`` after its manifest check; every failure is a ``ValueError`` that
    names the file (torch's own errors name none)."""
    file = p / name
    if manifest is not None:
        if name not in manifest:
            raise ValueError(
                f"Sharded checkpoint {p}: {name} is not listed in its {COMPLETE_FILE} manifest."
                f" {DAMAGED_HINT}"
            )
        verify_file(file, manifest[name], checkpoint=p)
    try:
        return torch.load(file, map_location="cpu", weights_only=False, mmap=mmap)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        raise ValueError(f"Sharded checkpoint {p}: {name} is unreadable ({exc}). {DAMAGED_HINT}") from exc


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint dict (without optimizer states) of a complete sharded checkpoint.

    Raises:
        ValueError: the checkpoint is incomplete, or ``meta.pt`` is missing, of another size than
            written, fails its checksum or cannot be unpickled; the message names the file.
    """
    p = resolve_checkpoint_dir(path)
    _, manifest = _read_complete(p)
    if not (p / META_FILE).is_file():
        raise ValueError(f"Sharded checkpoint {p} lacks {META_FILE}. {DAMAGED_HINT}")
    meta: dict[str, Any] = _load_checked(p, META_FILE, manifest, mmap=False)
    return meta


def _payloads(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every rank's payload (memory-mapped), each file checked against the manifest first."""
    p = resolve_checkpoint_dir(path)
    world, manifest = _read_complete(p)
    out = []
    for rank in range(world):
        file = p / rank_file(rank)
        if not file.is_file():
            raise ValueError(
                f"Sharded checkpoint {p} lacks {file.name} although it was saved by {world} ranks."
            )
        out.append(_load_checked(p, file.name, manifest, mmap=True))
    return out


_NO_TP = {"rank": 0, "size": 1, "dims": {}}


FABRIC_KEYS = "fabric_keys"  # a fabric.save's: which entries of its state were the module and optimizers
RANK_ENTRIES_KEY = "lightning_par_rank_entries"  # a checkpoint's per-rank entries from callbacks
# callables ``hook(checkpoint)`` a callback's on_save_checkpoint leaves for the strategy to run, on every
# rank, when the checkpoint is written: work (copies, collectives) that a dump never written (a flash
# snapshot's) must not pay
WRITE_HOOKS_KEY = "lightning_par_write_hooks"
# in a FlashCheckpoint snapshot's Lightning dict: weight-averaging callbacks' per-rank averages, by the
# callback's state_key (same layout, or every writer's merged when a snapshot is resharded)
SNAPSHOT_AVERAGES_KEY = "lightning_par_snapshot_averages"


def read_rank_entries(path: str | os.PathLike[str], key: str) -> list[tuple[dict[str, Any], Any]]:
    """``(tensor-parallel coordinates, entry)`` of every rank that saved an entry under ``key`` (see
    ``RANK_ENTRIES_KEY``), in rank order."""
    out = []
    for payload in _payloads(path):
        entry = payload.get("entries", {}).get(key)
        if entry is not None:
            out.append((payload.get("tp", _NO_TP), entry))
    return out


def read_optimizer_records(path: str | os.PathLike[str]) -> list[tuple[list[dict[str, Any]], Pieces]]:
    """For each optimizer: (param-group hyper-parameters with ``param_names``, pieces of the *full*
    parameters' state, assembled from all ranks whatever their data- and tensor-parallel layout)."""
    p = Path(path)
    shapes = read_meta(p)[METADATA_KEY]["params"]
    payloads = _payloads(p)
    out = []
    # a weights-only checkpoint has none (see save_sharded)
    for k, opt in enumerate(payloads[0].get("optimizers", [])):
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


def check_params_match(
    saved: Mapping[str, Any], current: Mapping[str, tuple[int, ...]], *, strict: bool = True, hint: str = ""
) -> None:
    """Raise a ``ValueError`` naming every parameter that is missing, unexpected or of another shape;
    with ``strict=False`` only shapes are compared, over the names both hold (torch's
    ``load_state_dict(strict=False)``: a new head, or one dropped, is left out of the load), and a
    checkpoint none of whose parameters the model has, which would load nothing, is refused (every name
    renamed: another attribute, a ``_orig_mod.`` prefix). ``hint`` ends the message."""
    saved_shapes = {k: tuple(v) for k, v in saved.items()}
    if not strict and saved_shapes and current and not set(saved_shapes) & set(current):
        raise ValueError(
            f"None of the checkpoint's {len(saved_shapes)} parameters is a parameter of the model (the"
            f" checkpoint's {sorted(saved_shapes)[:3]} ..., the model's {sorted(current)[:3]} ...): with"
            " strict loading off nothing would load. Rename the keys to the model's (on_load_checkpoint)"
            " or load it into the model it was saved from." + hint
        )
    missing = sorted(set(current) - set(saved_shapes)) if strict else []
    unexpected = sorted(set(saved_shapes) - set(current)) if strict else []
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
            " configuration it was saved from"
            + (
                ", or leave out the names only one side has: fabric.load(..., strict=False), or"
                " self.strict_loading = False on the LightningModule."
                if strict
                else "."
            )
            + hint
        )
