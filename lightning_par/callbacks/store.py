"""``FlashStore``: one rank's flash snapshots, in shared memory and on disk, without any training loop.

Both front doors drive it: the Trainer's ``FlashCheckpoint`` (:mod:`.flash`) and Fabric's
``FlashSnapshots`` (:mod:`lightning_par.fabric.flash`). They decide when to snapshot and what the state
is; the store holds it, persists it and finds it again.

How a snapshot is taken (:meth:`FlashStore.write`, rank by rank, after an optimizer step):

1. the front door's capture collects this rank's whole training state as *live* tensors plus a small tree
   (loop position, schedulers, RNG, ...), and names the storages only an optimizer step changes
   (parameters, masters, optimizer state: :mod:`lightning_par.checkpoint.rank_state`); the tree is
   pickled right away into the index.
2. The state is laid out in one flat buffer (:mod:`.snapshot`), held in a pre-allocated, reused slot of
   ``shm_dir`` (:mod:`.memory`, two slots by default: the newest complete snapshot is never the one
   being written). Small tensors (buffers, RNG) are copied at once.
3. With ``snapshot_copy="overlap"`` a copy thread copies the live tensors while the next step's data
   loading, forward and backward run; :meth:`FlashStore.fence` waits for it and must come before the
   next optimizer step. The training thread blocks for step 1, the small copies and any fence wait.
   ``"blocking"`` copies everything before returning.
4. The copy thread commits the slot (its meta file, written last) and, every ``persist_every_n_steps``,
   hands it to the persist thread (:mod:`.persister`), which writes it atomically to ``dirpath``
   (:mod:`.disk`: temp file, fsync, rename, meta file last as commit marker, CRC-32) and keeps the last
   ``keep_last``. A persist still running at the next persist step is waited for and the ranks agree on
   the step every one of them has committed (one all-reduce), so every rank persists the same steps and
   retention never deletes the newest snapshot complete everywhere. Steps 2-4 are
   :class:`.writer.SnapshotWriter`'s.

If ``shm_dir`` lacks room, the slots are staged in ``dirpath/.staging`` instead, with a warning;
``replicas`` also copies each committed slot to other nodes' shared memory (:mod:`.replica`).
:meth:`FlashStore.flush` writes the newest memory snapshot to disk if it is not there (bounded, never a
collective: safe from signal handlers). :meth:`FlashStore.find` agrees on the newest snapshot whose every
writer's part can be read somewhere, resharded if asked (:func:`.resume.find_snapshot`); a *lineage* (one
run) is started fresh (:meth:`~FlashStore.start_lineage`) or continued (:meth:`~FlashStore.adopt`). A
finished run frees its shared memory after flushing; a failed one leaves it for the restart.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import torch

from lightning_par.callbacks import _dist, snapshot
from lightning_par.callbacks.disk import DiskStore
from lightning_par.callbacks.memory import MemoryStore, NoRoom
from lightning_par.callbacks.persister import Persister
from lightning_par.callbacks.replica import Replicator
from lightning_par.callbacks.replica_open import open_replicator
from lightning_par.callbacks.resume import Found, check_fingerprint, find_snapshot
from lightning_par.callbacks.writer import SnapshotCopy, SnapshotWriter

log = logging.getLogger(__name__)

COPY_MODES = get_args(SnapshotCopy)

Capture = Callable[[], tuple[dict[str, Any], set[int]]]  # () -> (state with live tensors, live storages)


def positive_int(owner: str, name: str, value: Any) -> int:
    """``value`` if it is a positive ``int`` (not a bool), else a ``ValueError`` naming ``owner.name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {name} must be a positive integer, got {value!r}.")
    return value


class FlashStore:
    """One rank's snapshot store (see the module docstring). Construct with the options (checked here,
    messages prefixed with ``owner``), then :meth:`open` once the process group exists; :meth:`close`
    ends a run and :meth:`open` may start another.

    Args:
        dirpath: where snapshots are persisted (shared by all ranks or local to each node).
        owner: the front door's name, for messages.
        persist_every_n_steps: :meth:`write` persists the steps that are multiples of this.
        keep_last: persisted snapshots to keep (older ones go once a newer one is on every rank).
        shm_dir: the shared-memory file system of the memory slots.
        memory_slots: 2 keeps the previous snapshot while the next is written; 1 halves the memory.
        snapshot_copy: ``"overlap"`` (copy thread until :meth:`fence`) or ``"blocking"``.
        flush_timeout_s: the default bound of :meth:`flush`.
        replicas: copies of every snapshot kept in the shared memory of ranks on other nodes
            (:mod:`.replica`), sent in the background after the local copy; a lost node's snapshot then
            comes back from a survivor's memory instead of disk.
    """

    def __init__(
        self,
        dirpath: str | Path,
        *,
        owner: str,
        persist_every_n_steps: int,
        keep_last: int,
        shm_dir: str | Path,
        memory_slots: int,
        snapshot_copy: SnapshotCopy,
        flush_timeout_s: float,
        replicas: int = 0,
    ) -> None:
        if not isinstance(dirpath, str | os.PathLike) or not str(dirpath):
            raise ValueError(f"{owner}: dirpath must name a directory (a str or path), got {dirpath!r}.")
        self.owner = owner
        self.persist_every_n_steps = positive_int(owner, "persist_every_n_steps", persist_every_n_steps)
        self.keep_last = positive_int(owner, "keep_last", keep_last)
        if memory_slots not in (1, 2):
            raise ValueError(f"{owner}: memory_slots must be 1 or 2, got {memory_slots!r}.")
        if snapshot_copy not in COPY_MODES:
            raise ValueError(f"{owner}: snapshot_copy must be one of {COPY_MODES}, got {snapshot_copy!r}.")
        number = isinstance(flush_timeout_s, int | float) and not isinstance(flush_timeout_s, bool)
        if not number or not flush_timeout_s > 0:
            raise ValueError(f"{owner}: flush_timeout_s must be a number > 0, got {flush_timeout_s!r}.")
        self.dirpath = Path(dirpath)
        self.shm_dir = Path(shm_dir)
        self.memory_slots = memory_slots
        self.snapshot_copy: SnapshotCopy = snapshot_copy
        self.flush_timeout_s = float(flush_timeout_s)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ValueError(f"{owner}: replicas must be an integer >= 0, got {replicas!r}.")
        self.replicas = replicas
        self.stats: list[dict[str, Any]] = []  # one record per snapshot, for logs, tests and benchmarks
        self._reset()

    def _reset(self) -> None:
        self.rank, self.world_size = 0, 1
        self._device = torch.device("cpu")
        self._disk: DiskStore | None = None
        self._memory: MemoryStore | None = None
        self._memories: list[MemoryStore] = []
        self._staging: Path | None = None
        self._root: Path | None = None  # this job's folder in shm_dir: one memory folder per rank
        self._persister: Persister | None = None
        self._writer: SnapshotWriter | None = None
        self._replicator: Replicator | None = None
        self._lineage = ("", 0.0)
        self._last_step = -1
        self._open = False

    # ------------------------------------------------------------------ state
    @property
    def errors(self) -> list[str]:
        """Persist errors of this rank (also logged)."""
        return self._persister.errors if self._persister is not None else []

    @property
    def replica_stats(self) -> list[dict[str, Any]]:  # per replicated snapshot: bytes, seconds, error
        return self._replicator.stats if self._replicator is not None else []

    @property
    def lineage(self) -> str:
        """The id of the run the snapshots belong to ("" before :meth:`start_lineage` / :meth:`adopt`)."""
        return self._lineage[0]

    # ------------------------------------------------------------------ opening and resuming
    def open(self, *, rank: int, world_size: int, device: torch.device, node: int = 0) -> None:
        """Check that every rank can write ``dirpath`` (an ``OSError`` naming the ranks that cannot,
        before anything is written), remove partial files of interrupted saves, open the memory slots
        and start the copy and persist threads. Collective: every rank calls it. ``device`` is the
        training device (its collectives, pinned buffers); ``node`` this rank's node index (replicas go to
        other nodes)."""
        self._reset()
        self.stats = []
        self.rank, self.world_size, self._device = rank, world_size, device
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
                f"{self.owner}: cannot write snapshots to dirpath={str(dirpath)!r}: {'; '.join(problems)}."
                " Pass a writable directory (nothing was written)."
            )
        leftovers = self._disk.cleanup_partial()
        if leftovers:
            log.warning(
                "%s: removed %d partial file(s) of interrupted saves, e.g. %s",
                self.owner,
                len(leftovers),
                leftovers[0],
            )
        # one shared-memory directory per dirpath and rank: jobs with other dirpaths never collide
        key = hashlib.sha1(str(dirpath).encode()).hexdigest()[:16]
        self._staging = dirpath / ".staging" / f"rank{rank:05d}"
        self._root = self.shm_dir / "lightning_par_flash" / key
        replicator = (
            open_replicator(
                root=self._root,
                owner=self.owner,
                node=node,
                rank=rank,
                world_size=world_size,
                replicas=self.replicas,
                slots=self.memory_slots,
                timeout_s=max(60.0, self.flush_timeout_s),
            )
            if self.replicas and world_size > 1
            else None
        )
        try:
            self._memory = MemoryStore(self._root / f"rank{rank:05d}", slots=self.memory_slots)
            self._memories.append(self._memory)
        except OSError as exc:
            self._fall_back(f"{self.shm_dir} is unusable ({exc})")
        if self._staging.is_dir() and self._memory is not None and self._memory.directory != self._staging:
            # an earlier run staged on disk: its snapshots are candidates for the resume too
            self._memories.append(MemoryStore(self._staging, slots=self.memory_slots))
        self._persister = Persister(
            disk=self._disk,
            memory=self._active_memory,
            keep_last=self.keep_last,
            lineage=lambda: self.lineage,  # read when a persist runs: adopt() may change it after open()
        )
        self._replicator = replicator
        self._writer = SnapshotWriter(
            memory=self._active_memory,
            fall_back=self._no_room,
            persister=self._persister,
            slots=self.memory_slots,
            copy=self.snapshot_copy,
            device=device,
            stats=self.stats,
            replicate=(lambda b, h: replicator.submit(buffer=b, header=h)) if replicator else None,
            replica_done=(lambda h, t: replicator.wait_released(header=h, timeout=t)) if replicator else None,
        )
        self._open = True

    def _active_memory(self) -> MemoryStore:
        assert self._memory is not None
        return self._memory

    def _no_room(self, exc: NoRoom) -> bool:
        """The writer's fallback: move the memory snapshots to disk, unless they are there already."""
        if self._memory is not None and self._memory.directory == self._staging:
            return False
        if self._replicator is not None:
            self._replicator.wait_idle(self.flush_timeout_s)  # it may still send from the slots removed now
        self._fall_back(f"no room in {self.shm_dir} ({exc.strerror})")
        return True

    def _fall_back(self, why: str) -> None:
        assert self._staging is not None
        message = (
            f"{self.owner}: {why}; staging the memory snapshots on disk in {self._staging.parent} instead:"
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

    def find(self, *, lineage: str | None = None, reshard: bool = False) -> Found | None:
        """The newest snapshot whose every writer's part can be read (of ``lineage`` only, if given),
        the parts this rank needs loaded; with ``reshard``, also one written by another number of ranks
        (every part is then loaded, for :mod:`lightning_par.checkpoint.rank_state` to reshard). None if
        there is none. Collective."""
        assert self._disk is not None and self._root is not None, "open() the store first"
        return find_snapshot(
            memories=self._memories,
            node_root=self._root,
            slots=self.memory_slots,
            disk=self._disk,
            rank=self.rank,
            world_size=self.world_size,
            lineage=lineage,
            reshard=reshard,
        )

    def check(self, found: Found, fingerprint: dict[str, Any], *, remedy: str) -> None:
        """Raise a ``ValueError`` naming the differences if ``found`` was written by another model or
        layout on any rank (``remedy`` says what to do instead); a resharded snapshot may differ in the
        world and data-parallel sizes and the ZeRO stage. Collective; changes nothing."""
        check_fingerprint(found, fingerprint, owner=self.owner, dirpath=self.dirpath, remedy=remedy)

    def start_lineage(self) -> None:
        """Begin a new run: a fresh id (rank 0's, broadcast) and start time. Collective."""
        lineage = _dist.broadcast_object((uuid.uuid4().hex[:8], time.time()))
        self._lineage = (str(lineage[0]), float(lineage[1]))

    def adopt(self, found: Found) -> None:
        """Continue the run of ``found`` (after it was loaded): its lineage, its step as the last one
        snapshotted, and what is on disk already counted as persisted (flushes skip it)."""
        assert self._persister is not None and self._disk is not None
        self._lineage = (found.header["lineage"], float(found.header["lineage_time"]))
        self._last_step = found.step
        for header in self._disk.headers():
            self._persister.mark_persisted(header["lineage"], header["step"])

    # ------------------------------------------------------------------ snapshots
    def write(self, *, step: int, capture: Capture, fingerprint: dict[str, Any]) -> dict[str, Any] | None:
        """Snapshot ``step`` unless it is the last one snapshotted: ``capture()`` returns the state with
        live tensors and the storages that may be copied until the next optimizer step. Persists when
        ``step`` is a multiple of ``persist_every_n_steps``; that is collective (every rank writes the
        same steps). Returns the snapshot's stats record, or None if it was skipped or not held."""
        assert self._persister is not None and self._writer is not None, "open() the store first"
        if step == self._last_step:
            return None
        self._last_step = step
        self._writer.ready()
        start = time.perf_counter()
        persist = step % self.persist_every_n_steps == 0
        safe: int | None = None
        if persist:
            # the previous persist must be done on every rank before the newest step all of them hold is
            # agreed: retention keeps that one
            self._persister.wait_idle()
            committed = [float(self._persister.committed_step)]
            safe = int(_dist.all_reduce(committed, op="min", device=self._device)[0])
        state, live = capture()
        plan = snapshot.plan(state)
        header = {
            "format": snapshot.FORMAT_VERSION,
            "step": step,
            "lineage": self._lineage[0],
            "lineage_time": self._lineage[1],
            "rank": self.rank,
            "world_size": self.world_size,
            "nbytes": plan.nbytes,
            "index": plan.index(),
            "fingerprint": fingerprint,
            "time": time.time(),
        }
        record = self._writer.write(plan=plan, live=live, header=header, persist=persist, safe=safe)
        if record is not None:
            record["capture_s"] = time.perf_counter() - start
        return record

    def fence(self) -> None:
        """Wait until the copy thread has read what the next optimizer step changes (a no-op when no
        copy is in flight)."""
        if self._writer is not None:
            self._writer.fence()

    def flush(self, timeout: float | None = None) -> bool:
        """Write the newest complete memory snapshot to disk unless it is there; True once it is.
        Bounded by ``timeout`` (default ``flush_timeout_s``); safe from any thread and from signal
        handlers (never a collective)."""
        timeout = self.flush_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        if self._writer is not None:
            self._writer.wait(timeout)
        if self._persister is None:
            return False
        return self._persister.flush(max(0.0, deadline - time.monotonic()))

    def close(self, *, failed: bool, flush: bool = True) -> None:
        """End the run. Normally (``failed=False``) the copy in flight and the pending persist finish,
        then, with ``flush``, the newest snapshot goes to disk and the shared memory is freed, so running
        the job again with more steps continues from where this run ended. After a failure the memory
        slots are only unmapped: they are left for the restart. Not a collective; a second call does
        nothing."""
        if not self._open:
            return
        self._open = False
        try:
            if not failed:
                self.fence()
                if flush and self._persister is not None:
                    self._persister.wait_idle()
                    self.flush()
        finally:
            if self._writer is not None:
                self._writer.close()
            if self._replicator is not None:  # before the slots it reads from are unmapped
                self._replicator.close()
                if not failed:
                    self._replicator.remove()
            if self._persister is not None:
                self._persister.stop(drain=not failed)
            for memory in self._memories:
                if failed:
                    memory.close()
                else:
                    memory.remove()
