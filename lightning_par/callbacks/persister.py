"""The background thread that writes memory snapshots to disk, one at a time, off the training thread.

Jobs are ``(slot, header, safe_step)``: the slot is *busy* (not overwritten) until its data is on disk.
After a successful write, older snapshots are pruned (:meth:`DiskStore.retain`, with the step that every
rank had committed at submission). A failed write (a full disk, an I/O error) is logged and recorded in
:attr:`errors`; training goes on and the earlier snapshots stay intact.

:meth:`flush` asks the thread to persist the newest complete memory snapshot if it is not on disk yet and
waits (bounded) for it. It only sets and waits on events of its own, so it is safe to call from a signal
handler or from the watchdog thread while the training thread is stuck.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from lightning_par.callbacks.disk import DiskStore
from lightning_par.callbacks.memory import MemoryStore

log = logging.getLogger(__name__)

_STOP = object()


class Persister:
    """One daemon thread persisting ``memory()``'s slots to ``disk`` (see the module docstring)."""

    def __init__(
        self,
        *,
        disk: DiskStore,
        memory: Callable[[], MemoryStore],
        keep_last: int,
        lineage: Callable[[], str],
    ) -> None:
        self.disk = disk
        self._memory = memory
        self._lineage = lineage
        self.keep_last = keep_last
        self.errors: list[str] = []
        self.timings: dict[int, float] = {}  # step -> seconds to write it
        self.committed_step = -1  # newest step of the current lineage on disk (this rank)
        self._persisted: set[tuple[str, int]] = set()
        self._queue: queue.Queue[Any] = queue.Queue()
        self._cv = threading.Condition()
        self._pending = 0  # jobs announced and not finished
        self._flush_requested = threading.Event()
        self._flush_done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="flash-persist", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ training and copy threads
    def announce(self) -> None:
        """A job will be submitted (by the copy thread): :meth:`wait_idle` waits for it from now on."""
        with self._cv:
            self._pending += 1

    def submit(self, slot: int, header: dict[str, Any], safe_step: int | None) -> None:
        """Queue an announced job."""
        self._queue.put((slot, header, safe_step))

    def withdraw(self) -> None:
        """An announced job will not come (its copy failed)."""
        self._done()

    def _done(self) -> None:
        with self._cv:
            self._pending -= 1
            self._cv.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self._pending == 0, timeout)

    def mark_persisted(self, lineage: str, step: int) -> None:
        self._persisted.add((lineage, step))
        if lineage == self._lineage():
            self.committed_step = max(self.committed_step, step)

    def stop(self, *, drain: bool, timeout: float = 600.0) -> None:
        if drain:
            self.wait_idle(timeout)
        self._queue.put(_STOP)
        self._thread.join(timeout if drain else 5.0)

    # ------------------------------------------------------------------ any thread, signal handlers too
    def flush(self, timeout: float) -> bool:
        """Persist the newest complete memory snapshot unless it is on disk; True once it is."""
        if not self._thread.is_alive():
            return False
        self._flush_done.clear()
        self._flush_requested.set()
        return self._flush_done.wait(timeout)

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                item = None
            if item is _STOP:
                return
            if item is not None:
                try:
                    self._persist(*item)
                finally:
                    self._done()
            if self._flush_requested.is_set():
                self._flush_requested.clear()
                self._flush_newest()
                self._flush_done.set()

    def _flush_newest(self) -> None:
        memory = self._memory()
        with memory.lock:
            k = memory.newest()
            header = memory.header(k) if k is not None else None
            if header is None or header["lineage"] != self._lineage():
                return
            if (header["lineage"], header["step"]) in self._persisted:
                return
            memory.set_busy(k, True)  # type: ignore[arg-type]
        log.warning(
            "FlashCheckpoint: rank %d flushes step %d to disk before exiting", self.disk.rank, header["step"]
        )
        self._persist(k, header, None)  # type: ignore[arg-type]

    def _persist(self, slot: int, header: dict[str, Any], safe_step: int | None) -> None:
        memory = self._memory()
        step = header["step"]
        start = time.perf_counter()
        try:
            data = memoryview(memory.buffer(slot).numpy())[: header["nbytes"]]  # type: ignore[arg-type]
            path = self.disk.write(header, data)
            del data
            self.timings[step] = time.perf_counter() - start
            self.mark_persisted(header["lineage"], step)
            log.info(
                "FlashCheckpoint: rank %d persisted step %d to %s in %.2f s",
                self.disk.rank,
                step,
                path.parent,
                self.timings[step],
            )
            if safe_step is not None:
                self.disk.retain(lineage=header["lineage"], keep_last=self.keep_last, safe_step=safe_step)
        except OSError as exc:
            previous = f"step {self.committed_step}" if self.committed_step >= 0 else "none yet"
            message = (
                f"FlashCheckpoint: rank {self.disk.rank} could not persist step {step} to"
                f" {self.disk.step_dir(header['lineage'], step)}: {exc}. Training continues; the previous"
                f" checkpoint on disk ({previous}) is intact."
            )
            log.error(message)
            self.errors.append(message)
        finally:
            with memory.lock:
                memory.set_busy(slot, False)
