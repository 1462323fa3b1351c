"""The module run or read from a Lightning hook in ``"bf16-mixed"`` at ZeRO 1 and 3 (2 Gloo ranks), against
``"ddp"``.

With fp32 masters in the shards the module holds bf16 compute copies, and Lightning's hooks run outside
the step's autocast. A diffusion model sampled in ``on_validation_epoch_end`` from an fp32 noise tensor
(the usual pattern) failed in its first convolution with torch's "Input type (float) and bias type
(c10::BFloat16) should be the same", and an EMA's ``e.lerp_(p, w)`` in ``on_train_batch_end`` with
"expected dtype float for 'end'", both without a word of why; ``"ddp"`` computes in fp32 there. Now the
error carries a note naming the ways out, and both ways work: the sampling inside
``precision_plugin.forward_context()`` (autocast, as in a step) or inside
``strategy.gathered_params(writeback=True)`` (the fp32 weights) equals ``"ddp"``'s within bf16 rounding,
and the EMA updated inside ``gathered_params(writeback=True)`` too.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer

Sampling = Literal["plain", "autocast", "gathered"]


class Denoiser(pl.LightningModule):
    """A small convolutional denoiser with an EMA copy; samples a few steps at each validation end."""

    def __init__(self, *, sampling: Sampling, ema_recipe: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(), nn.Conv2d(8, 1, 3, padding=1)
        )
        self.ema = copy.deepcopy(self.net).requires_grad_(False)
        self.sampling = sampling
        self.ema_recipe = ema_recipe
        self.samples: list[Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (x,) = batch
        noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(batch_idx))
        return nn.functional.mse_loss(self.net(x + noise), noise)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        return None

    def _context(self, *, sampling: bool) -> Any:
        strategy = self.trainer.strategy
        if not isinstance(strategy, HybridParallelStrategy):
            return nullcontext()
        if sampling and self.sampling == "autocast":
            return self.trainer.precision_plugin.forward_context()
        if (sampling and self.sampling == "gathered") or (not sampling and self.ema_recipe):
            return strategy.gathered_params(writeback=True)
        return nullcontext()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with self._context(sampling=False), torch.no_grad():
            for e, p in zip(self.ema.parameters(), self.net.parameters(), strict=True):
                e.lerp_(p, 0.5)

    def on_validation_epoch_end(self) -> None:
        x = torch.randn(2, 1, 6, 6, generator=torch.Generator().manual_seed(7))  # fp32, as users write it
        with self._context(sampling=True), torch.no_grad():
            for _ in range(3):
                x = x - 0.5 * self.net(x).float()
        self.samples.append(x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        x = torch.randn(16, 1, 6, 6, generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(x), batch_size=4)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.zeros(4, 1, 6, 6)), batch_size=4)


def _fit(strategy: Any, *, sampling: Sampling = "plain", ema_recipe: bool = False) -> dict[str, Any]:
    model = Denoiser(sampling=sampling, ema_recipe=ema_recipe)
    trainer = cpu_trainer(strategy, precision="bf16-mixed", max_epochs=2, num_sanity_val_steps=0)
    try:
        trainer.fit(model)
    except RuntimeError as error:
        return {"error": str(error), "notes": "\n".join(getattr(error, "__notes__", []))}
    return {"samples": model.samples, "ema": {k: v.clone() for k, v in model.ema.state_dict().items()}}


def _job(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {"ddp": _fit("ddp")}
    for stage in (1, 3):
        for way in ("sampled", "autocast", "gathered"):
            sampling: Sampling = "plain" if way == "sampled" else way  # type: ignore[assignment]
            strategy = HybridParallelStrategy(zero_stage=stage)
            out[f"zero{stage}_{way}"] = _fit(strategy, sampling=sampling, ema_recipe=True)
    out["zero1_ema"] = _fit(HybridParallelStrategy(zero_stage=1), sampling="gathered")
    return out


def test_the_module_in_hooks_outside_autocast_is_explained_and_the_ways_out_equal_ddp() -> None:
    for out in run_distributed(_job, 2, init_group=False, timeout=300):
        ddp = out["ddp"]
        assert len(ddp["samples"]) == 2 and (ddp["samples"][1] - ddp["samples"][0]).abs().max() > 1e-2
        # the sampling from an fp32 tensor, and (ZeRO-1) the EMA's lerp_, meet the bf16 compute copies
        for name, message in (
            ("zero1_sampled", "should be the same"),
            ("zero3_sampled", "should be the same"),
            ("zero1_ema", "expected dtype float"),
        ):
            got = out[name]
            assert message in got["error"], (name, got)
            assert "on_validation_epoch_end runs outside" in got["notes"] or name == "zero1_ema", got
            assert "self.trainer.precision_plugin.forward_context()" in got["notes"], (name, got)
            assert "gathered_params(writeback=True)" in got["notes"], (name, got)
            assert "master_weights=False" in got["notes"], (name, got)
        assert "on_train_batch_end runs outside" in out["zero1_ema"]["notes"], out["zero1_ema"]
        for stage in (1, 3):
            for way in ("autocast", "gathered"):
                got = out[f"zero{stage}_{way}"]
                for mine, theirs in zip(got["samples"], ddp["samples"], strict=True):
                    torch.testing.assert_close(mine, theirs, atol=5e-2, rtol=5e-2)
                torch.testing.assert_close(got["ema"], ddp["ema"], atol=2e-2, rtol=2e-2)
