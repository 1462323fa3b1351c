"""Reading a checkpoint path that is neither one of our sharded directories nor a
``torch.distributed.checkpoint`` one: a single torch file, memory-mapped.

Contract
--------
:func:`read_torch_file` loads ``path`` with ``mmap=True`` (each rank then reads only the slices it keeps);
a file torch cannot map (a legacy, pre-zip ``torch.save``) is read without it, where torch's own message
told the user to re-save a file that may not be a checkpoint at all. :func:`refuse_directory` names a
directory that holds no checkpoint of a known kind, and the checkpoints it does hold, where the loaders
said only ``IsADirectoryError`` (a run pointed at its ``checkpoints/`` folder instead of a file in it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_par.checkpoint.dcp_import import is_dcp_checkpoint
from lightning_par.checkpoint.sharded import META_FILE, is_sharded_checkpoint

__all__ = ["read_torch_file", "refuse_directory"]

_LISTED = 5  # checkpoints named in the message


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
