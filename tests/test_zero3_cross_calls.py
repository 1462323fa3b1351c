"""ZeRO-3 and a layer that calls a submodule of another layer, on 2 Gloo ranks, against DDP.

A unit's parameters are whole only around its own module's forward and backward; elsewhere they are NaN
placeholders. A block that applies another block's projection (``self.peer.fc(x)``: sharing a layer by
calling it) computed with the placeholders and trained to NaN without an error; so did a unit named by
``zero3_units`` whose module's forward never runs (an ``nn.ModuleList``). During the engine's first
forward a guard now refuses such a call, naming the module, its unit and the caller.

* Default units (each block its own): the fit stops at its first forward with a ``RuntimeError`` naming
  ``blocks.0.fc`` and the calling unit ``blocks.2``, before any step; before, the weights went NaN.
* ``zero3_units=["blocks"]`` (the ``nn.ModuleList``): refused the same way.
* The fix the message gives, units that keep the blocks in the root (``zero3_units=["head"]``): the run
  equals Lightning's ``"ddp"``, and the guard's hook on the head's unit is gone after the first forward.
* A parameter read without its module being called: ``nn.MultiheadAttention`` hands ``out_proj.weight``
  to its functional form, so with every ``nn.Linear`` a unit (``zero3_units=[nn.Linear]``, a
  FSDP-style class policy) ``out_proj`` trained from NaN placeholders, silently. Now refused in the
  first step, naming the parameter, its unit and the reading function; the fix it names
  (``zero3_units=[nn.MultiheadAttention]``) equals ``"ddp"`` on an ``nn.TransformerEncoder``.
* A parameter read by code outside any forward: an L1 weight penalty summed over ``self.parameters()`` in
  ``training_step`` read the blocks' placeholders (NaN loss). Refused the same way, naming the reason,
  also when the sanity check's validation steps run first (the guard lasts until the first training
  step ends).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state

WORLD, STEPS = 2, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.peer: Block | None = None  # another block whose projection this one also applies

    def forward(self, x: Tensor) -> Tensor:
        y = torch.tanh(self.fc(x))
        return y + self.peer.fc(x) if self.peer is not None else y


class Shared(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        object.__setattr__(self.blocks[2], "peer", self.blocks[0])  # a reference, not a submodule
        self.head = nn.Linear(8, 1)
        self.hooks: list[int] = []  # forward pre-hooks on the head before each step

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(x).squeeze(-1), y)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.hooks.append(len(self.head._forward_pre_hooks))  # engine hooks on the head's unit

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def _trainer(strategy: Any) -> pl.Trainer:
    return cpu_trainer(strategy, max_steps=STEPS)


def _data() -> DataLoader[tuple[Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    return DataLoader(
        TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, generator=g)), batch_size=4
    )


class PerSample(Shared):
    """The blocks without the cross-call and a loss of per-sample terms through ``torch.vmap``: functorch's
    batched tensors, which have no storage of their own, pass the first step's read checks (before the
    placeholder-storage check learnt to skip them, they failed there)."""

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self.blocks[2], "peer", None)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        for block in self.blocks:
            x = block(x)
        return torch.vmap(lambda o, t: (o - t) ** 2)(self.head(x).squeeze(-1), y).mean()


def _fit(strategy: Any, kind: type[Shared] = Shared) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module = kind()
    _trainer(strategy).fit(module, _data())
    return {"state": final_state(module, strategy), "hooks": module.hooks}


def _refused(units: list[str] | None) -> dict[str, Any]:
    strategy = HybridParallelStrategy(zero_stage=3, zero3_units=units)
    trainer = _trainer(strategy)
    with pytest.raises(RuntimeError) as info:
        trainer.fit(Shared(), _data())
    strategy.destroy_process_groups()
    return {"message": str(info.value), "steps": trainer.global_step}


class Encoder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.head(self.encoder(x)).mean(dim=(1, 2)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.02)


class Penalised(Shared):
    """The blocks without the cross-call, and an L1 penalty on every weight computed in training_step."""

    def __init__(self, through_data: bool = False) -> None:
        super().__init__()
        object.__setattr__(self.blocks[2], "peer", None)
        self.through_data = through_data  # read as p.data: a plain tensor on the placeholder's storage

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        weights = [p.data if self.through_data else p for p in self.parameters()]
        return loss + 1e-3 * sum(w.abs().sum() for w in weights)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return super().training_step(batch, batch_idx)  # no penalty: the sanity check passes


def _penalised(through_data: bool = False) -> dict[str, Any]:
    strategy = HybridParallelStrategy(zero_stage=3)
    trainer = _trainer(strategy)
    with pytest.raises(RuntimeError) as info:  # after the sanity check's validation steps
        trainer.fit(Penalised(through_data), _data(), val_dataloaders=_data())
    strategy.destroy_process_groups()
    return {"message": str(info.value), "steps": trainer.global_step}


def _sequences() -> DataLoader[tuple[Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 5, 16, generator=g), torch.randn(32, generator=g))
    return DataLoader(data, batch_size=4)


def _encoder(units: list[type[nn.Module]] | None) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module = Encoder()
    strategy: Any = HybridParallelStrategy(zero_stage=3, zero3_units=units) if units else "ddp"
    trainer = _trainer(strategy)
    try:
        trainer.fit(module, _sequences())
    except RuntimeError as err:
        strategy.destroy_process_groups()
        return {"message": str(err), "steps": trainer.global_step}
    return {"state": final_state(module, strategy)}


def _runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {
        "ddp": _fit("ddp"),
        "root": _fit(HybridParallelStrategy(zero_stage=3, zero3_units=["head"])),
        "default": _refused(None),
        "module_list": _refused(["blocks"]),
        "encoder_ddp": _encoder(None),
        "encoder_linear": _encoder([nn.Linear]),
        "encoder_mha": _encoder([nn.MultiheadAttention]),
        "penalty": _penalised(),
        # through p.data (before: NaN penalties and weights, silently)
        "penalty_data": _penalised(through_data=True),
        "vmap_ddp": _fit("ddp", PerSample),
        "vmap": _fit(HybridParallelStrategy(zero_stage=3, zero3_units=[nn.Linear]), PerSample),
    }


def test_cross_unit_calls_are_refused_and_the_fix_equals_ddp() -> None:
    ranks = run_distributed(_runs, WORLD, init_group=False, timeout=300)
    for out in ranks:
        default, module_list = out["default"], out["module_list"]
        assert default["steps"] == 0 and module_list["steps"] == 0
        assert (
            "'blocks.0.fc', a module of unit 'blocks.0', was called from the forward of unit 'blocks.2'"
            in (default["message"])
        )
        assert "'blocks.0.fc', a module of unit 'blocks', was called outside" in module_list["message"]
        assert "zero3_units" in default["message"]
        hooks = out["root"]["hooks"]  # the guard's hook, there before the first forward, is gone after it
        assert len(hooks) == STEPS and hooks[0] == hooks[1] + 1 and len(set(hooks[1:])) == 1
    reference, ours = ranks[0]["ddp"]["state"], ranks[0]["root"]["state"]  # whole on rank 0
    assert ours.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(ours[key], value, msg=lambda m, k=key: f"{k}: {m}")

    refused = ranks[0]["encoder_linear"]  # every rank raised it (run_distributed returned)
    assert refused["steps"] == 0, refused
    assert (
        "parameter 'encoder.layers.0.self_attn.out_proj.weight' of unit"
        " 'encoder.layers.0.self_attn.out_proj' was read by 'multi_head_attention_forward'"
    ) in refused["message"]
    assert "nn.MultiheadAttention" in refused["message"]
    for key in ("penalty", "penalty_data"):
        penalty = ranks[0][key]
        assert penalty["steps"] == 0
        assert "parameter 'blocks.0.fc.weight' of unit 'blocks.0' was read by 'abs'" in penalty["message"]
        assert "after its module's forward" in penalty["message"] and "weight_decay" in penalty["message"]
    for key, value in ranks[0]["vmap_ddp"]["state"].items():
        torch.testing.assert_close(ranks[0]["vmap"]["state"][key], value, msg=f"vmap: {key}")
    reference, ours = ranks[0]["encoder_ddp"]["state"], ranks[0]["encoder_mha"]["state"]
    assert ours.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(ours[key], value, msg=lambda m, k=key: f"{k}: {m}")
