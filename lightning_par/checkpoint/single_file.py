"""Reading a checkpoint path that is neither one of our sharded directories nor a
``torch.distributed.checkpoint`` one: a single torch file, memory-mapped.

Contract
--------
:func:`read_torch_file` loads ``path`` with ``mmap=True`` (each rank then reads only the slices it keeps);
a file torch cannot map (a legacy, pre-zip ``torch.save``) is read without it, where torch's own message
told the user to re-save a file that may not be a checkpoint at all. :func:`refuse_directory` names a
directory that holds no checkpoint of a known kind, and the checkpoints it does hold, where the loaders
said only ``IsADirectoryError`` (a run pointed at its ``checkpoints/`` folder instead of a file in it).
:func:`local_path` reads a checkpoint path as a local one (``file://`` stripped), or None for another
fsspec protocol; :func:`write_over_directory` writes a single file where a checkpoint directory is.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol

from lightning_par.checkpoint.dcp_import import is_dcp_checkpoint
from lightning_par.checkpoint.sharded import META_FILE, is_sharded_checkpoint, swap_into_place

__all__ = [
    "DIRECTORY_NOTE",
    "FABRIC_DIRECTORY_NOTE",
    "local_path",
    "read_torch_file",
    "refuse_directory",
    "sharded_path",
    "write_over_directory",
]

_LISTED = 5  # checkpoints named in the message


# said at the first sharded save, before a user meets Lightning's bare IsADirectoryError in
# load_from_checkpoint, torch.load or a Trainer with another strategy (a probe porting a "ddp" project did)
DIRECTORY_NOTE = (
    "lightning_par: checkpoints are directories of per-rank files (the optimizer state is sharded), which"
    " this strategy resumes (ckpt_path=...). Lightning's load_from_checkpoint, torch.load and"
    " Trainers with other strategies cannot open a directory: convert one with `lightning-par-consolidate"
    " DIR OUT.ckpt`, or pass save_distributed_checkpoint=False to write one ordinary file."
)
# the same for fabric.save: litgpt's final save(path / "lit_model.pth", {"model": model}) at ZeRO-3 (no rank
# holds the model whole there) became a directory named like a file, which its tools then could not open
FABRIC_DIRECTORY_NOTE = (
    "lightning_par: fabric.save wrote a directory of per-rank files (the optimizer state is sharded at ZeRO"
    " 1-3; at ZeRO-3 and under tensor or pipeline parallelism the model's parameters too, even in a state"
    " without an optimizer), which fabric.load with this strategy reads. torch.load, Fabric's other"
    " strategies and litgpt's tools cannot open a directory: convert one with `lightning-par-consolidate DIR"
    " OUT.pth`, or pass save_distributed_checkpoint=False to write one ordinary file."
)


def refuse_directory(path: Path) -> None:
    """Raise if ``path`` is a directory that is not a checkpoint (see the module docstring)."""
    if not path.is_dir() or is_sharded_checkpoint(path) or is_dcp_checkpoint(path):
        return
    inside = sorted(p.name for p in path.iterdir() if _is_checkpoint(p))
    more = " ..." if len(inside) > _LISTED else ""
    held = (
        f" It holds {', '.join(inside[:_LISTED])}{more}: pass one of those." if inside else " None is in it."
    )
    raise ValueError(
        f"{str(path)!r} is a directory, not a checkpoint: it has no {META_FILE} (lightning_par's sharded"
        " checkpoints) and no .metadata (torch.distributed.checkpoint's)." + held
    )


def _is_checkpoint(path: Path) -> bool:
    return path.name.endswith(".ckpt") or is_sharded_checkpoint(path) or is_dcp_checkpoint(path)


def read_torch_file(path: Path, *, weights_only: bool) -> Any:
    """``torch.load`` of a single checkpoint file on the CPU, memory-mapped where torch can."""
    refuse_directory(path)
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    except RuntimeError as exc:
        if "mmap" not in str(exc):
            raise
    # a legacy (non-zip) torch file: read whole, as Lightning's own loader does
    return torch.load(path, map_location="cpu", weights_only=weights_only)


def local_path(filepath: Any) -> Path | None:
    """``filepath`` as a local path (a ``file://`` URL stripped), or None for another fsspec protocol
    (``s3://``, ``memory://``), which only a single file reaches (through fsspec)."""
    text = str(filepath)
    if text.startswith("file://"):
        return Path(text[len("file://") :])
    return Path(text) if _is_local_file_protocol(text) else None


def sharded_path(filepath: Any) -> Path:
    """The local path of a checkpoint directory, or a ``ValueError`` naming the fixes for a remote URL
    (before, pathlib turned ``s3://b/x`` into a local folder ``s3:/b/x``, silently)."""
    path = local_path(filepath)
    if path is None:
        raise ValueError(
            f"{filepath}: checkpoints written per rank (a directory: ZeRO 1-3, tensor or pipeline"
            " parallelism) go to a local or mounted path only. Save to one (a mounted bucket), or save one"
            " file through fsspec: HybridParallelStrategy(save_distributed_checkpoint=False)."
        )
    return path


def write_over_directory(filepath: Any, write: Callable[[Any], None]) -> None:
    """``write(path)`` of a single-file checkpoint at ``filepath``; where a checkpoint directory (or a link
    to one) is there, into a sibling file swapped in for it (before, fsspec's move put the file inside
    the directory and changed the directory's mode, and the save was lost without a word)."""
    path = local_path(filepath)
    if path is None or not path.is_dir():
        write(filepath)
        return
    staging = path.with_name(path.name + ".file-partial")
    write(staging)
    swap_into_place(staging, path=path)
