"""Peer replicas of flash snapshots (``lightning_par/callbacks/replica.py``) and the writer's hook.

Nodes are simulated on one machine: ``node_of`` is passed explicitly and every simulated node gets a
shared-memory root of its own, so a "node" only sees the replicas its ranks received.
"""

from __future__ import annotations

import shutil
import threading
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_par.callbacks import snapshot
from lightning_par.callbacks.disk import DiskStore
from lightning_par.callbacks.memory import MemoryStore, NoRoom
from lightning_par.callbacks.persister import Persister
from lightning_par.callbacks.replica import Replicator, replica_directory, replica_peers
from lightning_par.callbacks.writer import SnapshotWriter
from tests.distributed import run_distributed


@pytest.fixture
def shm_base(tmp_path: Path) -> Iterator[Path]:
    """A fresh directory in /dev/shm (tmpfs, as in a job) or, without one, under the pytest tmp dir."""
    shm = Path("/dev/shm")
    base = shm / f"lightning_par_test_{uuid.uuid4().hex[:8]}" if shm.is_dir() else tmp_path / "shm"
    base.mkdir(parents=True)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _header(rank: int, world_size: int, step: int, nbytes: int) -> dict[str, Any]:
    return {
        "format": snapshot.FORMAT_VERSION,
        "step": step,
        "lineage": "lin",
        "rank": rank,
        "world_size": world_size,
        "nbytes": nbytes,
        "index": b"",
    }


def _payload(rank: int, step: int) -> torch.Tensor:
    """What ``rank`` submits at ``step``: random bytes of a size of its own (any rank can recompute it)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, 256, (5000 + 37 * rank + 11 * step,), dtype=torch.uint8, generator=g)


# ---------------------------------------------------------------------- in-process
def test_peers_and_options_are_checked() -> None:
    # 2 nodes x 2 ranks, node ids unsorted and not 0-based: same local index on the next node
    assert replica_peers(rank=0, node_of=[7, 7, 3, 3], replicas=1) == ([2], [2])
    assert replica_peers(rank=3, node_of=[7, 7, 3, 3], replicas=1) == ([1], [1])
    # 3 nodes x 1 rank, 2 replicas: a ring shift per round
    assert replica_peers(rank=0, node_of=[0, 1, 2], replicas=2) == ([1, 2], [2, 1])
    assert replica_peers(rank=1, node_of=[0, 1, 2], replicas=0) == ([], [])
    with pytest.raises(ValueError, match=r"replicas=2 needs at least 3 nodes.*2 node\(s\).*replicas <= 1"):
        replica_peers(rank=0, node_of=[0, 0, 1, 1], replicas=2)
    with pytest.raises(ValueError, match="replicas=1 needs at least 2 nodes"):
        Replicator(
            root=Path("unused"),
            rank=0,
            world_size=1,
            node_of=[0],
            replicas=1,
            slots=2,
            group=None,
            timeout_s=1.0,
        )
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match="replicas must be an integer >= 0"):
            replica_peers(rank=0, node_of=[0, 1], replicas=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="same number of ranks on every node"):
        replica_peers(rank=0, node_of=[0, 0, 1], replicas=1)
    with pytest.raises(ValueError, match="needs a Gloo process group"):
        Replicator(
            root=Path("unused"),
            rank=0,
            world_size=2,
            node_of=[0, 1],
            replicas=1,
            slots=2,
            group=None,
            timeout_s=1.0,
        )


def test_replicas_zero_does_nothing(tmp_path: Path) -> None:
    replicator = Replicator(
        root=tmp_path, rank=0, world_size=2, node_of=[0, 1], replicas=0, slots=2, group=None, timeout_s=1.0
    )
    assert not replicator.active
    buffer = _payload(0, 1)
    header = _header(0, 2, 1, buffer.numel())
    replicator.submit(buffer=buffer, header=header)
    assert replicator.wait_released(header=header, timeout=0.0) and replicator.wait_idle(0.0)
    replicator.remove()
    assert replicator.stats == [] and replicator.errors == [] and list(tmp_path.iterdir()) == []


def test_writer_waits_for_the_replica_before_reusing_a_slot(tmp_path: Path) -> None:
    """One slot: every snapshot overwrites the previous one, so the writer must ask the replicator
    first; a snapshot that cannot be held is still handed over (as None) to keep the peers matched."""
    memory = MemoryStore(tmp_path / "rank00000", slots=1)
    persister = Persister(
        disk=DiskStore(tmp_path / "disk", rank=0), memory=lambda: memory, keep_last=1, lineage=lambda: "lin"
    )
    handed: list[tuple[int | None, int]] = []
    asked: list[tuple[int, float]] = []
    released = threading.Event()
    sending = {1}  # the replica of step 1 is still being sent when step 2 wants its slot

    def replicate(buffer: torch.Tensor | None, header: dict[str, Any]) -> None:
        handed.append((None if buffer is None else int(buffer[0]), header["step"]))

    def replica_done(header: dict[str, Any], timeout: float) -> bool:
        asked.append((header["step"], timeout))
        if header["step"] not in sending:
            return True
        if timeout == 0.0:
            return False  # still sending: the writer must wait (with a timeout), not overwrite
        assert memory.header(0) is not None, "the slot was invalidated while the replica read it"
        sending.discard(header["step"])
        released.set()
        return True

    writer = SnapshotWriter(
        memory=lambda: memory,
        fall_back=lambda exc: False,
        persister=persister,
        slots=1,
        copy="blocking",
        device=torch.device("cpu"),
        stats=[],
        replicate=replicate,
        replica_done=replica_done,
    )
    try:
        for step in (1, 2):
            state = {"w": torch.full((256,), step, dtype=torch.uint8)}
            plan = snapshot.plan(state)
            writer.ready()
            record = writer.write(
                plan=plan, live=set(), header=_header(0, 1, step, plan.nbytes), persist=False, safe=None
            )
            assert record is not None
        assert handed == [(1, 1), (2, 2)]
        assert asked == [(1, 0.0), (1, 30.0), (1, 0.0)] and released.is_set()
        assert [h["step"] for h in memory.headers()] == [2]

        def full(self: MemoryStore, k: int, nbytes: int, *, pin: bool = False) -> torch.Tensor:
            raise NoRoom(28, "No space left on device")

        original = MemoryStore.reserve
        MemoryStore.reserve = full  # type: ignore[method-assign]
        try:
            writer.ready()
            plan = snapshot.plan({"w": torch.zeros(2 << 22, dtype=torch.uint8)})  # needs a bigger buffer
            header = _header(0, 1, 3, plan.nbytes)
            assert writer.write(plan=plan, live=set(), header=header, persist=False, safe=None) is None
        finally:
            MemoryStore.reserve = original  # type: ignore[method-assign]
        assert handed[-1] == (None, 3)
    finally:
        writer.close()
        persister.stop(drain=True)
        memory.remove()


# ---------------------------------------------------------------------- 4 ranks on 2 simulated nodes
def _four_ranks(rank: int, world_size: int, base: str) -> dict[str, Any]:
    node_of = [0, 0, 1, 1]
    root = Path(base) / f"node{node_of[rank]}"
    group = dist.new_group(backend="gloo")
    if rank == 3:  # the receiver of rank 1 has no room for the replica of step 2 (its 2nd reservation)
        calls = {"n": 0}
        original = MemoryStore.reserve

        def reserve(self: MemoryStore, k: int, nbytes: int, *, pin: bool = False) -> torch.Tensor:
            calls["n"] += 1
            if calls["n"] == 2:
                raise NoRoom(28, f"no room for {nbytes} bytes in {self.directory}")
            return original(self, k, nbytes, pin=pin)

        MemoryStore.reserve = reserve  # type: ignore[method-assign]
    replicator = Replicator(
        root=root,
        rank=rank,
        world_size=world_size,
        node_of=node_of,
        replicas=1,
        slots=2,
        group=group,
        timeout_s=30.0,
    )
    (source,) = replicator.receive_from
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (1, 2, 3, 4):
            data = _payload(rank, step)
            slot = torch.full((data.numel() + 64,), 0xEE, dtype=torch.uint8)  # a slot has spare bytes
            slot[: data.numel()] = data
            # rank 2 could not hold step 1 itself: it still takes part, receiving rank 0's
            held_here = None if (rank, step) == (2, 1) else slot
            replicator.submit(buffer=held_here, header=_header(rank, world_size, step, data.numel()))
        assert replicator.wait_idle(30.0)
    replicator.close()
    dist.barrier()  # every rank's replicas are committed before any is read (as after a restart)

    # what a resume finds: a complete replica of the source's newest two steps, byte for byte
    held = MemoryStore(replica_directory(root, source), slots=2)
    assert [h["step"] for h in held.headers()] == [3, 4]
    for step in (3, 4):
        k = held.find("lin", step)
        assert k is not None
        want = _payload(source, step)
        assert held.header(k) == _header(source, world_size, step, want.numel())
        assert torch.equal(held.reserve(k, want.numel())[: want.numel()], want)
    held.close()
    dist.barrier()
    replicator.remove()
    assert not replica_directory(root, source).exists()
    messages = [str(w.message) for w in caught]
    return {"stats": replicator.stats, "errors": replicator.errors, "warnings": messages}


def test_four_ranks_replicate_across_nodes_and_survive_a_full_peer(shm_base: Path) -> None:
    results = run_distributed(_four_ranks, 4, str(shm_base), timeout=120.0)
    for rank, result in enumerate(results):
        assert [s["step"] for s in result["stats"]] == [1, 2, 3, 4]
        source = {0: 2, 1: 3, 2: 0, 3: 1}[rank]
        for s in result["stats"]:
            refused = s["step"] == 2 and rank in (1, 3)
            assert (s["error"] is None) != refused, (rank, s)
            nothing = (rank, s["step"]) in ((1, 2), (2, 1))  # refused by its peer / not held here
            assert s["bytes_sent"] == (0 if nothing else _payload(rank, s["step"]).numel())
            nothing = (source, s["step"]) in ((1, 2), (2, 1))
            assert s["bytes_received"] == (0 if nothing else _payload(source, s["step"]).numel())
    # the full receiver warns, naming itself, the step and the directory; the sender only records it
    (warning,) = results[3]["warnings"]
    assert "rank 3" in warning and "rank 1's step 2" in warning and "replica_rank00001" in warning
    assert (
        results[1]["warnings"] == [] and "rank 3 had no room for rank 1's step 2" in results[1]["errors"][0]
    )
    assert all(not r["warnings"] and not r["errors"] for r in (results[0], results[2]))


# ---------------------------------------------------------------------- the writer's hook, 2 nodes x 1
def _state(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return {"w": torch.randn(3000, generator=g), "b": torch.arange(rank + step), "step": step}


def _two_ranks_with_writer(rank: int, world_size: int, base: str) -> list[int]:
    root = Path(base) / f"node{rank}"
    group = dist.new_group(backend="gloo")
    memory = MemoryStore(root / f"rank{rank:05d}", slots=2)
    persister = Persister(
        disk=DiskStore(root / "disk", rank=rank), memory=lambda: memory, keep_last=1, lineage=lambda: "lin"
    )
    replicator = Replicator(
        root=root,
        rank=rank,
        world_size=world_size,
        node_of=[0, 1],
        replicas=1,
        slots=2,
        group=group,
        timeout_s=30.0,
    )
    writer = SnapshotWriter(
        memory=lambda: memory,
        fall_back=lambda exc: False,
        persister=persister,
        slots=2,
        copy="overlap",
        device=torch.device("cpu"),
        stats=[],
        replicate=lambda buffer, header: replicator.submit(buffer=buffer, header=header),
        replica_done=lambda header, timeout: replicator.wait_released(header=header, timeout=timeout),
    )
    live = _state(rank, 1)
    for step in (1, 2, 3):
        live.update(_state(rank, step))
        plan = snapshot.plan(live)
        writer.ready()
        header = _header(rank, world_size, step, plan.nbytes) | {"index": plan.index()}
        storages = {t.untyped_storage().data_ptr() for t in plan.sources}
        assert writer.write(plan=plan, live=storages, header=header, persist=False, safe=None) is not None
        writer.fence()
    writer.ready()
    assert replicator.wait_idle(30.0)
    writer.close()
    replicator.close()
    persister.stop(drain=True)
    dist.barrier()
    (source,) = replicator.receive_from
    held = MemoryStore(replica_directory(root, source), slots=2)
    steps = [h["step"] for h in held.headers()]
    for step in steps:  # the replica loads as the source's own state of that step
        k = held.find("lin", step)
        assert k is not None and held.header(k)["rank"] == source  # type: ignore[index]
        got, want = held.load(k), _state(source, step)
        assert got.keys() == want.keys() and got["step"] == step
        assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])
    held.close()
    dist.barrier()
    replicator.remove()
    memory.remove()
    assert replicator.errors == []

    # a peer that never answers (rank 1 submits a step rank 0 never takes): bounded, then off
    lonely = Replicator(
        root=root,
        rank=rank,
        world_size=world_size,
        node_of=[0, 1],
        replicas=1,
        slots=2,
        group=dist.new_group(backend="gloo"),
        timeout_s=1.0,
    )
    if rank == 1:
        data = _payload(rank, 9)
        lonely.submit(buffer=data, header=_header(rank, world_size, 9, data.numel()))
        assert lonely.wait_idle(20.0)
        assert len(lonely.errors) == 1 and "peer replicas are off" in lonely.errors[0]
        lonely.submit(buffer=data, header=_header(rank, world_size, 10, data.numel()))  # dropped
        assert lonely.wait_idle(0.0) and [s["step"] for s in lonely.stats] == [9]
    dist.barrier()  # rank 0 stays alive: rank 1's exchange must end by its own timeout
    lonely.remove()
    return steps


def test_the_writer_hands_its_committed_slots_to_the_replicator(shm_base: Path) -> None:
    assert run_distributed(_two_ranks_with_writer, 2, str(shm_base), timeout=120.0) == [[2, 3], [2, 3]]
