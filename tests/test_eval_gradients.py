"""A backward inside an evaluation step (an input saliency map, ``Trainer(inference_mode=False)``) in
``trainer.test`` / ``trainer.predict`` run without a fit, on 2 Gloo ranks, against ``"ddp"``.

At ZeRO-3 the engine's gradient hooks met an engine whose optimizers were never sharded (no fit) and failed
with "'Stage3Engine' object has no attribute '_master_owners'" on every rank; inside a fit the same step
worked. Now the saliency, the logged metric and the predictions equal ``"ddp"``'s at ZeRO 1 and 3.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer


class Saliency(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    def _saliency(self, batch: Any) -> Tensor:
        x, y = batch
        with torch.enable_grad():
            x = x.detach().clone().requires_grad_(True)
            F.cross_entropy(self.net(x), y).backward()  # the parameters' gradients are a by-product
        assert x.grad is not None
        return x.grad.abs()

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("saliency", self._saliency(batch).mean(), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._saliency(batch)

    def _loader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(16, 6, generator=g)
        return DataLoader(TensorDataset(x, torch.randint(0, 3, (16,), generator=g)), batch_size=4)

    def test_dataloader(self) -> DataLoader:
        return self._loader()

    def predict_dataloader(self) -> DataLoader:
        return self._loader()


def _evaluate(strategy: Any) -> dict[str, Any]:
    trainer = cpu_trainer(strategy, inference_mode=False)
    model = Saliency()
    trainer.test(model, verbose=False)
    metric = trainer.callback_metrics["saliency"].clone()
    predictions = trainer.predict(model)
    assert predictions is not None
    return {"metric": metric, "predictions": torch.cat([p for p in predictions if isinstance(p, Tensor)])}


def _job(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {"ddp": _evaluate("ddp")}
    for stage in (1, 3):
        out[f"zero{stage}"] = _evaluate(HybridParallelStrategy(zero_stage=stage))
    return out


def test_a_backward_in_test_and_predict_steps_without_fit_equals_ddp() -> None:
    for out in run_distributed(_job, 2, init_group=False):
        ddp = out["ddp"]
        assert ddp["metric"] > 0 and ddp["predictions"].shape == (8, 6)
        for name in ("zero1", "zero3"):
            torch.testing.assert_close(out[name]["metric"], ddp["metric"], msg=lambda m, n=name: f"{n}: {m}")
            torch.testing.assert_close(out[name]["predictions"], ddp["predictions"])
