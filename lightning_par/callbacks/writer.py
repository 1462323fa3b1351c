"""Copying one rank's snapshot into its memory slots: the copy thread, the fence, the hand-over to the
persist thread. ``FlashCheckpoint`` decides when and what to snapshot; :class:`SnapshotWriter` copies it.

For a laid-out state (:func:`.snapshot.plan`) and the set of storages that only an optimizer step
changes (*live*: parameters, masters, optimizer state):

1. a slot of the active memory store is claimed (never the newest complete one, never one being
   persisted) and its buffer reserved (pre-allocated once, reused);
2. the other tensors (buffers, RNG states: the next forward may change them) are copied at once;
3. the live tensors are copied by the copy thread (``"overlap"``: while the next step's data loading,
   forward and backward run; :meth:`SnapshotWriter.fence` waits for it before that step's optimizer
   step) or inline (``"blocking"``); device tensors go device-to-host on a side CUDA stream into pinned
   buffers;
4. the copy thread commits the slot (its meta file is written last) and, for a persist step, hands it to
   the :class:`~.persister.Persister`; with peer replicas it also hands it to the
   :class:`~.replica.Replicator` (``replicate``), and a slot is reused only once the replicator has
   released it (``replica_done``).

At the first snapshot of a process the slot's buffer does not exist yet, and touching a fresh buffer
costs about a second per GB: the copy thread then allocates it as well, after the step-2 tensors have
been cloned, and allocates the other slots right after.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import torch

from lightning_par.callbacks import snapshot
from lightning_par.callbacks.memory import MemoryStore, NoRoom
from lightning_par.callbacks.persister import Persister
from lightning_par.callbacks.snapshot import Plan

log = logging.getLogger(__name__)

SnapshotCopy = Literal["overlap", "blocking"]


class SnapshotWriter:
    """Snapshots of one rank into its memory slots (see the module docstring).

    Args:
        memory: the active memory store (it may change when ``fall_back`` moves it to disk).
        fall_back: called with the error when the active store has no room; returns False if there is
            nowhere else to go (the snapshot is then not saved).
        persister: the persist thread of this rank.
        slots: the number of memory slots (all are allocated after the first snapshot).
        copy: ``"overlap"`` or ``"blocking"``.
        device: the training device (CUDA: pinned buffers and a side stream).
        stats: a list that receives one record per snapshot (step, bytes, persist, fence wait, copy time).
        replicate: called by the copy thread with the slot's buffer and header right after a slot is
            committed, or with ``None`` when a snapshot could not be held, so that peer replicas
            (:class:`~.replica.Replicator`) exchange the same steps on every rank; it must return at once.
        replica_done: ``(header, timeout) -> bool``: True once nothing reads the snapshot of ``header``
            for a replica any more; a slot handed to ``replicate`` is overwritten only after that.
    """

    def __init__(
        self,
        *,
        memory: Callable[[], MemoryStore],
        fall_back: Callable[[NoRoom], bool],
        persister: Persister,
        slots: int,
        copy: SnapshotCopy,
        device: torch.device,
        stats: list[dict[str, Any]],
        replicate: Callable[[torch.Tensor | None, dict[str, Any]], None] | None = None,
        replica_done: Callable[[dict[str, Any], float], bool] | None = None,
    ) -> None:
        self._memory = memory
        self._fall_back = fall_back
        self._persister = persister
        self._slots = slots
        self._mode: SnapshotCopy = copy
        self._pin = device.type == "cuda"  # page-locked buffers for device-to-host copies
        self._cuda_stream: Any = torch.cuda.Stream(device=device) if self._pin else None
        # the copy thread works on this rank's GPU: a thread starts on device 0 (as torch's pin-memory
        # thread, it sets its device first), where it would pin the buffers under device 0's context and
        # make one there for every local rank
        setup: dict[str, Any] = (
            {"initializer": torch.cuda.set_device, "initargs": (device,)} if self._pin else {}
        )
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flash-copy", **setup)
        self._copy: Future[None] | None = None
        self._prealloc: Future[None] | None = None
        self._stats = stats
        self._replicate = replicate
        self._replica_done = replica_done

    # ------------------------------------------------------------------ training thread
    def fence(self) -> None:
        """Wait until the copy thread has read the tensors an optimizer step is about to change."""
        if self._copy is None:
            return
        start = time.perf_counter()
        try:
            self._copy.result()
        finally:
            self._copy = None
            if self._stats:
                self._stats[-1]["fence_wait_s"] += time.perf_counter() - start

    def ready(self) -> None:
        """Before a new snapshot: the previous copy and the slots' allocation are done."""
        self.fence()
        if self._prealloc is not None:
            self._prealloc.result()  # the other slots' allocation after the first snapshot (long done)

    def write(
        self, *, plan: Plan, live: set[int], header: dict[str, Any], persist: bool, safe: int | None
    ) -> dict[str, Any] | None:
        """Start the snapshot of ``plan`` (call :meth:`ready` first); its stats record, or None if it
        cannot be held. For a persist step the persister must not have been announced yet."""
        slot = self._claim_slot()
        deferred = [
            i for i, t in enumerate(plan.sources) if t.numel() and t.untyped_storage().data_ptr() in live
        ]
        chosen = set(deferred)
        now = [i for i in range(len(plan.sources)) if i not in chosen]
        buffer: torch.Tensor | None = None
        if self._prealloc is None:
            # the first snapshot of this process: the copy thread allocates the slot too; what the next
            # step may change is cloned now instead of copied
            for i in now:
                plan.sources[i] = plan.sources[i].clone()
            deferred = list(range(len(plan.sources)))
        else:
            try:
                buffer = self._reserve(slot, plan.nbytes)
            except OSError as exc:
                self._not_saved(header, exc)
                self._replicate_nothing(header)
                return None
            snapshot.copy_into(buffer, plan, now)
        event = None
        if any(t.is_cuda for t in plan.sources):
            # recorded after the copies above: the copy thread's stream waits for it, then that thread
            # synchronises before committing, so the training thread never waits for the device here
            event = torch.cuda.Event()
            event.record()
        if persist:
            self._persister.announce()
        record: dict[str, Any] = {"step": header["step"], "bytes": plan.nbytes, "persist": persist}
        record["fence_wait_s"] = 0.0
        self._stats.append(record)
        job = (slot, buffer, plan, deferred, header, persist, safe, event, record)
        if self._mode == "overlap":
            self._copy = self._copier.submit(self._complete, *job)
        else:
            self._complete(*job)
        if self._prealloc is None:  # first snapshot: allocate the other slots off the training thread
            self._prealloc = self._copier.submit(self._reserve_all, plan.nbytes)
        return record

    def wait(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds, errors ignored) for the copy in flight; any thread."""
        if self._copy is not None:
            with contextlib.suppress(Exception):
                self._copy.result(timeout)

    def close(self) -> None:
        self._copier.shutdown(wait=True)

    # ------------------------------------------------------------------ slots
    def _claim_slot(self) -> int:
        while True:
            memory = self._memory()
            with memory.lock:
                slot = memory.choose()
                held = memory.header(slot) if slot is not None else None
                if slot is not None and (held is None or self._replica_released(held, 0.0)):
                    memory.invalidate(slot)
                    return slot
            if held is None:
                self._persister.wait_idle()  # one slot, being persisted
                continue
            # the replica thread still sends this slot (it lags a snapshot behind): overwriting it now
            # would hand a torn snapshot to the peer; the replicator bounds each exchange, so this ends
            while not self._replica_released(held, 30.0):
                log.warning(
                    "FlashCheckpoint: rank %d waits for the replica thread to release step %d",
                    held["rank"],
                    held["step"],
                )

    def _replica_released(self, header: dict[str, Any], timeout: float) -> bool:
        return self._replica_done is None or self._replica_done(header, timeout)

    def _replicate_nothing(self, header: dict[str, Any]) -> None:
        """This rank holds nothing for the step: the replicator still takes part in its exchange."""
        if self._replicate is not None:
            self._replicate(None, header)

    @staticmethod
    def _not_saved(header: dict[str, Any], exc: OSError) -> None:
        log.error(
            "FlashCheckpoint: rank %d cannot hold snapshots (%s); step %d is not saved",
            header["rank"],
            exc,
            header["step"],
        )

    def _reserve(self, slot: int, nbytes: int) -> torch.Tensor:
        memory = self._memory()
        try:
            return memory.reserve(slot, nbytes, pin=self._pin)
        except NoRoom as exc:
            if not self._fall_back(exc):
                raise
            memory = self._memory()
            with memory.lock:
                memory.invalidate(slot)
            return memory.reserve(slot, nbytes, pin=self._pin)

    def _reserve_all(self, nbytes: int) -> None:
        """Copy thread: give every slot its buffer now, so no later snapshot pays the first touch."""
        memory = self._memory()
        for k in range(self._slots):
            try:
                memory.reserve(k, nbytes, pin=self._pin)
            except OSError as exc:  # the snapshot that needs this slot falls back, with its warning
                log.info("FlashCheckpoint: slot %d not pre-allocated (%s)", k, exc)
                return

    # ------------------------------------------------------------------ copy thread (or inline)
    def _complete(
        self,
        slot: int,
        buffer: torch.Tensor | None,
        plan: Plan,
        deferred: list[int],
        header: dict[str, Any],
        persist: bool,
        safe: int | None,
        event: Any,
        record: dict[str, Any],
    ) -> None:
        """The slot's allocation at the first snapshot (``buffer`` None), the big copies, the commit, the
        hand-over to the persist thread."""
        start = time.perf_counter()
        if buffer is None:
            try:
                buffer = self._reserve(slot, plan.nbytes)
            except OSError as exc:
                self._not_saved(header, exc)
                self._replicate_nothing(header)
                if persist:
                    self._persister.withdraw()
                return
        memory = self._memory()
        try:
            if event is not None:
                with torch.cuda.stream(self._cuda_stream):
                    self._cuda_stream.wait_event(event)
                    snapshot.copy_into(buffer, plan, deferred)
                self._cuda_stream.synchronize()
            else:
                snapshot.copy_into(buffer, plan, deferred)
            with memory.lock:
                memory.commit(slot, header)
                if persist:
                    memory.set_busy(slot, True)
        except Exception:
            log.exception("FlashCheckpoint: rank %d failed to copy step %d", header["rank"], header["step"])
            self._replicate_nothing(header)
            if persist:
                self._persister.withdraw()
            raise
        record["copy_s"] = time.perf_counter() - start
        if self._replicate is not None:
            self._replicate(buffer, header)
        if persist:
            self._persister.submit(slot, header, safe)
