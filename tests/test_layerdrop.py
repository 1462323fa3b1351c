"""Layer drop: whole layers (ZeRO-3 units) skipped in some steps, on 2 Gloo ranks, against DDP.

Hugging Face's speech and encoder-decoder models (``layerdrop`` in wav2vec2, HuBERT, Whisper, BART) skip a
random subset of their layers in each training forward, drawn from torch's generator. Under Lightning's
``seed_everything`` every rank draws the same subset, so at ZeRO-3 every rank skips the same units: their
all-gathers are skipped alike, and their parameters get no gradient in that step.

A residual stack of four layers with dropout, each skipped with probability 0.4, AdamW with weight decay,
``find_unused_parameters=True`` on both sides: ZeRO 0-3 end with the weights of Lightning's
``DDPStrategy(find_unused_parameters=True)`` (a parameter no rank used keeps ``grad=None`` and AdamW skips
it, weight decay included, as under DDP). The run skips layers in several steps and keeps some in each.

Every rank must skip the same units at ZeRO-3, as under FSDP and DeepSpeed's stage 3: a rank that skips a
unit another rank runs leaves their all-gathers unmatched (README, Troubleshooting).

A mixture of experts skips modules per rank by design: a hand-written MoE block (a router, top-1 routing
with ``torch.topk``, its experts in an ``nn.ModuleList`` inside the block, tokens dispatched with
``index_select`` / ``index_add``, an expert no token chose not called, a Switch-style load-balancing loss)
routes each rank's tokens to its own experts. Before, the default unit policy took the children of *every*
``nn.ModuleList``, each expert a unit of its own, gathered only on the ranks whose tokens chose it: the
all-gathers paired up differently on the two ranks (Gloo: "Received data size doesn't match expected
size", a hang on NCCL) in the first step, with or without ``find_unused_parameters``. Now a list inside a
block stays in the block's unit, and the name pattern ``"blocks.*"`` (whose ``*`` crosses dots) selects
the blocks, not every module inside them. A block whose experts all got tokens on one rank but not on the
other was reduced mid-backward on the first and at backward's end on the second, so the ranks' reductions
and gathers came in different orders: a hang with three blocks. Now a unit that got some gradients is
launched when backward reaches the next unit, on every rank. Both equal
``DDPStrategy(find_unused_parameters=True)``; so do blocks whose optional branch (a GNN's edge features)
runs on rank 0 only (before, a hang in the first backward), and without ``find_unused_parameters`` the
rank that missed them refuses at the end of that backward, naming the option (before, the same hang).
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

WORLD, LAYERS, DROP, STEPS = 2, 4, 0.4, 8
EXPERTS, DIM = 4, 8


class LayerDrop(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1)) for _ in range(LAYERS))
        self.head = nn.Linear(8, 1)
        self.skipped: list[list[int]] = []  # per step, the layers skipped

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        skipped = []
        for i, layer in enumerate(self.layers):
            if torch.rand(()) < DROP:  # the same draw on every rank (seed_everything)
                skipped.append(i)
                continue
            x = x + torch.tanh(layer(x))
        self.skipped.append(skipped)
        return F.mse_loss(self.head(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)


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


class ThreeBlocks(pl.LightningModule):
    """Three blocks of ``block`` in an ``nn.ModuleList`` and a head, trained with AdamW."""

    block: type[nn.Module]

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(self.block() for _ in range(3))
        self.head = nn.Linear(DIM, 1)
        self.skipped: list[list[int]] = []  # per step, what this rank left out (MoE: the experts it called)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05)


class EdgeBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.edge = nn.Linear(DIM, DIM), nn.Linear(3, DIM)

    def forward(self, x: Tensor, edges: Tensor | None) -> Tensor:
        if edges is not None:  # an optional branch (a GNN's edge features, when the batch has them)
            x = x + self.edge(edges)
        return torch.tanh(self.lin(x))


class MoENet(ThreeBlocks):
    block = MoE

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        aux = x.new_zeros(())
        for i, block in enumerate(self.blocks):
            x, balance, used = block(x)
            aux = aux + balance
            if i == 0:
                self.skipped.append(used)
        return F.mse_loss(self.head(x).squeeze(-1), y) + 0.01 * aux


class EdgeNet(ThreeBlocks):
    """Blocks whose edge branch runs on rank 0 only: a unit's parameters unused on one rank."""

    block = EdgeBlock

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        edges = x[:, :3].cos() if self.global_rank == 0 else None
        for block in self.blocks:
            x = block(x, edges)
        self.skipped.append([] if edges is not None else [0, 1, 2])
        return F.mse_loss(self.head(x).squeeze(-1), y)


def _fit(strategy: Any, model: type[pl.LightningModule] = LayerDrop, batch: int = 4) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module = model()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g) * 2, torch.randn(64, generator=g))
    trainer = cpu_trainer(strategy, max_steps=STEPS)
    trainer.fit(module, DataLoader(data, batch_size=batch))
    return {"state": final_state(module, strategy), "skipped": module.skipped}


def _runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {"ddp": _fit(DDPStrategy(find_unused_parameters=True))}
    for stage in range(4):
        out[f"zero{stage}"] = _fit(HybridParallelStrategy(zero_stage=stage, find_unused_parameters=True))
    # the mixture of experts, 6 samples per rank and step: the ranks call different experts, and in some
    # steps one rank calls every expert of a block where the other does not
    moe = {"ddp": _fit(DDPStrategy(find_unused_parameters=True), MoENet, 6)}
    for name, units in (("default", None), ("pattern", ["blocks.*"])):
        zero3 = HybridParallelStrategy(zero_stage=3, find_unused_parameters=True, zero3_units=units)
        moe[name] = _fit(zero3, MoENet, 6)
    # an optional branch inside every block, run on rank 0 only
    edges = {"ddp": _fit(DDPStrategy(find_unused_parameters=True), EdgeNet)}
    edges["zero3"] = _fit(HybridParallelStrategy(zero_stage=3, find_unused_parameters=True), EdgeNet)
    strict = HybridParallelStrategy(zero_stage=3)  # refused at backward's end (before, a hang)
    try:
        _fit(strict, EdgeNet)
        edges["strict"] = "not refused"
    except RuntimeError as error:
        edges["strict"] = str(error)
        strict.destroy_process_groups()
    return {"layer_drop": out, "moe": moe, "edges": edges}


def test_layer_drop_and_experts_equal_ddp() -> None:
    ranks = run_distributed(_runs, WORLD, init_group=False, timeout=300)
    out = ranks[0]["layer_drop"]
    skipped = out["ddp"]["skipped"]
    assert len(skipped) == STEPS
    assert sum(1 for s in skipped if s) >= 3  # layers were skipped in several steps ...
    assert all(len(s) < LAYERS for s in skipped)  # ... and some ran in each
    assert ranks[1]["layer_drop"]["ddp"]["skipped"] == skipped  # the same draws on both ranks
    reference = out["ddp"]["state"]
    for stage in range(4):
        run = out[f"zero{stage}"]
        assert run["skipped"] == skipped
        assert run["state"].keys() == reference.keys()
        for key, value in reference.items():
            torch.testing.assert_close(
                run["state"][key], value, msg=lambda m, k=key, s=stage: f"zero{s} {k}: {m}"
            )
    # the mixture of experts at ZeRO-3, default units and a name pattern
    used = [r["moe"]["ddp"]["skipped"] for r in ranks]
    assert len(used[0]) == STEPS
    assert any(a != b for a, b in zip(*used, strict=True))  # the ranks called different experts in some step
    assert any(len(a) == EXPERTS > len(b) for a, b in zip(*used, strict=True))  # all on rank 0 only
    reference = ranks[0]["moe"]["ddp"]["state"]
    for name in ("default", "pattern"):
        got = ranks[0]["moe"][name]
        assert [r["moe"][name]["skipped"] for r in ranks] == used
        assert got["state"].keys() == reference.keys()
        for key, value in reference.items():
            torch.testing.assert_close(got["state"][key], value, msg=lambda m, k=key, n=name: f"{n} {k}: {m}")
    edges = ranks[0]["edges"]
    for key, value in edges["ddp"]["state"].items():
        torch.testing.assert_close(
            edges["zero3"]["state"][key], value, msg=lambda m, k=key: f"edges {k}: {m}"
        )
    # without the option the rank that missed them refuses, naming it (no collective decides it, as
    # lightning_par/zero/unused.py says: the other rank's job then ends on the lost connection)
    strict = ranks[1]["edges"]["strict"]
    assert "got no gradient" in strict and "find_unused_parameters=True" in strict, strict
    assert ranks[0]["edges"]["strict"] != "not refused"
