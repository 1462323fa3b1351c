"""``lightning-par-consolidate DIR OUT.ckpt``: one ordinary Lightning checkpoint file from a sharded one
(ours, or the ``torch.distributed.checkpoint`` directory of Lightning's FSDP strategies).

The output is :func:`lightning_par.checkpoint.export.consolidate` written with ``torch.save``: full
``state_dict`` (ZeRO-3 and tensor-parallel pieces assembled), ``hyper_parameters`` from ``meta.pt`` (so
``LightningModule.load_from_checkpoint(OUT)`` works), loops and callbacks, and the optimizer states in
torch's own format unless ``--weights-only``. It is written atomically (temp file in OUT's directory,
fsync, rename), so OUT is either absent, the previous file, or the whole new one.

Exit status: 0 on success (one line on stdout says what was written); 2 on a usage error or when DIR is
not a complete, undamaged sharded checkpoint, OUT exists without ``--force``, or OUT is inside DIR (one
line on stderr).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_par.checkpoint.dcp_import import is_dcp_checkpoint
from lightning_par.checkpoint.export import consolidate
from lightning_par.checkpoint.files import fsync_dir
from lightning_par.checkpoint.sharded import FABRIC_KEYS, META_FILE, is_sharded_checkpoint
from lightning_par.checkpoint.single_file import refuse_directory

PROG = "lightning-par-consolidate"
# what a weights-only checkpoint lacks (as Lightning's save_weights_only): the schedulers step optimizers
_OPTIMIZER_KEYS = ("optimizer_states", "lr_schedulers")


class CliError(Exception):
    """A failure reported as one line on stderr with exit status 2."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Turn a sharded checkpoint directory (lightning_par's, or Lightning's FSDPStrategy /"
        " ModelParallelStrategy's) into one checkpoint file.",
    )
    parser.add_argument("directory", type=Path, metavar="DIR", help="the sharded checkpoint directory")
    parser.add_argument("output", type=Path, metavar="OUT", help="the checkpoint file to write (.ckpt)")
    parser.add_argument(
        "--weights-only", action="store_true", help="drop the optimizer states and LR schedulers"
    )
    parser.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    return parser


def consolidated_checkpoint(directory: Path, *, weights_only: bool) -> dict[str, Any]:
    """The single-file checkpoint dict of ``directory``.

    Raises:
        CliError: ``directory`` is not a sharded checkpoint.
        ValueError: it is incomplete or one of its files is damaged (the message names the file).
    """
    refuse_directory(directory)  # a folder of checkpoints: the message lists them
    if not (is_sharded_checkpoint(directory) or is_dcp_checkpoint(directory)):
        what = "does not exist" if not directory.exists() else f"has no {META_FILE}"
        raise CliError(f"{directory} is not a sharded checkpoint directory (it {what}).")
    checkpoint = consolidate(directory)
    if FABRIC_KEYS in checkpoint:  # fabric.save's layout: the optimizers under their own keys
        if weights_only:
            for key in checkpoint[FABRIC_KEYS].get("optimizers", []):
                checkpoint.pop(key, None)
        return checkpoint
    if weights_only or not checkpoint.get("optimizer_states"):
        # no states (a weights-only save holds none): without the key Lightning refuses to resume from
        # the file with its "contains only the model" message instead of resuming with fresh optimizers
        for key in _OPTIMIZER_KEYS:
            checkpoint.pop(key, None)
    return checkpoint


def check_output(directory: Path, output: Path) -> None:
    """Refuse an ``output`` inside ``directory``: overwriting one of its files (``meta.pt`` with ``--force``)
    destroyed the checkpoint, and a new file there is not part of it (its ``COMPLETE`` manifest lists
    the files). Checked before anything is read."""
    if output.resolve().is_relative_to(directory.resolve()) and directory.is_dir():
        raise CliError(
            f"{output} is inside the checkpoint directory {directory}; writing it there would damage or"
            f" clutter the checkpoint. Write the consolidated file outside it (e.g. {directory}.full.ckpt)."
        )


def write_atomic(checkpoint: dict[str, Any], output: Path, *, force: bool) -> int:
    """``torch.save`` to ``output`` through a temp file, fsync and rename; return the bytes written.

    Raises:
        CliError: ``output`` exists and ``force`` is false, or it is a directory.
    """
    if output.is_dir():
        raise CliError(f"{output} is a directory; give a file name for the consolidated checkpoint.")
    if output.exists() and not force:
        raise CliError(f"{output} exists; pass --force to overwrite it.")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(output.parent)
    return output.stat().st_size


def _count_parameters(state_dict: dict[str, Any]) -> tuple[int, int]:
    """(tensors, elements) of a state dict, a tied tensor counted once."""
    seen: set[tuple[int, int]] = set()
    elements = 0
    for value in state_dict.values():
        if isinstance(value, torch.Tensor):
            key = (value.data_ptr(), value.numel())  # tied weights share both
            if key not in seen:
                seen.add(key)
                elements += value.numel()
    return len(seen), elements


def _contents(checkpoint: dict[str, Any]) -> tuple[int, int, int]:
    """(tensors, elements, optimizer states) of a consolidated file: the Trainer's layout
    (``state_dict``, ``optimizer_states``) or ``fabric.save``'s (the module and optimizers under the keys
    it recorded; before, a Fabric file was reported as "0 parameters in 0 tensors")."""
    keys = checkpoint.get(FABRIC_KEYS)
    if keys is None:
        return (
            *_count_parameters(checkpoint.get("state_dict", {})),
            len(checkpoint.get("optimizer_states", [])),
        )
    module = checkpoint.get(keys["module"], {}) if keys.get("module") is not None else {}
    optimizers = sum(key in checkpoint for key in keys.get("optimizers", []))
    return (*_count_parameters(module), optimizers)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``lightning-par-consolidate``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        check_output(args.directory, args.output)
        checkpoint = consolidated_checkpoint(args.directory, weights_only=args.weights_only)
        nbytes = write_atomic(checkpoint, args.output, force=args.force)
    except (CliError, ValueError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    tensors, elements, optimizers = _contents(checkpoint)
    print(
        f"wrote {args.output}: {elements:,} parameters in {tensors} tensors, {optimizers} optimizer"
        f" state(s), {nbytes:,} bytes"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
