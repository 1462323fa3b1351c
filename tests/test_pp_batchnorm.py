"""A BatchNorm net we did not write (Hugging Face ``ResNetForImageClassification``) under pipeline
parallelism: every stage's running statistics follow its own micro-batches, and the exported state, the
validation loss (evaluation reads the statistics) and a checkpoint resumed without a pipeline hold the
statistics of the stage that owns each layer, not the untouched copies other stages keep of it.

Reference: one process feeding the same micro-batches one at a time with gradient accumulation over
``m`` of them (BatchNorm normalises each micro-batch by its own statistics, so the pipeline's split is
part of the model's arithmetic; the reference splits the same way). Gradients are clipped at 0.5 on
both sides."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import rank_state
from tests.test_batchnorm import SEED, Images, ResNetModule
from tests.test_pp_trainer import _trainer  # the pipeline tests' Trainer (clipping at 0.5)

M, BATCH, N = 2, 8, 32


class _Head(nn.Module):
    """Pooling and classifier of the model (referenced, not copied)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.pooler, self.classifier = net.resnet.pooler, net.classifier

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.pooler(x))


class PipelinedResNet(ResNetModule):
    """The BatchNorm test's ResNet behind the pipeline protocol: embedder, one layer per residual stage,
    pooling with the classifier."""

    def __init__(self) -> None:
        super().__init__()
        self._layers: list[nn.Module] | None = None

    def pipeline_layers(self) -> list[nn.Module]:
        if self._layers is None:  # built once, after any module swap, and cached (a plain list)
            resnet = self.net.resnet
            self._layers = [resnet.embedder, *resnet.encoder.stages, _Head(self.net)]
        return self._layers

    def pipeline_loss(self, logits: Tensor, batch: tuple[Tensor, Tensor]) -> Tensor:
        return F.cross_entropy(logits, batch[1])

    def pipeline_input(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        return batch[0]


def _pipelined(rank: int, world: int, tmp: str) -> dict[str, Any]:
    pl.seed_everything(SEED)
    module = PipelinedResNet()
    strategy = HybridParallelStrategy(pipeline_parallel_size=2, num_microbatches=M, pipeline_schedule="1f1b")
    trainer = _trainer(strategy, 2, tmp, [])
    train, val = DataLoader(Images(N), batch_size=BATCH), DataLoader(Images(8), batch_size=BATCH)
    trainer.fit(module, train, val)
    trainer.save_checkpoint(os.path.join(tmp, "pp.ckpt"))
    val_loss = float(trainer.callback_metrics["val_loss"])
    # a second setup of the pipelined model: the other stage's statistics stay its own (here they are
    # meta placeholders, not buffers to compute)
    validated = trainer.validate(module, val, verbose=False)[0]["val_loss"]
    return {
        "state": strategy.consolidated_state_dict(),  # collective; rank 0's is the full state
        "val_loss": val_loss,
        "validated": validated,
        "own": {k: v for k, v in rank_state(module).items() if "running_mean" in k},
    }


def _resumed(rank: int, world: int, tmp: str) -> dict[str, Tensor]:
    """The pipeline's checkpoint loaded without a pipeline (ZeRO-1 over 2 ranks), with no step left."""
    pl.seed_everything(SEED + 1)
    module = ResNetModule()
    trainer = _trainer(HybridParallelStrategy(zero_stage=1), 2, tmp, [])
    train = DataLoader(Images(N), batch_size=BATCH // 2)
    trainer.fit(module, train, ckpt_path=os.path.join(tmp, "pp.ckpt"))  # max_epochs reached: loads only
    return {k: v.clone() for k, v in module.state_dict().items()}


def _reference(tmp: Path) -> tuple[dict[str, Tensor], float]:
    pl.seed_everything(SEED)
    module = ResNetModule()
    trainer = _trainer("auto", 1, str(tmp / "ref"), [], accumulate_grad_batches=M)
    # the pipeline's micro-batches: Lightning shuffles training data under a distributed sampler (seeded
    # by seed_everything), and the pipeline cuts each batch into M contiguous parts
    order = list(DistributedSampler(Images(N), num_replicas=1, rank=0, shuffle=True, seed=SEED))
    micro = [order[i : i + BATCH // M] for i in range(0, N, BATCH // M)]
    trainer.fit(module, DataLoader(Images(N), batch_sampler=micro))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, _val_loss(module)


def _val_loss(module: ResNetModule) -> float:
    """The validation loss over the whole validation set in eval mode (what the pipeline logs: the mean
    of its micro-batches' means, micro-batches of equal size)."""
    module.eval()
    with torch.no_grad():
        x, y = Images(8).x, Images(8).y
        return float(F.cross_entropy(module.net(pixel_values=x).logits, y))


def test_batchnorm_statistics_under_pipeline_parallelism(tmp_path: Path) -> None:
    results = run_distributed(_pipelined, 2, str(tmp_path), init_group=False)
    ref_state, ref_val = _reference(tmp_path)
    state = results[0]["state"]
    assert set(state) == set(ref_state)
    stats = [k for k in ref_state if "running_" in k or "num_batches_tracked" in k]
    assert any("encoder.stages.1" in k for k in stats)  # statistics on the second stage
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, msg=k)
    for r in results:
        assert r["val_loss"] == pytest.approx(ref_val, rel=1e-5)
        assert r["validated"] == pytest.approx(ref_val, rel=1e-5)
    resumed = run_distributed(_resumed, 2, str(tmp_path), init_group=False)
    for r in resumed:
        for k, v in ref_state.items():
            torch.testing.assert_close(r[k], v, msg=k)
