"""Lightning's learning-rate finder (``LearningRateFinder``, as ``Tuner.lr_find`` runs it) at ZeRO 1-3, on
2 Gloo ranks, against Lightning's ``"ddp"`` in the same processes.

The finder saves a checkpoint, runs its trial steps at rising learning rates, restores the checkpoint
inside the same fit, sets the suggested rate on the module and the optimizer, and training goes on. At
ZeRO 1-3 the optimizer holds shards, restored by our checkpoint code: before this test, loading a state
saved before the first step kept the trial steps' Adam moments and step counts (44 steps counted where
``"ddp"`` counts 32), and the final weights differed from ``"ddp"`` by 0.0224.

Checked, at every stage: the trial losses, the suggested rate (on the module and in every param group),
the param groups' keys (the finder's ``initial_lr`` gone with the restore, as under torch's
``load_state_dict``), the optimizer's step count and the final weights equal ``"ddp"``'s; the finder's
checkpoint is gone. The model registers its head before the body it follows (as Hugging Face models do):
its gradients arrive in another order than registered, which the engine learns in the first trial
backward; before, restoring the finder's checkpoint (saved before that) at ZeRO-1/2 imposed the old
order on an optimizer that had stepped, and failed ("The ZeRO layout changed after the optimizer took a
step").
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import LearningRateFinder
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed

SEED, WORLD, MICRO, N, EPOCHS, TRIALS = 7, 2, 8, 256, 2, 30  # 16 steps per epoch; 30 trials give a suggestion


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lr = 1e-3  # the finder writes its suggestion here (update_attr=True)
        # the head registered before the body it follows, as Hugging Face models hold lm_head: the
        # gradients arrive in another order than the registration's, and the engine learns it
        self.head = nn.Linear(32, 1)
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU())

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def _loader() -> DataLoader[tuple[Tensor, ...]]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=MICRO, shuffle=True)


def _fit(strategy: Any) -> dict[str, Any]:
    pl.seed_everything(SEED)
    module = Regressor()
    finder = LearningRateFinder(num_training_steps=TRIALS, update_attr=True)
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=strategy,
            max_epochs=EPOCHS,
            default_root_dir=root,
            callbacks=[finder],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, _loader())
        left = sorted(os.listdir(root))
        state = trainer.strategy.consolidated_state_dict() if strategy != "ddp" else module.state_dict()  # type: ignore[attr-defined]
    optimizer = trainer.optimizers[0]
    steps = {float(s["step"]) for s in optimizer.state.values()}
    return {
        "losses": list(finder.optimal_lr.results["loss"]),
        "lr": module.lr,
        "group_lrs": [g["lr"] for g in optimizer.param_groups],
        "group_keys": [sorted(g) for g in optimizer.param_groups],
        "steps": steps,
        "left": left,
        "state": {k: v.detach().clone() for k, v in state.items()} if state else None,
    }


def _runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    hp = HybridParallelStrategy
    return {
        "ddp": _fit("ddp"),
        "s1": _fit(hp(zero_stage=1)),
        "s2": _fit(hp(zero_stage=2)),
        "s3": _fit(hp(zero_stage=3, meta_init=False)),  # meta_init=False: the module's own initial weights
    }


def test_lr_finder_at_zero_stages_equals_ddp() -> None:
    ranks = run_distributed(_runs, WORLD, init_group=False, timeout=300)
    ddp = ranks[0]["ddp"]
    assert ddp["lr"] != 1e-3 and ddp["group_lrs"] == [ddp["lr"]], "the finder suggested no rate"
    assert ddp["steps"] == {float(EPOCHS * N // (WORLD * MICRO))}, ddp["steps"]
    for r, out in enumerate(ranks):
        for key in ("s1", "s2", "s3"):
            run = out[key]
            assert run["left"] == [], f"rank {r} {key}: the finder's checkpoint was left: {run['left']}"
            torch.testing.assert_close(
                run["losses"], out["ddp"]["losses"], msg=f"rank {r} {key}: trial losses"
            )
            assert run["lr"] == ddp["lr"] and run["group_lrs"] == [ddp["lr"]], (
                key,
                run["lr"],
                run["group_lrs"],
            )
            assert run["steps"] == ddp["steps"], (
                f"rank {r} {key}: optimizer steps {run['steps']} (trials kept)"
            )
            assert run["group_keys"] == ddp["group_keys"], f"rank {r} {key}: {run['group_keys']}"
            if r == 0:  # the consolidated state lives on rank 0
                for name, value in ddp["state"].items():
                    torch.testing.assert_close(run["state"][name], value, msg=f"{key}: {name}")
