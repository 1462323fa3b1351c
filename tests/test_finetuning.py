"""Parameters whose ``requires_grad`` changes during training, on 2 Gloo ranks.

Lightning's ``BackboneFinetuning`` freezes a backbone at setup, then at a chosen epoch unfreezes it and
adds it to the optimizer with ``add_param_group``; schedules that freeze layers as training goes do the
reverse. Torch's DDP (Lightning's ``"ddp"``) registers its gradient hooks once, so it never averages the
unfrozen parameters' gradients and the replicas drift apart (Lightning-AI/pytorch-lightning#20340);
DeepSpeed's strategy refuses the callback.

* ZeRO stage 0 takes the unfrozen parameters in: a regressor trained with ``BackboneFinetuning`` (backbone
  unfrozen at epoch 1) and a callback that freezes the first backbone layer again at epoch 2 (a parameter
  without gradient: ``find_unused_parameters=True``, as DDP needs), with ``accumulate_grad_batches=2``,
  ends with the same weights on both ranks as one process fed the global batches in the same order
  (``Replay``), at fp32 tolerance.
* ZeRO 1-3 build the optimizer over shards of the parameters trainable at setup. A ``BaseFinetuning``
  callback is refused at setup (a ``ValueError`` naming the fix, before any step); unfreezing by hand (in
  ``on_train_batch_start``, at stages 1 and 3) is refused at the next training forward with a
  ``RuntimeError`` naming the parameters, after exactly the steps of epoch 0.
* Unfreezing inside an accumulation window (between its micro-batches) is refused at stage 0.
* Fabric: a loop that unfreezes the backbone after 2 steps and hands it to ``optimizer.add_param_group``
  equals the same loop in one process at stage 0, and is refused at the next forward at stage 1.
* ``ModelPruning`` (magnitude pruning at each epoch's end; by default the survivors are reset to their
  initial values by replacing ``param.data``, and the pruning is made permanent at the end, replacing
  ``.data`` again) equals Lightning's ``"ddp"`` at stage 0; at stage 1 in fp32 it equals ``"ddp"`` with
  resets to the initial values (``ResetsToInitial``: Lightning's own resets to trained values from the
  second reset on, its saved copies having become the live parameters), and at stage 2 in
  ``"bf16-mixed"`` within bf16 rounding (the same weights pruned); it is refused at setup at stage 3.
  Before, stages 1/2 ended 0.2 away from ``"ddp"`` without a word (the replaced ``.data`` left the
  buffer the optimizer updates), then were refused. A ``p.data = ...`` of the same shape during training
  (WGAN-style clipping by replacement) is taken back into the buffer at ZeRO 1/2 and equals ``"ddp"``,
  as the same clipping in place does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import BackboneFinetuning, ModelPruning
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_par import HybridParallelStrategy
from lightning_par.fabric import HybridParallelStrategy as FabricHybridParallelStrategy
from tests.distributed import run_distributed

SEED, WORLD, MICRO, N, EPOCHS, ACCUMULATE = 7, 2, 4, 32, 3, 2
STEPS_PER_EPOCH = N // (WORLD * MICRO * ACCUMULATE)  # 2
State = dict[str, Tensor]


class Regressor(pl.LightningModule):
    """A backbone (two linear layers) and a head; the optimizer takes what is trainable at setup, as
    ``BackboneFinetuning`` asks. ``flip``: ``(epoch, batch_idx, submodule, requires_grad)``, set by hand
    in ``on_train_batch_start`` (a user's own schedule, without the callback), the submodule frozen from
    the start when ``flip`` unfreezes it."""

    def __init__(self, flip: tuple[int, int, str, bool] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
        self.head = nn.Linear(16, 1)
        self.flip = flip
        if flip is not None and flip[3]:
            self.get_submodule(flip[2]).requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.flip is not None and (self.current_epoch, batch_idx) == self.flip[:2]:
            self.get_submodule(self.flip[2]).requires_grad_(self.flip[3])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-2)


class FreezeFirstLayer(pl.Callback):
    """Freeze ``backbone.0`` again at ``epoch`` (Adam skips parameters without gradients)."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            pl_module.get_submodule("backbone.0").requires_grad_(False)


def _callbacks() -> list[pl.Callback]:
    return [BackboneFinetuning(unfreeze_backbone_at_epoch=1), FreezeFirstLayer(epoch=2)]


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 8, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True).sin())


class Replay:
    """Batch sampler for one process: epoch ``e``'s global batches in the order Lightning's
    ``DistributedSampler`` gives ``WORLD`` ranks (rank 0's micro-batch, then rank 1's). Lightning calls
    ``set_epoch`` on a batch sampler's ``sampler`` only, so the epoch is counted here."""

    def __init__(self) -> None:
        self.epoch = -1

    def __iter__(self) -> Iterator[list[int]]:
        self.epoch += 1
        orders = []
        for r in range(WORLD):
            sampler = DistributedSampler(range(N), num_replicas=WORLD, rank=r, shuffle=True, seed=SEED)  # type: ignore[arg-type]
            sampler.set_epoch(self.epoch)
            orders.append(list(sampler))
        for k in range(len(self)):
            yield [i for order in orders for i in order[k * MICRO : (k + 1) * MICRO]]

    def __len__(self) -> int:
        return N // (MICRO * WORLD)


def _trainer(strategy: Any, devices: int, callbacks: list[pl.Callback], **options: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=EPOCHS,
        accumulate_grad_batches=ACCUMULATE,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def _state(module: nn.Module) -> State:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _fit(strategy: Any, callbacks: list[pl.Callback], **options: Any) -> State:
    pl.seed_everything(SEED)
    module = Regressor()
    trainer = _trainer(strategy, WORLD, callbacks, **options)
    trainer.fit(module, DataLoader(_data(), batch_size=MICRO, shuffle=True))
    return {k: v.float() for k, v in _state(module).items()}


def _refused(
    strategy: Any,
    error: type[Exception],
    *,
    flip: tuple[int, int, str, bool] | None = None,
    callbacks: list[pl.Callback] | None = None,
) -> dict[str, Any]:
    """The error a fit raises (every rank alike) and the optimizer steps taken before it."""
    pl.seed_everything(SEED)
    module = Regressor(flip)
    callbacks = callbacks if callbacks is not None else [] if flip else _callbacks()
    trainer = _trainer(strategy, WORLD, callbacks)
    with pytest.raises(error) as info:
        trainer.fit(module, DataLoader(_data(), batch_size=MICRO, shuffle=True))
    return {"message": str(info.value), "steps": trainer.global_step}


def _runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    hp = HybridParallelStrategy
    plan: dict[str, Callable[[], Any]] = {
        # the re-frozen layer gets no gradient: the unused-parameter flag, as DDP would need
        "s0": lambda: _fit(hp(zero_stage=0, find_unused_parameters=True), _callbacks()),
        "s0_window": lambda: _refused(hp(zero_stage=0), RuntimeError, flip=(1, 1, "backbone", True)),
        "s2_callback": lambda: _refused(hp(zero_stage=2), ValueError),
        "s1_unfreeze": lambda: _refused(hp(zero_stage=1), RuntimeError, flip=(1, 0, "backbone", True)),
        "s3_unfreeze": lambda: _refused(
            hp(zero_stage=3, meta_init=False), RuntimeError, flip=(1, 0, "backbone", True)
        ),
    }
    return {name: run() for name, run in plan.items()}


def _reference() -> tuple[State, State]:
    """One process, the global batch, the same callbacks; and the initial weights."""
    torch.set_num_threads(1)
    pl.seed_everything(SEED)
    module = Regressor()
    initial = _state(module)
    _trainer("auto", 1, _callbacks()).fit(module, DataLoader(_data(), batch_sampler=Replay()))
    return _state(module), initial


def _pruning() -> list[pl.Callback]:
    return [ModelPruning("l1_unstructured", amount=0.3, verbose=0)]


class ResetsToInitial(ModelPruning):
    """Lightning's ``ModelPruning`` whose lottery-ticket reset copies the initial values. Lightning's own
    sets ``param.data`` to its saved copy's tensor itself, so from then on the copy is the live parameter:
    the second reset restores the values trained since the first, not the initial ones. The ZeRO 1/2
    buffers take the values and leave the copy alone (every reset restores the initial values, as the
    algorithm states); with this callback ``"ddp"`` does the same."""

    @staticmethod
    def _copy_param(new: nn.Module, old: nn.Module, name: str) -> None:
        dst = getattr(new, name + "_orig") if hasattr(new, name + "_orig") else getattr(new, name)
        dst.data = getattr(old, name).data.clone()


def _initial_resets() -> list[pl.Callback]:
    return [ResetsToInitial("l1_unstructured", amount=0.3, verbose=0)]


class Clamp(pl.Callback):
    """WGAN-style weight clipping at each epoch's end: in place (``p.data.clamp_``) or by replacing the
    data (``p.data = p.data.clamp(...)``), both what a user's code does under ``"ddp"``. ``before_step``:
    at every optimizer step instead, in ``on_before_optimizer_step`` (inside the step's closure)."""

    def __init__(self, *, in_place: bool, before_step: bool = False) -> None:
        self.in_place, self.before_step = in_place, before_step

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.before_step:
            self._clamp(pl_module)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if self.before_step:
            self._clamp(pl_module)

    def _clamp(self, pl_module: pl.LightningModule) -> None:
        for p in pl_module.parameters():
            if self.in_place:
                p.data.clamp_(-0.2, 0.2)
            else:
                p.data = p.data.clamp(-0.2, 0.2)


class ResetAtEnd(pl.Callback):
    """At the end of training, every parameter's ``.data`` replaced by its initial fp32 values (a
    lottery-ticket reset of the whole model)."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        initial = Regressor()
        for p, q in zip(pl_module.parameters(), initial.parameters(), strict=True):
            p.data = q.data


def _pruning_runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    hp = HybridParallelStrategy
    return {
        "ddp": _fit("ddp", _pruning()),
        "s0": _fit(hp(zero_stage=0), _pruning()),
        "ddp_initial": _fit("ddp", _initial_resets()),
        "s1": _fit(hp(zero_stage=1), _pruning()),
        "s2_bf16": _fit(hp(zero_stage=2), _pruning(), precision="bf16-mixed"),
        "ddp_bf16": _fit("ddp", _initial_resets(), precision="bf16-mixed"),
        "s2_bf16_reset": _fit(hp(zero_stage=2), [ResetAtEnd()], precision="bf16-mixed"),
        "initial": _state(Regressor()),
        "s3": _refused(hp(zero_stage=3, meta_init=False), ValueError, callbacks=_pruning()),
        "ddp_clamp": _fit("ddp", [Clamp(in_place=True)]),
        "s2_clamp": _fit(hp(zero_stage=2), [Clamp(in_place=True)]),
        "ddp_replace": _fit("ddp", [Clamp(in_place=False)]),
        "s1_replace": _fit(hp(zero_stage=1), [Clamp(in_place=False)]),
        "ddp_step_replace": _fit("ddp", [Clamp(in_place=False, before_step=True)]),
        "s1_step_replace": _fit(hp(zero_stage=1), [Clamp(in_place=False, before_step=True)]),
        "ddp_step_bf16": _fit("ddp", [Clamp(in_place=True, before_step=True)], precision="bf16-mixed"),
        "s2_step_bf16": _fit(
            hp(zero_stage=2), [Clamp(in_place=True, before_step=True)], precision="bf16-mixed"
        ),
    }


def test_model_pruning_and_replaced_data_equal_ddp_at_zero_0_to_2() -> None:
    ranks = run_distributed(_pruning_runs, WORLD, init_group=False, timeout=300)
    for r, out in enumerate(ranks):
        zeros = float((out["ddp"]["backbone.0.weight"] == 0).float().mean())
        assert zeros > 0.2, zeros  # the callback pruned (and made it permanent) in the reference
        for key, reference in (("s0", "ddp"), ("s1", "ddp_initial")):
            assert out[key].keys() == out[reference].keys()
            for name, value in out[reference].items():
                torch.testing.assert_close(out[key][name], value, msg=f"rank {r} {key}: {name}")
        # in bf16-mixed the lottery-ticket reset reaches the fp32 masters exactly; the steps compute with
        # bf16 copies of the masters (ddp: fp32 weights under autocast), hence bf16 rounding
        for name, value in out["ddp_bf16"].items():
            got = out["s2_bf16"][name]
            torch.testing.assert_close(got, value, rtol=2e-2, atol=2e-3, msg=f"rank {r} bf16: {name}")
            assert torch.equal(got == 0, value == 0), name  # the same weights pruned
        # the fp32 masters take the replacing values themselves, not their bf16 rounding
        for name, value in out["initial"].items():
            torch.testing.assert_close(out["s2_bf16_reset"][name], value, rtol=0, atol=0, msg=name)
        refused = out["s3"]
        assert "ModelPruning cannot be used" in refused["message"], refused
        assert "gathered_params(writeback=True)" in refused["message"] and refused["steps"] == 0, refused
        # writing parameters between steps, in place or by replacing their data, follows "ddp" (before, a
        # replaced parameter silently stopped training at ZeRO 1/2, later it was refused)
        for name, value in out["ddp_clamp"].items():
            torch.testing.assert_close(out["s2_clamp"][name], value, msg=f"rank {r}: clamped {name}")
        for name, value in out["ddp_replace"].items():
            torch.testing.assert_close(out["s1_replace"][name], value, msg=f"rank {r}: replaced {name}")
        # inside the step's closure (on_before_optimizer_step): before, the replacement undid the update
        # and an in-place clamp of the bf16 copy was lost, silently
        for name, value in out["ddp_step_replace"].items():
            got = out["s1_step_replace"][name]
            torch.testing.assert_close(got, value, msg=f"rank {r}: replaced in the step {name}")
        for name, value in out["ddp_step_bf16"].items():
            got = out["s2_step_bf16"][name]
            # the clamp writes the bf16 copy, so a clamped element reaches the masters bf16-rounded (as the
            # README says; gathered_params(writeback=True) writes the masters): 1.1e-2 after 6 Adam steps,
            # before 0.17 (the clamp lost)
            torch.testing.assert_close(got, value, rtol=0, atol=2e-2, msg=f"rank {r}: bf16 clamp {name}")


# ------------------------------------------------------------------------------------------------ Fabric
FABRIC_STEPS, UNFREEZE_AT = 5, 2


def _fabric_loop(model: Regressor, optimizer: torch.optim.Optimizer, backward: Callable[[int], None]) -> None:
    """Head only for ``UNFREEZE_AT`` steps, then the backbone too, in a param group of its own;
    ``backward(step)`` runs the step's forward and backward."""
    for step in range(FABRIC_STEPS):
        if step == UNFREEZE_AT:
            model.backbone.requires_grad_(True)
            optimizer.add_param_group({"params": list(model.backbone.parameters()), "lr": 1e-3})
        backward(step)
        optimizer.step()
        optimizer.zero_grad()


def _global_batch(step: int) -> tuple[Tensor, Tensor]:
    data = _data()
    index = torch.arange(step * WORLD * MICRO, (step + 1) * WORLD * MICRO) % N
    return data.tensors[0][index], data.tensors[1][index]


def _fabric_run(rank: int, world: int, stage: int) -> State | str:
    """Stage 0: the final weights; above: the error of the first forward after the unfreezing."""
    fabric = Fabric(accelerator="cpu", devices=world, strategy=FabricHybridParallelStrategy(zero_stage=stage))
    fabric.launch()
    model = Regressor(flip=(0, 0, "backbone", True))  # the backbone frozen at setup
    module, optimizer = fabric.setup(model, torch.optim.Adam(model.head.parameters(), lr=1e-2))

    def backward(step: int) -> None:
        x, y = _global_batch(step)
        mine = slice(rank * MICRO, (rank + 1) * MICRO)
        fabric.backward(F.mse_loss(module(x[mine]), y[mine]))

    try:
        if stage == 0:
            _fabric_loop(model, optimizer, backward)
            return _state(model)
        with pytest.raises(RuntimeError) as info:
            _fabric_loop(model, optimizer, backward)
        return str(info.value)
    finally:
        fabric.strategy.destroy_process_groups()  # type: ignore[attr-defined]  # loop after loop


def _fabric_runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {"s0": _fabric_run(rank, world, 0), "s1": _fabric_run(rank, world, 1)}


def test_fabric_loop_unfreezing_equals_one_process_at_stage0_and_is_refused_at_stage1() -> None:
    ranks = run_distributed(_fabric_runs, WORLD, init_group=False, timeout=300)
    torch.manual_seed(0)
    model = Regressor(flip=(0, 0, "backbone", True))
    initial = _state(model)
    optimizer = torch.optim.Adam(model.head.parameters(), lr=1e-2)

    def backward(step: int) -> None:
        x, y = _global_batch(step)
        F.mse_loss(model(x), y).backward()

    _fabric_loop(model, optimizer, backward)
    reference = _state(model)
    assert not torch.equal(reference["backbone.0.weight"], initial["backbone.0.weight"])
    for r, out in enumerate(ranks):
        for name, value in reference.items():
            torch.testing.assert_close(out["s0"][name], value, msg=f"rank {r}: {name}")
        assert "requires_grad was set after setup on 'backbone.0.weight'" in out["s1"], out["s1"]


def test_requires_grad_changes_follow_one_process_at_stage0_and_are_refused_when_sharded() -> None:
    ranks = run_distributed(_runs, WORLD, init_group=False, timeout=300)
    reference, initial = _reference()
    # the schedule did what it says in the reference: the backbone trained from epoch 1 on, and its
    # first layer stopped at epoch 2 while the second went on
    for name in reference:
        assert not torch.equal(reference[name], initial[name]), name
    for r, out in enumerate(ranks):
        for name, value in reference.items():
            torch.testing.assert_close(out["s0"][name], value, msg=f"rank {r}: {name}")
        window = out["s0_window"]
        assert "inside a gradient accumulation window" in window["message"], window
        assert "'backbone.0.weight'" in window["message"], window
        assert window["steps"] == STEPS_PER_EPOCH, window  # epoch 1's first window was not stepped
        callback = out["s2_callback"]
        assert "BackboneFinetuning cannot be used" in callback["message"], callback
        assert "zero_stage=0" in callback["message"] and callback["steps"] == 0, callback
        for key in ("s1_unfreeze", "s3_unfreeze"):
            refused = out[key]
            assert "requires_grad was set after setup on 'backbone.0.weight'" in refused["message"], refused
            assert "zero_stage=0" in refused["message"], refused
            assert refused["steps"] == STEPS_PER_EPOCH, refused  # epoch 0's steps, then refused
    # both ranks hold the same weights (each equals the reference above; DDP's would differ here)
    for name in reference:
        assert torch.equal(ranks[0]["s0"][name], ranks[1]["s0"][name]), name
