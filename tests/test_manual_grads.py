"""Gradients that reach the optimizer other than through the strategy's backward, in manual optimization.

* ``loss.backward()`` instead of ``self.manual_backward(loss)``, and a backward started at the parameters
  themselves (``torch.autograd.backward(params, grad_tensors=grads)``, the form DP-SGD's clipped
  per-sample gradients take): the next window opens at the pass's first gradient, so each step applies its
  own window. Before, ZeRO 1-3 added the reduced gradients of every earlier step (weights 0.09-0.3 away
  from ``"ddp"`` after three SGD steps, silently). The reference is ``"ddp"`` with ``manual_backward``, the
  gradient averaged over the ranks (Lightning's ``"ddp"`` itself does not synchronise a raw
  ``loss.backward()`` in manual optimization).
* Gradients ``zero_grad()`` dropped between two backwards without a step (a batch skipped after its
  backward, a backward in ``on_train_batch_end`` for gradient statistics): ZeRO 1-3 added them to the next
  update (0.03-0.11 off ``"ddp"``); now dropped from the shards at the next pass's first gradient.
* A Fabric loop that drops an accumulation window with ``optimizer.zero_grad()`` after backwards under
  ``no_backward_sync`` (one or two optimizers): ZeRO 1-3 stepped with the dropped micro-batches too (0.48
  off a probe's ``"ddp"``); now each non-final pass marks the masters, and the ``zero_grad()`` drops them.
* ``p.grad = g`` written by hand: stage 0 steps with it as ``"ddp"`` does; ZeRO 1-3, whose optimizer steps
  the engine's reduced shards, refuse it before the update (before, ignored without a word), in the
  Trainer and in a Fabric loop.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par.fabric import HybridParallelStrategy as FabricStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer

WRITTEN = "were written into param.grad, which the optimizer does not read at ZeRO stages 1-3"


class Manual(pl.LightningModule):
    """Three SGD steps of ``mean(net(x)^2)``; ``mode`` says how the gradient reaches the optimizer."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        self.mode = mode

    def training_step(self, batch: list[Tensor], batch_idx: int) -> None:
        opt = self.optimizers()
        assert isinstance(opt, pl.core.optimizer.LightningOptimizer)
        loss = self.net(batch[0]).pow(2).mean()
        opt.zero_grad()
        if self.mode == "no_backward":  # a step whose loss was skipped (at ZeRO 1/2 the forward pointed
            pass  # param.grad at the engine's buffer: its own views are not written gradients)
        elif self.mode == "manual_backward":
            self.manual_backward(loss)
        elif self.mode == "zero_between":  # a backward dropped by zero_grad(), then the one that steps
            self.manual_backward(self.net(batch[0]).sum())
            opt.zero_grad()
            self.manual_backward(loss)
        elif self.mode in ("skip_batch", "skip_module", "skip_first"):  # a batch judged bad after its
            self.manual_backward(loss)  # backward: zeroed, not stepped (by the optimizer, or the module)
            if batch_idx == (0 if self.mode == "skip_first" else 1):
                opt.zero_grad() if self.mode == "skip_batch" else self.zero_grad()  # (first step: no read)
                return
        elif self.mode == "raw":
            loss.backward()
        else:  # the gradient made by hand, averaged over the ranks as DDP would
            params = list(self.parameters())
            grads = [g.clone() for g in torch.autograd.grad(loss, params)]
            for g in grads:
                torch.distributed.all_reduce(g)
                g /= torch.distributed.get_world_size()
            if self.mode == "leaf_backward":
                torch.autograd.backward(params, grad_tensors=grads)
            else:
                for p, g in zip(params, grads, strict=True):
                    p.grad = g
        opt.step()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class StrayBackward(pl.LightningModule):
    """Automatic optimization with a backward outside the training step after each step (gradient
    statistics read in ``on_train_batch_end``), dropped with ``zero_grad()`` as DDP users do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return self.net(batch[0]).pow(2).mean()

    def on_train_batch_end(self, outputs: Any, batch: list[Tensor], batch_idx: int) -> None:
        self.net(batch[0]).sum().backward()
        self.zero_grad()
        for opt in self.trainer.optimizers:
            opt.zero_grad()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class HandAccumulated(pl.LightningModule):
    """Manual optimization accumulating 3 micro-batches by hand, with a validation loop every 2 batches
    (inside the first window): Lightning's default ``on_validation_model_zero_grad`` drops the window's
    first micro-batches under DDP; ZeRO 1-3 stepped with them too (0.016-0.05 off in a probe)."""

    def __init__(self, no_sync: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        self.use_no_sync = no_sync  # DDP's idiom: trainer.model.no_sync() around the non-final backwards

    def training_step(self, batch: list[Tensor], batch_idx: int) -> None:
        opt = self.optimizers()
        assert isinstance(opt, pl.core.optimizer.LightningOptimizer)
        final = (batch_idx + 1) % 3 == 0
        with self.trainer.model.no_sync() if self.use_no_sync and not final else nullcontext():
            self.manual_backward(self.net(batch[0]).pow(2).mean() / 3)
        if final:
            opt.step()
            opt.zero_grad()

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        self.log("val", self.net(batch[0]).square().mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class ManualNorm(HandAccumulated):
    """Manual optimization, one step per batch, through a BatchNorm layer: each rank's running statistics
    as Lightning's ``"ddp"`` leaves them (it syncs buffers before the first forward only, in manual
    optimization; before, ZeRO 0-3 broadcast rank 0's after every step: rank 1's 0.2 off)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))

    def training_step(self, batch: list[Tensor], batch_idx: int) -> None:
        opt = self.optimizers()
        assert isinstance(opt, pl.core.optimizer.LightningOptimizer)
        self.manual_backward(self.net(batch[0] + self.global_rank).pow(2).mean())
        opt.step()
        opt.zero_grad()


class CopyMidWindow(pl.Callback):
    """A keep-best / EMA callback deep-copying the module mid-window and zeroing the copy: the copy's
    zero_grad() is its own (before, ZeRO 1-3's copy called the original's, dropping its window)."""

    def on_train_batch_end(
        self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == 2:  # the first micro-batch of the second window is in
            self.copy = copy.deepcopy(module)
            self.copy.zero_grad()


class Accumulated(StrayBackward):
    def on_train_batch_end(self, outputs: Any, batch: list[Tensor], batch_idx: int) -> None:
        """No stray backward here: only the copy a callback makes (``CopyMidWindow``)."""


def _copied_mid_window(strategy: str) -> dict[str, Tensor]:
    module = Accumulated()
    trainer = cpu_trainer(strategy, devices=2, max_steps=3, accumulate_grad_batches=2)
    trainer.callbacks.append(CopyMidWindow())
    trainer.fit(module, _data())
    assert "zero_grad" not in vars(module)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _hand_accumulated(strategy: str, norm: bool = False, no_sync: bool = False) -> dict[str, Tensor]:
    if norm:  # this rank's own state: the buffers may differ per rank
        module: pl.LightningModule = ManualNorm()
        cpu_trainer(strategy, devices=2, max_epochs=1, limit_val_batches=0).fit(module, _data())
        return {k: v.detach().clone() for k, v in module.state_dict().items()}
    module = HandAccumulated(no_sync)
    trainer = cpu_trainer(strategy, devices=2, max_epochs=1, val_check_interval=2, limit_val_batches=1)
    trainer.fit(module, _data(), _data())
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _data() -> DataLoader[Any]:
    return DataLoader(
        TensorDataset(torch.randn(24, 4, generator=torch.Generator().manual_seed(1))), batch_size=3
    )


def _fit(strategy: str, mode: str, world: int) -> dict[str, Tensor] | str:
    module: pl.LightningModule = StrayBackward() if mode == "stray_backward" else Manual(mode)
    trainer = cpu_trainer(strategy, devices=world, max_steps=3)
    try:
        trainer.fit(module, _data())
    except RuntimeError as err:
        if WRITTEN not in str(err):
            raise
        return str(err)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


RUNS = [
    ("ddp", "manual_backward"),
    ("ddp", "write"),
    ("zero0", "raw"),
    ("zero1", "raw"),
    ("zero2", "raw"),
    ("zero3", "raw"),
    ("zero2", "leaf_backward"),
    ("zero3", "leaf_backward"),
    ("zero0", "write"),
    ("zero1", "write"),
    ("zero3", "write"),
    ("ddp", "no_backward"),
    ("zero1", "no_backward"),
]
# gradients zero_grad() dropped between backwards, without a step: each against "ddp" in the same mode
DROPPED = [
    ("zero_between", "zero1"),
    ("zero_between", "zero3"),
    ("skip_batch", "zero2"),
    ("skip_module", "zero1"),
    ("skip_module", "zero3"),
    ("skip_first", "zero2"),
    ("stray_backward", "zero1"),
    ("stray_backward", "zero3"),
]
RUNS += [
    ("ddp", mode) for mode in ("zero_between", "skip_batch", "skip_module", "skip_first", "stray_backward")
] + [(s, m) for m, s in DROPPED]


def _fabric_skips(world: int, rank: int, strategy: Any, *, two: bool) -> dict[str, Tensor]:
    """A Fabric loop accumulating 3 micro-batches per step under ``no_backward_sync``, whose second window
    is dropped by ``optimizer.zero_grad()`` after its second micro-batch (a skipped window: DDP steps with
    the third micro-batch alone). ``two``: two optimizers, one per layer, only the first zeroed."""
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    groups = [model[0].parameters(), model[2].parameters()] if two else [model.parameters()]
    model, *opts = fabric.setup(model, *(torch.optim.Adam(g, lr=1e-2) for g in groups))
    g = torch.Generator().manual_seed(5 + rank)
    for window in range(3):
        for micro in range(3):
            with fabric.no_backward_sync(model, enabled=micro < 2):
                fabric.backward(model(torch.randn(3, 4, generator=g)).square().mean())
            if window == 1 and micro == 1:
                opts[0].zero_grad()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return _final(fabric, model)


def _final(fabric: Fabric, model: nn.Module) -> dict[str, Tensor]:
    """The trained weights (ours: consolidated on rank 0), our groups destroyed for the next run."""
    if not isinstance(fabric.strategy, FabricStrategy):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = fabric.strategy.consolidated_state_dict()
    fabric.strategy.destroy_process_groups()
    return state


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x: Tensor, *, use_b: bool) -> Tensor:
        return self.a(x) + self.b(x).tanh() if use_b else self.a(x)


def _fabric_branch(world: int, rank: int, strategy: Any) -> dict[str, Tensor]:
    """Two windows of 3 micro-batches at ``grad_sync="every"`` (ZeRO-2's default) where one rank's first
    micro-batch skips branch ``b`` (rank 0 in the first window, rank 1 in the second) and the others use
    it: after that pass the rank's shard of ``b`` (if it holds one) has the other ranks' reduced
    gradients while its own ``b``'s gradient was never set; the next pass must keep them, as DDP does."""
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    module = TwoBranches()
    model, opt = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.5))
    g = torch.Generator().manual_seed(5 + rank)
    for window in range(2):
        for micro in range(3):
            with fabric.no_backward_sync(model, enabled=micro < 2):
                x = torch.randn(3, 4, generator=g)
                fabric.backward(model(x, use_b=micro > 0 or rank != window).square().mean())
        opt.step()
        opt.zero_grad()
    return _final(fabric, model)


def _job(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {f"{s}/{m}": _fit(s, m, world) for s, m in RUNS}
    for two in (False, True):
        out[f"fabric_skip/ddp/{two}"] = _fabric_skips(world, rank, "ddp", two=two)
        for stage in (1, 2, 3) if not two else (2, 3):
            strategy = FabricStrategy(zero_stage=stage)
            out[f"fabric_skip/zero{stage}/{two}"] = _fabric_skips(world, rank, strategy, two=two)
    for strategy in ("ddp", "zero1", "zero3"):
        out[f"hand_accumulated/{strategy}"] = _hand_accumulated(strategy)
    for strategy in ("ddp", "zero2"):
        out[f"copied/{strategy}"] = _copied_mid_window(strategy)
    for strategy in ("ddp", "zero2"):
        out[f"no_sync/{strategy}"] = _hand_accumulated(strategy, no_sync=True)
    for strategy in ("ddp", "zero0", "zero2"):
        out[f"manual_norm/{strategy}"] = _hand_accumulated(strategy, norm=True)
    out["fabric_branch/ddp"] = _fabric_branch(world, rank, "ddp")
    for stage in (2, 3):
        out[f"fabric_branch/zero{stage}"] = _fabric_branch(world, rank, FabricStrategy(zero_stage=stage))
    # a Fabric loop at ZeRO-2 that writes param.grad: refused at optimizer.step(), nothing updated
    fabric = Fabric(accelerator="cpu", devices=world, strategy=FabricStrategy(zero_stage=2))
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=WRITTEN):
        opt.step()
    out["fabric_untouched"] = all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    return out


def test_gradients_from_user_backwards_and_writes_in_manual_optimization() -> None:
    for rank, out in enumerate(run_distributed(_job, 2, init_group=False, timeout=600)):
        ref = out["ddp/manual_backward"]
        assert isinstance(ref, dict)
        # the written gradient is the loss's gradient averaged over the ranks: ddp steps with it alike
        for key in ("ddp/write", "zero0/raw", "zero1/raw", "zero2/raw", "zero3/raw"):
            got = out[key]
            assert isinstance(got, dict), (rank, key, got)
            for name, value in ref.items():
                torch.testing.assert_close(got[name], value, msg=f"rank {rank} {key}: {name}")
        for key in ("zero2/leaf_backward", "zero3/leaf_backward", "zero0/write"):
            got = out[key]
            assert isinstance(got, dict), (rank, key, got)
            for name, value in out["ddp/write"].items():
                torch.testing.assert_close(got[name], value, msg=f"rank {rank} {key}: {name}")
        for mode, strategy in DROPPED:
            got, want = out[f"{strategy}/{mode}"], out[f"ddp/{mode}"]
            assert isinstance(got, dict) and isinstance(want, dict), (got, want)
            for name, value in want.items():
                torch.testing.assert_close(got[name], value, msg=f"rank {rank} {strategy}/{mode}: {name}")
        # a window zero_grad() dropped after non-synchronising backwards: as Fabric's "ddp" (before, ZeRO
        # 1-3 stepped with the dropped micro-batches too)
        for key, want in out.items():
            if key.startswith("fabric_skip/ddp/"):
                two = key.rsplit("/", 1)[1]
                for stage in (1, 2, 3) if two == "False" else (2, 3):
                    got = out[f"fabric_skip/zero{stage}/{two}"]
                    if rank == 0:  # the consolidated state lands on rank 0
                        for name, value in want.items():
                            torch.testing.assert_close(got[name], value, msg=f"{key} zero{stage}: {name}")
        # a window opened by hand, dropped by Lightning's module.zero_grad() before a validation loop
        for strategy in ("zero1", "zero3"):
            for name, value in out["hand_accumulated/ddp"].items():
                got = out[f"hand_accumulated/{strategy}"][name]
                torch.testing.assert_close(got, value, msg=f"rank {rank} hand-accumulated {strategy}: {name}")
        # a deepcopy made mid-window and zeroed: the original's window stays, as under "ddp"
        for name, value in out["copied/ddp"].items():
            torch.testing.assert_close(out["copied/zero2"][name], value, msg=f"rank {rank} copied: {name}")
        # trainer.model.no_sync() (before, AttributeError: trainer.model is the LightningModule here)
        for name, value in out["no_sync/ddp"].items():
            torch.testing.assert_close(out["no_sync/zero2"][name], value, msg=f"rank {rank} no_sync: {name}")
        # manual optimization through BatchNorm: each rank's statistics as "ddp" leaves them
        want = out["manual_norm/ddp"]
        for strategy in ("zero0", "zero2"):
            for name, value in want.items():
                got = out[f"manual_norm/{strategy}"][name]
                torch.testing.assert_close(got, value, msg=f"rank {rank} manual norm {strategy}: {name}")
        # a branch one rank skipped in a non-final pass: its reduced gradients stay in the window
        for stage in (2, 3):
            if rank == 0:
                for name, value in out["fabric_branch/ddp"].items():
                    got = out[f"fabric_branch/zero{stage}"][name]
                    torch.testing.assert_close(got, value, msg=f"branch zero{stage}: {name}")
        got, initial = out["zero1/no_backward"], Manual("no_backward").state_dict()
        assert isinstance(got, dict), got
        for name, value in out["ddp/no_backward"].items():
            torch.testing.assert_close(value, initial[name], rtol=0, atol=0)  # no gradient, no update
            torch.testing.assert_close(got[name], value, rtol=0, atol=0)
        for key in ("zero1/write", "zero3/write"):
            message = out[key]
            assert (
                isinstance(message, str)
                and "'net.0.bias', 'net.0.weight', 'net.2.bias' and 1 more" in message
                and "zero_stage=0" in message
            ), message
        assert out["fabric_untouched"]
