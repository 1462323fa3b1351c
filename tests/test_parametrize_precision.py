"""Parametrized weights (``torch.nn.utils.parametrize``) in ``"bf16-mixed"`` at ZeRO 1-3, against ``"ddp"``.

Under ``"ddp"``'s mixed precision a parametrization computes from its fp32 original; at ZeRO 1-3 the
original the module holds is the engine's bf16 compute copy, and the parametrization computed from that:
torch's ``orthogonal`` (``matrix_exp``) gave NaN gradients (every weight NaN after the second step, no
word), ``weight_norm`` and a user's own trained 1e-3 to 7e-2 off ``"ddp"``, and reading the weight
outside a step failed ("expected m1 and m2 to have the same dtype": ``orthogonal``'s fp32 ``base`` beside
the bf16 original). Now every parametrization computes from fp32 casts of its originals
(``lightning_par.module_dtypes.parametrizations_in_fp32``), as under ``"ddp"``; the rest of the model
computes with bf16 copies of the fp32 masters as before, so ours equals ``"ddp"`` within bf16 rounding
(as for spectral norm, ``tests/test_spectral_norm_precision.py``), in the Trainer and in a Fabric loop.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.nn.utils import parametrizations, parametrize
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from lightning_par.fabric import HybridParallelStrategy as FabricStrategy
from lightning_par.module_dtypes import parametrizations_in_fp32, restore_norms
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state

STEPS = 4


class Scaled(nn.Module):
    """A user's own parametrization."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(x.mean())


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    parametrizations.weight_norm(net[0])
    parametrizations.orthogonal(net[2])  # matrix_exp: NaN gradients from a bf16 original
    parametrize.register_parametrization(net[4], "weight", Scaled())
    return net


def test_the_parametrizations_compute_from_fp32_originals() -> None:
    net = _net()
    with torch.no_grad():
        for p in net.parameters():
            p.data = p.data.to(torch.bfloat16)  # the engine's compute copies
    parametrizations_in_fp32(net)
    assert net[2].weight.dtype == torch.float32  # before: the dtype error against the fp32 base
    net[2].weight.sum().backward()
    original = net[2].parametrizations.weight.original
    assert original.grad is not None and original.grad.dtype == torch.bfloat16
    assert bool(original.grad.isfinite().all())
    restore_norms(net)
    assert "forward" not in net[2].parametrizations.weight.__dict__


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.losses: list[float] = []
        self.read: Tensor | None = None

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(float(loss))
        return loss

    def on_train_end(self) -> None:
        self.read = self.net[2].weight.detach().float().clone()  # a read outside a step

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.2)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    return TensorDataset(x, torch.tanh(x.sum(1, keepdim=True)))


def _fabric_run(strategy: Any, world: int, rank: int) -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="bf16-mixed")
    fabric.launch()
    net = _net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.2))
    x, y = _data().tensors
    losses = []
    for step in range(STEPS):
        rows = slice(16 * step + 8 * rank, 16 * step + 8 * rank + 8)
        loss = F.mse_loss(model(x[rows]), y[rows])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    if isinstance(strategy, FabricStrategy):
        strategy.destroy_process_groups()
    return {"losses": losses}


def _runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name in ("ddp", "zero1", "zero3"):
        strategy: Any = "ddp" if name == "ddp" else HybridParallelStrategy(zero_stage=int(name[-1]))
        module = Model()
        trainer = cpu_trainer(strategy, devices=world, max_steps=STEPS, precision="bf16-mixed")
        trainer.fit(module, DataLoader(_data(), batch_size=8))
        out[name] = {
            "losses": module.losses,
            "read": module.read,
            "state": {k: v.float() for k, v in final_state(module, strategy).items()},
        }
    out["fabric_ddp"] = _fabric_run("ddp", world, rank)
    out["fabric_zero1"] = _fabric_run(FabricStrategy(zero_stage=1), world, rank)
    return out


def test_parametrized_weights_train_in_bf16_mixed_as_under_ddp() -> None:
    results = run_distributed(_runs, 2, init_group=False, timeout=300)
    for rank, out in enumerate(results):
        ddp = out["ddp"]
        for stage in ("zero1", "zero3"):
            got = out[stage]
            # bf16 rounding of the compute copies (the parametrizations compute in fp32 as under "ddp")
            torch.testing.assert_close(got["losses"], ddp["losses"], rtol=2e-2, atol=2e-3)
            torch.testing.assert_close(got["read"], ddp["read"], rtol=2e-2, atol=5e-3)
            if rank == 0:
                assert got["state"].keys() == ddp["state"].keys()
                torch.testing.assert_close(got["state"], ddp["state"], rtol=2e-2, atol=5e-3)
        fabric = out["fabric_zero1"]["losses"]
        torch.testing.assert_close(fabric, out["fabric_ddp"]["losses"], rtol=2e-2, atol=2e-3)
