"""Root parameters read after a forward without gradients at ZeRO-3, on 2 Gloo ranks, against ``"ddp"``.

The root unit (what no block owns: embeddings, a learnable temperature) was freed after every forward run
under ``torch.no_grad()``, so code after it read NaN placeholders, silently: a ``validation_step`` scoring
``self(x)`` with ``self.log_t`` logged NaN, a teacher pass under ``no_grad`` in ``training_step`` left the
temperature NaN for the rest of the step, and a Fabric evaluation (or GradCache's ``no_grad`` encodes
followed by the loss over the temperature) computed and trained NaN. The root now stays gathered after
such a forward, as FSDP2's root does, until the step ends or the next optimizer step.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from lightning_par.fabric import HybridParallelStrategy as FabricStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state


class Scorer(nn.Module):
    """Two blocks (ZeRO-3 units) under an embedding and a temperature that belong to the root."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.log_t = nn.Parameter(torch.tensor(0.05).log())

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return h.mean(1)

    def scored(self, e: Tensor) -> Tensor:
        return e.sum() / self.log_t.exp()


def _tokens() -> Tensor:
    return torch.randint(0, 16, (32, 5), generator=torch.Generator().manual_seed(0))


def _loss(model: Any, x: Tensor, seen: list[Tensor]) -> Tensor:
    with torch.no_grad():
        target = model(x).flip(0)  # a teacher pass of the same model
        seen.append(model.log_t.detach().clone())  # read after it, before the next forward
    return ((model(x) - target) ** 2).mean() / model.log_t.exp()


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Scorer()
        self.seen: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    @property
    def log_t(self) -> nn.Parameter:
        return self.net.log_t

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return _loss(self, batch[0], self.seen)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.seen.append(self.net.scored(self(batch[0])).detach().clone())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(strategy: Any) -> dict[str, Any]:
    data = TensorDataset(_tokens())
    module = Module()
    trainer = cpu_trainer(
        strategy, max_steps=3, val_check_interval=2, limit_val_batches=2, num_sanity_val_steps=0
    )
    trainer.fit(module, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    return {"seen": torch.stack(module.seen), "state": final_state(module, strategy)}


def _fabric(strategy: Any) -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    net = Scorer()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x = _tokens()[4 * fabric.global_rank :][:4]
    seen: list[Tensor] = []
    for _ in range(2):
        fabric.backward(_loss(model, x, seen))
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # an evaluation between steps
            seen.append(net.scored(model(x)).clone())
    with fabric.strategy.gathered_params() if strategy != "ddp" else torch.no_grad():
        state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return {"seen": torch.stack(seen), "state": state}


def _job(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {"trainer_ddp": _trainer("ddp"), "trainer_zero3": _trainer(HybridParallelStrategy(zero_stage=3))}
    out["fabric_ddp"] = _fabric("ddp")
    strategy = FabricStrategy(zero_stage=3)
    out["fabric_zero3"] = _fabric(strategy)
    strategy.destroy_process_groups()
    return out


def test_root_parameters_read_after_a_forward_without_gradients_equal_ddp() -> None:
    for rank, out in enumerate(run_distributed(_job, 2, init_group=False)):
        for front in ("trainer", "fabric"):
            ddp, ours = out[f"{front}_ddp"], out[f"{front}_zero3"]
            assert ddp["seen"].isfinite().all() and len(ddp["seen"]) >= 4
            torch.testing.assert_close(ours["seen"], ddp["seen"], msg=lambda m, f=front: f"{f}: {m}")
            if rank == 0 or front == "fabric":  # the Trainer's consolidated state lands on rank 0
                torch.testing.assert_close(ours["state"], ddp["state"], msg=lambda m, f=front: f"{f}: {m}")
