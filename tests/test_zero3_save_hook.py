"""A LightningModule's ``on_save_checkpoint`` and ``on_train_epoch_end`` reading weights at ZeRO-3, on 2 Gloo
ranks, against ``"ddp"``.

Lightning calls the hook while it builds the checkpoint, outside any step, where ZeRO-3's parameters are
NaN placeholders: a hook that stored ``self.net[0].weight.clone()`` (or a norm of it) in the checkpoint
saved NaN, silently (measured: the saved tensor all NaN, the norm NaN, where ``"ddp"`` saved the weight);
so did a weight norm taken in ``on_train_epoch_end`` (the engine's between-steps watch covers the first
step's gap only), and so did one taken in ``on_train_batch_end`` after the first steps or in any
``on_validation_batch_end``. Now a read of a placeholder inside the module's hook is refused with the fix,
and the fix the message names (``gathered_params()`` around the read) saves and computes what ``"ddp"``
does. A user's callback reading a weight in its ``on_train_epoch_end`` is refused the same way, and so is
the module's ``on_validation_epoch_end`` under ``trainer.validate`` alone. The hooks are the module's and
the callback's own again after ``fit``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, fit_refused


class SavesAWeight(pl.LightningModule):
    def __init__(self, *, gathered: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.gathered, self.save_hook_only = gathered, False
        self.epoch_norm: Tensor | None = None

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=4)

    def on_train_epoch_end(self) -> None:  # a weight norm logged once per epoch
        if self.gathered and isinstance(self.trainer.strategy, HybridParallelStrategy):
            with self.trainer.strategy.gathered_params():
                self.epoch_norm = self.net[2].weight.norm().detach().clone()
        else:
            self.epoch_norm = self.net[2].weight.norm().detach().clone()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.gathered and isinstance(self.trainer.strategy, HybridParallelStrategy):
            with self.trainer.strategy.gathered_params():
                checkpoint["first_weight"] = self.net[0].weight.detach().clone()
        else:
            checkpoint["first_weight"] = self.net[0].weight.detach().clone()


class SavesOnly(SavesAWeight):
    """The checkpoint hook alone (the epoch hook of the parent is Lightning's own again)."""

    on_train_epoch_end = pl.LightningModule.on_train_epoch_end


class NormLogger(Callback):
    """A user's callback logging a weight norm at each epoch's end."""

    def __init__(self) -> None:
        self.norms: list[Tensor] = []

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.norms.append(pl_module.net[0].weight.norm().detach().clone())


class Plain(SavesOnly):
    on_save_checkpoint = pl.LightningModule.on_save_checkpoint  # no hook of the module reads weights


class ValidatesAWeight(Plain):
    """``trainer.validate`` alone (no fit): a weight norm in ``on_validation_epoch_end``."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val", F.mse_loss(self.net(x), y), sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        self.epoch_norm = self.net[0].weight.norm().detach().clone()


class LateBatchReads(Plain):
    """Per-batch hooks reading a weight after the first steps (``on_train_batch_end`` from step 2 on) or in
    ``validate`` (``on_validation_batch_end``): before, NaN where the between-steps watch had ended."""

    def on_train_batch_end(self, *args: Any) -> None:
        if self.global_step >= 2:
            self.epoch_norm = self.net[0].weight.norm().detach().clone()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val", F.mse_loss(self.net(x), y), sync_dist=True)

    def on_validation_batch_end(self, *args: Any) -> None:
        self.epoch_norm = self.net[0].weight.norm().detach().clone()


def _late(strategy: Any) -> str | None:
    trainer = cpu_trainer(strategy, max_epochs=1, limit_val_batches=0)
    return fit_refused(trainer, LateBatchReads(gathered=False), strategy)


def _validate(strategy: Any, module_cls: type[Plain] | None = None) -> str | None:
    trainer = cpu_trainer(strategy)
    module = (module_cls or ValidatesAWeight)(gathered=False)
    try:
        trainer.validate(module, module.train_dataloader(), verbose=False)
    except RuntimeError as error:
        return str(error)
    finally:
        strategy.destroy_process_groups()
    return None


def _callback_fit(strategy: Any) -> tuple[str | None, bool]:
    """The callback under ``strategy``: the refusal, and whether its hook is its class's own afterwards."""
    logger = NormLogger()
    trainer = cpu_trainer(strategy, max_epochs=1, callbacks=[logger])
    refused = fit_refused(trainer, Plain(gathered=False), strategy)
    return refused, "on_train_epoch_end" not in vars(logger)


def _fit(strategy: Any, root: Path, *, gathered: bool, save_only: bool = False) -> tuple[str | None, Any]:
    module = (SavesOnly if save_only else SavesAWeight)(gathered=gathered)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1,
        default_root_dir=root,
        callbacks=[ModelCheckpoint(dirpath=root, filename="last")],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if isinstance(strategy, HybridParallelStrategy):
        refused = fit_refused(trainer, module, strategy)
    else:
        trainer.fit(module)
        refused = None
    if refused is not None:
        return refused, None
    path = root / "last.ckpt"
    saved = torch.load(path / "meta.pt" if path.is_dir() else path, weights_only=False)
    if isinstance(strategy, HybridParallelStrategy):
        strategy.destroy_process_groups()
    patched = {"on_save_checkpoint", "on_train_epoch_end"} & set(vars(module))
    return None, (saved["first_weight"], patched, module.epoch_norm)


def _runs(rank: int, world: int, root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    base = Path(root)
    return {
        "ddp": _fit("ddp", base / "ddp", gathered=False),
        "plain": _fit(HybridParallelStrategy(zero_stage=3), base / "plain", gathered=False),
        "save_only": _fit(
            HybridParallelStrategy(zero_stage=3), base / "save", gathered=False, save_only=True
        ),
        "gathered": _fit(HybridParallelStrategy(zero_stage=3), base / "gathered", gathered=True),
        "callback": _callback_fit(HybridParallelStrategy(zero_stage=3)),
        "validate": _validate(HybridParallelStrategy(zero_stage=3)),
        "late_batch": _late(HybridParallelStrategy(zero_stage=3)),
        "validate_batch": _validate(HybridParallelStrategy(zero_stage=3), LateBatchReads),
    }


def test_weights_read_in_on_save_checkpoint_at_zero3(tmp_path: Path) -> None:
    for r, out in enumerate(run_distributed(_runs, 2, str(tmp_path), init_group=False, timeout=300)):
        # ModelCheckpoint saves at the epoch's end, after the module's on_train_epoch_end
        refused, _ = out["plain"]
        assert refused is not None and "in on_train_epoch_end" in refused, (r, refused)
        assert "'net.2.weight'" in refused and "gathered_params()" in refused, refused
        refused, _ = out["save_only"]
        assert refused is not None and "in on_save_checkpoint" in refused, (r, refused)
        assert "'net.0.weight'" in refused and "gathered_params()" in refused, refused
        _, (expected, _, expected_norm) = out["ddp"]
        _, (got, patched_after_fit, norm) = out["gathered"]
        assert not got.isnan().any() and not patched_after_fit, (r, patched_after_fit)
        torch.testing.assert_close(got, expected, msg=f"rank {r}")
        torch.testing.assert_close(norm, expected_norm, msg=f"rank {r}: epoch-end norm")
        refused, restored = out["callback"]
        assert refused is not None and "in a callback's on_train_epoch_end" in refused, (r, refused)
        assert restored, r
        refused = out["validate"]
        assert refused is not None and "in on_validation_epoch_end" in refused, (r, refused)
        for key, hook in (
            ("late_batch", "on_train_batch_end"),
            ("validate_batch", "on_validation_batch_end"),
        ):
            refused = out[key]
            assert refused is not None and f"'norm' in {hook}," in refused, (r, key, refused)
            assert "gathered_params()" in refused, (r, key, refused)
