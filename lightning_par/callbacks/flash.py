"""``FlashCheckpoint``: snapshots in shared memory every few steps, persisted in the background, resumed
automatically after a crash.

How a snapshot is taken (rank by rank, at the end of every ``every_n_steps``-th optimizer step):

1. :func:`.rank_state.capture` collects this rank's whole training state as *live* tensors plus a small
   tree (loops, callbacks, schedulers, RNG, data position); the tree is pickled right away into the index.
2. The state is laid out in one flat buffer (:mod:`.snapshot`), held in a pre-allocated, reused slot of
   ``/dev/shm`` (:mod:`.memory`, two slots by default: the newest complete snapshot is never the one
   being written). Small tensors (buffers, RNG) are copied at once.
3. Parameters, masters and optimizer state change only in an optimizer step, so with
   ``snapshot_copy="overlap"`` a copy thread copies them while the next step's data loading, forward and
   backward run; ``on_before_optimizer_step`` waits for it (the *fence*). The training thread blocks for
   step 1, the small copies and any fence wait. ``"blocking"`` copies everything before returning.
4. The copy thread commits the slot (its meta file, written last) and, every ``persist_every_n_steps``,
   hands it to the persist thread (:mod:`.persister`), which writes it atomically to ``dirpath``
   (:mod:`.disk`: temp file, fsync, rename, meta file last as commit marker, CRC-32) and keeps the last
   ``keep_last``. A persist still running at the next persist step is waited for, so every rank persists
   the same steps. Steps 2-4 are :class:`.writer.SnapshotWriter`'s.

On SIGTERM, on an exception and from the hang watchdog, the newest complete memory snapshot is written to
disk if it is not there yet (bounded by ``flush_timeout_s``). On start with ``auto_resume`` (torchrun
restart, SLURM requeue, the same command run again), :func:`.resume.find_snapshot` agrees with all ranks
on the newest snapshot complete everywhere, memory preferred over disk, skipping corrupt or partial ones
with a warning, and everything is restored before the first step; a mid-epoch resume continues with the
exact remaining batches. A snapshot, when found, wins over ``trainer.fit(ckpt_path=...)``.
"""

from __future__ import annotations

import hashlib
import logging
import signal
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, get_args

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer

from lightning_par.callbacks import _dist, rank_state, snapshot
from lightning_par.callbacks.disk import DiskStore
from lightning_par.callbacks.memory import MemoryStore, NoRoom
from lightning_par.callbacks.persister import Persister
from lightning_par.callbacks.resume import Found, find_snapshot
from lightning_par.callbacks.writer import SnapshotCopy, SnapshotWriter

log = logging.getLogger(__name__)

_COPY_MODES = get_args(SnapshotCopy)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"FlashCheckpoint: {name} must be a positive integer, got {value!r}.")
    return value


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
    ) -> None:
        if not str(dirpath):
            raise ValueError("FlashCheckpoint: dirpath must name a directory.")
        self.every_n_steps = _positive_int("every_n_steps", every_n_steps)
        self.persist_every_n_steps = _positive_int("persist_every_n_steps", persist_every_n_steps)
        if persist_every_n_steps % every_n_steps:
            raise ValueError(
                f"FlashCheckpoint: persist_every_n_steps={persist_every_n_steps} must be a multiple of"
                f" every_n_steps={every_n_steps} (only snapshots are persisted)."
            )
        self.keep_last = _positive_int("keep_last", keep_last)
        if memory_slots not in (1, 2):
            raise ValueError(f"FlashCheckpoint: memory_slots must be 1 or 2, got {memory_slots!r}.")
        if snapshot_copy not in _COPY_MODES:
            raise ValueError(
                f"FlashCheckpoint: snapshot_copy must be one of {_COPY_MODES}, got {snapshot_copy!r}."
            )
        if not flush_timeout_s > 0:
            raise ValueError(f"FlashCheckpoint: flush_timeout_s must be > 0, got {flush_timeout_s!r}.")
        self.dirpath = Path(dirpath)
        self.auto_resume = auto_resume
        self.shm_dir = Path(shm_dir)
        self.memory_slots = memory_slots
        self.snapshot_copy: SnapshotCopy = snapshot_copy
        self.flush_on_exit = flush_on_exit
        self.flush_timeout_s = float(flush_timeout_s)
        # what happened, for logs, tests and benchmarks
        self.stats: list[dict[str, Any]] = []
        self.resumed: dict[str, Any] | None = None
        self._reset()

    def _reset(self) -> None:
        self._disk: DiskStore | None = None
        self._memory: MemoryStore | None = None
        self._memories: list[MemoryStore] = []
        self._staging: Path | None = None
        self._persister: Persister | None = None
        self._writer: SnapshotWriter | None = None
        self._found: Found | None = None
        self._lineage = ("", 0.0)
        self._fingerprint: dict[str, Any] = {}
        self._last_step = -1
        self._failed = False
        self._saved_resume_start: Any = None
        self._saved_sigterm: Any = None

    # ------------------------------------------------------------------ public
    @property
    def errors(self) -> list[str]:
        """Persist errors of this rank (also logged)."""
        return self._persister.errors if self._persister is not None else []

    @property
    def lineage(self) -> str:
        return self._lineage[0]

    def flush(self, timeout: float | None = None) -> bool:
        """Write the newest complete memory snapshot to disk unless it is there; True once it is.
        Safe from any thread and from signal handlers (never a collective)."""
        timeout = self.flush_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        if self._writer is not None:
            self._writer.wait(timeout)
        if self._persister is None:
            return False
        return self._persister.flush(max(0.0, deadline - time.monotonic()))

    def rollback(self, trainer: pl.Trainer) -> int:
        """Restore weights, optimizers, LR schedulers and precision state from this run's newest snapshot
        complete on every rank (memory first); return its step. Collective: all ranks call it together."""
        self._fence()
        assert self._disk is not None
        found = find_snapshot(
            memories=self._memories, disk=self._disk, world_size=trainer.world_size, lineage=self.lineage
        )
        if found is None:
            raise RuntimeError("FlashCheckpoint: there is no snapshot of this run to roll back to yet.")
        rank_state.restore(trainer, found.state, full=False)
        return found.step

    # ------------------------------------------------------------------ setup and resume
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        rank_state.check_supported(trainer.strategy)
        self._reset()
        self.stats = []
        self.resumed = None
        rank = trainer.global_rank
        dirpath = self.dirpath.expanduser().absolute()
        self._disk = DiskStore(dirpath, rank=rank)
        problem = None
        try:
            self._disk.check_writable()
        except OSError as exc:
            problem = f"rank {rank} ({_dist.HOST}): {type(exc).__name__}: {exc}"
        problems = [p for p in _dist.gather_objects(problem) if p]
        if problems:
            raise OSError(
                f"FlashCheckpoint: cannot write snapshots to dirpath={str(dirpath)!r}: {'; '.join(problems)}."
                " Pass a writable directory (nothing was written)."
            )
        leftovers = self._disk.cleanup_partial()
        if leftovers:
            log.warning(
                "FlashCheckpoint: removed %d partial file(s) of interrupted saves, e.g. %s",
                len(leftovers),
                leftovers[0],
            )
        key = hashlib.sha1(str(dirpath).encode()).hexdigest()[:16]
        self._staging = dirpath / ".staging" / f"rank{rank:05d}"
        try:
            self._memory = MemoryStore(
                self.shm_dir / "lightning_par_flash" / key / f"rank{rank:05d}", slots=self.memory_slots
            )
            self._memories.append(self._memory)
        except OSError as exc:
            self._fall_back(f"{self.shm_dir} is unusable ({exc})")
        if self._staging.is_dir() and self._memory is not None and self._memory.directory != self._staging:
            self._memories.append(MemoryStore(self._staging, slots=self.memory_slots))
        self._persister = Persister(
            disk=self._disk,
            memory=self._active_memory,
            keep_last=self.keep_last,
            lineage=lambda: self.lineage,
        )
        self._writer = SnapshotWriter(
            memory=self._active_memory,
            fall_back=self._no_room,
            persister=self._persister,
            slots=self.memory_slots,
            copy=self.snapshot_copy,
            device=trainer.strategy.root_device,
            stats=self.stats,
        )
        if self.auto_resume:
            self._found = find_snapshot(
                memories=self._memories, disk=self._disk, world_size=trainer.world_size
            )
        if self._found is not None:
            self._ignore_ckpt_path(trainer)

    def _active_memory(self) -> MemoryStore:
        assert self._memory is not None
        return self._memory

    def _no_room(self, exc: NoRoom) -> bool:
        """The writer's fallback: move the memory snapshots to disk, unless they are there already."""
        if self._memory is not None and self._memory.directory == self._staging:
            return False
        self._fall_back(f"no room in {self.shm_dir} ({exc.strerror})")
        return True

    def _fall_back(self, why: str) -> None:
        assert self._staging is not None
        message = (
            f"FlashCheckpoint: {why}; staging the memory snapshots on disk in {self._staging.parent} instead:"
            " they still survive a crashed process, but each snapshot now costs page-cache writes."
        )
        log.warning(message)
        warnings.warn(message, stacklevel=2)
        if self._memory is not None:
            self._memory.remove()
            self._memories.remove(self._memory)
        staged = [m for m in self._memories if m.directory == self._staging]
        self._memory = staged[0] if staged else MemoryStore(self._staging, slots=self.memory_slots)
        if not staged:
            self._memories.insert(0, self._memory)

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
            lineage = _dist.broadcast_object((uuid.uuid4().hex[:8], time.time()))
            self._lineage = (str(lineage[0]), float(lineage[1]))
            return
        diffs = rank_state.differences(found.header["fingerprint"], self._fingerprint)
        every = [d for d in _dist.gather_objects(diffs) if d]
        if every:
            self._found = None
            raise ValueError(
                f"FlashCheckpoint: the snapshot of step {found.step} in {self.dirpath} (and in shared memory)"
                f" was written by another model or layout: {'; '.join(every[0])}. Nothing was loaded, changed"
                " or deleted; resume with the original configuration, pass another dirpath, or"
                " auto_resume=False."
            )
        rank_state.restore(trainer, found.state, full=True)
        self._lineage = (found.header["lineage"], float(found.header["lineage_time"]))
        self._last_step = found.step
        assert self._persister is not None and self._disk is not None
        for header in self._disk.headers():
            self._persister.mark_persisted(header["lineage"], header["step"])
        self.resumed = {"step": found.step, "lineage": self.lineage, "sources": found.sources}
        rank_zero_info(
            f"FlashCheckpoint: resumed step {found.step} (lineage {self.lineage}) from {found.sources}"
        )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_ckpt_path(trainer)
        if self._found is not None:
            how = rank_state.resume_data_and_rng(trainer, self._found.state)
            if self.resumed is not None:
                self.resumed["data"] = how
            rank_zero_info(f"FlashCheckpoint: data position: {how}")
            self._found = None
        if self.flush_on_exit:
            self._saved_sigterm = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._on_sigterm)

    # ------------------------------------------------------------------ snapshots
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.fit_loop.epoch_loop._should_accumulate():
            return
        step = trainer.global_step
        if step > 0 and step % self.every_n_steps == 0 and step != self._last_step:
            self._last_step = step
            self.snapshot(trainer, step)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        self._fence()

    def _fence(self) -> None:
        if self._writer is not None:
            self._writer.fence()

    def snapshot(self, trainer: pl.Trainer, step: int) -> None:
        """Take a snapshot now (collective when it is a persist step: all ranks call it at that step)."""
        assert self._persister is not None and self._writer is not None
        self._writer.ready()
        start = time.perf_counter()
        persist = step % self.persist_every_n_steps == 0
        safe: int | None = None
        if persist:
            self._persister.wait_idle()
            device = trainer.strategy.root_device
            safe = int(_dist.all_reduce([float(self._persister.committed_step)], op="min", device=device)[0])
        state, live = rank_state.capture(trainer)
        plan = snapshot.plan(state)
        header = {
            "format": snapshot.FORMAT_VERSION,
            "step": step,
            "lineage": self._lineage[0],
            "lineage_time": self._lineage[1],
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "nbytes": plan.nbytes,
            "index": plan.index(),
            "fingerprint": self._fingerprint,
            "time": time.time(),
        }
        record = self._writer.write(plan=plan, live=live, header=header, persist=persist, safe=safe)
        if record is not None:
            record["capture_s"] = time.perf_counter() - start

    # ------------------------------------------------------------------ failures and the end
    def _on_sigterm(self, signum: int, frame: Any) -> None:
        log.warning(
            "FlashCheckpoint: SIGTERM on rank %s; flushing the newest snapshot",
            self._disk.rank if self._disk else "?",
        )
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
        if self._saved_sigterm is not None:
            signal.signal(signal.SIGTERM, self._saved_sigterm)
            self._saved_sigterm = None
        try:
            if not self._failed:
                self._fence()
                if self.flush_on_exit and self._persister is not None:
                    # a finished run frees its shared memory: its newest snapshot goes to disk first, so
                    # running the command again with more steps continues from where this run ended
                    self._persister.wait_idle()
                    self.flush()
        finally:
            if self._writer is not None:
                self._writer.close()
            if self._persister is not None:
                self._persister.stop(drain=not self._failed)
            for memory in self._memories:
                # a finished run frees its shared memory; a failed one leaves it for the restart
                if self._failed:
                    memory.close()
                else:
                    memory.remove()
            self._found = None
