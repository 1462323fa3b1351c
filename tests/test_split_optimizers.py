"""A model split over two optimizers, both stepped after one backward, on 2 Gloo ranks, against ``"ddp"``.

Muon for the matrices and AdamW for the rest, or a head with its own learning rate, are set up as two
optimizers over one backward: ``backward(); opt_body.step(); opt_head.step()``. At ZeRO 1-3 the first
step opened a new gradient window (the masters' gradients dropped, the reduced shards zeroed), so the
second optimizer found no gradients and its parameters did not move, silently: the head stayed where it
started (an update of 0 where one process moved it 0.012), and with clipping and AdamW the weights ended
0.11 away from ``"ddp"``. Now the window opens at the next backward, so every optimizer stepped after a
backward finds its gradients.

Checked at ZeRO 1-3, in a Fabric loop (with per-optimizer clipping) and in a Trainer's manual
optimization step: the final weights equal ``"ddp"``'s.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from lightning_par.fabric import HybridParallelStrategy as FabricStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _optimizers(net: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    body = [p for name, p in net.named_parameters() if not name.startswith("4.")]
    return torch.optim.AdamW(body, lr=0.02), torch.optim.SGD(net[4].parameters(), lr=0.1)  # type: ignore[index]


def _fabric(rank: int, strategy: Any) -> dict[str, Tensor]:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    net = _net()
    model, opt_body, opt_head = fabric.setup(net, *_optimizers(net))
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        fabric.backward((model(x) - y).pow(2).mean())
        fabric.clip_gradients(model, opt_body, max_norm=0.5)
        opt_body.step()
        fabric.clip_gradients(model, opt_head, max_norm=0.5)  # the head's gradients, after the body's step
        opt_head.step()
        opt_body.zero_grad()
        opt_head.zero_grad()
    ours = isinstance(strategy, FabricStrategy)
    with fabric.strategy.gathered_params() if ours else nullcontext():
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if ours:
        strategy.destroy_process_groups()
    return state


class Split(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.automatic_optimization = False

    def training_step(self, batch: tuple[Tensor, Tensor], index: int) -> None:
        x, y = batch
        opt_body, opt_head = self.optimizers()  # type: ignore[misc]
        self.manual_backward((self.net(x) - y).pow(2).mean())
        opt_body.step()
        opt_head.step()
        opt_body.zero_grad()
        opt_head.zero_grad()

    def configure_optimizers(self) -> Any:
        return _optimizers(self.net)


def _trainer(strategy: Any) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(
        TensorDataset(torch.randn(24, 8, generator=g), torch.randn(24, 1, generator=g)), batch_size=4
    )
    module = Split()
    cpu_trainer(strategy, max_epochs=1).fit(module, loader)
    return final_state(module, strategy)


def _runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {"fabric/ddp": _fabric(rank, "ddp"), "trainer/ddp": _trainer("ddp")}
    for stage in (1, 2, 3):
        out[f"fabric/zero{stage}"] = _fabric(rank, FabricStrategy(zero_stage=stage))
        out[f"trainer/zero{stage}"] = _trainer(HybridParallelStrategy(zero_stage=stage))
    return out


def test_two_optimizers_stepped_after_one_backward_equal_ddp() -> None:
    out = run_distributed(_runs, 2, init_group=False)[0]
    start = _net().state_dict()
    for door, head in (("fabric", "4.weight"), ("trainer", "net.4.weight")):
        assert (out[f"{door}/ddp"][head] - start["4.weight"]).abs().max() > 1e-3  # the head moved
        for stage in (1, 2, 3):
            assert_close(out[f"{door}/zero{stage}"], out[f"{door}/ddp"], msg=f"{door} zero{stage}")
