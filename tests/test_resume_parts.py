"""Finding a snapshot by its parts (``lightning_par.callbacks.resume``), on a bare ``FlashStore`` in two
forked ranks: a newest snapshot missing a rank's part everywhere is named and skipped (nothing deleted),
a part held only by another rank is sent to the rank that needs it, and ``replicas`` beyond the number
of other nodes is reduced to the nodes there are, with a warning (an elastic job that lost nodes goes on)."""

from __future__ import annotations

import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_par.callbacks.store import FlashStore
from tests.distributed import run_distributed


def _store(tmp: Path, rank: int, **options: Any) -> FlashStore:
    store = FlashStore(
        tmp / "disk",
        owner="FlashCheckpoint",
        persist_every_n_steps=100,  # memory only, unless a test persists
        keep_last=2,
        shm_dir=tmp / f"shm{rank}",  # one "node" per rank
        memory_slots=2,
        snapshot_copy="blocking",
        flush_timeout_s=10.0,
        **options,
    )
    store.open(rank=rank, world_size=2, device=torch.device("cpu"), node=0)
    return store


def _write(store: FlashStore, rank: int, step: int) -> None:
    state = {"w": torch.full((4,), float(10 * step + rank))}
    store.write(step=step, capture=lambda: (state, set()), fingerprint={"strategy": "test"})


def _parts(rank: int, world: int, tmp_dir: str) -> dict[str, Any]:
    tmp = Path(tmp_dir)
    store = _store(tmp, rank)
    store.start_lineage()
    for step in (2, 4, 6):
        _write(store, rank, step)
    store.close(failed=True)  # a crash: the memory slots stay
    torch.distributed.barrier()
    slots = sorted((tmp / f"shm{rank}").rglob("slot*.meta"))
    out: dict[str, Any] = {"slots_before": len(slots)}
    if rank == 1:  # rank 1's newest snapshot is gone (no replica, no disk copy)
        for meta in slots:
            if _step(meta) == 6:
                meta.unlink()
    torch.distributed.barrier()
    store = _store(tmp, rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = store.find()
    assert found is not None
    out["step"], out["w"] = found.step, found.state["w"]
    out["warnings"] = [str(w.message) for w in caught]
    out["slots_after"] = len(sorted((tmp / f"shm{rank}").rglob("slot*.meta")))
    store.close(failed=True)
    torch.distributed.barrier()
    # rank 1 loses its whole node's memory; rank 0 holds a copy of rank 1's folder (as a replica would)
    if rank == 1:
        source = next((tmp / "shm1").rglob("rank00001"))
        target = next((tmp / "shm0").rglob("rank00000")).parent / "replica_rank00001"
        shutil.copytree(source, target)
        shutil.rmtree(tmp / "shm1")
    torch.distributed.barrier()
    store = _store(tmp, rank)
    found = store.find()
    assert found is not None
    out["moved"] = (found.step, found.state["w"], found.sources)
    store.close(failed=False)
    with pytest.warns(UserWarning, match=r"replicas=1 needs 2 nodes .* runs on 1; keeping 0 replica"):
        _store(tmp / "replicas", rank, replicas=1).close(failed=False)
    torch.distributed.barrier()  # both ranks' closes are done: no folder is removed under the listing
    out["replica_files"] = sorted(p.name for p in (tmp / "replicas").rglob("*.bin"))
    return out


def _step(meta: Path) -> int:
    return int(pickle.loads(meta.read_bytes())["step"])


def test_missing_parts_are_named_sent_or_skipped(tmp_path: Path) -> None:
    r0, r1 = run_distributed(_parts, 2, str(tmp_path))
    # the newest snapshot lacks rank 1's part everywhere: named, skipped, nothing deleted
    assert r0["step"] == r1["step"] == 4
    assert torch.equal(r0["w"], torch.full((4,), 40.0)) and torch.equal(r1["w"], torch.full((4,), 41.0))
    text = " ".join(r0["warnings"])
    assert "step 6" in text and "no copy of rank(s) [1]" in text and "nothing deleted" in text, text
    assert r0["slots_after"] == r0["slots_before"] and r1["slots_after"] == r1["slots_before"] - 1
    # rank 1's part comes from rank 0's memory (a replica folder), sent over the group
    for rank, r in enumerate((r0, r1)):
        step, w, sources = r["moved"]
        assert step == 4 and torch.equal(w, torch.full((4,), 40.0 + rank)), r["moved"]
        assert sources[0].startswith("memory") and sources[1] == "rank 0's memory", sources
    assert r0["replica_files"] == r1["replica_files"] == []
