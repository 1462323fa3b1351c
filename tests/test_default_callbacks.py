"""The command line's default checkpoint callbacks (conf/callbacks/default.yaml) and ``ckpt_path=last``.

Before: one monitored ``ModelCheckpoint`` with ``save_last=True``, whose ``last.ckpt`` Lightning (2.6)
rewrites only when the best checkpoint changes. A run whose ``val_loss`` got worse kept an old
``last.ckpt``, and ``ckpt_path=last`` went back to it: the resumed run trained those epochs again.
Now ``last.ckpt`` comes from a second, unmonitored callback and follows every validation run.

2 ranks, ZeRO-3 (a sharded ``last.ckpt`` directory, overwritten in place), a Hugging Face Llama whose
validation loss is made to rise every epoch: 2 epochs, then a resume with ``ckpt_path="last"`` to 3,
against 3 epochs uninterrupted.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf
from torch import Tensor
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.resume_path import check_ckpt_path, last_checkpoints
from lightning_par.train import find_config_dir, instantiate_named
from tests.distributed import run_distributed
from tests.fits import final_state
from tests.third_party import LoraLlama, Tokens

STEPS_PER_EPOCH = 4  # 16 samples, 2 ranks, 2 per batch


class WorseEachEpoch(LoraLlama):
    """Its logged ``val_loss`` rises by 10 per epoch, so the best checkpoint stays the first epoch's."""

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten()) + 10.0 * self.current_epoch
        self.log("val_loss", loss, sync_dist=True)
        return loss


class StartStep(pl.Callback):
    def __init__(self) -> None:
        self.step = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step = trainer.global_step


def _callbacks(checkpoint_dir: str) -> list[Any]:
    """The checkpoint callbacks of conf/callbacks/default.yaml as the command line builds them."""
    node = OmegaConf.load(find_config_dir() / "callbacks" / "default.yaml")
    cfg = OmegaConf.create({"paths": {"checkpoint_dir": checkpoint_dir}, "callbacks": node})
    # the checkpoint callbacks only: the learning-rate monitor needs a logger, the progress bar a terminal
    return [cb for cb in instantiate_named("callbacks", cfg.callbacks) if isinstance(cb, ModelCheckpoint)]


def _fit(epochs: int, checkpoint_dir: str, ckpt_path: str | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    module = WorseEachEpoch(lora=False)
    start = StartStep()
    strategy = HybridParallelStrategy(zero_stage=3)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=epochs,
        callbacks=[start, *_callbacks(checkpoint_dir)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
        default_root_dir=checkpoint_dir,
    )
    loader = DataLoader(Tokens(16), batch_size=2, shuffle=True)
    trainer.fit(module, loader, DataLoader(Tokens(4, seed=7), batch_size=2), ckpt_path=ckpt_path)
    names = sorted(p.name for p in Path(checkpoint_dir).iterdir())
    return {"start": start.step, "names": names, "state": final_state(module, strategy)}


def _job(rank: int, world: int, tmp: str) -> dict[str, Any]:
    full = _fit(3, os.path.join(tmp, "full"))
    first = _fit(2, os.path.join(tmp, "resumed"))
    resumed = _fit(3, os.path.join(tmp, "resumed"), ckpt_path="last")
    return {"full": full, "first": first, "resumed": resumed}


def test_last_checkpoint_follows_every_validation_and_resumes_there(tmp_path: Path) -> None:
    results = run_distributed(_job, 2, str(tmp_path), init_group=False, timeout=400)
    r = results[0]
    # the best stays the first epoch's; last.ckpt is the second epoch's, and the resume starts there
    last, best = r["first"]["names"]
    assert last == "last.ckpt" and best.startswith(f"step{STEPS_PER_EPOCH:06d}-"), r["first"]["names"]
    for rank_result in results:
        assert rank_result["resumed"]["start"] == 2 * STEPS_PER_EPOCH
        assert rank_result["full"]["start"] == 0
    full, resumed = r["full"]["state"], r["resumed"]["state"]
    assert full.keys() == resumed.keys()
    for name in full:
        torch.testing.assert_close(resumed[name], full[name], rtol=0, atol=0, msg=name)


def _run(directory: Path, task: str) -> Path:
    """A run directory as Hydra leaves it: its saved config names the task."""
    (directory / ".hydra").mkdir(parents=True)
    (directory / ".hydra" / "config.yaml").write_text(f"task_name: {task}\nseed: 0\n")
    return directory


def test_ckpt_path_last_checks(tmp_path: Path) -> None:
    task = tmp_path / "outputs" / "task"
    run, earlier = _run(task / "2026-02-01_00-00-00", "task"), task / "2026-01-01_00-00-00"
    (run / "checkpoints").mkdir(parents=True)
    last = {"checkpoint_dir": run / "checkpoints", "run_dir": run, "task_name": "task"}
    # no earlier run: passes (the first attempt of a command that always carries ckpt_path=last)
    check_ckpt_path("last", **last)
    (earlier / "checkpoints" / "last.ckpt").mkdir(parents=True)  # a sharded last checkpoint
    check_ckpt_path("last", **last)  # a folder without Hydra's saved config: not known to be a run of it
    _run(earlier, "task")
    with pytest.raises(ValueError, match=f"hydra.run.dir='{earlier}' ckpt_path=last"):
        check_ckpt_path("last", **last)
    # one directory per task (hydra.run.dir=.../${task_name} in a config file): the other tasks' runs
    # beside this one's first run are not its own
    first_task = _run(tmp_path / "per_task" / "first_task", "first_task")
    (first_task / "checkpoints" / "last.ckpt").mkdir(parents=True)
    second = _run(tmp_path / "per_task" / "second_task", "second_task")
    (second / "checkpoints").mkdir()
    check_ckpt_path("last", checkpoint_dir=second / "checkpoints", run_dir=second, task_name="second_task")
    # checkpoints written outside the run directory, or a sweep (no run_dir): not compared
    check_ckpt_path("last", checkpoint_dir=tmp_path / "elsewhere", run_dir=run, task_name="task")
    check_ckpt_path("last")
    # the run's own last checkpoint (last-v1 too): passes
    (run / "checkpoints" / "last-v1.ckpt").write_bytes(b"")
    assert last_checkpoints(run / "checkpoints") == [run / "checkpoints" / "last-v1.ckpt"]
    check_ckpt_path("last", **last)
    with pytest.raises(ValueError, match="no checkpoint at"):
        check_ckpt_path(str(tmp_path / "missing.ckpt"))
    # the running fit's best, which a fit that starts has none of (Lightning's message blamed the callback)
    with pytest.raises(ValueError, match="ckpt_path=best names the best checkpoint of the running fit"):
        check_ckpt_path("best")
