"""Layer drop: whole layers (ZeRO-3 units) skipped in some steps, on 2 Gloo ranks, against DDP.

Hugging Face's speech and encoder-decoder models (``layerdrop`` in wav2vec2, HuBERT, Whisper, BART) skip a
random subset of their layers in each training forward, drawn from torch's generator. Under Lightning's
``seed_everything`` every rank draws the same subset, so at ZeRO-3 every rank skips the same units: their
all-gathers are skipped alike, and their parameters get no gradient in that step.

A residual stack of four layers with dropout, each skipped with probability 0.4, AdamW with weight decay,
``find_unused_parameters=True`` on both sides: ZeRO 0-3 end with the weights of Lightning's
``DDPStrategy(find_unused_parameters=True)`` (a parameter no rank used keeps ``grad=None`` and AdamW skips
it, weight decay included, as under DDP). The run skips layers in several steps and keeps some in each.

Every rank must skip the same units at ZeRO-3, as under FSDP and DeepSpeed's stage 3: a rank that skips a
unit another rank runs leaves their all-gathers unmatched (README, Troubleshooting).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state

WORLD, LAYERS, DROP, STEPS = 2, 4, 0.4, 8


class LayerDrop(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1)) for _ in range(LAYERS))
        self.head = nn.Linear(8, 1)
        self.skipped: list[list[int]] = []  # per step, the layers skipped

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        skipped = []
        for i, layer in enumerate(self.layers):
            if torch.rand(()) < DROP:  # the same draw on every rank (seed_everything)
                skipped.append(i)
                continue
            x = x + torch.tanh(layer(x))
        self.skipped.append(skipped)
        return F.mse_loss(self.head(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)


def _fit(strategy: Any) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module = LayerDrop()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, generator=g))
    trainer = cpu_trainer(strategy, max_steps=STEPS)
    trainer.fit(module, DataLoader(data, batch_size=4))
    return {"state": final_state(module, strategy), "skipped": module.skipped}


def _runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {"ddp": _fit(DDPStrategy(find_unused_parameters=True))}
    for stage in range(4):
        out[f"zero{stage}"] = _fit(HybridParallelStrategy(zero_stage=stage, find_unused_parameters=True))
    return out


def test_layer_drop_equals_ddp_at_every_stage() -> None:
    ranks = run_distributed(_runs, WORLD, init_group=False, timeout=300)
    out = ranks[0]
    skipped = out["ddp"]["skipped"]
    assert len(skipped) == STEPS
    assert sum(1 for s in skipped if s) >= 3  # layers were skipped in several steps ...
    assert all(len(s) < LAYERS for s in skipped)  # ... and some ran in each
    assert ranks[1]["ddp"]["skipped"] == skipped  # the same draws on both ranks
    reference = out["ddp"]["state"]
    for stage in range(4):
        run = out[f"zero{stage}"]
        assert run["skipped"] == skipped
        assert run["state"].keys() == reference.keys()
        for key, value in reference.items():
            torch.testing.assert_close(
                run["state"][key], value, msg=lambda m, k=key, s=stage: f"zero{s} {k}: {m}"
            )
