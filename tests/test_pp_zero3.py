"""ZeRO-3 with pipeline stages in the Trainer (world 4: pp2 x dp2) against the single-process Trainer.

Each stage's units are sharded over its dp pair. Under the pipeline they stay gathered across a step's
micro-batches (``reshard_after_forward`` unset) and every unit is reduced once per step, after the last
micro-batch and the tied embedding/head exchange; with ``reshard_after_forward=True`` they are re-gathered
per use. 1F1B (with global-norm clipping), interleaved 1F1B and the zero-bubble schedule give the
reference's losses, validation loss and final weights (``consolidated_state_dict()``, which gathers over
stages and shards), and ``trainer.test`` after fit gives the reference's final validation loss; the
counts of gathers and reductions per step are checked against what the mode promises. A unit policy
that crosses a stage boundary is refused at setup, on every rank.

A model built by the strategy on the meta device (``configure_model()`` under ``meta_init``) starts as
the one-process twin (``materialize_model`` with the engine's seed), bitwise, whichever stage holds a
block; before, each stage seeded its units by their index within the stage, so block 1 (stage 1) was
drawn exactly as block 0 (stage 0).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.models import GPTModule
from lightning_par.zero.meta_build import params_on_meta
from lightning_par.zero.meta_init import materialize_model
from lightning_par.zero.units import check_pipeline_units
from tests.distributed import run_distributed
from tests.test_pp_trainer import GLOBAL, KW, SGDGPT, N, _module, _reference, _trainer
from tests.test_strategy import LossRecorder, Tokens

WORLD, DP = 4, 2
CASES: dict[str, dict[str, Any]] = {
    "1f1b": dict(pipeline_schedule="1f1b", num_microbatches=4),
    "interleaved_reshard": dict(
        pipeline_schedule="interleaved_1f1b",
        virtual_stages=2,
        partition_method="uniform",
        num_microbatches=2,
        reshard_after_forward=True,
    ),
    "zb": dict(pipeline_schedule="zb", num_microbatches=2),
    "interleaved_zb": dict(
        pipeline_schedule="interleaved_zb", virtual_stages=2, partition_method="uniform", num_microbatches=2
    ),
}


class CountCollectives(pl.Callback):
    """Per training step: how many times units started a gather, and how many unit reductions ran."""

    def __init__(self) -> None:
        self.gathers: list[int] = []
        self.reductions: list[int] = []
        self.units = 0
        self.counting = False

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        engine = trainer.strategy._engine  # type: ignore[attr-defined]
        self.units = len(engine.units)
        launch = engine._launch

        def counted_launch(unit: Any) -> None:
            self.reductions[-1] += self.counting
            launch(unit)

        engine._launch = counted_launch  # instance attribute: gone with the engine
        for unit in engine.units:
            gather = unit.gather

            def counted_gather(group: Any, _unit: Any = unit, _gather: Any = gather) -> None:
                self.gathers[-1] += self.counting and _unit.state == "sharded"
                _gather(group)

            unit.gather = counted_gather

    def on_train_batch_start(self, *args: Any) -> None:
        self.gathers.append(0)
        self.reductions.append(0)
        self.counting = True

    def on_train_batch_end(self, *args: Any) -> None:
        self.counting = False  # validation runs between this and the next batch


def _run(rank: int, world: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, kw in CASES.items():
        rec, count = LossRecorder(), CountCollectives()
        strategy = HybridParallelStrategy(zero_stage=3, pipeline_parallel_size=2, **kw)
        trainer = _trainer(strategy, world, str(Path(tmp) / name), [rec, count])
        train = DataLoader(Tokens(N), batch_size=GLOBAL // DP, shuffle=True)
        trainer.fit(_module(), train, DataLoader(Tokens(8), batch_size=8 // DP))
        state = trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]
        val_loss = float(trainer.callback_metrics["val_loss"])
        if name == "1f1b":  # the evaluation path after fit: the final weights on the validation data
            tested = trainer.test(trainer.lightning_module, DataLoader(Tokens(8), batch_size=8 // DP))
        out[name] = {
            "losses": rec.losses,
            "val_loss": val_loss,
            "state": {k: v.clone() for k, v in state.items()},
            "gathers": count.gathers,
            "reductions": count.reductions,
            "units": count.units,
            "test_loss": tested[0]["test_loss"] if name == "1f1b" else None,
        }
    out["meta"] = _meta_init(world, tmp)
    # blocks 0 and 1 are pipeline layers on different stages: a unit holding both crosses the boundary
    strategy = HybridParallelStrategy(zero_stage=3, pipeline_parallel_size=2, zero3_units=["model.blocks"])
    trainer = _trainer(strategy, world, str(Path(tmp) / "bad"), [])
    with pytest.raises(ValueError) as refused:
        trainer.fit(_module(), DataLoader(Tokens(N), batch_size=GLOBAL // DP))
    out["refused"] = str(refused.value)
    return out


class InitialState(pl.Callback):
    """The consolidated weights when training starts, and the seed the engine initialised them from."""

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.state = {k: v.clone() for k, v in trainer.strategy.consolidated_state_dict().items()}  # type: ignore[attr-defined]
        self.seed = trainer.strategy.engine.init_seed  # type: ignore[attr-defined]


class RankSeeded(SGDGPT):
    """Builds its network in a random state that differs across ranks, as a model whose construction draws
    differently per rank would: the engine then draws the init's seed, which the first rank's must win."""

    def configure_model(self) -> None:
        torch.manual_seed(self.global_rank)
        super().configure_model()


def _meta_init(world: int, tmp: str) -> dict[str, Any]:
    grab = InitialState()
    strategy = HybridParallelStrategy(zero_stage=3, pipeline_parallel_size=2, num_microbatches=2)
    trainer = _trainer(strategy, world, str(Path(tmp) / "meta"), [grab], max_steps=1)
    module = RankSeeded(**KW)  # configure_model() left to the strategy: built on the meta device
    trainer.fit(module, DataLoader(Tokens(N), batch_size=GLOBAL // DP))
    return {"state": grab.state, "seed": grab.seed}


def _check_meta_init(results: list[dict[str, Any]]) -> None:
    seed = results[0]["meta"]["seed"]
    assert all(r["meta"]["seed"] == seed for r in results)
    twin = SGDGPT(**KW)
    with params_on_meta():
        twin.configure_model()
    materialize_model(twin, seed=seed, device=torch.device("cpu"))
    state = results[0]["meta"]["state"]
    assert state.keys() == twin.state_dict().keys()
    for k, v in twin.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=0, msg=k)
    blocks = [state[f"model.blocks.{i}.attn.q_proj.weight"] for i in range(KW["n_layer"])]
    assert not torch.equal(blocks[0], blocks[1])  # stage 0's block and stage 1's


def test_zero3_pipeline_matches_single_process(tmp_path: Path) -> None:
    results = run_distributed(_run, WORLD, str(tmp_path), init_group=False, timeout=400)
    _check_meta_init(results)
    ref_losses, ref_state, ref_val = _reference(tmp_path)
    steps = len(ref_losses)
    for name, kw in CASES.items():
        losses = torch.tensor([r[name]["losses"] for r in results])
        torch.testing.assert_close(losses.mean(0), ref_losses, msg=name)
        for r in results:
            assert r[name]["val_loss"] == pytest.approx(ref_val, rel=1e-5), name
            if name == "1f1b":
                assert r[name]["test_loss"] == pytest.approx(ref_val, rel=1e-5)
        state = results[0][name]["state"]
        assert set(ref_state) <= set(state), name
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, msg=f"{name}: {k}")
        for rank, r in enumerate(results):
            got = r[name]
            assert len(got["gathers"]) == steps
            # every unit of the stage (the blocks, and the root: embedding or head) reduced once per step
            assert got["reductions"] == [got["units"]] * steps, (name, rank, got["reductions"])
            if kw.get("reshard_after_forward"):  # gathered for each micro-batch's forward and backward
                assert min(got["gathers"]) > 2 * got["units"], (name, rank, got["gathers"])
            else:  # gathered once per step, kept across the micro-batches
                assert got["gathers"] == [got["units"]] * steps, (name, rank, got["gathers"])
    for r in results:
        refused = r["refused"]
        assert "zero3_units selects 'model.blocks'" in refused, refused
        assert "on stages [0, 1], so its parameters cross a stage boundary" in refused, refused


def test_pipeline_unit_policies_are_checked_against_the_layers() -> None:
    module = GPTModule(**{k: v for k, v in KW.items() if k != "max_steps"})
    module.configure_model()
    layers = list(module.pipeline_layers())  # embedding, block, block, head
    pieces = [(0, 2), (2, 4)]
    check_pipeline_units(module, None, layers=layers, pieces=pieces, pp_size=2)  # the blocks
    check_pipeline_units(module, ["*.attn", "*.mlp"], layers=layers, pieces=pieces, pp_size=2)
    module.metrics = torch.nn.ModuleList([torch.nn.Identity()])  # no parameters: no unit, not refused
    check_pipeline_units(module, None, layers=layers, pieces=pieces, pp_size=2)
    del module.metrics
    with pytest.raises(ValueError, match=r"'model' as a ZeRO-3 unit, but it holds pipeline layers 0\.\.3"):
        check_pipeline_units(module, ["model"], layers=layers, pieces=pieces, pp_size=2)
    # all on one stage, but above the layers: the pipeline never calls it
    with pytest.raises(ValueError, match=r"'model.blocks' .* would never gather it"):
        check_pipeline_units(module, ["model.blocks"], layers=layers, pieces=[(0, 3), (3, 4)], pp_size=2)
    # a copy of the model beside the layers (an EMA made in __init__): named as such, with the fix (before,
    # "zero3_units selects ..." though zero3_units was never set)
    module.ema = copy.deepcopy(module.model)
    with pytest.raises(
        ValueError, match=r"found 'ema.blocks.0' .* outside the pipeline's layers .*ShardedEMA"
    ):
        check_pipeline_units(module, None, layers=layers, pieces=pieces, pp_size=2)
