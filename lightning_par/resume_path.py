"""The ``ckpt_path`` of ``lightning-par-train``, checked before any process starts.

Contract
--------
:func:`check_ckpt_path` raises ``ValueError`` naming the fix when

* the path names no file or directory, or a directory that is no checkpoint (a run's ``checkpoints/``
  folder given for one of its checkpoints), which Lightning finds only after every rank built the model;
* it is ``last`` and this run's checkpoint directory holds no last checkpoint while an earlier run of the
  same task does. Hydra gives every run a new directory (``outputs/<task>/<time>``) unless
  ``hydra.run.dir`` names one, so ``ckpt_path=last`` alone looks in a directory that was created a moment
  ago; Lightning then warns and trains from scratch, which a user resuming a run does not notice until
  the curves start over. The earlier run is named with the override that resumes it. Earlier runs are
  the run directory's siblings whose saved config (``.hydra/config.yaml``) has this ``task_name``: a
  layout of one directory per task (``hydra.run.dir`` set to ``.../${task_name}`` in a config file) has
  other tasks' runs beside it, which are not this one's.

``last`` with no earlier run passes, as in Lightning, so a command can always carry it ("set and
forget": the first attempt starts, the requeued ones resume), and so do Lightning's other names but
``best``, which names the running fit's best checkpoint: a fit that starts has none.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from lightning_par.checkpoint.single_file import refuse_directory

__all__ = ["check_ckpt_path", "last_checkpoints"]

# Lightning's ModelCheckpoint.CHECKPOINT_NAME_LAST with its version suffix (last.ckpt, last-v1.ckpt)
_LAST = re.compile(r"^last(-v?\d+)?\.ckpt$")
_NAMES = ("last", "best", "hpc")


def last_checkpoints(directory: Path) -> list[Path]:
    """The last checkpoints (files or sharded directories) directly in ``directory``, newest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _LAST.match(p.name)]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def check_ckpt_path(
    ckpt_path: Any,
    *,
    checkpoint_dir: Path | None = None,
    run_dir: Path | None = None,
    task_name: str | None = None,
) -> None:
    """Refuse a ``ckpt_path`` that cannot mean what the user asked for (see the module docstring).

    Args:
        ckpt_path: the config's value (None: a fresh start).
        checkpoint_dir: where this run's ModelCheckpoint callbacks write (``paths.checkpoint_dir``).
        run_dir: this run's own directory (``paths.output_dir``); its siblings are the task's other runs.
            Without both, ``last`` is not checked (a sweep's jobs are siblings of each other).
        task_name: the run's ``task_name``; a sibling whose saved config names another is not an earlier
            run of this task.
    """
    if ckpt_path is None:
        return
    text = str(ckpt_path)
    if text == "best":  # Lightning's name for the current fit's best, which a new fit has not made yet
        raise ValueError(
            "ckpt_path=best names the best checkpoint of the running fit, and a fit that starts has none"
            " (Lightning would stop with 'ModelCheckpoint is not configured to save the best model'): to"
            " go on from a run, pass ckpt_path=last with its hydra.run.dir, or the best file's path"
            " (<run>/checkpoints/step...-val_loss....ckpt)."
        )
    if text == "last" and checkpoint_dir is not None and run_dir is not None:
        _check_last(checkpoint_dir=checkpoint_dir, run_dir=run_dir, task_name=task_name)
    if text in _NAMES or text.startswith("registry") or "://" in text:
        return
    if not Path(text).exists():
        raise ValueError(
            f"no checkpoint at {text!r}: give an existing file or directory, or 'last' with the resumed"
            " run's hydra.run.dir."
        )
    refuse_directory(Path(text))


def _same_task(run: Path, task_name: str | None) -> bool:
    """Whether ``run`` is a run of ``task_name``, by the config Hydra saved in it (None: any run)."""
    if task_name is None:
        return True
    saved = run / ".hydra" / "config.yaml"
    if not saved.is_file():
        return False
    try:
        config = OmegaConf.to_container(OmegaConf.load(saved), resolve=False)
    except Exception:  # unreadable: not known to be this task's
        return False
    return isinstance(config, dict) and config.get("task_name") == task_name


def _check_last(*, checkpoint_dir: Path, run_dir: Path, task_name: str | None) -> None:
    if last_checkpoints(checkpoint_dir):
        return
    try:
        inside = checkpoint_dir.resolve().relative_to(run_dir.resolve())
    except ValueError:  # checkpoints written outside the run directory: its siblings say nothing
        return
    earlier = [
        (found[0], sibling)
        for sibling in run_dir.resolve().parent.iterdir()
        if sibling.is_dir() and sibling != run_dir.resolve() and _same_task(sibling, task_name)
        for found in [last_checkpoints(sibling / inside)]
        if found
    ]
    if not earlier:
        return
    newest, its_run = max(earlier, key=lambda pair: pair[0].stat().st_mtime)
    raise ValueError(
        f"ckpt_path=last finds no last checkpoint in this run's {str(checkpoint_dir)!r}: the command got a"
        " new run directory (Hydra's, or a torchrun / srun launch's), so the run would start from scratch."
        " The newest earlier run of"
        f" this task with one is {str(its_run)!r}: resume it with hydra.run.dir='{its_run}' ckpt_path=last"
        f" (or ckpt_path='{newest}'); to start anew, drop ckpt_path=last."
    )
