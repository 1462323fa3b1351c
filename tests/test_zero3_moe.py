"""A mixture of experts at ZeRO-3 with the default units, on 2 Gloo ranks, against DDP.

A hand-written MoE block (a router, top-1 routing with ``torch.topk``, its experts in an ``nn.ModuleList``
inside the block, tokens dispatched with ``index_select`` / ``index_add_``, an expert no token chose not
called, a Switch-style load-balancing loss) routes each rank's tokens to its own experts. Before, the
default unit policy took the children of *every* ``nn.ModuleList``, each expert a unit of its own,
gathered only on the ranks whose tokens chose it: the all-gathers paired up differently on the two ranks
(Gloo: "Received data size doesn't match expected size", a hang on NCCL) in the first step, with or
without ``find_unused_parameters``. Now a list inside a block stays in the block's unit, and the
name pattern ``"blocks.*"`` (whose ``*`` crosses dots) selects the blocks, not every module inside them:
both equal ``DDPStrategy(find_unused_parameters=True)``.
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

EXPERTS, DIM, STEPS = 4, 8, 6


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 16), nn.GELU(), nn.Linear(16, DIM)) for _ in range(EXPERTS)
        )

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, list[int]]:
        probs = self.router(x).softmax(-1)
        weight, choice = probs.topk(1, dim=-1)
        out = torch.zeros_like(x)
        used = []
        for e, expert in enumerate(self.experts):
            rows = (choice[:, 0] == e).nonzero().squeeze(-1)
            if rows.numel() == 0:  # no token chose it on this rank: not called
                continue
            used.append(e)
            out = out.index_add(0, rows, expert(x.index_select(0, rows)) * weight[rows])
        share = F.one_hot(choice[:, 0], EXPERTS).float().mean(0)
        balance = EXPERTS * (share * probs.mean(0)).sum()
        return x + out, balance, used


class MoENet(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(MoE() for _ in range(2))
        self.head = nn.Linear(DIM, 1)
        self.used: list[list[int]] = []  # per step, the experts of the first block this rank called

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        aux = x.new_zeros(())
        for i, block in enumerate(self.blocks):
            x, balance, used = block(x)
            aux = aux + balance
            if i == 0:
                self.used.append(used)
        return F.mse_loss(self.head(x).squeeze(-1), y) + 0.01 * aux

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def _fit(strategy: Any) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module = MoENet()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, DIM, generator=g) * 2, torch.randn(48, generator=g))
    trainer = cpu_trainer(strategy, max_steps=STEPS)
    trainer.fit(module, DataLoader(data, batch_size=2))
    return {"state": final_state(module, strategy), "used": module.used}


def _runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {"ddp": _fit(DDPStrategy(find_unused_parameters=True))}
    out["default"] = _fit(HybridParallelStrategy(zero_stage=3, find_unused_parameters=True))
    out["pattern"] = _fit(
        HybridParallelStrategy(zero_stage=3, find_unused_parameters=True, zero3_units=["blocks.*"])
    )
    return out


def test_experts_routed_apart_on_each_rank_equal_ddp_at_zero3() -> None:
    ranks = run_distributed(_runs, 2, init_group=False, timeout=300)
    used = [r["ddp"]["used"] for r in ranks]
    assert len(used[0]) == STEPS
    assert any(a != b for a, b in zip(*used, strict=True))  # the ranks called different experts in some step
    reference = ranks[0]["ddp"]["state"]
    for run in ("default", "pattern"):
        got = ranks[0][run]
        assert [r[run]["used"] for r in ranks] == used
        assert got["state"].keys() == reference.keys()
        for key, value in reference.items():
            torch.testing.assert_close(got["state"][key], value, msg=lambda m, k=key, r=run: f"{r} {k}: {m}")
