"""Logging gradient norms from ``on_before_optimizer_step`` at ZeRO 1-3, on 2 Gloo ranks.

Lightning's documented recipe is ``self.log_dict(grad_norm(self, norm_type=2))`` in
``on_before_optimizer_step``. At ZeRO 1-3 the gradients live in each rank's shards and ``param.grad`` is
None, so that function returns ``{}`` and nothing is logged. ``trainer.strategy.grad_norm(module,
norm_type)`` gives the same dictionary from the shards (a parameter's pieces may lie on both ranks).

Checked against Lightning's ``grad_norm`` under ``"ddp"`` in the same processes, at every optimizer step
of a run with a frozen layer (left out, as Lightning leaves out parameters without a gradient): the keys,
every parameter's norm and the total, for the 2-norm and the inf-norm, of the whole LightningModule and of
one submodule (names relative to it), at stages 1, 2 and 3.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import grad_norm
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed

WORLD, STEPS = 2, 3


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 24), nn.ReLU(), nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 1))
        self.net[2].requires_grad_(False)  # frozen: no gradient, no entry
        self.records: list[dict[str, float]] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        strategy: Any = self.trainer.strategy
        norms = grad_norm if isinstance(strategy, pl.strategies.DDPStrategy) else strategy.grad_norm
        record: dict[str, float] = {}
        for target, tag in ((self, "all"), (self.net[4], "head")):
            for p in (2, "inf"):
                for key, value in norms(target, norm_type=p).items():
                    record[f"{tag}:{key}"] = float(value)
        self.records.append(record)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def _fit(strategy: Any) -> list[dict[str, float]]:
    pl.seed_everything(7)
    module = Net()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 8, generator=g)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        module, DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8, shuffle=True)
    )
    return module.records


def _runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    hp = HybridParallelStrategy
    return {
        "ddp": _fit("ddp"),
        "s1": _fit(hp(zero_stage=1)),
        "s2": _fit(hp(zero_stage=2)),
        "s3": _fit(hp(zero_stage=3, meta_init=False)),
    }


def test_grad_norm_from_shards_equals_lightning_grad_norm_under_ddp() -> None:
    ranks = run_distributed(_runs, WORLD, init_group=False, timeout=300)
    ddp = ranks[0]["ddp"]
    assert len(ddp) == STEPS
    assert "all:grad_2.0_norm/net.0.weight" in ddp[0] and "head:grad_inf_norm/weight" in ddp[0], sorted(
        ddp[0]
    )
    assert not any("net.2." in k for k in ddp[0]), "the frozen layer has an entry"
    for r, out in enumerate(ranks):
        for key in ("s1", "s2", "s3"):
            assert len(out[key]) == STEPS, (r, key)
            for step, (ours, theirs) in enumerate(zip(out[key], out["ddp"], strict=True)):
                assert set(ours) == set(theirs), (r, key, step, sorted(set(ours) ^ set(theirs)))
                for name, value in theirs.items():
                    torch.testing.assert_close(
                        ours[name], value, rtol=1e-5, atol=1e-7, msg=f"{r} {key} {name}"
                    )
