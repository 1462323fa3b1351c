"""The files of a sharded checkpoint: CRC-32 manifest and damage detection, atomic overwrite through a
staging directory (crash at every step of a save), weights-only saves, and the consolidation CLI.

Checkpoints are made once, by real 2-rank Lightning fits at ZeRO stage 2 (module fixture); the crash
and damage cases then run in this process on copies, calling the save functions directly (ranks as
threads with a real barrier, or one after the other where no barrier is involved).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import warnings
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.checkpoint import consolidate_cli, sharded
from lightning_par.checkpoint import io as checkpoint_io
from lightning_par.checkpoint.export import consolidate
from lightning_par.checkpoint.io import save_sharded
from lightning_par.checkpoint.sharded import (
    COMPLETE_FILE,
    META_FILE,
    is_sharded_checkpoint,
    mark_complete,
    prepare_staging,
    previous_dir,
    rank_file,
    read_meta,
    read_optimizer_records,
    resolve_checkpoint_dir,
    staging_dir,
    swap_into_place,
    write_meta,
    write_rank_file,
)
from lightning_par.models import GPTModule
from tests.distributed import run_distributed
from tests.test_strategy import MICRO, N_SAMPLES, STEPS_PER_EPOCH, WORLD, Tokens, _module, _trainer

REPO = Path(__file__).resolve().parents[1]
FIRST_STEP = STEPS_PER_EPOCH  # after fit 1 (one epoch)
SECOND_STEP = 2 * STEPS_PER_EPOCH  # after fit 2 (resumed, two epochs)


# ---------------------------------------------------------------------------------------------- fixture
def _state(module: pl.LightningModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _fits(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Fit 1 (stage 2, one epoch): ``ckpt/last.ckpt`` overwritten after every step, a weights-only
    checkpoint at the epoch's end, then ``manual.ckpt`` by ``trainer.save_checkpoint``. Fit 2 resumes
    from ``manual.ckpt``, trains a second epoch and saves ``manual.ckpt`` again over the first."""
    loader = DataLoader(Tokens(N_SAMPLES), batch_size=MICRO, shuffle=True)
    manual = os.path.join(tmp, "manual.ckpt")
    callbacks: list[pl.Callback] = [
        ModelCheckpoint(dirpath=os.path.join(tmp, "ckpt"), save_last=True, every_n_train_steps=1),
        ModelCheckpoint(dirpath=os.path.join(tmp, "weights"), save_weights_only=True, every_n_epochs=1),
    ]
    module = _module()
    trainer = _trainer(HybridParallelStrategy(zero_stage=2), 1, tmp, callbacks, world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader)
        trainer.save_checkpoint(manual)
    notes = [str(w.message) for w in caught if "checkpoints are directories" in str(w.message)]
    first = {"step": trainer.global_step, "state": _state(module), "notes": notes}

    module = _module()
    trainer = _trainer(HybridParallelStrategy(zero_stage=2), 2, tmp, [], world)
    trainer.fit(module, loader, ckpt_path=manual)
    trainer.save_checkpoint(manual)
    return {"first": first, "second": {"step": trainer.global_step, "state": _state(module)}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("fits")
    results = run_distributed(_fits, WORLD, str(tmp), init_group=False)
    out = results[0]
    weights = [p for p in (tmp / "weights").iterdir() if p.name.endswith(".ckpt")]
    assert len(weights) == 1, weights
    out.update(last=tmp / "ckpt" / "last.ckpt", manual=tmp / "manual.ckpt", weights=weights[0], root=tmp)
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _assert_state(got: dict[str, Any], ref: dict[str, torch.Tensor], what: str) -> None:
    assert set(ref) <= set(got), (what, sorted(set(ref) - set(got)))
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, msg=f"{what}: {k}")


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(path.name) and p != path)


def _contents(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """meta and rank payloads of a checkpoint, to save them again elsewhere."""
    meta = read_meta(path)
    payloads = [torch.load(path / rank_file(r), weights_only=False) for r in range(WORLD)]
    return meta, payloads


def _save_as_ranks(
    meta: dict[str, Any], payloads: list[dict[str, Any]], path: Path
) -> list[BaseException | None]:
    """``save_sharded`` on WORLD threads sharing a real barrier, as the ranks of a job; an exception on
    one rank breaks the barrier for the others (a crashed job). Returns each rank's exception."""
    barrier = threading.Barrier(WORLD, timeout=60)
    errors: list[BaseException | None] = [None] * WORLD

    def rank(r: int) -> None:
        try:
            save_sharded(
                dict(meta), path, payload=payloads[r], rank=r, world_size=WORLD, barrier=barrier.wait
            )
        except BaseException as exc:
            errors[r] = exc
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


@contextmanager
def _fail_on_call(owner: Any, name: str, n: int, exc: BaseException) -> Iterator[mock.MagicMock]:
    """Patch ``owner.name`` so that its ``n``-th call (1-based) raises ``exc`` (a crash at that point);
    the other calls go through to the real function."""
    original: Callable[..., Any] = getattr(owner, name)
    calls = [0]

    def side_effect(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == n:
            raise exc
        return original(*args, **kwargs)

    with mock.patch.object(owner, name, side_effect=side_effect) as patched:
        yield patched


# ---------------------------------------------------------------------------------------------- (a)
def test_overwritten_checkpoints_hold_the_last_save_and_a_manifest(trained: dict[str, Any]) -> None:
    first, second = trained["first"], trained["second"]
    assert (first["step"], second["step"]) == (FIRST_STEP, SECOND_STEP)
    # manual.ckpt: saved at step 4, then again at step 8 by the resumed run (which loaded step 4 from it)
    manual: Path = trained["manual"]
    assert read_meta(manual)["global_step"] == SECOND_STEP
    _assert_state(consolidate(manual)["state_dict"], second["state"], "manual.ckpt")
    # last.ckpt: overwritten after each of the 4 steps by ModelCheckpoint, holds the last
    last: Path = trained["last"]
    assert read_meta(last)["global_step"] == FIRST_STEP
    _assert_state(consolidate(last)["state_dict"], first["state"], "last.ckpt")
    # no staging directory, no .previous, no per-file .crc or .tmp left behind
    for path in (manual, last):
        assert _siblings(path) == []
        assert sorted(p.name for p in path.iterdir()) == sorted(
            [META_FILE, COMPLETE_FILE, rank_file(0), rank_file(1)]
        )
    assert sorted(p.name for p in last.parent.iterdir()) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    # COMPLETE: world size first (what older readers parse), then sizes and CRC-32s of every file
    first_line, manifest = (manual / COMPLETE_FILE).read_text().split("\n", 1)
    assert first_line == str(WORLD)
    files = json.loads(manifest)["files"]
    assert set(files) == {META_FILE, rank_file(0), rank_file(1)}
    for name, digest in files.items():
        data = (manual / name).read_bytes()
        assert digest == {"size": len(data), "crc32": zlib.crc32(data)}, name


# ---------------------------------------------------------------------------------------------- (b)
def test_a_crashed_save_leaves_the_previous_checkpoint(trained: dict[str, Any], tmp_path: Path) -> None:
    old = consolidate(trained["last"])
    target = _copy(trained["last"], tmp_path / "model.ckpt")  # step 4, complete
    meta, payloads = _contents(trained["manual"])  # step 8, saved over it
    staging = staging_dir(target, step=SECOND_STEP)

    def assert_still_old(what: str) -> None:
        assert read_meta(target)["global_step"] == FIRST_STEP, what
        full = consolidate(target)
        _assert_state(full["state_dict"], old["state_dict"], what)
        for got, ref in zip(full["optimizer_states"], old["optimizer_states"], strict=True):
            for index, state in ref["state"].items():
                _assert_state(got["state"][index], state, f"{what}: optimizer state {index}")

    # 1) crash while writing: rank 0 dies writing meta.pt after both rank files are written
    with _fail_on_call(checkpoint_io, "write_meta", 1, OSError(28, "No space left on device")):
        errors = _save_as_ranks(meta, payloads, target)
    assert isinstance(errors[0], OSError) and errors[1] is not None
    assert (staging / rank_file(0)).is_file() and not (staging / COMPLETE_FILE).exists()
    assert_still_old("crash while writing")

    # 2) crash after the staging directory is complete, before the swap
    with _fail_on_call(checkpoint_io, "swap_into_place", 1, OSError("killed")):
        errors = _save_as_ranks(meta, payloads, target)
    assert isinstance(errors[0], OSError)
    assert (staging / COMPLETE_FILE).is_file()
    assert_still_old("crash before the swap")

    # 3) crash after both renames, before the old checkpoint is deleted: the new one is in place
    # (fsync_dir: 1st call in mark_complete, 2nd in the swap, between the renames and the deletion)
    with _fail_on_call(sharded, "fsync_dir", 2, OSError("killed")):
        errors = _save_as_ranks(meta, payloads, target)
    assert isinstance(errors[0], OSError)
    assert previous_dir(target).is_dir()
    assert read_meta(target)["global_step"] == SECOND_STEP
    _assert_state(consolidate(target)["state_dict"], trained["second"]["state"], "after the swap")

    # the next save cleans up: the stale .previous and the staging directories of the crashed saves
    (tmp_path / f"model.ckpt.partial-step{FIRST_STEP:09d}").mkdir()  # a crash at another step
    assert _save_as_ranks(meta, payloads, target) == [None, None]
    assert _siblings(target) == []
    assert read_meta(target)["global_step"] == SECOND_STEP


def test_a_single_file_checkpoint_is_replaced_only_once_the_directory_is_complete(
    trained: dict[str, Any], tmp_path: Path
) -> None:
    meta, payloads = _contents(trained["manual"])
    target = tmp_path / "model.ckpt"
    torch.save({"global_step": 1, "state_dict": {}}, target)  # e.g. a stage-0 checkpoint, same name
    with _fail_on_call(checkpoint_io, "mark_complete", 1, OSError("killed")):
        errors = _save_as_ranks(meta, payloads, target)
    assert errors[0] is not None
    assert torch.load(target, weights_only=False)["global_step"] == 1  # untouched
    assert _save_as_ranks(meta, payloads, target) == [None, None]
    assert is_sharded_checkpoint(target) and read_meta(target)["global_step"] == SECOND_STEP
    assert _siblings(target) == []


# ---------------------------------------------------------------------------------------------- (c)
def test_a_crash_between_the_renames_falls_back_to_previous(trained: dict[str, Any], tmp_path: Path) -> None:
    old = consolidate(trained["last"])
    target = _copy(trained["last"], tmp_path / "model.ckpt")
    meta, payloads = _contents(trained["manual"])
    # the ranks' writes one after the other (no barrier needed), then the swap dies at its second rename
    staging = staging_dir(target, step=SECOND_STEP)
    prepare_staging(target, staging=staging)
    for r in range(WORLD):
        write_rank_file(staging, r, payloads[r])
    write_meta(staging, meta)
    mark_complete(staging, WORLD)
    with _fail_on_call(os, "replace", 2, OSError("killed")), pytest.raises(OSError, match="killed"):
        swap_into_place(staging, path=target)
    previous = previous_dir(target)
    assert not target.exists() and previous.is_dir() and staging.is_dir()

    message = rf"{target} is missing but {previous} exists.*{previous} \(the previous checkpoint\)"
    with pytest.warns(UserWarning, match=message):
        assert resolve_checkpoint_dir(target) == previous
    with pytest.warns(UserWarning, match=message):
        assert is_sharded_checkpoint(target)
    with pytest.warns(UserWarning, match=message):
        assert read_meta(target)["global_step"] == FIRST_STEP
    with pytest.warns(UserWarning, match=message):
        _assert_state(consolidate(target)["state_dict"], old["state_dict"], "fallback to .previous")

    # the next save puts the new checkpoint at the path and only then deletes .previous
    assert _save_as_ranks(meta, payloads, target) == [None, None]
    assert _siblings(target) == []
    assert read_meta(target)["global_step"] == SECOND_STEP


# ---------------------------------------------------------------------------------------------- (d)
@pytest.mark.parametrize("name", [rank_file(1), META_FILE])
def test_damaged_files_are_named(trained: dict[str, Any], tmp_path: Path, name: str) -> None:
    truncated = _copy(trained["manual"], tmp_path / "truncated.ckpt")
    size = (truncated / name).stat().st_size
    os.truncate(truncated / name, size - 7)
    message = (
        rf"truncated\.ckpt: {name} is {size - 7} bytes, but {size} bytes were written \(the file was"
        r" truncated.*The checkpoint is damaged: load an earlier one\."
    )
    with pytest.raises(ValueError, match=message):
        consolidate(truncated)

    flipped = _copy(trained["manual"], tmp_path / "flipped.ckpt")
    data = bytearray((flipped / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (flipped / name).write_bytes(bytes(data))
    message = (
        rf"flipped\.ckpt: {name} fails its checksum \(CRC-32 [0-9a-f]{{8}}, but [0-9a-f]{{8}} was written"
        r".*The checkpoint is damaged: load an earlier one\."
    )
    with pytest.raises(ValueError, match=message):
        read_meta(flipped) if name == META_FILE else read_optimizer_records(flipped)

    # a checkpoint whose COMPLETE holds only the world size (before manifests) is read without checks
    legacy = _copy(trained["manual"], tmp_path / "legacy.ckpt")
    (legacy / COMPLETE_FILE).write_text(f"{WORLD}\n")
    _assert_state(consolidate(legacy)["state_dict"], trained["second"]["state"], "legacy COMPLETE")
    # ... and a truncated file there still fails with its name, not only torch's zip error
    os.truncate(legacy / name, size - 7)
    with pytest.raises(ValueError, match=rf"legacy\.ckpt: {name} is unreadable .*load an earlier one"):
        consolidate(legacy)


def test_missing_rank_file_and_incomplete_checkpoint_keep_their_errors(
    trained: dict[str, Any], tmp_path: Path
) -> None:
    no_meta = _copy(trained["manual"], tmp_path / "no_meta.ckpt")
    (no_meta / META_FILE).unlink()  # still ours: its reader names the file (before: IsADirectoryError)
    assert is_sharded_checkpoint(no_meta)
    with pytest.raises(ValueError, match=rf"no_meta\.ckpt lacks {META_FILE}\. The checkpoint is damaged"):
        consolidate(no_meta)
    ckpt = _copy(trained["manual"], tmp_path / "model.ckpt")
    (ckpt / rank_file(1)).unlink()
    with pytest.raises(ValueError, match=rf"lacks {rank_file(1)} although it was saved by 2 ranks"):
        consolidate(ckpt)
    (ckpt / COMPLETE_FILE).unlink()
    with pytest.raises(ValueError, match="incomplete sharded checkpoint"):
        read_meta(ckpt)


# ---------------------------------------------------------------------------------------------- (e)
def test_sharded_saves_say_how_to_open_them_elsewhere(trained: dict[str, Any]) -> None:
    """A user porting a ``"ddp"`` project met Lightning's bare ``IsADirectoryError`` in
    ``load_from_checkpoint``; the first sharded save now says what opens the directory (rank 0)."""
    (note, *_) = trained["first"]["notes"]
    assert "lightning-par-consolidate" in note and "save_distributed_checkpoint=False" in note, note
    assert "load_from_checkpoint" in note, note


def test_weights_only_checkpoints_hold_no_optimizer_state(trained: dict[str, Any]) -> None:
    """At ZeRO-2 in fp32 every rank holds the whole model, whose parameters are the masters: a weights-only
    checkpoint is one Lightning file, as "ddp" writes it, which ``load_from_checkpoint`` reads in a plain
    process (before, a directory of rank files: IsADirectoryError there). Full checkpoints stay sharded."""
    weights: Path = trained["weights"]
    assert weights.is_file() and not is_sharded_checkpoint(weights)
    saved = torch.load(weights, weights_only=True)
    assert "optimizer_states" not in saved and "lr_schedulers" not in saved
    assert saved["global_step"] == FIRST_STEP
    _assert_state(saved["state_dict"], trained["first"]["state"], "weights-only file")
    _assert_state(GPTModule.load_from_checkpoint(weights).state_dict(), trained["first"]["state"], "loaded")
    assert is_sharded_checkpoint(trained["last"])
    for r in range(WORLD):
        full = torch.load(trained["last"] / rank_file(r), weights_only=False)
        assert full["optimizers"][0]["records"], "a full checkpoint does hold optimizer records"


# ---------------------------------------------------------------------------------------------- (f)
def test_consolidate_cli(trained: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manual: Path = trained["manual"]
    ref: dict[str, torch.Tensor] = trained["second"]["state"]
    out = tmp_path / "export" / "model.ckpt"
    assert consolidate_cli.main([str(manual), str(out)]) == 0
    line = capsys.readouterr().out.strip()
    n_params = _module().gpt.num_parameters()
    assert line == (
        f"wrote {out}: {n_params:,} parameters in {len(ref) - 1} tensors, 1 optimizer state(s),"
        f" {out.stat().st_size:,} bytes"
    )  # the tied head/embedding weight is counted once
    full = torch.load(out, weights_only=False)
    _assert_state(full["state_dict"], ref, "CLI torch.load")
    assert full["global_step"] == SECOND_STEP
    assert len(full["optimizer_states"][0]["state"]) == len(list(_module().parameters()))
    _assert_state(GPTModule.load_from_checkpoint(out).state_dict(), ref, "CLI load_from_checkpoint")
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.ckpt"]  # no temp file left

    # errors: one line on stderr, status 2, and OUT untouched
    assert consolidate_cli.main([str(tmp_path / "nowhere"), str(tmp_path / "x.ckpt")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"lightning-par-consolidate: error: {tmp_path / 'nowhere'} is not a sharded checkpoint directory"
        " (it does not exist).\n"
    )
    # a folder of checkpoints (a run's checkpoints/): the message lists them, as for ckpt_path
    assert consolidate_cli.main([str(out.parent), str(tmp_path / "x.ckpt")]) == 2
    assert "is a directory, not a checkpoint" in (err := capsys.readouterr().err) and "model.ckpt" in err, err
    before = out.stat()
    assert consolidate_cli.main([str(manual), str(out)]) == 2
    exists = f"lightning-par-consolidate: error: {out} exists; pass --force to overwrite it.\n"
    assert capsys.readouterr().err == exists
    assert out.stat().st_mtime_ns == before.st_mtime_ns
    # OUT inside DIR: before, --force overwrote meta.pt with the consolidated file, destroying the
    # checkpoint ("meta.pt is ... bytes, but ... bytes were written"); now refused before anything is read
    damaged = _copy(manual, tmp_path / "damaged.ckpt")
    meta = (damaged / META_FILE).read_bytes()
    assert consolidate_cli.main([str(damaged), str(damaged / META_FILE), "--force"]) == 2
    assert "is inside the checkpoint directory" in capsys.readouterr().err
    assert (damaged / META_FILE).read_bytes() == meta
    assert consolidate_cli.main([str(damaged), str(damaged / "new.ckpt")]) == 2
    assert not (damaged / "new.ckpt").exists()
    capsys.readouterr()
    os.truncate(damaged / rank_file(1), 100)
    assert consolidate_cli.main([str(damaged), str(tmp_path / "d.ckpt"), "--force"]) == 2
    err = capsys.readouterr().err
    assert f"{rank_file(1)} is 100 bytes" in err and err.count("\n") == 1
    assert not (tmp_path / "d.ckpt").exists()
    (damaged / COMPLETE_FILE).unlink()
    assert consolidate_cli.main([str(damaged), str(tmp_path / "d.ckpt")]) == 2
    assert "incomplete sharded checkpoint" in capsys.readouterr().err

    # as a separate process (as the console script runs it), weights only, over the existing OUT
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_par.checkpoint.consolidate_cli", str(manual), str(out)]
        + ["--weights-only", "--force"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote {out}: {n_params:,} parameters") and "0 optimizer" in proc.stdout
    slim = torch.load(out, weights_only=False)
    assert "optimizer_states" not in slim and "lr_schedulers" not in slim
    _assert_state(GPTModule.load_from_checkpoint(out).state_dict(), ref, "CLI --weights-only")
    assert out.stat().st_size < before.st_size


def test_consolidate_cli_is_a_console_script() -> None:
    line = 'lightning-par-consolidate = "lightning_par.checkpoint.consolidate_cli:main"'
    scripts = (REPO / "pyproject.toml").read_text().split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    assert line in scripts.splitlines()
    assert callable(consolidate_cli.main)
