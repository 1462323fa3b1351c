"""Flash checkpoints piece by piece, and failures inside a running job (forked Gloo ranks, no torchrun).

* The flat snapshot format, the shared-memory slots' commit protocol and the disk store's atomic writes,
  checksums and retention.
* A full disk (an injected ``ENOSPC`` from step 6 on one rank): training goes on, the error is reported,
  earlier checkpoints stay intact; then a truncated file on one rank and a corrupted one on the other:
  both are named and skipped, the resume falls back to an older snapshot, and the final weights still
  equal an uninterrupted run; a job of another world size is refused with a clear message.
* Bad input: an unwritable dirpath, no room in ``/dev/shm`` (snapshots staged on disk, with a warning, and
  resumed from there), a snapshot of another model: clear messages, nothing deleted.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import warnings
from collections import namedtuple
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_par.callbacks import (
    FlashCheckpoint,
    HangWatchdog,
    LossGuard,
    NodeHealthCheck,
    StragglerDetector,
    snapshot,
)
from lightning_par.callbacks import disk as disk_module
from lightning_par.callbacks import memory as memory_module
from lightning_par.callbacks.disk import CorruptSnapshot, DiskStore
from lightning_par.callbacks.memory import MemoryStore, NoRoom
from lightning_par.callbacks.watchdog import thread_stacks
from lightning_par.models import GPTModule
from tests import fault_job
from tests.distributed import run_distributed

Pair = namedtuple("Pair", "a b")


# ---------------------------------------------------------------------------------------------- formats
def test_snapshot_round_trip_keeps_structure_values_and_ties() -> None:
    w = torch.randn(4, 3)
    state = {
        "w": w,
        "tied": w,  # the same tensor twice: one slot
        "t": w.t(),  # a non-contiguous view: its own contiguous slot
        "flags": torch.tensor([True, False]),
        "step": torch.tensor(7.0),
        "half": torch.arange(5, dtype=torch.bfloat16),
        "pair": Pair(1, [torch.ones(2, dtype=torch.int64), "x"]),
        "plain": {"lr": 0.1, "name": "adam"},
    }
    plan = snapshot.plan(state)
    assert len(plan.sources) == len(plan.slots) == 6
    assert all(s.offset % snapshot.ALIGN == 0 for s in plan.slots)
    buffer = torch.zeros(plan.nbytes, dtype=torch.uint8)
    snapshot.copy_into(buffer, plan, range(len(plan.sources)))
    original = w.clone()
    w.add_(1)  # the snapshot is a copy, not a view of the live tensors
    back = snapshot.read(buffer, plan.index(), clone=True)
    assert torch.equal(back["w"], original) and back["tied"] is back["w"]
    assert torch.equal(back["t"], original.t()) and torch.equal(back["flags"], state["flags"])
    assert back["step"].item() == 7.0 and back["half"].dtype == torch.bfloat16
    assert isinstance(back["pair"], Pair) and back["pair"].b[1] == "x" and back["plain"] == state["plain"]
    with pytest.raises(TypeError, match="only dense torch tensors"):
        snapshot.plan({"s": torch.eye(2).to_sparse()})


def test_memory_slots_commit_protocol_and_no_room(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore(tmp_path / "rank00000", slots=2)
    for step in (2, 4):
        k = store.choose()
        assert k is not None
        store.invalidate(k)
        store.reserve(k, 1000).fill_(step)
        store.commit(k, {"format": snapshot.FORMAT_VERSION, "step": step, "lineage": "l", "nbytes": 1000})
    assert [h["step"] for h in store.headers()] == [2, 4]
    k = store.choose()  # the oldest complete slot is overwritten, never the newest
    assert k is not None and store.header(k)["step"] == 2  # type: ignore[index]
    store.invalidate(k)  # a copy interrupted here leaves only step 4
    store.close()
    again = MemoryStore(tmp_path / "rank00000", slots=2)  # a restarted process
    assert [h["step"] for h in again.headers()] == [4]
    assert again.find("l", 4) is not None and again.find("l", 2) is None
    again.remove()
    assert not (tmp_path / "rank00000").exists()

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(memory_module.os, "posix_fallocate", full)
    with pytest.raises(NoRoom, match="cannot reserve"):
        MemoryStore(tmp_path / "small", slots=1).reserve(0, 10_000)


def test_disk_store_atomic_writes_checksums_and_retention(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = snapshot.plan({"x": torch.arange(1000, dtype=torch.float32)})
    buffer = torch.zeros(plan.nbytes, dtype=torch.uint8)
    snapshot.copy_into(buffer, plan, [0])
    store = DiskStore(tmp_path, rank=0)

    def header(step: int) -> dict[str, Any]:
        return {"format": 1, "step": step, "lineage": "ab", "nbytes": plan.nbytes, "index": plan.index()}

    for step in (2, 4, 6):
        store.write(header(step), memoryview(buffer.numpy()))
    assert sorted(h["step"] for h in store.headers()) == [2, 4, 6]
    loaded = store.load(next(h for h in store.headers() if h["step"] == 6))
    assert torch.equal(loaded["x"], torch.arange(1000, dtype=torch.float32))

    # a failing write (full disk) leaves no partial file and the earlier snapshots intact
    def full(fd: int, data: memoryview) -> None:
        raise OSError(errno.ENOSPC, "full")

    monkeypatch.setattr(disk_module, "write_bytes", full)
    with pytest.raises(OSError, match="full"):
        store.write(header(8), memoryview(buffer.numpy()))
    monkeypatch.undo()
    assert not store.step_dir("ab", 8).exists() and sorted(h["step"] for h in store.headers()) == [2, 4, 6]
    # retention: keep the last 1, plus everything from the newest step all ranks have (4) on
    store.retain(lineage="ab", keep_last=1, safe_step=4)
    assert sorted(h["step"] for h in store.headers()) == [4, 6]
    # corruption is detected and named
    data = store.step_dir("ab", 6) / "rank00000.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptSnapshot, match="checksum mismatch") as info:
        store.load(next(h for h in store.headers() if h["step"] == 6))
    assert info.value.path == data
    data.write_bytes(bytes(raw[:-8]))
    with pytest.raises(CorruptSnapshot, match="truncated"):
        store.load(next(h for h in store.headers() if h["step"] == 6))


def test_disk_write_survives_another_rank_removing_the_step_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks share step directories, and a rank whose write failed removes the directory if it is still
    empty: between another rank's mkdir and its open (a race seen in CI, where rank 0 then failed with
    ENOENT). The directory is made again and the write succeeds."""
    plan = snapshot.plan({"x": torch.arange(1000, dtype=torch.float32)})
    buffer = torch.zeros(plan.nbytes, dtype=torch.uint8)
    snapshot.copy_into(buffer, plan, [0])
    store = DiskStore(tmp_path, rank=0)
    header = {"format": 1, "step": 8, "lineage": "ab", "nbytes": plan.nbytes, "index": plan.index()}
    real_open = disk_module.os.open
    raced: list[str] = []

    def raced_open(path: Any, *args: Any) -> int:
        if str(path).endswith("rank00000.bin.tmp") and not raced:
            raced.append(str(path))
            Path(path).parent.rmdir()  # the other rank's cleanup, just before our open
        return real_open(path, *args)

    monkeypatch.setattr(disk_module.os, "open", raced_open)
    store.write(header, memoryview(buffer.numpy()))
    monkeypatch.undo()
    assert raced and [h["step"] for h in store.headers()] == [8]
    loaded = store.load(store.headers()[0])
    assert torch.equal(loaded["x"], torch.arange(1000, dtype=torch.float32))


def test_disk_write_survives_the_step_directory_vanishing_inside_mkdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same race one step earlier (seen once in CI, a full disk on rank 1): another rank makes the
    step directory, so our ``mkdir`` fails with EEXIST, and removes it before ``exist_ok`` looks, so
    ``Path.mkdir`` raises ``FileExistsError`` for a directory that no longer exists. Made again."""
    plan = snapshot.plan({"x": torch.arange(10, dtype=torch.float32)})
    buffer = torch.zeros(plan.nbytes, dtype=torch.uint8)
    snapshot.copy_into(buffer, plan, [0])
    store = DiskStore(tmp_path, rank=0)
    header = {"format": 1, "step": 6, "lineage": "ab", "nbytes": plan.nbytes, "index": plan.index()}
    real_mkdir = Path.mkdir
    raced: list[Path] = []

    def raced_mkdir(self: Path, *args: Any, **kwargs: Any) -> None:
        if self.name.startswith("step-") and not raced:
            raced.append(self)
            raise FileExistsError(17, "File exists", str(self))  # made and removed by the other rank
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", raced_mkdir)
    store.write(header, memoryview(buffer.numpy()))
    monkeypatch.undo()
    assert raced and [h["step"] for h in store.headers()] == [6]
    assert torch.equal(store.load(store.headers()[0])["x"], torch.arange(10, dtype=torch.float32))


def test_options_are_checked_with_clear_errors() -> None:
    with pytest.raises(ValueError, match="must be a multiple of every_n_steps=4"):
        FlashCheckpoint("x", every_n_steps=4, persist_every_n_steps=10)
    with pytest.raises(ValueError, match="snapshot_copy must be one of"):
        FlashCheckpoint("x", snapshot_copy="lazy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="memory_slots must be 1 or 2"):
        FlashCheckpoint("x", memory_slots=3)
    with pytest.raises(ValueError, match="action must be one of"):
        NodeHealthCheck(action="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="action must be one of"):
        LossGuard(action="retry")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"exit_code must be an integer in 1\.\.255"):
        HangWatchdog(exit_code=0)
    # wrong types named (before: "'>' not supported between instances of 'str' and 'int'", and torch's
    # "expected str, bytes or os.PathLike object, not NoneType")
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds > 0, got '10'"):
        HangWatchdog(timeout_s="10")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dirpath must name a directory \(a str or path\), got None"):
        FlashCheckpoint(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="slow_factor must be > 1"):
        StragglerDetector(slow_factor=1.0)
    assert "test_options_are_checked_with_clear_errors" in thread_stacks()


# ------------------------------------------------------------------------------------- single process
class Crash(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("injected crash")


def _fit(
    steps: int,
    callbacks: list[pl.Callback],
    *,
    n_embd: int = 32,
    devices: int = 1,
    strategy: str = "zero2",
    accumulate: int = 1,
    schedule_steps: int | None = None,
) -> GPTModule:
    torch.set_num_threads(1)
    pl.seed_everything(7, verbose=False)
    model = {**fault_job.MODEL, "n_embd": n_embd}
    module = GPTModule(**model, warmup_steps=2, max_steps=schedule_steps or steps)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="auto" if devices == 1 else strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
        accumulate_grad_batches=accumulate,
    )
    data = fault_job.Tokens(fault_job.SAMPLES // 2)
    if devices == 1:  # an order that follows (seed, epoch), as the DistributedSampler of several processes
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=7)
        loader = DataLoader(data, batch_size=2, sampler=sampler)
    else:
        loader = DataLoader(data, batch_size=2, shuffle=True)
    trainer.fit(module, loader)
    return module


def test_bad_dirpath_no_room_in_shm_and_another_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(OSError, match=r"cannot write snapshots to dirpath=.*Pass a writable directory"):
        _fit(4, [FlashCheckpoint(blocker / "ckpt", every_n_steps=2, persist_every_n_steps=2)])

    shm, dirpath = tmp_path / "shm", tmp_path / "ckpt"
    real_usage = shutil.disk_usage

    def usage(path: Any) -> Any:
        return real_usage(path)._replace(free=0) if str(path).startswith(str(shm)) else real_usage(path)

    monkeypatch.setattr(memory_module.shutil, "disk_usage", usage)  # /dev/shm is full
    flash = FlashCheckpoint(dirpath, every_n_steps=2, persist_every_n_steps=4, shm_dir=shm)
    full = pytest.warns(UserWarning, match=r"no room in .*staging the memory snapshots on disk")
    with full, pytest.raises(RuntimeError, match="injected crash"):
        _fit(10, [flash, Crash(7)])
    assert (dirpath / ".staging" / "rank00000" / "slot0.meta").exists()
    resumed = FlashCheckpoint(dirpath, every_n_steps=2, persist_every_n_steps=4, shm_dir=shm)
    weights = _fit(10, [resumed]).state_dict()
    assert resumed.resumed is not None and resumed.resumed["step"] == 6, resumed.resumed
    assert ".staging" in resumed.resumed["sources"][0]
    reference = _fit(10, []).state_dict()
    assert all(torch.equal(weights[k], v) for k, v in reference.items())
    monkeypatch.undo()

    before = sorted(p.relative_to(dirpath) for p in dirpath.rglob("*"))
    with pytest.raises(ValueError, match=r"written by another model or layout: parameters shapes: .*Nothing"):
        _fit(10, [FlashCheckpoint(dirpath, every_n_steps=2, persist_every_n_steps=4, shm_dir=shm)], n_embd=64)
    assert sorted(p.relative_to(dirpath) for p in dirpath.rglob("*")) == before, "something was deleted"


def test_a_finished_run_leaves_its_newest_snapshot_on_disk(tmp_path: Path) -> None:
    """A run that ends cleanly frees its shared memory, so its newest snapshot (step 6; only step 4 was a
    persist step) is flushed to disk first: running it again with more steps continues from step 6."""
    dirpath, shm = tmp_path / "ckpt", tmp_path / "shm"
    handler = signal.getsignal(signal.SIGTERM)
    _fit(6, [FlashCheckpoint(dirpath, every_n_steps=2, persist_every_n_steps=4, shm_dir=shm)])
    assert sorted(h["step"] for h in DiskStore(dirpath, rank=0).headers()) == [4, 6]
    assert not list(shm.rglob("*/*")), "a finished run keeps no shared memory, nor an empty job folder"
    # the process's SIGTERM handler is the one from before the fit (before, the finished Trainer's,
    # nesting one more per fit: every Trainer stayed alive and SIGTERM no longer ended the process)
    assert signal.getsignal(signal.SIGTERM) == handler
    again = FlashCheckpoint(dirpath, every_n_steps=2, persist_every_n_steps=4, shm_dir=shm)
    _fit(8, [again])
    assert again.resumed is not None and again.resumed["step"] == 6, again.resumed
    assert all(s.startswith("disk") for s in again.resumed["sources"])
    assert signal.getsignal(signal.SIGTERM) == handler


def test_snapshots_close_accumulation_windows_only(tmp_path: Path) -> None:
    """With 3 micro-batches per step, snapshots are taken once per window, after its optimizer step (the
    global step moved), never mid-window: a run stopped at step 4 and resumed to 6 from its snapshot
    equals an uninterrupted 6-step run exactly."""
    reference = _fit(6, [], accumulate=3).state_dict()
    dirpath, shm = tmp_path / "ckpt", tmp_path / "shm"
    first = FlashCheckpoint(dirpath, every_n_steps=2, persist_every_n_steps=2, shm_dir=shm)
    _fit(4, [first], accumulate=3, schedule_steps=6)  # stopped early, on the 6-step LR schedule
    assert [r["step"] for r in first.stats] == [2, 4], first.stats
    again = FlashCheckpoint(dirpath, every_n_steps=2, persist_every_n_steps=2, shm_dir=shm)
    resumed = _fit(6, [again], accumulate=3).state_dict()
    assert again.resumed is not None and again.resumed["step"] == 4, again.resumed
    for name, value in reference.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=name)


# -------------------------------------------------------------------------------------- forked ranks
def _full_disk_then_corruption(rank: int, world: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {"reference": _fit(10, [], devices=2).state_dict()}
    dirpath, shm = Path(tmp) / "ckpt", Path(tmp) / f"shm{rank}"
    real = disk_module.write_bytes

    def full_disk(fd: int, data: memoryview) -> None:
        step = int(re.search(r"step-(\d+)-", os.readlink(f"/proc/self/fd/{fd}")).group(1))  # type: ignore[union-attr]
        if step >= 6:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)

    if rank == 1:  # the disk fills up from step 6 on
        disk_module.write_bytes = full_disk
    flash = FlashCheckpoint(dirpath, every_n_steps=2, persist_every_n_steps=2, keep_last=4, shm_dir=shm)
    try:
        _fit(8, [flash], devices=2)
    finally:
        disk_module.write_bytes = real
    out["errors"] = list(flash.errors)
    out["steps_on_disk"] = sorted(h["step"] for h in DiskStore(dirpath, rank=rank).headers())
    torch.distributed.barrier()
    # the newest snapshot both ranks completed (step 4): truncated on rank 0, corrupted on rank 1
    data = next(dirpath.glob(f"step-000000004-*/rank{rank:05d}.bin"))
    raw = bytearray(data.read_bytes())
    if rank == 0:
        data.write_bytes(bytes(raw[:-16]))
    else:
        raw[0] ^= 0xFF
        data.write_bytes(bytes(raw))
    resumed = FlashCheckpoint(dirpath, every_n_steps=2, persist_every_n_steps=2, keep_last=4, shm_dir=shm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["weights"] = _fit(10, [resumed], devices=2).state_dict()
    out["warnings"] = [str(w.message) for w in caught]
    out["resumed"] = resumed.resumed
    return out


def test_full_disk_and_corrupt_files_are_survived(tmp_path: Path) -> None:
    results = run_distributed(_full_disk_then_corruption, 2, str(tmp_path), init_group=False)
    r0, r1 = results
    # rank 1: steps 6 and 8 failed, and so did the flush of step 8 when fit ended (it is retried there)
    assert r0["errors"] == [] and len(r1["errors"]) == 3, r1["errors"]
    assert "step 8" in r1["errors"][2]
    assert "No space left on device" in r1["errors"][0] and "Training continues" in r1["errors"][0]
    assert "previous checkpoint on disk (step 4) is intact" in r1["errors"][0]
    assert r0["steps_on_disk"] == [2, 4, 6, 8] and r1["steps_on_disk"] == [2, 4], results
    text = " ".join(r0["warnings"])
    assert "not complete on every rank" in text and "step 8" in text  # only rank 0 has 6 and 8
    assert "rank00000.bin" in text and "truncated" in text
    assert "rank00001.bin" in text and "checksum mismatch" in text
    for r in results:
        assert r["resumed"]["step"] == 2 and all(s.startswith("disk") for s in r["resumed"]["sources"])
        assert all(torch.equal(r["weights"][k], v) for k, v in r["reference"].items())
    # a job of another world size would be resharded, but another strategy is refused before anything is
    # loaded or deleted
    before = sorted((tmp_path / "ckpt").rglob("*"))
    refused = r"another model or layout: strategy: snapshot HybridParallelStrategy, now SingleDeviceStrategy"
    with pytest.raises(ValueError, match=refused):
        _fit(10, [FlashCheckpoint(tmp_path / "ckpt", shm_dir=tmp_path / "shm0")])
    assert sorted((tmp_path / "ckpt").rglob("*")) == before


def _ddp_epoch_boundary(rank: int, world: int, tmp: str) -> dict[str, Any]:
    reference = _fit(10, [], devices=2, strategy="ddp").state_dict()
    flash = FlashCheckpoint(
        Path(tmp) / "ckpt", every_n_steps=3, persist_every_n_steps=6, shm_dir=Path(tmp) / "shm"
    )
    with pytest.raises(RuntimeError, match="injected crash"):
        _fit(10, [flash, Crash(7)], devices=2, strategy="ddp")  # an epoch is 6 steps: snapshot 6 ends it
    resumed = FlashCheckpoint(
        Path(tmp) / "ckpt", every_n_steps=3, persist_every_n_steps=6, shm_dir=Path(tmp) / "shm"
    )
    weights = _fit(10, [resumed], devices=2, strategy="ddp").state_dict()
    return {"same": all(torch.equal(weights[k], v) for k, v in reference.items()), "resumed": resumed.resumed}


def test_lightning_ddp_resumes_at_an_epoch_boundary(tmp_path: Path) -> None:
    for r in run_distributed(_ddp_epoch_boundary, 2, str(tmp_path), init_group=False):
        assert r["resumed"]["step"] == 6 and r["resumed"]["data"] == "nothing to reposition", r["resumed"]
        assert all(s.startswith("memory") for s in r["resumed"]["sources"])
        assert r["same"], "the resumed DDP run differs from the uninterrupted one"
