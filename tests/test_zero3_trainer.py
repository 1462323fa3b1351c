"""ZeRO-3 inside the Lightning Trainer: equivalence with a single-process Trainer (activation
checkpointing on, tied embeddings, validation metrics), resume at stage 2 and on 4 ranks from a stage-3
checkpoint, consolidated export, memory report, and a model whose unsharded state exceeds the budget."""

from __future__ import annotations

import ctypes
import os
import resource
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.memory import estimate_memory
from lightning_par.models import GPTModule
from tests.distributed import run_distributed
from tests.test_strategy import (
    ACCUM,
    MICRO,
    N_SAMPLES,
    WORLD,
    LossRecorder,
    Tokens,
    _module,
    _reference_order,
)

GLOBAL = MICRO * WORLD


class Probe(pl.Callback):
    """Memory report mid-training and the consolidated state dict at the end (both collective)."""

    def __init__(self) -> None:
        self.report: dict[str, int] = {}
        self.export: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.report = dict(trainer.strategy.memory_report())  # type: ignore[attr-defined]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.export = trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]


def _trainer(strategy: Any, epochs: int, tmp: str, devices: int, callbacks: list[pl.Callback]) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=epochs,
        accumulate_grad_batches=ACCUM,
        gradient_clip_val=1.0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp,
        callbacks=callbacks,
    )


def _fit(
    strategy: Any,
    epochs: int,
    tmp: str,
    world: int,
    *,
    callbacks: list[pl.Callback] = (),  # type: ignore[assignment]
    resume: str | None = None,
) -> tuple[LossRecorder, GPTModule, pl.Trainer]:
    rec = LossRecorder()
    module = _module()
    trainer = _trainer(strategy, epochs, tmp, world, [rec, *callbacks])
    train = DataLoader(Tokens(N_SAMPLES), batch_size=GLOBAL // world, shuffle=True)
    val = DataLoader(Tokens(8), batch_size=GLOBAL // world)
    trainer.fit(module, train, val, ckpt_path=resume)
    return rec, module, trainer


def _state(module: GPTModule) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def _runs(rank: int, world: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    probe = Probe()
    strategy = HybridParallelStrategy(zero_stage=3, activation_checkpointing=True, reduce_op="reduce_scatter")
    rec, module, trainer = _fit(strategy, 2, tmp, world, callbacks=[probe])
    out["s3"] = {
        "losses": rec.losses,
        "state": _state(module),
        "report": probe.report,
        "estimate": estimate_memory(_module().gpt, zero_stage=3, dp=world),
        "val": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val")},
        "export": probe.export,
    }
    ckpt_dir = os.path.join(tmp, "ckpt")
    first, _, _ = _fit("zero3", 1, tmp, world, callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True)])
    rec2, module, _ = _fit("zero2", 2, tmp, world, resume=os.path.join(ckpt_dir, "last.ckpt"))
    out["resume_s2"] = {"losses": first.losses + rec2.losses, "state": _state(module)}
    return out


def _resume_four(rank: int, world: int, last: str, tmp: str) -> dict[str, Any]:
    rec, module, _ = _fit("zero3", 2, tmp, world, resume=last)
    return {"losses": rec.losses, "state": _state(module)}


def _reference(tmp: Path) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float], GPTModule]:
    rec = LossRecorder()
    module = _module()
    trainer = _trainer("auto", 1, str(tmp / "ref"), 1, [rec])
    train = DataLoader(Tokens(N_SAMPLES), batch_sampler=_reference_order())
    trainer.fit(module, train, DataLoader(Tokens(8), batch_size=GLOBAL))
    val = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val")}
    return torch.tensor(rec.losses), module.state_dict(), val, module


def _assert_state(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str) -> None:
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, msg=f"{what}: {k}")


def test_zero3_trainer_equivalence_resume_export_memory(tmp_path: Path) -> None:
    results = run_distributed(_runs, WORLD, str(tmp_path), init_group=False)
    ref_losses, ref_state, ref_val, ref_module = _reference(tmp_path)

    for rank, r in enumerate(results):
        _assert_state(r["s3"]["state"], ref_state, f"stage 3 rank {rank}")
        _assert_state(
            r["resume_s2"]["state"], ref_state, f"stage-3 checkpoint resumed at stage 2, rank {rank}"
        )
        assert set(r["s3"]["val"]) == {"val_loss", "val_ppl"}
        for key, value in ref_val.items():
            assert r["s3"]["val"][key] == pytest.approx(value, rel=1e-5), key
    for key in ("s3", "resume_s2"):
        torch.testing.assert_close(torch.tensor([r[key]["losses"] for r in results]).mean(0), ref_losses)

    # consolidated export (rank 0 only) loads into the plain model and gives the same outputs
    export = results[0]["s3"]["export"]
    assert results[1]["s3"]["export"] == {}
    plain = GPTModule(**{**_module().hparams})
    plain.configure_model()
    plain.load_state_dict(export)
    x = Tokens(4).data[:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(plain(x), ref_module(x))

    # memory: parameters, gradients and AdamW state are each 1/N of the model (fp32: 4 + 4 + 8 bytes)
    n = _module().gpt.num_parameters()
    for r in results:
        rep, est = r["s3"]["report"], r["s3"]["estimate"]
        model_states = rep["parameters"] + rep["gradients"] + rep["optimizer_state"]
        assert model_states <= 16 * n / WORLD * 1.05 + 4096, (rep, n)
        for k in ("parameters", "gradients", "optimizer_state"):
            assert rep[k] == pytest.approx(est[k], rel=0.05), (k, rep, est)
        assert rep["live_units"] <= est["live_units"]

    # the stage-3 checkpoint, resumed on 4 ranks (dp 4, half the per-rank batch: the same global batch)
    four = run_distributed(
        _resume_four, 4, str(tmp_path / "ckpt" / "last.ckpt"), str(tmp_path), init_group=False
    )
    for rank, r in enumerate(four):
        _assert_state(r["state"], ref_state, f"resumed on 4 ranks, rank {rank}")
    torch.testing.assert_close(
        torch.tensor([r["losses"] for r in four]).mean(0), ref_losses[len(ref_losses) // 2 :]
    )


BIG: dict[str, Any] = dict(vocab_size=256, block_size=32, n_layer=8, n_head=12, n_embd=768, max_steps=2)


class BigGPT(GPTModule):
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _big(rank: int, world: int, tmp: str) -> dict[str, float]:
    # glibc raises its mmap threshold each time a large block is freed, after which freed gathers and
    # gradient buffers stay in the heap and RSS creeps up step after step; a fixed threshold (what
    # MALLOC_MMAP_THRESHOLD_=1048576 does for a fresh process) returns them to the OS.
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rec = LossRecorder()
    module = BigGPT(**BIG)  # built by the strategy inside configure_model(), on the meta device
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=HybridParallelStrategy(zero_stage=3, unshard_on_teardown=False),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp,
        callbacks=[rec],
    )
    trainer.fit(module, DataLoader(Tokens(4), batch_size=1))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "growth": float(peak - before),
        "loss": rec.losses[-1],
        "numel": float(module.gpt.num_parameters()),
    }


def test_zero3_trains_a_model_whose_unsharded_state_exceeds_the_budget(tmp_path: Path) -> None:
    results = run_distributed(_big, WORLD, str(tmp_path), init_group=False)
    numel = results[0]["numel"]
    budget = 16 * numel  # fp32 AdamW model states of the unsharded model: what one process would need
    for r in results:
        assert torch.isfinite(torch.tensor(r["loss"]))
        assert r["growth"] < budget, (
            f"peak RSS grew {r['growth'] / 2**20:.0f} MiB, budget {budget / 2**20:.0f} MiB"
        )
