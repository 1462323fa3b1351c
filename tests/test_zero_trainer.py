"""ZeRO 1/2 inside the Lightning Trainer: equivalence with a single-process Trainer, sharded checkpoints
that resume at another stage and another dp size, memory report against the estimate."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import FSDPPrecision
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.checkpoint import consolidate, is_sharded_checkpoint
from lightning_par.memory import estimate_memory
from lightning_par.models import GPTModule
from lightning_par.precision import ParallelPrecision
from tests.distributed import run_distributed
from tests.test_strategy import (
    MICRO,
    N_SAMPLES,
    WORLD,
    LossRecorder,
    Tokens,
    _module,
    _reference_order,
    _trainer,
)

GLOBAL = MICRO * WORLD  # samples per micro-step over all ranks


class MemoryProbe(pl.Callback):
    """The strategy's memory report in the middle of training (after a step, before teardown)."""

    def __init__(self) -> None:
        self.report: dict[str, int] = {}

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, HybridParallelStrategy)
        self.report = dict(strategy.memory_report())


def _fit(
    strategy: Any,
    epochs: int,
    tmp: str,
    world: int,
    *,
    ckpt_dir: str | None = None,
    resume: str | None = None,
    probe: MemoryProbe | None = None,
) -> tuple[LossRecorder, GPTModule, pl.Trainer]:
    rec = LossRecorder()
    callbacks: list[pl.Callback] = [rec] + ([probe] if probe else [])
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, save_last=True))
    module = _module()
    trainer = _trainer(strategy, epochs, tmp, callbacks, world)
    loader = DataLoader(Tokens(N_SAMPLES), batch_size=GLOBAL // world, shuffle=True)
    trainer.fit(module, loader, ckpt_path=resume)
    return rec, module, trainer


def _state(module: GPTModule) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def _runs_two(rank: int, world: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage in (0, 1, 2):
        probe = MemoryProbe()
        strategy = HybridParallelStrategy(zero_stage=stage, bucket_size_mb=0.01)
        rec, module, _ = _fit(strategy, 2, tmp, world, probe=probe)
        report = probe.report
        estimate = estimate_memory(module, zero_stage=stage, dp=world, bucket_size_mb=0.01)
        out[f"s{stage}"] = {
            "losses": rec.losses,
            "state": _state(module),
            "report": report,
            "estimate": estimate,
        }
    # interrupted after one epoch at stage 2, then resumed at stage 1 and at stage 0 (same world)
    ckpt_dir = os.path.join(tmp, "ckpt")
    rec1, _, _ = _fit("zero2", 1, tmp, world, ckpt_dir=ckpt_dir)
    last = os.path.join(ckpt_dir, "last.ckpt")
    assert is_sharded_checkpoint(last)
    out["first_epoch"] = rec1.losses
    for stage in (1, 0):
        rec2, module, _ = _fit(f"zero{stage}", 2, tmp, world, resume=last)
        out[f"resume_s{stage}"] = {"losses": rec1.losses + rec2.losses, "state": _state(module)}
    return out


def _resume_four(rank: int, world: int, last: str, tmp: str) -> dict[str, Any]:
    rec, module, _ = _fit("zero2", 2, tmp, world, resume=last)
    return {"losses": rec.losses, "state": _state(module)}


def _reference(tmp: Path) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    rec = LossRecorder()
    module = _module()
    loader = DataLoader(Tokens(N_SAMPLES), batch_sampler=_reference_order())
    trainer = _trainer("auto", 1, str(tmp / "ref"), [rec], 1)
    trainer.fit(module, loader)
    return torch.tensor(rec.losses), module.state_dict()


def _assert_state(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str) -> None:
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, msg=f"{what}: {k}")


def test_zero12_trainer_equivalence_resume_and_memory(tmp_path: Path) -> None:
    results = run_distributed(_runs_two, WORLD, str(tmp_path), init_group=False)
    ref_losses, ref_state = _reference(tmp_path)
    steps_per_epoch = len(ref_losses) // 2
    # stage 0: every rank holds everything; the estimate (and the planner built on it) match the report
    n_params = _module().gpt.num_parameters()
    for r in results:
        rep, est = r["s0"]["report"], r["s0"]["estimate"]
        assert rep["optimizer_state"] == pytest.approx(8 * n_params, rel=0.02)
        for key in ("parameters", "gradients", "optimizer_state"):
            assert rep[key] == pytest.approx(est[key], rel=0.05), (key, rep, est)

    for stage in (1, 2):
        for rank, r in enumerate(results):
            got = r[f"s{stage}"]
            assert len(got["losses"]) == len(ref_losses)
            _assert_state(got["state"], ref_state, f"stage {stage} rank {rank}")
        torch.testing.assert_close(
            torch.tensor([r[f"s{stage}"]["losses"] for r in results]).mean(0), ref_losses
        )
        # memory: optimizer state (AdamW, fp32 params are the masters) is 8 bytes/param split over the ranks
        n_params = _module().gpt.num_parameters()  # tied weights once
        reports = [r[f"s{stage}"]["report"] for r in results]
        assert sum(rep["optimizer_state"] for rep in reports) == pytest.approx(8 * n_params, rel=0.02)
        for rep in reports:
            est = results[0][f"s{stage}"]["estimate"]
            assert rep["optimizer_state"] == pytest.approx(8 * n_params / WORLD, rel=0.05)
            model_states = ("parameters", "gradients", "optimizer_state")
            assert sum(rep[k] for k in model_states) == pytest.approx(
                sum(est[k] for k in model_states), rel=0.05
            )
            for key in model_states:
                assert rep[key] == pytest.approx(est[key], rel=0.05), (key, rep, est)
            assert rep["comm_buffers"] <= est["comm_buffers"], (rep, est)
        if stage == 2:
            # gradients: the 1/N shard; full-size buckets only as bounded communication buffers
            assert reports[0]["gradients"] == pytest.approx(4 * n_params / WORLD, rel=0.05)

    for stage in (1, 0):
        for rank, r in enumerate(results):
            _assert_state(r[f"resume_s{stage}"]["state"], ref_state, f"resume at stage {stage}, rank {rank}")
        resumed = torch.tensor([r[f"resume_s{stage}"]["losses"] for r in results]).mean(0)
        torch.testing.assert_close(resumed, ref_losses)

    # the same stage-2 checkpoint, resumed on 4 ranks (dp 4, half the per-rank batch: same global batch)
    last = str(tmp_path / "ckpt" / "last.ckpt")
    four = run_distributed(_resume_four, 4, last, str(tmp_path), init_group=False)
    for rank, r in enumerate(four):
        _assert_state(r["state"], ref_state, f"resume on 4 ranks, rank {rank}")
    resumed = torch.tensor([r["losses"] for r in four]).mean(0)
    torch.testing.assert_close(resumed, ref_losses[steps_per_epoch:])

    # consolidated export: one file with torch's optimizer format, loadable by a plain optimizer
    full = consolidate(last)
    module = _module()
    opt = module.configure_optimizers()["optimizer"]
    opt.load_state_dict(full["optimizer_states"][0])
    assert len(opt.state) == len(list(module.parameters()))
    module.load_state_dict(full["state_dict"])


def _bad_checkpoint(rank: int, world: int, last: str, tmp: str) -> str:
    rec = LossRecorder()
    module = GPTModule(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32, max_steps=4)
    module.configure_model()
    trainer = _trainer("zero1", 1, tmp, [rec], world)
    loader = DataLoader(Tokens(N_SAMPLES), batch_size=MICRO, shuffle=True)
    with pytest.raises(ValueError, match=r"does not match the model.*not in the model: \['model.blocks.1"):
        trainer.fit(module, loader, ckpt_path=last)
    # an optimizer whose update is not element-wise is refused at setup, before any step
    module = LbfgsGPT(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32, max_steps=4)
    module.configure_model()
    trainer = _trainer("zero1", 1, tmp, [rec], world)
    with pytest.raises(TypeError, match=r"cannot shard torch\.optim\.lbfgs\.LBFGS"):
        trainer.fit(module, loader)
    assert trainer.global_step == 0
    return "ok"


class LbfgsGPT(GPTModule):
    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters())


def test_mismatched_and_partial_checkpoints(tmp_path: Path) -> None:
    def make(rank: int, world: int, tmp: str) -> None:
        _fit("zero2", 1, tmp, world, ckpt_dir=os.path.join(tmp, "ckpt"))

    run_distributed(make, WORLD, str(tmp_path), init_group=False)
    last = str(tmp_path / "ckpt" / "last.ckpt")
    assert run_distributed(_bad_checkpoint, WORLD, last, str(tmp_path), init_group=False) == ["ok", "ok"]
    (Path(last) / "COMPLETE").unlink()
    with pytest.raises(ValueError, match="incomplete sharded checkpoint"):
        consolidate(last)


def test_zero_stage_options_are_checked() -> None:
    with pytest.raises(ValueError, match="grad_sync='every' reduces into a gradient shard"):
        HybridParallelStrategy(zero_stage=0, grad_sync="every")
    with pytest.raises(ValueError, match="reduce_op must be"):
        HybridParallelStrategy(zero_stage=1, reduce_op="broadcast")  # type: ignore[arg-type]
    # Lightning's precision strings become ParallelPrecision at stage >= 1 (fp32 masters in the shards)
    trainer = pl.Trainer(strategy="zero2", accelerator="cpu", devices=2, precision="bf16-mixed")
    assert isinstance(trainer.precision_plugin, ParallelPrecision)
    assert trainer.precision_plugin.precision == "bf16-mixed"
    # and at stage 0 too, without masters (fp32 parameters under autocast; masters there are refused at
    # setup, see tests/test_precision_regressions.py)
    trainer = pl.Trainer(
        strategy="zero0", accelerator="cpu", devices=2, plugins=[ParallelPrecision("16-mixed")]
    )
    assert isinstance(trainer.precision_plugin, ParallelPrecision) and trainer.precision_plugin.scaler
    with pytest.raises(ValueError, match=r"FSDPPrecision\('bf16-mixed'\) cannot be used with ZeRO stage 3"):
        pl.Trainer(strategy="zero3", accelerator="cpu", devices=2, plugins=[FSDPPrecision("bf16-mixed")])
