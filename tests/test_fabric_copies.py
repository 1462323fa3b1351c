"""Copies of the set-up model and modules beside it in Fabric loops, against Fabric's ``"ddp"``. Each was a
probe's finding:

* An EMA made with ``copy.deepcopy(model.module)`` after setup at ZeRO-3, outside ``gathered_params()``,
  copied the NaN placeholders and computed NaN without a word; its first forward now refuses it, naming
  the fix. Made inside ``gathered_params()`` it holds whole weights, but it carried the engine's hooks:
  its ``state_dict()`` was refused as if sharded and its forward gathered the original's units. The hooks
  now act on the original only, and the EMA trained and read so equals ``"ddp"``'s.
* ``fabric.save(path, {"model": ..., "optimizer": ..., "ema": ema})`` was refused ("a module this
  strategy did not set up"); another module is now saved and loaded through its state dict, as Fabric's
  own strategies do.
* A ``FlashSnapshots`` state with such an EMA beside the model was refused ("exactly one model"); now it
  is an entry restored through its state dict, copied when the snapshot is taken.
* A module with every parameter frozen, set up alone and called with gradients enabled (a teacher), failed
  at ZeRO 0/1 with an ``IndexError``; now its output is the module's own.
* ``copy.deepcopy(model)`` of what ``fabric.setup`` returned (Fabric's wrapper, which holds the strategy)
  failed at every layout ("cannot pickle 'ProcessGroup' object"); Fabric's ``"ddp"`` copies it. The copy
  now shares the strategy, and at tp2 its forward no longer consumes the original's first-input check.
* ``torch.save(model)`` of that wrapper met the same "cannot pickle 'ProcessGroup' object"; it is refused
  naming ``torch.save(model.module, f)``, whose file loads in one process to ``"ddp"``'s module (under
  Fabric's ``"ddp"`` the wrapper pickles, but its DDP cannot be loaded outside the run's process group).
"""

from __future__ import annotations

import copy
import io
import pickle
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import Tensor, nn

from lightning_par.fabric import FlashSnapshots, HybridParallelStrategy
from tests.distributed import run_distributed
from tests.third_party import llama

WORLD, STEPS, DECAY = 2, 4, 0.5


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _batch(rank: int, step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def _fabric(strategy: Any) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    return fabric


def _ema_run(rank: int, name: str, strategy: Any, path: Path) -> dict[str, Any]:
    fabric = _fabric(strategy)
    net = _net()
    model, optimizer = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=0.05))
    ours = isinstance(strategy, HybridParallelStrategy)
    out: dict[str, Any] = {}
    gathered = fabric.strategy.gathered_params if ours else nullcontext
    probe = _batch(99, 0)[0]
    if name == "zero3":  # a copy of the placeholders: refused at its first use
        early = copy.deepcopy(model.module)
        try:
            early(probe)
            out["early"] = "ran"
        except RuntimeError as exc:
            out["early"] = str(exc)
    with gathered():
        ema = copy.deepcopy(model.module)
    for step in range(STEPS):
        x, y = _batch(rank, step)
        fabric.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        with gathered(), torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                e.lerp_(p, 1 - DECAY)
    out["ema_out"] = ema(probe).detach()  # the copy's own forward, outside any gather
    out["ema"] = {k: v.clone() for k, v in ema.state_dict().items()}
    fabric.save(path, {"model": model, "optimizer": optimizer, "ema": ema, "step": STEPS})
    fresh = _net()
    state = {"model": model, "optimizer": optimizer, "ema": fresh, "step": 0}
    fabric.load(path, state)
    out["loaded_ema"] = fresh.state_dict()
    out["step"] = state["step"]
    # a flash snapshot holds the EMA beside the set-up model (before, refused: "exactly one model")
    flash = {"dirpath": path.with_suffix(".flash"), "shm_dir": path.with_suffix(f".shm{rank}")}
    with FlashSnapshots(fabric, snapshot_copy="blocking", **flash) as snapshots:
        snapshots.snapshot(STEPS, {"model": model, "optimizer": optimizer, "ema": ema})
    restored = _net()
    with FlashSnapshots(fabric, **flash) as snapshots:
        out["flash_step"] = snapshots.restore({"model": model, "optimizer": optimizer, "ema": restored})
    out["flash_ema"] = restored.state_dict()
    if ours:  # a second module (a frozen teacher) set up beside the model: refused, naming to_device
        try:
            fabric.setup_module(_net().requires_grad_(False))
        except ValueError as error:
            out["second"] = str(error)
        strategy.destroy_process_groups()
    return out


def _frozen_run(stage: int) -> Tensor:
    strategy = HybridParallelStrategy(zero_stage=stage)
    fabric = _fabric(strategy)
    teacher = _net().requires_grad_(False)
    teacher = fabric.setup_module(teacher)
    out = teacher(_batch(99, 0)[0])  # gradients enabled, as in a distillation step
    strategy.destroy_process_groups()
    return out


def _ids(step: int) -> Tensor:
    """The same tokens on every rank: ``"ddp"`` (two replicas) and tp2 (one) then see the same data."""
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))


def _wrapper_copy_run(strategy: Any) -> dict[str, Any]:
    """An EMA made as ``copy.deepcopy(model)`` of Fabric's wrapper before the first forward, called before
    the original's first forward, then updated from the original after each step."""
    ours = isinstance(strategy, HybridParallelStrategy)
    fabric = _fabric(strategy)
    net = llama()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    gathered = fabric.strategy.gathered_params if ours else nullcontext
    with gathered():
        ema = copy.deepcopy(model)
    probe = _ids(99)
    with torch.no_grad():
        out: dict[str, Any] = {"first": ema(input_ids=probe).logits}
    for step in range(STEPS):
        ids = _ids(step)
        fabric.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
        with gathered(), torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                e.lerp_(p, 1 - DECAY)
    with torch.no_grad():
        out["ema_out"] = ema(input_ids=probe).logits
    if ours:  # the wrapper holds the strategy: refused by name (before, "cannot pickle 'ProcessGroup'")
        # (at ZeRO-3 outside gathered_params the placeholders' refusal comes first, under tp the slices')
        with gathered(), pytest.raises((TypeError, RuntimeError)) as info:
            torch.save(model, io.BytesIO())
        out["wrapper_pickle"] = str(info.value)
        if strategy.tensor_parallel_size > 1:
            return out
    buffer = io.BytesIO()
    with gathered():
        torch.save(model.module, buffer)  # the way the refusal names
    buffer.seek(0)
    with torch.no_grad():
        out["pickled_out"] = torch.load(buffer, weights_only=False)(input_ids=probe).logits
    if ours:
        strategy.destroy_process_groups()
    return out


class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def _lightning_module_copy(rank: int, strategy: Any) -> Tensor:
    """A LightningModule set up by Fabric holds the Fabric (and so its strategy and precision plugin):
    ``copy.deepcopy(model)`` after a step, as for an EMA (before, "cannot pickle 'ProcessGroup' object"
    at ZeRO 1-3, through the plugin's groups), computes as the original."""
    fabric = _fabric(strategy)
    module = _Module()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    x, y = _batch(rank, 0)
    fabric.backward(F.mse_loss(model(x), y))
    optimizer.step()
    gathered = strategy.gathered_params if isinstance(strategy, HybridParallelStrategy) else nullcontext
    with gathered():
        twin = copy.deepcopy(model)
    with torch.no_grad():
        out = twin(_batch(99, 0)[0])
    if isinstance(strategy, HybridParallelStrategy):
        strategy.destroy_process_groups()
    return out


def _tp_check_after_copy(rank: int) -> str:
    """At tp2 the original's first forward still compares its inputs over the tp ranks after a copy's
    forward (before, the copy carried the check's hook and used it up)."""
    strategy = HybridParallelStrategy(tensor_parallel_size=WORLD, tp_plan="llama")
    fabric = _fabric(strategy)
    model = fabric.setup_module(llama())
    copy.deepcopy(model)(input_ids=_ids(0))
    try:
        model(input_ids=_ids(rank))
        refusal = "not refused"
    except RuntimeError as exc:
        refusal = str(exc)
    strategy.destroy_process_groups()
    return refusal


def _job(rank: int, world: int, tmp: str) -> dict[str, Any]:
    layouts: dict[str, Any] = {
        "ddp": "ddp",
        "zero1": HybridParallelStrategy(zero_stage=1),
        "zero3": HybridParallelStrategy(zero_stage=3),
        "zero3_file": HybridParallelStrategy(zero_stage=3, save_distributed_checkpoint=False),
    }
    out: dict[str, Any] = {name: _ema_run(rank, name, s, Path(tmp) / name) for name, s in layouts.items()}
    out["frozen"] = {stage: _frozen_run(stage) for stage in (0, 1, 2, 3)}
    wrapped = {"ddp": "ddp", **{f"zero{k}": HybridParallelStrategy(zero_stage=k) for k in (1, 3)}}
    wrapped["tp2"] = HybridParallelStrategy(tensor_parallel_size=WORLD, tp_plan="llama")
    out["wrapper"] = {name: _wrapper_copy_run(s) for name, s in wrapped.items()}
    out["tp_check"] = _tp_check_after_copy(rank)
    out["lightning_copy"] = {
        "ddp": _lightning_module_copy(rank, "ddp"),
        **{f"zero{k}": _lightning_module_copy(rank, HybridParallelStrategy(zero_stage=k)) for k in (1, 3)},
    }
    return out


def test_ema_copies_extra_modules_and_a_frozen_module_as_under_ddp(tmp_path: Path) -> None:
    for out in run_distributed(_job, WORLD, str(tmp_path), init_group=False, timeout=300):
        reference = out["ddp"]
        assert (reference["ema"]["0.weight"] - _net().state_dict()["0.weight"]).abs().max() > 1e-2
        for name in ("zero1", "zero3", "zero3_file"):
            got = out[name]
            torch.testing.assert_close(got["ema"], reference["ema"], msg=lambda m, n=name: f"{n}: {m}")
            torch.testing.assert_close(got["ema_out"], reference["ema_out"])
            torch.testing.assert_close(got["loaded_ema"], reference["ema"])
            torch.testing.assert_close(got["flash_ema"], reference["ema"])
            assert got["step"] == got["flash_step"] == STEPS
            assert "one module per Fabric" in got["second"] and "fabric.to_device(module)" in got["second"]
        assert "is a copy (copy.deepcopy, AveragedModel) of a ZeRO-3 module" in out["zero3"]["early"]
        assert "gathered_params()" in out["zero3"]["early"]
        torch.testing.assert_close(reference["loaded_ema"], reference["ema"])
        torch.testing.assert_close(reference["flash_ema"], reference["ema"])
        expected = _net()(_batch(99, 0)[0])
        for stage, value in out["frozen"].items():
            torch.testing.assert_close(value, expected, msg=lambda m, s=stage: f"frozen at ZeRO-{s}: {m}")
        wrapper = out["wrapper"]
        assert (wrapper["ddp"]["ema_out"] - wrapper["ddp"]["first"]).abs().max() > 1e-2
        for name in ("zero1", "zero3", "tp2"):
            refusal = (
                "pickled (torch.save(model), pickle.dumps) while its parameters are tensor-parallel slices"
                if name == "tp2"
                else "torch.save(model.module, f)"
            )
            assert refusal in wrapper[name]["wrapper_pickle"], wrapper[name]["wrapper_pickle"]
            for key in ("first", "ema_out") + (() if name == "tp2" else ("pickled_out",)):
                msg = lambda m, n=name, k=key: f"deepcopy(model) at {n}, {k}: {m}"  # noqa: E731
                torch.testing.assert_close(wrapper[name][key], wrapper["ddp"][key], msg=msg)
        assert "were given different forward batches" in out["tp_check"], out["tp_check"]
        copies = out["lightning_copy"]
        for name in ("zero1", "zero3"):
            torch.testing.assert_close(copies[name], copies["ddp"], msg=lambda m, n=name: f"{n}: {m}")


def test_a_strategy_not_yet_launched_is_copied_like_any_object() -> None:
    strategy = HybridParallelStrategy(zero_stage=2, tensor_parallel_size=2, tp_plan="llama")
    copied = copy.deepcopy(strategy)
    assert copied is not strategy
    assert (copied.zero_stage, copied.tensor_parallel_size, copied.tp_plan) == (2, 2, "llama")
    unpickled = pickle.loads(pickle.dumps(strategy))  # a spawn launcher sends it so
    assert (unpickled.zero_stage, unpickled.tensor_parallel_size, unpickled.tp_plan) == (2, 2, "llama")
