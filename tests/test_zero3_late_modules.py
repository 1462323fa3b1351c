"""A module attached to the model after setup (an EMA copy made in ``on_fit_start``, as many users keep
one) at ZeRO-3, against Lightning's ``"ddp"``.

ZeRO-3's units hold the parameters that existed at setup; a later module's parameters are whole on every
rank. Before, three things went wrong with them:

* the copy made as the README says, inside ``gathered_params()``, was refused on leaving it: "The model's
  parameters changed inside gathered_params() (modules replaced or removed ...)" (nothing was removed);
* ``consolidated_state_dict()`` and a one-file checkpoint raised "No rank holds parameter 'ema.0.weight';
  the layout lost it (this is a bug)";
* a sharded checkpoint left them out without a word: resumed, the EMA restarted from its first values
  (0.029 off ``"ddp"``).

Now they are checkpointed whole and loaded back, and the exports equal ``"ddp"``'s at ZeRO-1 and ZeRO-3.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state
from tests.third_party import Tokens, llama

STEPS, MORE = 4, 2


class EmaBase(pl.LightningModule):
    """A network (the attribute ``source`` names) and an EMA of it, made in ``on_fit_start`` (or in
    ``__init__`` with ``early``: the resumed runs, where the copy exists before the checkpoint loads)."""

    source = "net"  # the attribute holding the network the EMA follows

    def _gathered(self, **options: Any) -> Any:
        strategy = self.trainer.strategy
        ours = isinstance(strategy, HybridParallelStrategy)
        return strategy.gathered_params(**options) if ours else nullcontext()

    def on_fit_start(self) -> None:
        if not hasattr(self, "ema"):
            with self._gathered():  # at ZeRO-3 the weights are whole only in here
                self.ema = copy.deepcopy(getattr(self, self.source)).requires_grad_(False)

    def on_train_batch_end(self, *args: Any) -> None:
        # writeback: an EMA made in __init__ is a (frozen) part of ZeRO-3's units, whose writes it keeps
        with self._gathered(writeback=True), torch.no_grad():
            for e, p in zip(self.ema.parameters(), getattr(self, self.source).parameters(), strict=True):
                e.lerp_(p, 0.5)


class EmaModule(EmaBase):
    """An MLP and its EMA."""

    def __init__(self, *, early: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        if early:
            self.ema = copy.deepcopy(self.net).requires_grad_(False)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.net.parameters(), lr=0.05)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(
        TensorDataset(torch.randn(48, 4, generator=g), torch.randn(48, 1, generator=g)), batch_size=4
    )


def _runs(rank: int, world: int, tmp: str) -> dict[str, dict[str, dict[str, Tensor]]]:
    out = {}
    layouts: dict[str, Any] = {
        "ddp": lambda: "ddp",
        "zero1": lambda: HybridParallelStrategy(zero_stage=1),
        "zero3": lambda: HybridParallelStrategy(zero_stage=3, meta_init=False),
        "zero3_file": lambda: HybridParallelStrategy(
            zero_stage=3, meta_init=False, save_distributed_checkpoint=False
        ),
    }
    for name, make in layouts.items():
        path = str(Path(tmp) / f"{name}.ckpt")
        module, strategy = EmaModule(), make()
        trainer = cpu_trainer(strategy, max_steps=STEPS)
        trainer.fit(module, _data())
        trainer.save_checkpoint(path)
        first = final_state(module, strategy)  # consolidated (ours) or the module's own state dict
        module, strategy = EmaModule(early=True), make()  # the EMA exists before the checkpoint loads
        cpu_trainer(strategy, max_steps=STEPS + MORE).fit(module, _data(), ckpt_path=path)
        out[name] = {"first": first, "resumed": final_state(module, strategy)}
    return out


def _assert_runs_equal(results: dict[str, Any], reference: dict[str, Any]) -> None:
    """Every layout's states of each run (first, resumed) equal the reference's, key for key."""
    for name, runs in results.items():
        for run, state in runs.items():
            assert state.keys() == reference[run].keys(), (name, run)
            for key, value in reference[run].items():
                torch.testing.assert_close(
                    state[key], value, msg=lambda m, n=name, r=run, k=key: f"{n} {r} {k}: {m}"
                )


def test_a_module_attached_after_setup_is_checkpointed_and_resumed_as_under_ddp(tmp_path: Path) -> None:
    results = run_distributed(_runs, 2, str(tmp_path), init_group=False, timeout=300)[0]
    reference = results.pop("ddp")
    first_ema = reference["first"]["ema.0.weight"]
    assert (first_ema - EmaModule().net[0].weight).abs().max() > 1e-2  # the EMA moved
    assert (reference["resumed"]["ema.0.weight"] - first_ema).abs().max() > 1e-3  # and kept moving
    _assert_runs_equal(results, reference)


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = EmaModule().net

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def _fabric(rank: int, world: int, tmp: str) -> dict[str, dict[str, Tensor]]:
    """Fabric: an EMA attached to the set-up module after setup is saved with it and loaded back by
    ``fabric.load`` (which at ZeRO-3 fills the units' shards; the EMA is no unit's), and by a flash
    snapshot's restore (before, left out of the snapshot at ZeRO-3)."""
    from lightning.fabric import Fabric

    from lightning_par.fabric import FlashSnapshots
    from lightning_par.fabric import HybridParallelStrategy as FabricStrategy

    out = {}
    for name, strategy in (("ddp", "ddp"), ("zero3", FabricStrategy(zero_stage=3))):
        fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
        fabric.launch()
        net = _Holder()
        model, optimizer = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=0.05))
        ours = isinstance(strategy, FabricStrategy)
        gathered = fabric.strategy.gathered_params if ours else nullcontext
        with gathered():
            ema = copy.deepcopy(net.net).requires_grad_(False)
        net.ema = ema  # attached to the set-up module: part of its state from now on
        for x, y in list(_data())[rank : 2 * STEPS : world]:
            fabric.backward(F.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            with gathered(), torch.no_grad():
                for e, p in zip(ema.parameters(), net.net.parameters(), strict=True):
                    e.lerp_(p, 0.5)
        saved = {k: v.clone() for k, v in ema.state_dict().items()}
        path = Path(tmp) / f"fabric_{name}"
        fabric.save(path, {"model": model, "optimizer": optimizer})
        with torch.no_grad():
            for e in ema.parameters():
                e.zero_()
        fabric.load(path, {"model": model, "optimizer": optimizer})
        out[name] = {"saved": saved, "loaded": {k: v.clone() for k, v in ema.state_dict().items()}}
        # a flash snapshot of the same state (ZeRO-3 sends the units' shards, the EMA in the model tree)
        flash = {"dirpath": path.with_suffix(".flash"), "shm_dir": path.with_suffix(f".shm{rank}")}
        with FlashSnapshots(fabric, snapshot_copy="blocking", **flash) as snapshots:
            snapshots.snapshot(STEPS, {"model": model, "optimizer": optimizer})
        with torch.no_grad():
            for e in ema.parameters():
                e.zero_()
        with FlashSnapshots(fabric, **flash) as snapshots:
            snapshots.restore({"model": model, "optimizer": optimizer})
        out[name]["flash"] = {k: v.clone() for k, v in ema.state_dict().items()}
        if ours:
            strategy.destroy_process_groups()
    return out


def test_fabric_loads_a_module_attached_after_setup_at_zero3(tmp_path: Path) -> None:
    for out in run_distributed(_fabric, 2, str(tmp_path), init_group=False, timeout=300):
        assert (out["ddp"]["saved"]["0.weight"] - EmaModule().net[0].weight).abs().max() > 1e-2
        for name in ("ddp", "zero3"):
            torch.testing.assert_close(out[name]["loaded"], out[name]["saved"])
            torch.testing.assert_close(out[name]["flash"], out[name]["saved"])
        torch.testing.assert_close(out["zero3"]["saved"], out["ddp"]["saved"])


class EmaLlama(EmaBase):
    """A Hugging Face Llama under the "llama" plan and its EMA (made after setup: tensor-parallel slices)."""

    tp_plan = "llama"
    source = "model"

    def __init__(self, *, early: bool = False) -> None:
        super().__init__()
        self.model = llama()
        if early:
            self.ema = copy.deepcopy(self.model).requires_grad_(False)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        ids, labels = batch
        return self.model(input_ids=ids, labels=labels).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.model.parameters(), lr=0.5)


def _tp_runs(rank: int, world: int, tmp: str, stages: list[int]) -> dict[str, dict[str, dict[str, Tensor]]]:
    out = {}
    for stage in stages:
        path = str(Path(tmp) / f"tp{world}_{stage}.ckpt")

        def make(s: int = stage) -> Any:
            if world == 1:
                return "auto"
            return HybridParallelStrategy(zero_stage=s, tensor_parallel_size=2, meta_init=False)

        data = DataLoader(Tokens(8), batch_size=4)
        module, strategy = EmaLlama(), make()
        # dp = 1 in both: every rank reads the whole loader in order, as the one process does
        trainer = cpu_trainer(strategy, devices=world, max_steps=2, use_distributed_sampler=False)
        trainer.fit(module, data)
        trainer.save_checkpoint(path)
        first = final_state(module, strategy)
        module, strategy = EmaLlama(early=True), make()
        resumed = cpu_trainer(strategy, devices=world, max_steps=4, use_distributed_sampler=False)
        resumed.fit(module, data, ckpt_path=path)
        out[f"zero{stage}"] = {"first": first, "resumed": final_state(module, strategy)}
    return out


def test_a_tensor_parallel_copy_attached_after_setup_is_checkpointed_as_one_process(tmp_path: Path) -> None:
    """A deep copy of a tensor-parallel model holds this rank's slices: before, its parameters lost the
    marks of their cut (torch's Parameter copy drops Python attributes) and the slices' state-dict guard,
    carried along, refused the whole model's checkpoint and export ("state_dict() reached
    'model.model.embed_tokens' ... tensor-parallel slices"). Now the copy is saved, exported and resumed
    as one process's EMA, at ZeRO-0 and ZeRO-3."""
    reference = run_distributed(_tp_runs, 1, str(tmp_path / "one"), [0], init_group=False)[0]["zero0"]
    results = run_distributed(_tp_runs, 2, str(tmp_path / "tp"), [0, 3], init_group=False, timeout=300)[0]
    assert (
        reference["resumed"]["ema.lm_head.weight"] - reference["first"]["ema.lm_head.weight"]
    ).abs().max() > 1e-4
    _assert_runs_equal(results, reference)
