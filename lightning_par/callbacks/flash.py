"""``FlashCheckpoint``: snapshots in shared memory every few steps, persisted in the background, resumed
automatically after a crash: the Lightning ``Trainer``'s adapter over :class:`.store.FlashStore` (whose
module docstring describes how a snapshot is taken, persisted and found again).

What this adapter adds for the Trainer:

* a snapshot at the end of every ``every_n_steps``-th optimizer step (``on_train_batch_end``, not inside
  an accumulation window), of the state :func:`.rank_state.capture` collects: model and optimizer trees,
  loops, callbacks, schedulers, precision plugin, RNG and the data position; with
  ``snapshot_copy="overlap"``, ``on_before_optimizer_step`` is the fence;
* on SIGTERM, on an exception and from the hang watchdog, the newest complete memory snapshot is written
  to disk if it is not there yet (bounded by ``flush_timeout_s``); ``teardown`` closes the store (a
  finished run flushes and frees its shared memory, a failed one leaves it for the restart);
* on start with ``auto_resume`` (torchrun restart, SLURM requeue, the same command run again), the
  snapshot the ranks agree on is restored before the first step (:func:`.rank_state.restore`), and a
  mid-epoch resume continues with the exact remaining batches (:func:`.rank_state.resume_data_and_rng`).
  A snapshot, when found, wins over ``trainer.fit(ckpt_path=...)``;
* :meth:`FlashCheckpoint.rollback` for ``LossGuard(action="rollback")``.
"""

from __future__ import annotations

import logging
import signal
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer

from lightning_par.callbacks import rank_state
from lightning_par.callbacks.resume import Found
from lightning_par.callbacks.store import FlashStore, positive_int
from lightning_par.callbacks.writer import SnapshotCopy
from lightning_par.strategy import HybridParallelStrategy

log = logging.getLogger(__name__)

_OWNER = "FlashCheckpoint"


class FlashCheckpoint(Callback):
    """Fast, fault-tolerant checkpoints for the Lightning ``Trainer`` (see the module docstring).

    Args:
        dirpath: where snapshots are persisted (shared by all ranks or local to each node).
        every_n_steps: take a memory snapshot every this many optimizer steps.
        persist_every_n_steps: write the snapshot to ``dirpath`` every this many steps (a multiple of
            ``every_n_steps``).
        keep_last: persisted snapshots to keep (older ones are deleted once a newer one is on every rank).
        auto_resume: resume from the newest complete snapshot when ``fit`` starts.
        shm_dir: the shared-memory file system for the memory snapshots; if it lacks room they are staged
            in ``dirpath/.staging`` on disk instead, with a warning.
        memory_slots: 2 keeps the previous snapshot while the next is written; 1 halves the memory.
        snapshot_copy: ``"overlap"`` copies the weights and optimizer state while the next step computes,
            ``"blocking"`` copies everything before the training thread continues.
        flush_on_exit: write the newest memory snapshot to disk on SIGTERM, on exceptions and when ``fit``
            ends (a finished run frees its shared memory).
        flush_timeout_s: the longest such a flush may delay the exit.
        keep_global_batch: when a snapshot is resumed at another data-parallel size (elastic: a node lost
            and not replaced), raise ``accumulate_grad_batches`` by ``old_dp / new_dp`` so that every
            optimizer step sees the same samples as before; False keeps the accumulation (the global
            batch then changes with the dp size). Either way the snapshot is resharded.
        replicas: also copy every snapshot, in the background, into the shared memory of a rank on each of
            this many other nodes, so that a lost node's state comes back from a survivor's memory, not
            from disk (a peer without room warns and keeps going; the local snapshot is kept).
    """

    def __init__(
        self,
        dirpath: str | Path,
        *,
        every_n_steps: int = 10,
        persist_every_n_steps: int = 100,
        keep_last: int = 2,
        auto_resume: bool = True,
        shm_dir: str | Path = "/dev/shm",
        memory_slots: int = 2,
        snapshot_copy: SnapshotCopy = "overlap",
        flush_on_exit: bool = True,
        flush_timeout_s: float = 30.0,
        keep_global_batch: bool = False,
        replicas: int = 0,
    ) -> None:
        self.every_n_steps = positive_int(_OWNER, "every_n_steps", every_n_steps)
        self.store = FlashStore(
            dirpath,
            owner=_OWNER,
            persist_every_n_steps=persist_every_n_steps,
            keep_last=keep_last,
            shm_dir=shm_dir,
            memory_slots=memory_slots,
            snapshot_copy=snapshot_copy,
            flush_timeout_s=flush_timeout_s,
            replicas=replicas,
        )
        if persist_every_n_steps % every_n_steps:
            raise ValueError(
                f"{_OWNER}: persist_every_n_steps={persist_every_n_steps} must be a multiple of"
                f" every_n_steps={every_n_steps} (only snapshots are persisted)."
            )
        self.dirpath = self.store.dirpath
        self.auto_resume = auto_resume
        self.flush_on_exit = flush_on_exit
        self.keep_global_batch = keep_global_batch
        self.resumed: dict[str, Any] | None = None  # what was resumed, for logs, tests and benchmarks
        self._reset()

    def _reset(self) -> None:
        self._found: Found | None = None
        self._state: dict[str, Any] | None = None  # what on_train_start positions the data from
        self._fingerprint: dict[str, Any] = {}
        self._failed = False
        self._saved_resume_start: Any = None
        self._saved_sigterm: Any = None
        self._batch_step = -1  # the global step at the end of the previous training batch

    # ------------------------------------------------------------------ public
    @property
    def stats(self) -> list[dict[str, Any]]:
        """One record per snapshot of the current (or last) fit: step, bytes, persist, timings."""
        return self.store.stats

    @property
    def errors(self) -> list[str]:
        """Persist errors of this rank (also logged)."""
        return self.store.errors

    @property
    def lineage(self) -> str:
        return self.store.lineage

    def flush(self, timeout: float | None = None) -> bool:
        """Write the newest complete memory snapshot to disk unless it is there; True once it is.
        Safe from any thread and from signal handlers (never a collective)."""
        return self.store.flush(timeout)

    def rollback(self, trainer: pl.Trainer) -> int:
        """Restore weights, optimizers, LR schedulers and precision state from this run's newest snapshot
        complete on every rank (memory first); return its step. Collective: all ranks call it together."""
        self.store.fence()
        found = self.store.find(lineage=self.lineage)
        if found is None:
            raise RuntimeError(f"{_OWNER}: there is no snapshot of this run to roll back to yet.")
        rank_state.restore(trainer, found.state, full=False)
        return found.step

    # ------------------------------------------------------------------ setup and resume
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        rank_state.check_supported(trainer.strategy)
        if isinstance(trainer.strategy, HybridParallelStrategy):  # its writes between steps wait too
            trainer.strategy.before_state_write.append(self.store.fence)
        self._reset()
        self.resumed = None
        self.store.open(
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            device=trainer.strategy.root_device,
            node=trainer.node_rank,
        )
        if self.auto_resume:
            self._found = self.store.find(reshard=True)
        if self._found is not None:
            self._ignore_ckpt_path(trainer)

    @property
    def restores_at_fit_start(self) -> bool:
        """Whether this fit resumes from a snapshot found at setup (read by the strategy: a model that an
        interrupted run left holding placeholders is then overwritten, not refused)."""
        return self._found is not None

    def _ignore_ckpt_path(self, trainer: pl.Trainer) -> None:
        """A snapshot wins over ``fit(ckpt_path=...)``: Lightning's loading of that path is skipped."""
        connector = trainer._checkpoint_connector
        self._saved_resume_start = connector.resume_start
        step = self._found.step if self._found else -1

        def resume_start(checkpoint_path: Any = None, weights_only: Any = None) -> None:
            if checkpoint_path:
                rank_zero_warn(
                    f"FlashCheckpoint: resuming from its snapshot of step {step};"
                    f" ckpt_path={checkpoint_path!r} is not loaded (pass auto_resume=False to load it"
                    " instead)."
                )
            connector._ckpt_path = None

        connector.resume_start = resume_start  # type: ignore[method-assign]

    def _restore_ckpt_path(self, trainer: pl.Trainer) -> None:
        if self._saved_resume_start is not None:
            trainer._checkpoint_connector.resume_start = self._saved_resume_start  # type: ignore[method-assign]
            self._saved_resume_start = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fingerprint = rank_state.fingerprint(trainer)
        found = self._found
        if found is None:
            self.store.start_lineage()
            return
        try:
            self.store.check(
                found,
                self._fingerprint,
                remedy="resume with the original configuration, pass another dirpath, or auto_resume=False",
            )
        except ValueError:
            self._found = None
            raise
        try:
            if found.resharded:
                self._state = rank_state.resharded(trainer, found, keep_global_batch=self.keep_global_batch)
            else:
                self._state = found.state
        except ValueError:
            self._found = None
            raise
        rank_state.restore(trainer, self._state, full=True)
        self.store.adopt(found)
        self.resumed = {
            "step": found.step,
            "lineage": self.lineage,
            "sources": found.sources,
            "world_size": found.world_size,
        }
        how = f" resharded from {found.world_size} ranks" if found.resharded else ""
        rank_zero_info(
            f"{_OWNER}: resumed step {found.step} (lineage {self.lineage}){how} from {found.sources}"
        )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_ckpt_path(trainer)
        self._batch_step = trainer.global_step  # after any restore: the step training continues from
        if self._found is not None and self._state is not None:
            how = rank_state.resume_data_and_rng(trainer, self._state)
            if self.resumed is not None:
                self.resumed["data"] = how
            rank_zero_info(f"FlashCheckpoint: data position: {how}")
            self._found = self._state = None
        if self.flush_on_exit:
            self._saved_sigterm = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._on_sigterm)

    # ------------------------------------------------------------------ snapshots
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # an optimizer window closed when the global step moved since the last batch (public state, the
        # same verdict as the loop's own accumulation check; a partly accumulated window is never taken)
        step, previous = trainer.global_step, self._batch_step
        self._batch_step = step
        if step == previous:
            return
        if step > 0 and step % self.every_n_steps == 0:
            self.snapshot(trainer, step)  # the store skips a step it already holds

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        self.store.fence()

    def fence(self) -> None:
        """Wait until the snapshot copy in flight (``snapshot_copy="overlap"``) has read the weights and
        optimizer state. The optimizer step waits for it by itself, and so do ``ShardedEMA``'s writes and
        ``trainer.strategy.gathered_params(writeback=True)``; call it before your own in-place writes of
        weights between steps (a clamp in ``on_train_batch_end``), or use ``snapshot_copy="blocking"``."""
        self.store.fence()

    def snapshot(self, trainer: pl.Trainer, step: int) -> None:
        """Take a snapshot now (collective when it is a persist step: all ranks call it at that step)."""
        capture = partial(rank_state.capture, trainer)  # the store times it
        self.store.write(step=step, capture=capture, fingerprint=self._fingerprint)

    # ------------------------------------------------------------------ failures and the end
    def _on_sigterm(self, signum: int, frame: Any) -> None:
        log.warning("%s: SIGTERM on rank %s; flushing the newest snapshot", _OWNER, self.store.rank)
        self.flush()
        previous = self._saved_sigterm
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._failed = True
        if self.flush_on_exit and self.lineage:
            self.flush()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._restore_ckpt_path(trainer)
        strategy = trainer.strategy
        if isinstance(strategy, HybridParallelStrategy) and self.store.fence in strategy.before_state_write:
            strategy.before_state_write.remove(self.store.fence)
        if self._saved_sigterm is not None:
            # only while ours is installed: Lightning's teardown, which runs before the callbacks', puts
            # its original handler back itself, and the one saved here is then the finished Trainer's
            # (putting it back kept every Trainer alive and left the process deaf to SIGTERM)
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, self._saved_sigterm)
            self._saved_sigterm = None
        try:
            self.store.close(failed=self._failed, flush=self.flush_on_exit)
        finally:
            self._found = None
