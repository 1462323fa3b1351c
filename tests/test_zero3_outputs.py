"""ZeRO-3 units whose modules return their tensors inside a dataclass or a ``UserDict``, on 2 Gloo ranks.

The engine finds a unit's output tensors to hook the unit's re-gather before its backward. It looked into
lists, tuples and dicts only: a block returning a dataclass (``Out(h=...)``) or a ``UserDict`` had its
outputs unseen, nothing gathered the unit for backward, and torch failed on the freed storage ("setStorage:
... out of bounds for storage of size 0"). Now mappings and dataclasses are looked into.

Checked: both forms at ZeRO-3 (blocks as units, resharded after forward) equal Lightning's ``"ddp"``.
"""

from __future__ import annotations

import dataclasses
from collections import UserDict
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state


@dataclasses.dataclass
class Out:
    h: Tensor


class Block(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.form = form

    def forward(self, x: Tensor) -> Any:
        h = torch.tanh(self.fc(x))
        return Out(h) if self.form == "dataclass" else UserDict({"h": h})


class Net(pl.LightningModule):
    def __init__(self, form: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(form) for _ in range(2)])
        self.head = nn.Linear(8, 1)

    def training_step(self, batch: tuple[Tensor, Tensor], index: int) -> Tensor:
        x, y = batch
        for block in self.blocks:
            out = block(x)
            x = out.h if isinstance(out, Out) else out["h"]
        return nn.functional.mse_loss(self.head(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, generator=g)), batch_size=4
    )


def _runs(rank: int, world: int) -> dict[str, dict[str, Tensor]]:
    torch.set_num_threads(1)
    out = {}
    for form in ("dataclass", "userdict"):
        for name, strategy in (("ddp", "ddp"), ("zero3", HybridParallelStrategy(zero_stage=3))):
            module = Net(form)
            cpu_trainer(strategy, max_steps=3).fit(module, _loader())
            out[f"{form}/{name}"] = final_state(module, strategy)
    return out


def test_units_returning_dataclasses_and_user_dicts_equal_ddp() -> None:
    out = run_distributed(_runs, 2, init_group=False)[0]
    for form in ("dataclass", "userdict"):
        assert_close(out[f"{form}/zero3"], out[f"{form}/ddp"], msg=form)
