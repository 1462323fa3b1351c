"""A GAN in manual optimization with gradient accumulation, at ZeRO 0-3 against Lightning's ``"ddp"``.

The generator's step comes before the discriminator's last backward of the accumulation window
(``og.step()`` at the window's last batch, then the discriminator's loss on the updated generator), so
when the generator steps the discriminator holds gradients it has not used yet. Before, the next
backward opened a new gradient window for every parameter: at ZeRO 1-3 the discriminator's earlier
micro-batches were dropped, and at ZeRO 0 the generator's gradient, unused in the discriminator's
backward, was set to ``None`` (DDP leaves a gradient of an unused parameter as it is). The weights ended
up to 0.07 away from ``"ddp"``, silently. Now a window drops only the gradients of the optimizers that
stepped or were zeroed, and a parameter unused in a pass keeps its gradient of earlier passes (the
WGAN-GP of ``tests/test_input_grads.py``, which zeroes each optimizer before its backward and lets the
generator's backward reach the critic, checks the zeroing side).
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
from tests.fits import cpu_trainer, final_state

ACC, BATCHES = 2, 4  # per rank: two windows of two micro-batches


class Gan(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.g = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
        self.d = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (x,) = batch
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        z = torch.randn(
            x.shape[0], 4, generator=torch.Generator().manual_seed(1000 * self.global_rank + batch_idx)
        )
        last = (batch_idx + 1) % ACC == 0
        ones, zeros = torch.ones(x.shape[0], 1), torch.zeros(x.shape[0], 1)
        self.toggle_optimizer(opt_g)
        self.manual_backward(F.binary_cross_entropy_with_logits(self.d(self.g(z)), ones) / ACC)
        if last:
            opt_g.step()
            opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        real = F.binary_cross_entropy_with_logits(self.d(x), ones)
        fake = F.binary_cross_entropy_with_logits(self.d(self.g(z).detach()), zeros)
        self.manual_backward((real + fake) / ACC)
        if last:
            opt_d.step()
            opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

    def configure_optimizers(self) -> Any:
        return [
            torch.optim.AdamW(self.g.parameters(), lr=1e-2),
            torch.optim.AdamW(self.d.parameters(), lr=1e-2),
        ]


def _fit(strategy: Any) -> dict[str, Tensor]:
    data = TensorDataset(torch.randn(4 * BATCHES * 2, 8, generator=torch.Generator().manual_seed(5)))
    module = Gan()
    cpu_trainer(strategy, max_epochs=1).fit(module, DataLoader(data, batch_size=4))
    return final_state(module, strategy)


def _runs(rank: int, world: int) -> dict[str, dict[str, Tensor]]:
    out = {"ddp": _fit("ddp_find_unused_parameters_true")}
    for stage in (0, 1, 2, 3):
        strategy = HybridParallelStrategy(zero_stage=stage, find_unused_parameters=True, meta_init=False)
        out[f"zero{stage}"] = _fit(strategy)
    return out


def test_gan_with_accumulation_in_manual_optimization_equals_ddp() -> None:
    out = run_distributed(_runs, 2, init_group=False, timeout=300)[0]
    reference = out.pop("ddp")
    assert (reference["d.0.weight"] - Gan().d[0].weight).abs().max() > 1e-2  # both networks trained
    assert (reference["g.0.weight"] - Gan().g[0].weight).abs().max() > 1e-3
    for name, state in out.items():
        for key, value in reference.items():
            torch.testing.assert_close(state[key], value, msg=lambda m, n=name, k=key: f"{n} {k}: {m}")
