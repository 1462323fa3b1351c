"""A model with BatchNorm that we did not write (Hugging Face ``ResNetForImageClassification``): buffers in
every checkpoint and kept equal as DDP keeps them. Saved at ZeRO-2 and ZeRO-3 on 2 ranks, resumed at the
other stage on 4 ranks, it continues exactly as Lightning's own ``"ddp"`` does with the same save and
resume: weights and every rank's running statistics equal. ``sync_batchnorm=True`` converts over the
data-parallel group and reverts after the run; on CPU, where torch's SyncBatchNorm cannot train, the fit is
refused at setup, as ``"ddp"`` refuses it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_par import HybridParallelStrategy
from lightning_par.fabric import HybridParallelStrategy as FabricStrategy
from tests.distributed import run_distributed

SEED, GLOBAL_BATCH, N = 11, 8, 32


class Images(Dataset[tuple[Tensor, Tensor]]):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(n, 3, 16, 16, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


class ResNetModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers import ResNetConfig, ResNetForImageClassification

        torch.manual_seed(SEED)
        config = ResNetConfig(
            num_channels=3,
            embedding_size=8,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            layer_type="basic",
            num_labels=4,
        )
        self.net = ResNetForImageClassification(config)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.net(pixel_values=x).logits, y)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(pixel_values=x).logits, y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _trainer(strategy: Any, devices: int, epochs: int, tmp: str, *, val: bool) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=epochs,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1 if val else 0,
        default_root_dir=tmp,
    )


def _loaders(world: int) -> tuple[DataLoader[Any], DataLoader[Any]]:
    per_rank = GLOBAL_BATCH // 2 // world  # two micro-batches per optimizer step
    return (
        DataLoader(Images(N), batch_size=per_rank, shuffle=True),
        DataLoader(Images(8), batch_size=per_rank),
    )


def _state(module: pl.LightningModule, trainer: pl.Trainer) -> dict[str, Tensor]:
    strategy = trainer.strategy
    if isinstance(strategy, HybridParallelStrategy):
        return strategy.consolidated_state_dict()  # collective; the full state on rank 0
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


LAYOUTS = {"ddp": "ddp", "zero2": "zero2", "zero3": HybridParallelStrategy(zero_stage=3, meta_init=False)}
RESUME = {"ddp": "ddp", "zero2": "zero3", "zero3": "zero2"}  # saved with -> resumed with, on 4 ranks


def _save(rank: int, world: int, tmp: str) -> dict[str, Any]:
    out = {}
    for name, strategy in LAYOUTS.items():
        pl.seed_everything(SEED)
        module = ResNetModule()
        trainer = _trainer(strategy, world, 1, tmp, val=False)
        trainer.fit(module, *_loaders(world))
        trainer.save_checkpoint(os.path.join(tmp, f"{name}.ckpt"))
        out[name] = _state(module, trainer)
        out[f"{name}_buffers"] = {k: b.clone() for k, b in module.named_buffers()}
    out["sync_batchnorm"] = _sync_batchnorm(world, tmp)
    return out


class _Stop(Exception):
    pass


class SyncBNProbe(pl.Callback):
    """Where Trainer(sync_batchnorm=True) put the BatchNorm layers, and over which group they sync; stops
    the run before its first forward (torch's SyncBatchNorm refuses CPU tensors in training)."""

    def __init__(self) -> None:
        self.groups: list[Any] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        layers = [m for m in pl_module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        assert layers and all(isinstance(m, torch.nn.SyncBatchNorm) for m in layers)
        self.groups = [m.process_group for m in layers]
        raise _Stop


def _sync_batchnorm(world: int, tmp: str) -> dict[str, Any]:
    """``sync_batchnorm=True`` (fitting only, as Lightning's DDP): the layers synchronise over the
    data-parallel group (not the world, which would include tensor- and pipeline-parallel ranks) and are
    plain BatchNorm again after the run. Torch's SyncBatchNorm runs its synchronising forward on GPUs only:
    on CPU the fit is refused at setup, as ``"ddp"`` refuses it (before, the layers were converted, the
    sanity check ran and the first training forward failed in torch); the conversion itself is checked
    with that refusal lifted, the run stopped before its first forward."""
    out: dict[str, Any] = {}

    def trainer(strategy: str, callbacks: list[pl.Callback]) -> pl.Trainer:
        return pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=strategy,
            sync_batchnorm=True,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
            default_root_dir=tmp,
        )

    for strategy in ("ddp", "zero2"):
        pl.seed_everything(SEED)
        module = ResNetModule()
        before = {k: v.clone() for k, v in module.state_dict().items()}
        with pytest.raises(ValueError, match="SyncBatchNorm") as refused:
            trainer(strategy, []).fit(module, _loaders(world)[0])
        out[f"{strategy}_refused"] = str(refused.value)
        out[f"{strategy}_untouched"] = all(torch.equal(module.state_dict()[k], v) for k, v in before.items())
        out[f"{strategy}_plain"] = not any(isinstance(m, torch.nn.SyncBatchNorm) for m in module.modules())
    # a Fabric loop with layers the user converted: refused at setup, as Fabric's "ddp" refuses them
    for name, fabric_strategy in (("fabric_ddp", "ddp"), ("fabric_zero2", FabricStrategy(zero_stage=2))):
        fabric = Fabric(accelerator="cpu", devices=world, strategy=fabric_strategy)
        fabric.launch()
        with pytest.raises(ValueError, match="SyncBatchNorm") as refused:
            fabric.setup(torch.nn.SyncBatchNorm.convert_sync_batchnorm(ResNetModule().net))
        out[f"{name}_refused"] = str(refused.value)
    pl.seed_everything(SEED)
    module, probe = ResNetModule(), SyncBNProbe()
    run = trainer("zero2", [probe])
    with mock.patch("lightning_par.strategy.refuse_sync_batchnorm_on_cpu"), pytest.raises(_Stop):
        run.fit(module, _loaders(world)[0])
    dp_group = run.strategy.mesh.dp_group  # type: ignore[attr-defined]
    out["same_group"] = bool(probe.groups) and all(g is dp_group for g in probe.groups)
    out["reverted"] = not any(isinstance(m, torch.nn.SyncBatchNorm) for m in module.modules())
    return out


def _resume(rank: int, world: int, tmp: str) -> dict[str, Any]:
    out = {}
    for saved, strategy in RESUME.items():
        pl.seed_everything(SEED)
        module = ResNetModule()
        trainer = _trainer(strategy, world, 2, tmp, val=True)
        trainer.fit(module, *_loaders(world), ckpt_path=os.path.join(tmp, f"{saved}.ckpt"))
        out[saved] = _state(module, trainer)
        out[f"{saved}_buffers"] = {k: b.clone() for k, b in module.named_buffers()}
    return out


def _assert_equal(got: dict[str, Tensor], ref: dict[str, Tensor], what: str) -> None:
    assert set(got) == set(ref), (what, sorted(set(ref) ^ set(got)))
    for key, value in ref.items():
        torch.testing.assert_close(got[key], value, msg=f"{what}: {key}")


def test_batchnorm_resnet_save_resume_across_stage_and_dp_like_ddp(tmp_path: Path) -> None:
    saved_ranks = run_distributed(_save, 2, str(tmp_path), init_group=False)
    saved = saved_ranks[0]
    for r in saved_ranks:
        sync = r["sync_batchnorm"]
        assert sync["same_group"] and sync["reverted"], sync
        assert (
            "SyncBatchNorm trains on GPUs only" in sync["zero2_refused"]
            and "sync_batchnorm" in sync["zero2_refused"]
        )
        assert "SyncBatchNorm trains on GPUs only" in sync["fabric_zero2_refused"], sync
        for strategy in ("ddp", "zero2"):  # refused before any step, the model left as it was
            assert sync[f"{strategy}_untouched"] and sync[f"{strategy}_plain"], sync
    ref = saved["ddp"]
    # every rank's own buffers as DDP leaves them (rank 0's broadcast at the first forward of each
    # window, then the rank's own updates): a rank that never synced, or synced at other times, differs
    for rank, r in enumerate(saved_ranks):
        for name in ("zero2", "zero3"):
            _assert_equal(r[f"{name}_buffers"], r["ddp_buffers"], f"rank {rank} buffers at {name}")
    assert not torch.equal(
        saved_ranks[0]["ddp_buffers"][next(k for k in ref if k.endswith("running_mean"))],
        saved_ranks[1]["ddp_buffers"][next(k for k in ref if k.endswith("running_mean"))],
    ), "the ranks' statistics differ after their own last training forward"
    assert any("running_mean" in k for k in ref) and any("num_batches_tracked" in k for k in ref)
    for name in ("zero2", "zero3"):
        _assert_equal(saved[name], ref, f"after epoch 1 at {name} on 2 ranks")
    resumed_ranks = run_distributed(_resume, 4, str(tmp_path), init_group=False)
    resumed = resumed_ranks[0]
    for name in ("zero2", "zero3"):
        _assert_equal(
            resumed[name], resumed["ddp"], f"saved at {name} (2 ranks), resumed at {RESUME[name]} (4)"
        )
        for rank, r in enumerate(resumed_ranks):
            _assert_equal(r[f"{name}_buffers"], r["ddp_buffers"], f"rank {rank} buffers resumed from {name}")
    # the statistics did move in the second epoch (a resume that dropped them would not match ddp), and
    # the validation forward after the last step took rank 0's on every rank, as DDP does
    key = next(k for k in ref if k.endswith("running_mean"))
    assert not torch.equal(resumed["ddp"][key], ref[key])
    for r in resumed_ranks[1:]:
        assert torch.equal(r["ddp_buffers"][key], resumed_ranks[0]["ddp_buffers"][key])
