"""``HangWatchdog``: a rank that makes no progress exits, so the launcher restarts the job.

A hung collective (a peer that died without closing its sockets, a deadlock, a stuck file system) can
block every rank until the process-group timeout, often 30 minutes. The watchdog is a thread that the
training loop's hooks keep alive (every batch start and end, optimizer step, validation batch); if none
comes for ``timeout_s`` seconds, it logs the Python stacks of all threads (so the hang can be located),
asks every ``FlashCheckpoint`` of the trainer to write its newest memory snapshot to disk (bounded), and
ends the process with ``exit_code`` (non-zero: torchrun ``--max-restarts`` and SLURM requeue scripts
restart the job, which resumes from the newest snapshot).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.optim import Optimizer

from lightning_par.callbacks import _dist
from lightning_par.callbacks.flash import FlashCheckpoint

log = logging.getLogger(__name__)

HANG_EXIT_CODE = 75  # EX_TEMPFAIL: a temporary failure, try again


def thread_stacks() -> str:
    """The Python stack of every thread of this process, as text."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(
            f"--- thread {names.get(ident, '?')} ({ident}) ---\n" + "".join(traceback.format_stack(frame))
        )
    return "\n".join(parts)


class HangWatchdog(Callback):
    """Exit when training makes no progress for ``timeout_s`` seconds (see the module docstring).

    Args:
        timeout_s: longest time without progress (a step, a validation batch). It must exceed the slowest
            legitimate gap: a step, a validation run's batch, a blocking checkpoint save.
        exit_code: the exit status of a process ended for hanging.
        flush_timeout_s: how long the flush of memory snapshots may delay the exit.
    """

    def __init__(
        self, *, timeout_s: float = 600.0, exit_code: int = HANG_EXIT_CODE, flush_timeout_s: float = 30.0
    ) -> None:
        seconds = (("timeout_s", timeout_s, False), ("flush_timeout_s", flush_timeout_s, True))
        for name, value, zero in seconds:
            number = not isinstance(value, bool) and isinstance(value, int | float)
            if not number or not (value >= 0 if zero else value > 0):
                bound = ">= 0" if zero else "> 0"
                raise ValueError(f"HangWatchdog: {name} must be a number of seconds {bound}, got {value!r}.")
        if isinstance(exit_code, bool) or not isinstance(exit_code, int) or not 0 < exit_code < 256:
            raise ValueError(f"HangWatchdog: exit_code must be an integer in 1..255, got {exit_code!r}.")
        self.timeout_s = float(timeout_s)
        self.exit_code = exit_code
        self.flush_timeout_s = float(flush_timeout_s)
        self._last = time.monotonic()
        self._what = "start"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._flashes: list[FlashCheckpoint] = []
        self._rank = 0
        self._step = 0

    def beat(self, what: str) -> None:
        """Record progress (the hooks below call this; long custom work may call it too)."""
        self._last = time.monotonic()
        self._what = what

    # ------------------------------------------------------------------ hooks that mean progress
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._rank = trainer.global_rank
        self._flashes = [cb for cb in trainer.callbacks if isinstance(cb, FlashCheckpoint)]  # type: ignore[attr-defined]
        self.beat("train start")
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
        self._thread.start()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step = trainer.global_step
        self.beat(f"batch {batch_idx} start")

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self.beat("backward")

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        self.beat("optimizer step")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._step = trainer.global_step
        self.beat(f"batch {batch_idx} end")

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self.beat(f"validation batch {batch_idx}")

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.beat("validation start")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._halt()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._halt()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._halt()

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    # ------------------------------------------------------------------ the thread
    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(poll):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                self._fire(idle)
                return

    def _fire(self, idle: float) -> None:
        message = (
            f"HangWatchdog: no training progress on rank {self._rank} ({_dist.HOST}, pid {os.getpid()}) for"
            f" {idle:.1f} s (timeout_s={self.timeout_s:g}); last progress: {self._what} at step {self._step}."
            f" Exiting with status {self.exit_code} so that the launcher restarts the job."
        )
        log.error(message)
        # the stacks go to stderr directly: the process is about to end, whatever logging is set up
        print(f"{message} Python stacks of all threads:\n{thread_stacks()}", file=sys.stderr, flush=True)
        for flash in self._flashes:
            try:
                flash.flush(self.flush_timeout_s)
            except Exception:
                log.exception("HangWatchdog: flushing the memory snapshot failed")
        sys.stderr.flush()
        os._exit(self.exit_code)
