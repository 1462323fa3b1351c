"""Mixed-precision flows of users' Lightning code, against Lightning's / Fabric's own ``"ddp"`` with the same
precision, on 2 Gloo ranks. Each was silently different (or failing) before:

* Manual optimization with two updates inside one ``training_step`` (an inner loop; a GAN's two
  optimizers) under ``"bf16-mixed"`` without fp32 masters (ZeRO-0, or ``master_weights=False``): the
  second forward reused autocast's casts of the weights from before the first update (0.18 off
  ``"ddp"``). Autocast now runs without its weight-cast cache, as Lightning's ``MixedPrecision``.
* ``"bf16-true"`` at ZeRO-1/2: ``trainer.validate`` / ``predict`` without a fit failed ("mat1 and mat2
  must have the same dtype"): the module stayed fp32 for masters no evaluation builds. An evaluation
  run converts the module as stage 0 and ``"ddp"`` do; Fabric refuses a forward before
  ``setup_optimizers`` with the fix.
* A user's ``GradScaler(init_scale=..., growth_interval=...)`` in Lightning's / Fabric's
  ``MixedPrecision("16-mixed")`` was replaced by the default scale (65536, growth every 2000 steps); its
  settings are carried over. A ``"ddp"`` fp16 checkpoint's scale was dropped on resume with our strategy
  (another checkpoint key); it is read, and ours is written in the GradScaler format too, so a ``"ddp"``
  run resumes from our scale. ``trainer.scaler.get_scale()`` works (before, AttributeError).
* Fabric, two optimizers clipped after one backward under fp16: the second one's gradients were clipped
  still scaled (its returned norm 1064 where ``"ddp"`` gives 1.04); each optimizer is now unscaled once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixed
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy, ParallelPrecision
from lightning_par.fabric import HybridParallelStrategy as FabricStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state


def _data(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


class InnerSteps(pl.LightningModule):
    """Two SGD updates on each batch: the second loss must see the once-updated weights."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = _net()

    def training_step(self, batch: Any, index: int) -> None:
        x, y = batch
        opt = self.optimizers()
        for _ in range(2):
            loss = F.mse_loss(self.net(x).float(), y)
            self.manual_backward(loss)
            opt.step()  # type: ignore[union-attr]
            opt.zero_grad()  # type: ignore[union-attr]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.2)


def _strategy(name: str, **kw: Any) -> Any:
    return "ddp" if name == "ddp" else HybridParallelStrategy(zero_stage=int(name[4]), **kw)


def _inner(rank: int, world: int, name: str) -> dict[str, Tensor]:
    torch.set_num_threads(1)
    pl.seed_everything(1)
    module = InnerSteps()
    strategy: Any
    if name == "zero2_no_masters":
        strategy = HybridParallelStrategy(zero_stage=2)
        precision = ParallelPrecision("bf16-mixed", master_weights=False)
        trainer = cpu_trainer(strategy, max_epochs=1, plugins=[precision])
    else:
        strategy = _strategy(name)
        trainer = cpu_trainer(strategy, max_epochs=1, precision="bf16-mixed")
    trainer.fit(module, DataLoader(_data(), batch_size=4))
    return final_state(module, strategy)


def test_manual_inner_updates_under_autocast_equal_ddp() -> None:
    ddp = run_distributed(_inner, 2, "ddp", init_group=False)[0]
    start = _net().state_dict()
    assert max(float((ddp[f"net.{k}"] - v).abs().max()) for k, v in start.items()) > 1e-2  # it trained
    for name in ("zero0", "zero2_no_masters"):
        ours = run_distributed(_inner, 2, name, init_group=False)[0]
        for k, v in ddp.items():
            torch.testing.assert_close(ours[k], v, msg=f"{name}: {k}")


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.scales: list[float] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, index: int) -> Tensor:
        return F.mse_loss(self(batch[0]).float(), batch[1])

    def validation_step(self, batch: Any, index: int) -> None:
        self.log("val", F.mse_loss(self(batch[0]).float(), batch[1]), sync_dist=True)

    def predict_step(self, batch: Any, index: int) -> Tensor:
        return self(batch[0]).float()

    def on_train_batch_end(self, *args: Any) -> None:
        self.scales.append(float(self.trainer.scaler.get_scale()))  # type: ignore[union-attr]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _bf16_true_evaluation(rank: int, world: int, name: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    strategy = _strategy(name)
    trainer = cpu_trainer(strategy, precision="bf16-true")
    module = Regression()
    val = trainer.validate(module, DataLoader(_data(), batch_size=4), verbose=False)[0]["val"]
    predicted = trainer.predict(module, DataLoader(_data(8), batch_size=4))
    dtype = next(module.parameters()).dtype
    return {"val": val, "predicted": torch.cat(predicted), "dtype": dtype}  # type: ignore[arg-type]


def test_bf16_true_evaluation_at_zero1_and_2_equals_ddp() -> None:
    ddp = run_distributed(_bf16_true_evaluation, 2, "ddp", init_group=False)
    for name in ("zero1", "zero2"):
        for rank, got in enumerate(run_distributed(_bf16_true_evaluation, 2, name, init_group=False)):
            assert got["val"] == ddp[rank]["val"], (name, got["val"], ddp[rank]["val"])
            torch.testing.assert_close(got["predicted"], ddp[rank]["predicted"], rtol=0, atol=0)
            assert got["dtype"] == ddp[rank]["dtype"] == torch.bfloat16  # converted as Lightning's


def _fp16_plugin() -> MixedPrecision:
    scaler = torch.amp.GradScaler("cpu", init_scale=128.0, growth_interval=1)
    return MixedPrecision("16-mixed", "cpu", scaler=scaler)


def _fp16_scaler(rank: int, world: int, name: str, tmp: str) -> dict[str, Any]:
    """fp16 with the user's GradScaler settings; then the checkpoint resumed by the other front."""
    torch.set_num_threads(1)
    pl.seed_everything(1)
    module = Regression()
    strategy = _strategy(name) if name == "ddp" else _strategy(name, save_distributed_checkpoint=False)
    trainer = cpu_trainer(strategy, max_steps=3, plugins=[_fp16_plugin()])
    trainer.fit(module, DataLoader(_data(), batch_size=4))
    path = str(Path(tmp) / f"{name}.ckpt")
    trainer.save_checkpoint(path)
    state = final_state(module, strategy)
    # resume the other kind's checkpoint for one more step
    other = "ddp" if name != "ddp" else "zero1"
    resumed_module = Regression()
    resumed = _strategy(other)
    trainer = cpu_trainer(resumed, max_steps=4, plugins=[_fp16_plugin()])
    trainer.fit(resumed_module, DataLoader(_data(), batch_size=4), ckpt_path=path)
    final_state(resumed_module, resumed)
    return {"scales": module.scales, "state": state, "resumed_scales": resumed_module.scales}


def test_fp16_user_grad_scaler_settings_and_scale_across_checkpoints(tmp_path: Path) -> None:
    ddp = run_distributed(_fp16_scaler, 2, "ddp", str(tmp_path), init_group=False)[0]
    ours = run_distributed(_fp16_scaler, 2, "zero1", str(tmp_path), init_group=False)[0]
    # growth every clean step from 128, as the user's GradScaler (before: 65536, growing every 2000)
    assert ddp["scales"] == [256.0, 512.0, 1024.0], ddp["scales"]
    assert ours["scales"] == ddp["scales"], ours["scales"]
    for k, v in ddp["state"].items():
        torch.testing.assert_close(ours["state"][k], v, rtol=2e-3, atol=2e-3, msg=k)
    # the next step continues from the checkpoint's scale in either direction (before: 128 again at ZeRO-1;
    # ours as one file, which "ddp" reads)
    assert ddp["resumed_scales"] == [2048.0], ddp["resumed_scales"]  # "ddp" checkpoint -> zero1
    assert ours["resumed_scales"] == [2048.0], ours["resumed_scales"]  # zero1 checkpoint -> "ddp"


def _fabric_two_optimizers(rank: int, world: int, name: str, interleaved: bool) -> dict[str, Any]:
    """One backward, then each optimizer clipped and stepped: both clipped first and then both stepped,
    or (``interleaved``) each clipped right before its own step. The two orders are the same update."""
    torch.set_num_threads(1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    fabric = Fabric(
        accelerator="cpu",
        devices=world,
        strategy="ddp" if name == "ddp" else FabricStrategy(zero_stage=int(name[4])),
        plugins=[FabricMixed("16-mixed", "cpu", scaler=scaler)],
    )
    fabric.launch()
    model = _net()
    first, second = (torch.optim.SGD(model[i].parameters(), lr=0.1) for i in (0, 2))
    model, first, second = fabric.setup(model, first, second)
    x, y = _data()[:]
    norms = []
    for step in range(3):
        rows = slice(rank * 4 + step * 8, rank * 4 + step * 8 + 4)
        fabric.backward(F.mse_loss(model(x[rows]).float(), y[rows]))
        if interleaved:
            norms.append([])
            for opt in (first, second):
                norms[-1].append(float(fabric.clip_gradients(model, opt, max_norm=0.05)))
                opt.step()
        else:
            norms.append([float(fabric.clip_gradients(model, opt, max_norm=0.05)) for opt in (first, second)])
            first.step()
            second.step()
        first.zero_grad()
        second.zero_grad()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"norms": norms, "state": state if name in ("ddp", "zero0") else None}


def _fabric_bf16_true_forward_before_optimizers(rank: int, world: int) -> str:
    fabric = Fabric(
        accelerator="cpu", devices=world, strategy=FabricStrategy(zero_stage=1), precision="bf16-true"
    )
    fabric.launch()
    model = fabric.setup_module(_net())
    with pytest.raises(RuntimeError) as refused:
        model(torch.randn(2, 8))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    assert model(torch.randn(2, 8)).dtype == torch.float32 and optimizer is not None  # now it runs
    return str(refused.value)


def test_fabric_fp16_two_optimizers_clip_norms_equal_ddp() -> None:
    """Both clipped, then both stepped, equals "ddp" clipping each right before its step (torch's
    GradScaler, asked for the first order, unscales the second optimizer twice: its update is 1/scale of
    the right one, so that order is not the reference)."""
    ddp = run_distributed(_fabric_two_optimizers, 2, "ddp", True, init_group=False)[0]
    assert all(n < 10 for pair in ddp["norms"] for n in pair), ddp["norms"]  # unscaled norms
    for name in ("zero0", "zero2"):
        for interleaved in (False, True):
            ours = run_distributed(_fabric_two_optimizers, 2, name, interleaved, init_group=False)[0]
            what = f"{name} interleaved={interleaved}"
            torch.testing.assert_close(torch.tensor(ours["norms"]), torch.tensor(ddp["norms"]), msg=what)
            for k, v in (ours["state"] or {}).items():
                torch.testing.assert_close(v, ddp["state"][k], msg=f"{what}: {k}")
    message = run_distributed(_fabric_bf16_true_forward_before_optimizers, 2, init_group=False)[0]
    assert "bf16-true' at zero_stage=1" in message and "fabric.setup(model, optimizer)" in message, message


def _fp16_one_process(rank: int, world: int, strategy: str) -> dict[str, Tensor]:
    torch.manual_seed(0)
    module = Regression()
    trainer = cpu_trainer(
        strategy,
        devices=1,
        plugins=[ParallelPrecision("16-mixed")],
        # one epoch of 4 batches: Lightning's loop counts the skipped first step (the initial scale
        # overflows), ours does not (README), so max_steps would run another batch under "zero0"
        max_epochs=1,
        gradient_clip_val=0.5,
        use_distributed_sampler=False,  # the loader's order under both (Lightning's sampler shuffles)
    )
    trainer.fit(module, DataLoader(_data(), batch_size=8))
    assert module.scales == [65536.0, 32768.0, 32768.0, 32768.0]  # one skip, then training
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_fp16_plugin_under_lightnings_single_device_strategy_equals_zero0() -> None:
    """``plugins=[ParallelPrecision("16-mixed")]``, the README's real fp16 on a CPU, under Lightning's own
    single-device strategy (a one-process reference): trains, with clipping, as our ``"zero0"`` at one
    device. Before, the first optimizer step all-reduced the overflow flag over a process group nobody
    had started ("Default process group has not been initialized")."""
    auto = run_distributed(_fp16_one_process, 1, "auto", init_group=False)[0]
    zero0 = run_distributed(_fp16_one_process, 1, "zero0", init_group=False)[0]
    for k, v in zero0.items():
        torch.testing.assert_close(auto[k], v, rtol=0, atol=0, msg=k)
