"""A contrastive loss over the global batch through a differentiable gather, on 4 Gloo ranks (tp2 x dp2).

SimCLR and CLIP losses gather every rank's embeddings with gradients (``self.all_gather(z,
sync_grads=True)``, ``fabric.all_gather(z, sync_grads=True)``). Under tensor parallelism the README
tells users to gather over the data-parallel group (the world holds each sample tp times). Before,
that form failed in the first backward: the strategies used torch's ``torch.distributed.nn.all_gather``,
whose backward on Gloo scatters from the group-local index as if it were a global rank, so a group not
made of ranks ``0..n-1`` raised "Global rank 0 is not part of group" (at tp2 x dp2 the dp groups are
ranks {0, 2} and {1, 3}). Now both front doors gather with ``lightning_par.data_reduce.gather_stacked``.

Checked against one process that computes the same loss over the global batch (the two dp ranks'
batches in rank order): the losses and the final weights of the Trainer at ZeRO-1 and of a Fabric loop
at ZeRO-3, and the gradient rule (each rank's slot gets the sum over the ranks of its gradient) in the
reference's terms. The world-group gather (no ``group``) keeps its documented shape: tp copies included.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from lightning_par.fabric import HybridParallelStrategy as FabricStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state
from tests.third_party import replay_order

WORLD, TP, DP, BATCH, STEPS, DIM = 4, 2, 2, 4, 3, 8
PLAN = {"encoder.enc.0": "colwise", "encoder.enc.2": "rowwise"}


def _data() -> TensorDataset:
    return TensorDataset(torch.randn(32, DIM, generator=torch.Generator().manual_seed(1)))


def _views(x: Tensor) -> tuple[Tensor, Tensor]:
    return x + 0.1 * torch.sin(3 * x), x - 0.1 * torch.cos(2 * x)


def _contrastive(z1: Tensor, z2: Tensor) -> Tensor:
    logits = 5.0 * z1 @ z2.T
    labels = torch.arange(len(z1))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, DIM))

    def forward(self, x: Tensor) -> Tensor:
        return F.normalize(self.enc(x), dim=-1)


class SimCLR(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.losses: list[Tensor] = []
        self.world_shape: tuple[int, ...] = ()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        a, b = _views(batch[0])
        dp_group = self.trainer.strategy.mesh.dp_group
        z1 = self.all_gather(self.encoder(a), sync_grads=True, group=dp_group).flatten(0, 1)
        z2 = self.all_gather(self.encoder(b), sync_grads=True, group=dp_group).flatten(0, 1)
        if batch_idx == 0:  # the world form, documented to hold each sample tp times
            self.world_shape = tuple(self.all_gather(self.encoder(a).detach()).shape)
        loss = _contrastive(z1, z2)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _trainer_run(world: int) -> dict[str, Any]:
    strategy = HybridParallelStrategy(zero_stage=1, tensor_parallel_size=TP, tp_plan=PLAN)
    module = SimCLR()
    trainer = cpu_trainer(strategy, devices=world, max_steps=STEPS)
    trainer.fit(module, DataLoader(_data(), batch_size=BATCH, shuffle=False))
    state = final_state(module, strategy)
    return {"losses": torch.stack(module.losses), "state": state, "world_shape": module.world_shape}


def _fabric_run(world: int) -> dict[str, Any]:
    strategy = FabricStrategy(zero_stage=3, tensor_parallel_size=TP, tp_plan=PLAN)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    net = nn.Module()
    net.encoder = Encoder()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    loader = fabric.setup_dataloaders(DataLoader(_data(), batch_size=BATCH, shuffle=False))
    dp_group = strategy.mesh.dp_group
    losses = []
    for _, (x,) in zip(range(STEPS), loader, strict=False):
        a, b = _views(x)
        z1 = fabric.all_gather(model.encoder(a), group=dp_group, sync_grads=True)
        z2 = fabric.all_gather(model.encoder(b), group=dp_group, sync_grads=True)
        loss = _contrastive(z1.flatten(0, 1), z2.flatten(0, 1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    state = strategy.consolidated_state_dict()
    strategy.destroy_process_groups()
    return {"losses": torch.stack(losses), "state": state}


def _runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {"trainer": _trainer_run(world), "fabric": _fabric_run(world)}


def _reference(order: list[list[int]]) -> dict[str, Any]:
    """One process over the global batches ``order`` (the dp ranks' batches in rank order)."""
    encoder = Encoder()
    optimizer = torch.optim.AdamW(encoder.parameters(), lr=1e-2)
    (data,) = _data().tensors
    losses = []
    for rows in order[:STEPS]:
        a, b = _views(data[rows])
        loss = _contrastive(encoder(a), encoder(b))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return {
        "losses": torch.stack(losses),
        "state": {f"encoder.{k}": v for k, v in encoder.state_dict().items()},
    }


def test_contrastive_loss_gathered_with_gradients_over_the_data_parallel_group() -> None:
    results = run_distributed(_runs, WORLD, init_group=False, timeout=300)
    n = len(_data())
    # Lightning's sampler shuffles training data (seed 0); Fabric's keeps a loader's order: dp rank r's
    # k-th batch is samples r + DP * (k * BATCH + j)
    orders = {
        "trainer": replay_order(n, dp=DP, micro=BATCH, epochs=1, seed=0),
        "fabric": [[r + DP * (k * BATCH + j) for r in range(DP) for j in range(BATCH)] for k in range(STEPS)],
    }
    for front, order in orders.items():
        reference = _reference(order)
        for rank, result in enumerate(results):
            torch.testing.assert_close(
                result[front]["losses"], reference["losses"], msg=f"{front} rank {rank}"
            )
        state = results[0][front]["state"]
        for name, value in reference["state"].items():
            torch.testing.assert_close(state[name], value, atol=2e-6, rtol=1e-5, msg=f"{front} {name}")
    assert results[0]["trainer"]["world_shape"] == (WORLD, BATCH, DIM)  # the world: tp copies included
