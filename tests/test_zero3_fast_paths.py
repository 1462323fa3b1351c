"""ZeRO-3 evaluation through torch's transformer fast paths, on 2 Gloo ranks, against Lightning's ``"ddp"``.

The first-step read guard of ZeRO-3 is a torch function mode, and any mode on the stack makes torch's
``nn.TransformerEncoder`` / ``nn.TransformerEncoderLayer`` / ``nn.MultiheadAttention`` leave their inference
fast paths. So the first batch of every ``predict`` / ``validate`` (and a fit's sanity check) ran the slow
path: a padded encoder with ``enable_nested_tensor=True`` returned values at the padded positions where
``"ddp"`` returns zeros (2.6 apart; a mean over every position differed), and the first batch of a loop
differed from the later ones (found by a probe). The guard now leaves those modules' forwards alone where
everything they read is gathered while they run: with the default units (each encoder layer) and with the
layers named as units, predictions and a validation metric over all positions equal ``"ddp"``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer


class PaddedEncoder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        pad = torch.arange(x.shape[1])[None, :] >= lengths[:, None]
        return self.enc(self.emb(x), src_key_padding_mask=pad)

    def predict_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return self(*batch)

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        # a mean over every position, the padded ones included (what the fast path sets to zero)
        self.log("all_positions", self(*batch).abs().mean(), sync_dist=True)


def _loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (24, 8), generator=g)
    lengths = torch.tensor([8, 7, 5, 8, 3, 6, 6, 4] * 3)  # every rank's batches hold padded rows
    return DataLoader(TensorDataset(tokens, lengths), batch_size=4)


def _job(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    layouts: dict[str, Any] = {
        "ddp": "ddp",
        "zero3": HybridParallelStrategy(zero_stage=3),
        "zero3_layers": HybridParallelStrategy(zero_stage=3, zero3_units=[nn.TransformerEncoderLayer]),
    }
    for name, strategy in layouts.items():
        module = PaddedEncoder()
        predictions = cpu_trainer(strategy, devices=world).predict(module, _loader())
        assert predictions is not None
        out[f"{name}/predict"] = [p.clone() for p in predictions]  # type: ignore[union-attr]
    for name in ("ddp", "zero3"):
        strategy = "ddp" if name == "ddp" else HybridParallelStrategy(zero_stage=3)
        trainer = cpu_trainer(strategy, devices=world)
        trainer.validate(PaddedEncoder(), _loader(), verbose=False)
        out[f"{name}/validate"] = trainer.callback_metrics["all_positions"].clone()
    return out


def test_zero3_evaluation_takes_the_transformer_fast_paths_as_ddp() -> None:
    for rank, out in enumerate(run_distributed(_job, 2, init_group=False)):
        ref = out["ddp/predict"]
        assert len(ref) == 3
        padded = ref[0][2, 6:]  # row 2 holds 3 (rank 0) or 6 tokens: the fast path's zeros at its padding
        assert torch.equal(padded, torch.zeros_like(padded)), "the reference took the fast path"
        for name in ("zero3/predict", "zero3_layers/predict"):
            for batch, (got, want) in enumerate(zip(out[name], ref, strict=True)):
                torch.testing.assert_close(got, want, msg=f"rank {rank} {name} batch {batch}")
        torch.testing.assert_close(out["zero3/validate"], out["ddp/validate"])
