"""A Hugging Face Llama with a PEFT LoRA adapter, fine-tuned with ``AdamW(self.parameters())`` (frozen base
weights in the optimizer) at ZeRO stages 0-3 and under tensor parallelism, against the same LightningModule
in one process, each run with Hugging Face's reentrant activation checkpointing on (the nested backward
passes of its layers must not end the gradient reduction early; before, stages 0-2 lost the first
layer's adapter gradients, and the tensor-parallel embedding dropped the hook that makes its output
require grad): adapters and base weights equal, base weights untouched, and at stage 3 the frozen base
sharded 1/N with optimizer state for the adapters only (as estimate_memory predicts); a frozen block
under pipeline parallelism (1F1B and zb); a FlashCheckpoint resume at stage 3 bitwise equal to an
uninterrupted run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.callbacks import FlashCheckpoint
from lightning_par.fabric import HybridParallelStrategy as FabricStrategy
from lightning_par.memory import estimate_memory
from lightning_par.models import GPTModule
from tests.distributed import run_distributed
from tests.test_fabric_tp import STEPS
from tests.test_fabric_tp import _loop as _fabric_loop
from tests.third_party import (
    LoraLlama,
    LossRecorder,
    Tokens,
    add_lora,
    checkpoint_layers,
    llama,
    replay_order,
)

SEED, MICRO, N = 3, 2, 16


class Probe(pl.Callback):
    def __init__(self) -> None:
        self.report: dict[str, int] = {}
        self.frozen = 0
        self.export: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        strategy = trainer.strategy
        self.report = dict(strategy.memory_report())  # type: ignore[attr-defined]
        engine = strategy.engine  # type: ignore[attr-defined]
        if engine.shards_params:  # ZeRO-3: how much of the frozen base model this rank holds
            self.frozen = engine.memory_bytes()["frozen_shard"]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.export = trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]


def _trainer(
    strategy: Any, devices: int, tmp: str, callbacks: list[pl.Callback], max_steps: int = -1
) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=1 if max_steps < 0 else -1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp,
        callbacks=callbacks,
    )


class FrozenBlockGPT(GPTModule):
    """The package's GPT (it has the pipeline protocol) with its first block frozen, SGD over all
    parameters (the pipeline re-associates fp32 sums; Adam would amplify that, see tests/reference.py)."""

    def configure_model(self) -> None:
        super().configure_model()
        for p in self.gpt.blocks[0].parameters():
            p.requires_grad_(False)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.3, momentum=0.9)


GPT_KW: dict[str, Any] = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, bias=False)


def _frozen_gpt() -> FrozenBlockGPT:
    pl.seed_everything(SEED)
    module = FrozenBlockGPT(**GPT_KW, max_steps=4)
    module.configure_model()
    return module


def _runs(rank: int, world: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    layouts: list[tuple[str, dict[str, Any], int]] = [
        *((f"zero{s}", {"zero_stage": s, "meta_init": False}, world) for s in (0, 1, 2, 3)),
        ("tp2", {"tensor_parallel_size": 2, "tp_plan": "llama"}, 1),
    ]
    for name, kw, dp in layouts:
        pl.seed_everything(SEED)
        rec, probe = LossRecorder(), Probe()
        trainer = _trainer(HybridParallelStrategy(**kw), world, tmp, [rec, probe])
        # Hugging Face's reentrant activation checkpointing in every layout, the reference without it
        module = LoraLlama(checkpointing=True)
        trainer.fit(module, DataLoader(Tokens(N), batch_size=MICRO * world // dp, shuffle=True))
        out[name] = {
            "losses": rec.losses,
            "report": probe.report,
            "frozen": probe.frozen,
            "export": probe.export,
        }
    # pipeline parallelism with a frozen block: placeholders of the other stage, ZeRO-1 over nothing;
    # zb defers the trainable linears' weight gradients and leaves the frozen block's in B
    for name, schedule in (("pp2", "1f1b"), ("pp2_zb", "zb")):
        rec, probe = LossRecorder(), Probe()
        strategy = HybridParallelStrategy(
            zero_stage=1, pipeline_parallel_size=2, num_microbatches=2, pipeline_schedule=schedule
        )
        trainer = _trainer(strategy, world, tmp, [rec, probe])
        trainer.fit(_frozen_gpt(), DataLoader(Tokens(N), batch_size=2 * MICRO, shuffle=True))
        out[name] = {"losses": rec.losses, "export": probe.export}
    out["flash"] = _flash(rank, world, tmp)
    return out


def _flash(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """FlashCheckpoint at ZeRO-3 with a frozen base: 4 steps, then the same command with 8 resumes from
    the snapshot of step 4 (shards of the frozen and trainable parameters, AdamW state, data position)."""
    dirpath, shm = Path(tmp) / "flash", Path(tmp) / f"shm{rank}"
    states = {}
    for name, steps, flash in (
        ("uninterrupted", 8, None),
        ("first", 4, FlashCheckpoint(dirpath, every_n_steps=2, persist_every_n_steps=2, shm_dir=shm)),
        ("resumed", 8, FlashCheckpoint(dirpath, every_n_steps=2, persist_every_n_steps=2, shm_dir=shm)),
    ):
        pl.seed_everything(SEED)
        probe = Probe()
        trainer = _trainer(
            HybridParallelStrategy(zero_stage=3, meta_init=False),
            world,
            tmp,
            [probe] if flash is None else [probe, flash],
            max_steps=steps,
        )
        trainer.fit(LoraLlama(), DataLoader(Tokens(N), batch_size=MICRO, shuffle=True))
        states[name] = probe.export
        if name == "resumed":
            assert flash is not None and flash.resumed is not None
            states["resumed_from"] = flash.resumed["step"]
    return states


def _reference(dp: int, micro: int) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    pl.seed_everything(SEED)
    rec = LossRecorder()
    module = LoraLlama()
    module.configure_model()
    initial = {k: v.detach().clone() for k, v in module.state_dict().items()}
    order = replay_order(N, dp=dp, micro=micro, epochs=1, seed=SEED)
    trainer = _trainer("auto", 1, "", [rec])
    trainer.fit(module, DataLoader(Tokens(N), batch_sampler=order))
    return rec.losses, {k: v.detach() for k, v in module.state_dict().items()}, initial


def test_lora_llama_matches_one_process_at_every_stage_and_tp(tmp_path: Path) -> None:
    results = run_distributed(_runs, 2, str(tmp_path), init_group=False)
    references = {(2, MICRO): _reference(2, MICRO), (1, 2 * MICRO): _reference(1, 2 * MICRO)}
    checks = {f"zero{s}": (2, MICRO) for s in (0, 1, 2, 3)} | {"tp2": (1, 2 * MICRO)}
    for name, (dp, micro) in checks.items():
        ref_losses, ref_state, initial = references[(dp, micro)]
        _check_run(name, [r[name] for r in results], dp, ref_losses, ref_state, initial)

    # the frozen block under pipeline parallelism
    pl.seed_everything(SEED)
    module = _frozen_gpt()
    initial = {k: v.detach().clone() for k, v in module.state_dict().items()}
    rec = LossRecorder()
    order = replay_order(N, dp=1, micro=2 * MICRO, epochs=1, seed=SEED)
    _trainer("auto", 1, "", [rec]).fit(module, DataLoader(Tokens(N), batch_sampler=order))
    ref_state = {k: v.detach() for k, v in module.state_dict().items()}
    for name in ("pp2", "pp2_zb"):
        ranks = [r[name] for r in results]
        _check_run(name, ranks, 1, rec.losses, ref_state, initial, frozen="model.blocks.0.")

    flash = results[0]["flash"]
    assert flash["resumed_from"] == 4
    for key, value in flash["uninterrupted"].items():
        assert torch.equal(flash["resumed"][key], value), f"flash resume: {key}"
    assert any(not torch.equal(flash["first"][k], v) for k, v in flash["uninterrupted"].items())

    module = LoraLlama()
    module.configure_model()
    assert module.model is not None
    base = sum(p.numel() * p.element_size() for p in module.model.parameters() if not p.requires_grad)
    adapters = sum(p.numel() for p in module.model.parameters() if p.requires_grad)
    estimate = estimate_memory(module, zero_stage=3, dp=2)
    for r in results:
        s3 = r["zero3"]
        # the frozen base is sharded 1/N (plus each unit's padding to a multiple of N)
        assert s3["frozen"] == pytest.approx(base / 2, rel=0.01), (s3["frozen"], base)
        # AdamW state (exp_avg, exp_avg_sq: 8 bytes per element, plus a step counter per fragment) is the
        # adapters' alone, 1/N of it per rank
        assert s3["report"]["optimizer_state"] == pytest.approx(8 * adapters / 2, rel=0.05)
        assert s3["report"]["gradients"] == pytest.approx(4 * adapters / 2, rel=0.05)
        # the prediction before launch counts frozen parameters as parameters only
        for key in ("parameters", "gradients", "optimizer_state"):
            assert s3["report"][key] == pytest.approx(estimate[key], rel=0.02), key
        for stage in ("zero1", "zero2"):
            assert r[stage]["report"]["optimizer_state"] == pytest.approx(8 * adapters / 2, rel=0.05)
        # stage 0 keeps the user's optimizer: state for the adapters only (torch skips gradient-less params)
        assert r["zero0"]["report"]["optimizer_state"] == pytest.approx(8 * adapters, rel=0.05)


def _check_run(
    name: str,
    ranks: list[dict[str, Any]],
    dp: int,
    ref_losses: list[float],
    ref_state: dict[str, torch.Tensor],
    initial: dict[str, torch.Tensor],
    *,
    frozen: str = "",
) -> None:
    """Losses and the exported state against the reference; frozen entries untouched, trained ones moved
    (``frozen``: the prefix of frozen names; default: everything but the LoRA adapters)."""
    losses = torch.tensor([r["losses"] for r in ranks])
    # each dp rank's loss is the mean over its half of the reference batch; tp ranks agree
    torch.testing.assert_close(losses.mean(0) if dp > 1 else losses[0], torch.tensor(ref_losses))
    export = ranks[0]["export"]
    assert ranks[1]["export"] == {}
    assert set(export) == set(ref_state), name
    for key, value in ref_state.items():
        torch.testing.assert_close(export[key], value, msg=f"{name}: {key}")
        is_frozen = key.startswith(frozen) if frozen else "lora_" not in key
        if is_frozen:  # the frozen base is exactly what it was
            assert torch.equal(export[key], initial[key]), f"{name}: frozen {key} changed"
        elif key.endswith("weight"):
            assert not torch.equal(value, initial[key]), f"{name}: {key} did not train"


def _fabric_lora(rank: int, world: int) -> dict[str, Any]:
    """Fabric's loop over a LoRA Llama with reentrant checkpointing at ZeRO-2 and ZeRO-3; the final
    adapter weights."""
    torch.set_num_threads(1)
    out = {}
    for stage in (2, 3):
        fabric = Fabric(accelerator="cpu", devices=world, strategy=FabricStrategy(zero_stage=stage))
        fabric.launch()
        model = llama(seed=0)
        checkpoint_layers(model, reentrant=True)
        model = add_lora(model)
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-5))
        losses = _fabric_loop(fabric, model, optimizer, dp_rank=rank, dp=world, steps=range(STEPS), norms=[])
        full = fabric.strategy.consolidated_state_dict()  # type: ignore[attr-defined]
        out[f"zero{stage}"] = {
            "losses": losses,
            "lora": {k: v.clone() for k, v in full.items() if "lora_" in k},
        }
        fabric.strategy.destroy_process_groups()  # type: ignore[attr-defined]
    return out


def test_fabric_lora_with_reentrant_checkpointing_equals_one_process() -> None:
    """The Fabric front door hands each loss to the engine: at ZeRO-2 the reduction waits for the outer
    backward pass (before, the first layer's adapters got no gradient: UnusedParametersError); ZeRO-3
    the same way. (Units whose hooks run inside a reentrant checkpoint, as transformers 4 calls its
    layers: ``tests/test_zero3.py``.)"""
    runs = run_distributed(_fabric_lora, 2, init_group=False)
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=1)
    model = add_lora(llama(seed=0))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-5))
    losses = _fabric_loop(fabric, model, optimizer, dp_rank=0, dp=1, steps=range(STEPS), norms=[])
    trained = {k: v.detach() for k, v in model.state_dict().items() if "lora_" in k}
    for stage in ("zero2", "zero3"):
        for run in runs:
            torch.testing.assert_close(torch.tensor(run[stage]["losses"]), torch.tensor(losses), msg=stage)
        assert trained.keys() == runs[0][stage]["lora"].keys()
        for k, v in trained.items():
            torch.testing.assert_close(runs[0][stage]["lora"][k], v, msg=f"{stage}: {k}")
