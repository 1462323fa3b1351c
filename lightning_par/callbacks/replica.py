"""Peer replicas of flash snapshots: each committed snapshot of a rank is copied into the shared memory
of a rank on another node, so a lost node's snapshot can come back from a survivor's memory, not disk.

Layout, next to the ranks' own slots (``root`` is ``<shm_dir>/lightning_par_flash/<job key>``)::

    root/rank00003/               this node's rank 3: its own slots (memory.py)
    root/replica_rank00001/       the replica of rank 1 (on another node), held by this node's rank 3

A replica directory is a :class:`~.memory.MemoryStore` with the sender's header unchanged
(``header["rank"]`` is the sender), so a resume can list every directory under ``root`` and treat each
complete slot as a piece of rank ``header["rank"]``.

Peers (:func:`replica_peers`): with the nodes sorted, rank ``r`` sends its snapshot, for ``j = 1 ..
replicas``, to the rank with the same local index on node ``(node(r) + j) % n_nodes`` and receives from
the rank with its local index on node ``(node(r) - j) % n_nodes``. Round ``j`` is a ring shift, so every
send is matched by exactly one receive.

The exchange of one snapshot, per round, on the dedicated Gloo group (CPU tensors only):

1. *meta*: every rank sends ``[nbytes, header length, step]`` (int64) to its target and receives its
   source's (``nbytes == -1``: that rank holds nothing for this step and sends nothing);
2. *verdict*: the receiver claims a replica slot (oldest first, meta file removed before the overwrite)
   and sends back one byte: 1 accepted, 0 no room (a warning on the receiving rank; the snapshot stays
   in the sender's own memory; later steps try again);
3. *data*: only if accepted, the sender sends ``buffer[:nbytes]`` and the pickled header; the receiver
   receives them straight into the slot and commits it (meta file last, as for a rank's own slots).

Every rank exchanges the same steps in the same order (snapshots are taken at deterministic steps, and a
rank whose local snapshot failed submits ``buffer=None`` instead of nothing), so the exchanges stay
matched. A failed or timed-out exchange (a peer died) cannot be re-matched: the replicator then records
the error and stops replicating for the rest of the run; training goes on.
"""

from __future__ import annotations

import logging
import pickle
import queue
import threading
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_par.callbacks.memory import MemoryStore

log = logging.getLogger(__name__)

_ACCEPT, _REFUSE = 1, 0
# the replica group is Gloo over host memory (the slots are shared-memory files): every tensor of an
# exchange lives on the host, whatever device training uses
_HOST = torch.device("cpu")
_TAG_META, _TAG_VERDICT, _TAG_DATA, _TAG_HEADER = 7101, 7102, 7103, 7104  # distinct: one peer, many ops


def replica_directory(root: Path, rank: int) -> Path:
    """Where this node holds the replica of ``rank``'s snapshots."""
    return root / f"replica_rank{rank:05d}"


def replica_peers(*, rank: int, node_of: Sequence[int], replicas: int) -> tuple[list[int], list[int]]:
    """``(send_to, receive_from)`` of ``rank``: entry ``j - 1`` is its target and source in round ``j``.

    Raises:
        ValueError: ``replicas`` is not an int >= 0, or exceeds the number of nodes - 1, or the nodes
            hold different numbers of ranks (refused rather than guessed: same-local-index peers would
            not exist for every rank).
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise ValueError(f"replicas must be an integer >= 0, got {replicas!r}.")
    if not 0 <= rank < len(node_of):
        raise ValueError(f"rank {rank} is outside node_of (length {len(node_of)}).")
    nodes = sorted(set(node_of))
    if replicas > len(nodes) - 1:
        raise ValueError(
            f"replicas={replicas} needs at least {replicas + 1} nodes (each replica goes to a different"
            f" other node), but the job runs on {len(nodes)} node(s). Pass replicas <= {len(nodes) - 1}"
            " (replicas=0 turns peer replicas off) or run on more nodes."
        )
    ranks_on = {n: [r for r, m in enumerate(node_of) if m == n] for n in nodes}
    sizes = {n: len(rs) for n, rs in ranks_on.items()}
    if replicas and len(set(sizes.values())) > 1:
        raise ValueError(
            f"peer replicas need the same number of ranks on every node, got ranks per node {sizes}."
            " Run the same number of processes on every node, or pass replicas=0."
        )
    position = nodes.index(node_of[rank])
    local = ranks_on[node_of[rank]].index(rank)
    send_to = [ranks_on[nodes[(position + j) % len(nodes)]][local] for j in range(1, replicas + 1)]
    receive_from = [ranks_on[nodes[(position - j) % len(nodes)]][local] for j in range(1, replicas + 1)]
    return send_to, receive_from


@dataclass
class _Job:
    buffer: torch.Tensor | None  # None: this rank holds nothing for the step (it still receives)
    header: dict[str, Any]
    key: tuple[str, int]  # (lineage, step): what wait_released() is asked about


class Replicator:
    """Copies this rank's committed snapshots to its peers and holds its sources' replicas (see the
    module docstring), in a daemon thread of its own.

    Args:
        root: this node's ``<shm_dir>/lightning_par_flash/<job key>`` directory.
        rank, world_size: of this process in the job; ``group`` must span the whole world, in rank order.
        node_of: the node index of every rank (all ranks pass the same).
        replicas: copies of each snapshot on other nodes (0: the replicator does nothing).
        slots: replica slots per source (2 keeps the previous replica while the next one arrives).
        group: a Gloo group of its own (``dist.new_group(backend="gloo")``), so the replica traffic never
            interleaves with training collectives; None only when there is nothing to replicate.
        timeout_s: the bound of each wait of an exchange (a peer that does not answer in time fails it).
    """

    def __init__(
        self,
        *,
        root: Path,
        rank: int,
        world_size: int,
        node_of: Sequence[int],
        replicas: int,
        slots: int,
        group: ProcessGroup | None,
        timeout_s: float,
    ) -> None:
        if len(node_of) != world_size:
            raise ValueError(f"node_of must name the node of all {world_size} ranks, got {len(node_of)}.")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be a positive integer, got {slots!r}.")
        if not isinstance(timeout_s, int | float) or isinstance(timeout_s, bool) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a number > 0, got {timeout_s!r}.")
        self.send_to, self.receive_from = replica_peers(rank=rank, node_of=node_of, replicas=replicas)
        self.active = replicas > 0 and world_size > 1
        if self.active:
            if group is None:
                raise ValueError(f"replicas={replicas} needs a Gloo process group for the replica traffic.")
            if dist.get_world_size(group) != world_size:
                raise ValueError(
                    f"the replica group has {dist.get_world_size(group)} ranks, the job {world_size}:"
                    " create it over all ranks with dist.new_group(backend='gloo')."
                )
        self.root = root
        self.rank = rank
        self.slots = slots
        self.timeout = timedelta(seconds=float(timeout_s))
        self.stats: list[dict[str, Any]] = []  # one record per step: bytes, seconds, error
        self.errors: list[str] = []
        self._group = group
        self._stores: dict[int, MemoryStore] = {}  # source rank -> its replica slots on this node
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._cv = threading.Condition()
        self._outstanding: Counter[tuple[str, int]] = Counter()  # submitted, not finished
        self._broken = False  # an exchange failed: the peers can no longer be matched
        self._closed = False
        self._thread: threading.Thread | None = None
        if self.active:
            self._thread = threading.Thread(target=self._loop, name="flash-replica", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ copy and training threads
    def submit(self, *, buffer: torch.Tensor | None, header: dict[str, Any]) -> None:
        """Queue the snapshot just committed in ``buffer`` (a CPU uint8 slot, ``header["nbytes"]`` valid
        bytes) and return at once. ``buffer=None``: this rank holds nothing for the step but takes part
        in the exchange. The slot must not be overwritten before :meth:`wait_released` says so."""
        if not self.active or self._closed:
            return
        if buffer is not None and (buffer.device.type != "cpu" or buffer.dtype != torch.uint8):
            raise ValueError(
                f"replicas are sent from CPU uint8 buffers, got {buffer.dtype} on {buffer.device}."
            )
        job = _Job(buffer=buffer, header=header, key=(str(header["lineage"]), int(header["step"])))
        with self._cv:
            if self._broken:
                return
            self._outstanding[job.key] += 1
        self._queue.put(job)

    def wait_released(self, *, header: dict[str, Any], timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until no queued or running exchange reads the snapshot of
        ``header`` (its lineage and step); True once its slot may be overwritten."""
        key = (str(header["lineage"]), int(header["step"]))
        with self._cv:
            return self._cv.wait_for(lambda: key not in self._outstanding or not self._alive(), timeout)

    def wait_idle(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until every submitted snapshot is exchanged; True if so."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._outstanding or not self._alive(), timeout)

    def close(self, *, timeout: float | None = None) -> None:
        """Drain the queue (at most ``timeout`` seconds, default ``timeout_s``), stop the thread (what is
        still queued then is dropped) and unmap the replica slots; their data stays for a resume."""
        if self._closed:
            return
        self._closed = True
        wait = self.timeout.total_seconds() if timeout is None else timeout
        if self._thread is not None:
            if not self.wait_idle(wait):
                log.warning("Replicator: rank %d stops with replicas still in flight", self.rank)
            with self._cv:
                self._broken = True  # drop what is left: it would never be matched now
            self._queue.put(None)
            self._thread.join(max(1.0, wait))
            if self._thread.is_alive():  # stuck in an exchange: it may still write into its slot
                log.warning("Replicator: rank %d's thread did not stop; replica slots stay mapped", self.rank)
                return
        for store in self._stores.values():
            store.close()

    def remove(self) -> None:
        """Close, then delete the replica directories this rank holds (a run that finished normally)."""
        self.close()
        if self._thread is not None and self._thread.is_alive():
            return
        for source in self.receive_from:
            store = self._stores.pop(source, None)
            directory = replica_directory(self.root, source)
            if store is None and directory.is_dir():  # left by an earlier attempt, never opened here
                store = MemoryStore(directory, slots=self.slots)
            if store is not None:
                store.remove()

    def _alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                with self._cv:
                    skip = self._broken
                if not skip:
                    self._replicate(job)
            finally:
                job.buffer = None  # no reference to a slot that its store may unmap later
                with self._cv:
                    self._outstanding[job.key] -= 1
                    if self._outstanding[job.key] <= 0:
                        del self._outstanding[job.key]
                    self._cv.notify_all()

    def _replicate(self, job: _Job) -> None:
        step = int(job.header["step"])
        record: dict[str, Any] = {"step": step, "bytes_sent": 0, "bytes_received": 0, "error": None}
        start = time.perf_counter()
        problems: list[str] = []
        try:
            payload = (
                None if job.buffer is None else pickle.dumps(job.header, protocol=pickle.HIGHEST_PROTOCOL)
            )
            for dst, src in zip(self.send_to, self.receive_from, strict=True):
                self._round(job, payload, dst=dst, src=src, record=record, problems=problems)
        except Exception as exc:  # a peer died or timed out: later exchanges could not be matched
            message = (
                f"Replicator: rank {self.rank} failed to exchange the replica of step {step}"
                f" ({type(exc).__name__}: {exc}); peer replicas are off for the rest of this run."
            )
            log.error(message)
            problems.append(message)
            with self._cv:
                self._broken = True
        record["seconds"] = time.perf_counter() - start
        record["error"] = "; ".join(problems) or None
        self.errors.extend(problems)
        self.stats.append(record)

    def _round(
        self,
        job: _Job,
        payload: bytes | None,
        *,
        dst: int,
        src: int,
        record: dict[str, Any],
        problems: list[str],
    ) -> None:
        """One exchange: send this rank's snapshot to ``dst``, receive ``src``'s (the module docstring)."""
        step = int(job.header["step"])
        nbytes = -1 if job.buffer is None or payload is None else int(job.header["nbytes"])
        if job.buffer is not None and nbytes > job.buffer.numel():
            # sent as "nothing held", never raised: the peers must still see this rank's exchange
            problems.append(f"Replicator: rank {self.rank}'s step {step} claims more bytes than its buffer")
            nbytes = -1
        # 1. meta: what each side would send
        meta_out = torch.tensor(
            [nbytes, len(payload) if payload else 0, step], dtype=torch.int64, device=_HOST
        )
        meta_in = torch.empty(3, dtype=torch.int64, device=_HOST)
        self._exchange([(dist.isend, meta_out, dst, _TAG_META), (dist.irecv, meta_in, src, _TAG_META)])
        their_nbytes, their_header_len, their_step = (int(v) for v in meta_in)
        if their_step != step and their_nbytes >= 0:  # still a valid snapshot of that rank: take it
            log.warning(
                "Replicator: rank %d exchanges its step %d with rank %d's step %d",
                self.rank,
                step,
                src,
                their_step,
            )
        # 2. verdict: room for the source's snapshot?
        claimed = self._claim(src, their_nbytes, their_step, problems) if their_nbytes >= 0 else None
        verdict_out = torch.tensor([_REFUSE if claimed is None else _ACCEPT], dtype=torch.uint8, device=_HOST)
        verdict_in = torch.empty(1, dtype=torch.uint8, device=_HOST)
        self._exchange(
            [(dist.isend, verdict_out, src, _TAG_VERDICT), (dist.irecv, verdict_in, dst, _TAG_VERDICT)]
        )
        accepted = nbytes >= 0 and int(verdict_in[0]) == _ACCEPT
        if nbytes >= 0 and not accepted:
            problems.append(f"Replicator: rank {dst} had no room for rank {self.rank}'s step {step}")
        # 3. data, only where it was accepted
        ops: list[tuple[Any, torch.Tensor, int, int]] = []
        if accepted:
            assert job.buffer is not None and payload is not None
            if nbytes:  # an empty state has no data to send (Gloo needs at least one element)
                ops.append((dist.isend, job.buffer[:nbytes], dst, _TAG_DATA))
            ops.append(
                (dist.isend, torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst, _TAG_HEADER)
            )
        header_in = torch.empty(max(their_header_len, 1), dtype=torch.uint8, device=_HOST)
        if claimed is not None:
            store, slot, target = claimed
            if their_nbytes:
                ops.append((dist.irecv, target[:their_nbytes], src, _TAG_DATA))
            ops.append((dist.irecv, header_in[:their_header_len], src, _TAG_HEADER))
        self._exchange(ops)
        if accepted:
            record["bytes_sent"] += nbytes
        if claimed is not None:
            try:  # the exchange itself completed, so a bad header costs this replica only
                header = pickle.loads(header_in[:their_header_len].numpy().tobytes())
            except Exception:
                header = {}
            if (
                not isinstance(header, dict)
                or header.get("rank") != src
                or header.get("nbytes") != their_nbytes
            ):
                problems.append(f"Replicator: rank {self.rank} got a mismatched header from rank {src}")
                return  # the slot stays invalidated: never read
            with store.lock:
                store.commit(slot, header)
            record["bytes_received"] += their_nbytes

    def _claim(
        self, src: int, nbytes: int, step: int, problems: list[str]
    ) -> tuple[MemoryStore, int, torch.Tensor] | None:
        """A replica slot of ``src`` with room for ``nbytes`` (its old meta removed); None if no room."""
        directory = replica_directory(self.root, src)
        try:
            store = self._stores.get(src)
            if store is None:
                store = self._stores[src] = MemoryStore(directory, slots=self.slots)
            with store.lock:
                slot = store.choose()
                assert slot is not None  # nothing marks replica slots busy
                store.invalidate(slot)
            return store, slot, store.reserve(slot, nbytes)
        except OSError as exc:  # NoRoom included; anything else about the file system likewise
            message = (
                f"Replicator: rank {self.rank} has no room for the replica of rank {src}'s step {step} in"
                f" {directory} ({exc}). That snapshot stays in rank {src}'s own memory (and on disk when"
                " persisted); training continues and later steps try again."
            )
            log.warning(message)
            warnings.warn(message, stacklevel=1)
            problems.append(message)
            return None

    def _exchange(self, ops: list[tuple[Any, torch.Tensor, int, int]]) -> None:
        """Post ``(isend|irecv, tensor, peer, tag)`` ops together and wait for all, each bounded."""
        if not ops:
            return
        works = dist.batch_isend_irecv(
            [dist.P2POp(op, t, peer, self._group, tag) for op, t, peer, tag in ops]
        )
        for work in works:
            work.wait(self.timeout)
