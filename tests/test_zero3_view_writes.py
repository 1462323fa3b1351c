"""An in-place write through a view of a ZeRO-3 unit's output, on 2 Gloo ranks, against ``"ddp"``.

Hugging Face's negative-binomial distribution head (time-series transformers) computes its logits with a
``Linear(d, 1)`` of an ``nn.ModuleList`` (a ZeRO-3 unit each) on a 3-D input, squeezes the output and adds
to it in place (``logits += scale.log()``). The write rebases the history onto the output's base, past the
output's own node where the unit's pre-backward gather hook sat: the unit's backward read its freed weights
and failed ("setStorage: ... out of bounds for storage of size 0"). The bases of output views are hooked
too now: the losses and weights equal ``"ddp"``'s.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state


class Heads(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 8)
        self.proj = nn.ModuleList([nn.Linear(8, 1), nn.Linear(8, 1)])  # as Hugging Face's projection
        self.losses: list[Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        h = torch.tanh(self.body(x))  # (batch, time, 8): each head's output is a view of its 2-D product
        mean, logits = (p(h).squeeze(-1) for p in self.proj)
        logits += y.abs().log().mean(1, keepdim=True)  # in place through the squeezed view
        loss = ((mean - y) ** 2 + logits.exp()).mean()
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(strategy: Any) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16, 5, 4, generator=g), torch.randn(16, 5, generator=g) + 3)
    module = Heads()
    cpu_trainer(strategy, max_steps=3).fit(module, DataLoader(data, batch_size=4))
    return {"losses": torch.stack(module.losses), "state": final_state(module, strategy)}


def _job(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {"ddp": _fit("ddp"), "zero3": _fit(HybridParallelStrategy(zero_stage=3))}


def test_an_in_place_write_through_a_view_of_a_units_output_equals_ddp() -> None:
    for rank, out in enumerate(run_distributed(_job, 2, init_group=False)):
        torch.testing.assert_close(out["zero3"]["losses"], out["ddp"]["losses"])
        if rank == 0:  # the consolidated state lands on rank 0
            torch.testing.assert_close(out["zero3"]["state"], out["ddp"]["state"])
