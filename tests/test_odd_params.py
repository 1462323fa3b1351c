"""Parameters and optimizers outside the transformer mould, at ZeRO 1-3 against Lightning's ``"ddp"``.

* torch's Adagrad fills its state in its constructor. The optimizer ZeRO 1/2 rebuild over the shards thus
  held state before any step, and the first backward, which lays the buckets out in the order gradients
  arrive, refused to move it ("The ZeRO layout changed after the optimizer took a step; this is a bug").
* A parameter with no elements (a placeholder some models register) has no fragment on any rank: the
  consolidated state (``trainer.save_checkpoint`` with one file) raised on rank 0 alone, "No rank holds
  parameter", and rank 1 waited in the next collective.

* ``trainer.save_checkpoint`` after ``fit`` then ``test`` / ``validate`` (``ModelCheckpoint``, then
  ``test(ckpt_path="best")``, then a save) failed at ZeRO 1-3 with a ``KeyError`` on a fragment tensor:
  the evaluation run's engine held no optimizer fragments. Lightning keeps the fit's optimizers and
  ``"ddp"`` checkpoints their state; so do we now.

All run in one model here (an MLP whose head's gradients arrive first), trained, evaluated, saved and
resumed, as under ``"ddp"``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer

STEPS, MORE = 3, 2


class OddModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.l2 = nn.Linear(16, 1)
        self.empty = nn.Parameter(torch.empty(0))

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(torch.tanh(self.norm(self.l1(x)))).squeeze(-1) + self.empty.sum()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adagrad(self.parameters(), lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(
        TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, generator=g)), batch_size=4
    )


def _fit(strategy: Any, tmp: str, steps: int, ckpt_path: str | None = None) -> pl.Trainer:
    trainer = cpu_trainer(strategy, max_steps=steps, default_root_dir=tmp)
    trainer.fit(OddModel(), _data(), ckpt_path=ckpt_path)
    return trainer


def _runs(rank: int, world: int, tmp: str) -> dict[str, dict[str, Tensor]]:
    out = {}
    layouts: dict[str, Any] = {"ddp": lambda: "ddp"}
    for stage in (1, 2, 3):
        for fmt, sharded in (("dir", True), ("file", False)):
            layouts[f"zero{stage}_{fmt}"] = lambda s=stage, d=sharded: HybridParallelStrategy(
                zero_stage=s, meta_init=False, save_distributed_checkpoint=d
            )
    for name, make in layouts.items():
        path = str(Path(tmp) / f"{name}.ckpt")
        first = _fit(make(), tmp, STEPS)
        module = first.lightning_module
        first.test(module, _data(), verbose=False)
        first.validate(module, _data(), verbose=False)
        first.save_checkpoint(path)  # after evaluation runs: the fit's optimizer state too
        resumed = _fit(make(), tmp, STEPS + MORE, ckpt_path=path)
        strategy = resumed.strategy
        if isinstance(strategy, HybridParallelStrategy):
            out[name] = strategy.consolidated_state_dict()
        else:
            out[name] = {k: v.detach().clone() for k, v in resumed.lightning_module.state_dict().items()}
    return out


def test_adagrad_and_an_empty_parameter_train_save_and_resume_as_under_ddp(tmp_path: Path) -> None:
    results = run_distributed(_runs, 2, str(tmp_path), init_group=False, timeout=300)[0]
    reference = results.pop("ddp")
    assert reference["empty"].shape == (0,)
    assert (reference["l1.weight"] - OddModel().l1.weight).abs().max() > 1e-2  # it trained
    for name, state in results.items():
        assert state.keys() == reference.keys(), name
        for key, value in reference.items():
            torch.testing.assert_close(state[key], value, msg=lambda m, n=name, k=key: f"{n} {k}: {m}")
