"""Fabric's separate setup calls and a fine-tune's partial load, against Fabric's ``"ddp"`` on 2 Gloo ranks.
Each was found by a probe:

* ``model = fabric.setup_module(model)`` then ``opt_g, opt_d = fabric.setup_optimizers(opt_g, opt_d)``
  (the README's meta-init order, with a GAN's two optimizers) was refused at every ZeRO stage: Fabric
  hands the optimizers over one call each, and the second was taken for a repeated setup ("already set
  up; pass all of them in one ... setup_optimizers(*optimizers) call", the call that failed). Now they
  are recorded and sharded together at their first use (here a ``fabric.save`` before the first
  forward, the first forward, or an EMA of the weights asked for right after), and train as ``"ddp"``;
  an optimizer set up after that is refused, and so is the same module set up again (before, at ZeRO-3,
  as a placeholder read by Fabric's move to the device).
* ``fabric.load(path, {"model": model}, strict=False)`` into a model with a new head (a fine-tune) was
  refused for every checkpoint of ours ("missing in the checkpoint: ['aux.bias', 'aux.weight']"),
  ``strict`` notwithstanding. Now the names both hold load, as torch's ``load_state_dict(strict=False)``
  does, and the head keeps its initial values; a shape that differs is still refused. The Trainer takes
  ``LightningModule.strict_loading = False`` the same way (``trainer.validate(ckpt_path=...)``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy as TrainerStrategy
from lightning_par.fabric import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer

WORLD, STEPS = 2, 3


class Net(nn.Module):
    """A generator and a critic (two optimizers); ``aux``: the new head of a fine-tune."""

    def __init__(self, *, aux: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.g, self.d = nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        if aux:
            torch.manual_seed(1)
            self.aux = nn.Linear(8, 2)

    def forward(self, z: Tensor, step: str) -> Tensor:
        fake = self.g(z)
        loss = F.softplus(-self.d(fake)) if step == "g" else F.softplus(self.d(fake.detach()))
        extra = self.aux(z).square().mean() if hasattr(self, "aux") else 0.0
        return loss.mean() + extra + sum((0.0 * p.sum() for p in self.parameters()), torch.zeros(()))


def _batch(rank: int, step: int) -> Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))


def _fabric(strategy: Any) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    return fabric


def _weights(fabric: Fabric, model: Any) -> dict[str, Tensor]:
    ours = isinstance(fabric.strategy, HybridParallelStrategy)
    with fabric.strategy.gathered_params() if ours else nullcontext():  # type: ignore[attr-defined]
        return {k: v.detach().clone() for k, v in model.module.named_parameters()}


def _steps(fabric: Fabric, model: Any, opt_g: Any, opt_d: Any, *, rank: int) -> list[float]:
    losses = []
    for step in range(STEPS):
        for which, opt in (("g", opt_g), ("d", opt_d)):
            loss = model(_batch(rank, step), which)
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses


def _run(rank: int, name: str, make: Callable[[], Any], root: Path) -> dict[str, Any]:
    strategy = make()
    fabric = _fabric(strategy)
    ours = isinstance(strategy, HybridParallelStrategy)
    net = fabric.setup_module(Net())
    opt_g = torch.optim.Adam(net.g.parameters(), lr=0.01)
    opt_d = torch.optim.SGD(net.d.parameters(), lr=0.1, momentum=0.9)
    opt_g, opt_d = fabric.setup_optimizers(opt_g, opt_d)  # before: the second one refused
    fabric.save(root / f"{name}_start", {"model": net, "opt_g": opt_g, "opt_d": opt_d})  # a first use
    out: dict[str, Any] = {"losses": _steps(fabric, net, opt_g, opt_d, rank=rank)}
    out["trained"] = _weights(fabric, net)
    if ours:
        try:
            fabric.setup_optimizers(torch.optim.SGD(net.g.parameters(), lr=0.1))
            out["late"] = None
        except ValueError as error:
            out["late"] = str(error)
        try:  # the same module again: named before Fabric moves it (before, at ZeRO-3 a placeholder read)
            fabric.setup_module(net.module)
            out["twice"] = None
        except ValueError as error:
            out["twice"] = str(error)
    path = root / name
    fabric.save(path, {"model": net, "opt_g": opt_g, "opt_d": opt_d})
    if ours:
        strategy.destroy_process_groups()
    # a fine-tune: the weights into a model with a new head, strict=False, then trained on
    fabric = _fabric(make())
    tuned = Net(aux=True)
    head = {k: v.clone() for k, v in tuned.aux.state_dict().items()}
    tuned, tune_opt = fabric.setup(tuned, torch.optim.SGD(tuned.parameters(), lr=0.05))
    fabric.load(path, {"model": tuned}, strict=False)
    out["loaded"] = _weights(fabric, tuned)
    out["head"] = head
    loss = tuned(_batch(rank, 9), "g")
    fabric.backward(loss)
    tune_opt.step()
    out["tuned"] = _weights(fabric, tuned)
    if ours:
        try:
            fabric.load(path, {"model": tuned})  # strict: the missing head is named
            out["strict"] = None
        except ValueError as error:
            out["strict"] = str(error)
        fabric.strategy.destroy_process_groups()  # type: ignore[attr-defined]
    return out


def _averaged(rank: int, stage: int) -> dict[str, Tensor]:
    """An EMA asked for right after setup_optimizers, before the optimizers are sharded: it binds to what
    it averages at its first update, after the first forward, so it follows their shards (at ZeRO 1-3 the
    fp32 masters) and equals ZeRO-0's, which averages the parameters."""
    strategy = HybridParallelStrategy(zero_stage=stage)
    fabric = _fabric(strategy)
    net = fabric.setup_module(Net())
    opt_g, opt_d = fabric.setup_optimizers(
        torch.optim.Adam(net.g.parameters(), lr=0.01), torch.optim.Adam(net.d.parameters(), lr=0.01)
    )
    averages = strategy.weight_averages(decay=0.5)
    for step in range(STEPS):
        for which, opt in (("g", opt_g), ("d", opt_d)):
            fabric.backward(net(_batch(rank, step), which))
            opt.step()
            opt.zero_grad()
        averages.update()
    averages.copy_to_targets()
    out = _weights(fabric, net)
    strategy.destroy_process_groups()
    return out


class Regression(pl.LightningModule):
    def __init__(self, *, aux: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        if aux:
            self.aux = nn.Linear(4, 1)
            self.strict_loading = False

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y) + (self.aux(x).square().mean() if hasattr(self, "aux") else 0)
        self.log("val", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.05)


def _trainer_validation(name: str, make: Callable[[], Any], root: Path) -> float:
    strategy = make()
    generator = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(16, 4, generator=generator), torch.randn(16, 1, generator=generator))
    trainer = cpu_trainer(strategy, max_steps=3)
    trainer.fit(Regression(), DataLoader(data, batch_size=4))
    path = root / f"{name}.ckpt"
    trainer.save_checkpoint(path)
    if isinstance(strategy, TrainerStrategy):
        strategy.destroy_process_groups()
    strategy = make()
    trainer = cpu_trainer(strategy)
    (metrics,) = trainer.validate(Regression(aux=True), DataLoader(data, batch_size=4), ckpt_path=path)
    if isinstance(strategy, TrainerStrategy):
        strategy.destroy_process_groups()
    return float(metrics["val"])


def _job(rank: int, world: int, tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    root = Path(tmp)
    layouts: dict[str, Callable[[], Any]] = {
        "ddp": lambda: "ddp",
        "zero1": lambda: HybridParallelStrategy(zero_stage=1),
        "zero3": lambda: HybridParallelStrategy(zero_stage=3),
        "zero3_file": lambda: HybridParallelStrategy(zero_stage=3, save_distributed_checkpoint=False),
    }
    out: dict[str, Any] = {name: _run(rank, name, make, root) for name, make in layouts.items()}
    out["averaged"] = {stage: _averaged(rank, stage) for stage in (0, 1, 3)}
    trainers: dict[str, Callable[[], Any]] = {
        "ddp": lambda: "ddp",
        "zero3": lambda: TrainerStrategy(zero_stage=3),
    }
    out["validate"] = {name: _trainer_validation(name, make, root) for name, make in trainers.items()}
    return out


def test_setup_optimizers_one_by_one_and_a_partial_load_as_under_ddp(tmp_path: Path) -> None:
    for out in run_distributed(_job, WORLD, str(tmp_path), init_group=False, timeout=300):
        reference = out["ddp"]
        for name in ("zero1", "zero3", "zero3_file"):
            got = out[name]
            torch.testing.assert_close(got["losses"], reference["losses"])
            for key in ("trained", "loaded", "tuned"):
                torch.testing.assert_close(
                    got[key], reference[key], msg=lambda m, n=name, k=key: f"{n} {k}: {m}"
                )
            for k, v in got["head"].items():  # the new head kept its initial values through the load
                torch.testing.assert_close(got["loaded"][f"aux.{k}"], v, rtol=0, atol=0)
            assert "already set up" in got["late"] and "before the model's first forward" in got["late"], got
            assert "This module was already set up by lightning_par" in got["twice"], got["twice"]
            assert "missing in the checkpoint: ['aux.bias', 'aux.weight']" in got["strict"], got["strict"]
            assert "strict=False" in got["strict"], got["strict"]
        for k in reference["trained"]:  # the loaded weights are the trained ones, the new head aside
            torch.testing.assert_close(reference["loaded"][k], reference["trained"][k], rtol=0, atol=0)
        averaged = out["averaged"]
        assert (averaged[0]["g.weight"] - reference["trained"]["g.weight"]).abs().max() > 1e-4  # an average
        for stage in (1, 3):
            torch.testing.assert_close(averaged[stage], averaged[0], msg=lambda m, s=stage: f"EMA {s}: {m}")
        # before, refused: "missing in the checkpoint: ['aux.bias', 'aux.weight']"
        torch.testing.assert_close(out["validate"]["zero3"], out["validate"]["ddp"])
