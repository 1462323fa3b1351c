"""Buffers in a Fabric loop (BatchNorm statistics, a running input normaliser, a step counter), each rank
on its own data, on 2 Gloo ranks, against Fabric's ``"ddp"``.

DDP (``broadcast_buffers=True``) gives every rank the first rank's buffers before a forward that follows a
synchronising training forward, and before the first. The Trainer strategy did so; the Fabric strategy
did not, at any stage: each rank kept statistics of its own data, so the normalised inputs, the gradients
and the weights parted from ``"ddp"`` without a word (a probe: BatchNorm variance 7.7 apart between the
ranks, weights 2.5e-2 off). Now losses and weights equal Fabric's ``"ddp"`` on every rank at ZeRO 0, 1
and 3 (rank 0's buffers and evaluation too), with gradient accumulation under ``no_backward_sync``
(which does not synchronise, as DDP's ``no_sync``) and two forwards before each backward;
``broadcast_buffers=False`` keeps each rank's own, as DDP's. Forwards without gradients neither
synchronise nor count: code runs them on one rank (generation on rank 0, as the forward on rank 0 alone
here), so rank 1 evaluates with its own statistics of the last step where DDP's wrapper would take rank
0's first. (The broadcast writes without a version bump, as DDP's: a first version failed the backward
of two forwards, "modified by an inplace operation".)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import Tensor, nn

from lightning_par.fabric import HybridParallelStrategy
from tests.distributed import run_distributed

STEPS, ACCUMULATE = 3, 2


class Normalised(nn.Module):
    """A running input normaliser updated in forward, a BatchNorm and a counter of training forwards."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.fc1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.lerp_(x.mean(0), 0.5)
                self.seen += 1
        h = self.fc1(x - self.mean)
        return self.fc2(torch.relu(self.bn(h)) + h)  # the residual keeps the shift the norm would remove


def _batch(rank: int, step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, 4, generator=g) * (1 + 3 * rank) + rank  # the ranks' statistics differ
    return x, x.sum(1, keepdim=True)


def _loop(strategy: Any, rank: int) -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = Normalised()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    losses = []
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            x, y = _batch(rank, ACCUMULATE * step + micro)
            with fabric.no_backward_sync(model, enabled=micro < ACCUMULATE - 1):
                # two forwards before one backward (two views of a batch): the second one's broadcast
                # must leave the BatchNorm statistics the first saved for its backward usable
                loss = F.mse_loss(model(x), y) + F.mse_loss(model(0.5 * x), 0.5 * y)
                fabric.backward(loss)
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        out = model(_batch(rank, 99)[0])
    if isinstance(strategy, HybridParallelStrategy):
        with strategy.gathered_params(), torch.no_grad():  # (ZeRO-3 gathers on every rank here)
            if rank == 0:
                model(_batch(rank, 98)[0])  # on one rank (generation on rank 0): no collective waits
    if isinstance(strategy, HybridParallelStrategy):
        strategy.teardown()  # the whole model left behind (ZeRO-3's shards gathered)
        strategy.destroy_process_groups()
    state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    return {"losses": torch.stack(losses), "out": out, "state": state}


def _job(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    runs = {"ddp": _loop("ddp", rank)}
    for stage in (0, 1, 3):
        runs[f"zero{stage}"] = _loop(HybridParallelStrategy(zero_stage=stage), rank)
    runs["own"] = _loop(HybridParallelStrategy(zero_stage=1, broadcast_buffers=False), rank)
    return runs


def test_fabric_buffers_follow_ddp_broadcasts() -> None:
    ranks = run_distributed(_job, 2, init_group=False)
    for rank, runs in enumerate(ranks):
        ddp = runs["ddp"]
        weights = [k for k in ddp["state"] if k.endswith(("weight", "bias")) and "running" not in k]
        for name in ("zero0", "zero1", "zero3"):
            msg = lambda m, n=name, r=rank: f"rank {r} {n}: {m}"  # noqa: E731
            # the losses read the synchronised normaliser and statistics at every training forward
            torch.testing.assert_close(runs[name]["losses"], ddp["losses"], msg=msg)
            for key in weights:
                torch.testing.assert_close(runs[name]["state"][key], ddp["state"][key], msg=msg)
            if rank == 0:  # the evaluation forward synchronises under DDP, not here (the docstring)
                torch.testing.assert_close(runs[name]["out"], ddp["out"], msg=msg)
                torch.testing.assert_close(runs[name]["state"], ddp["state"], msg=msg)
        if rank == 1:  # each rank's own buffers (the control): its losses part from DDP's
            gap = (runs["own"]["losses"] - ddp["losses"]).abs().max()
            assert gap > 1e-3, gap
