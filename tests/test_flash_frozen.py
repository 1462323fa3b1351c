"""Resuming with another frozen set, and an error on one rank only, at ZeRO stages that keep state in flat
fragments.

A FlashCheckpoint snapshot written while every parameter trained, resumed by a run that freezes the first
block (a fine-tune changed between the crash and the restart): at the same world size ZeRO 1-3 lay their
fragments out over the trainable parameters, so the snapshot does not fit. Before, ZeRO-3 hung (one rank
raised in the restore, its teardown then waited in a gather its peer never joined) and ZeRO-1 under a
pipeline named a bucket-order problem; now every rank refuses it by name before loading anything. At
another world size the snapshot is resharded by name, and that resume equals resuming from a
``trainer.save_checkpoint`` file, which also loads by name. An exception on one rank of a ZeRO-3 fit
reaches the user instead of hanging in the teardown's gather.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.callbacks import FlashCheckpoint
from lightning_par.checkpoint.rank_state import differences
from lightning_par.models import GPTModule
from tests.distributed import run_distributed
from tests.test_lora import GPT_KW, Probe, _trainer
from tests.third_party import Tokens

STEPS = 8


class FreezableGPT(GPTModule):
    """The package's GPT, AdamW over every parameter, its first block frozen when ``freeze`` is set."""

    freeze = False
    fail_on_rank: int | None = None

    def configure_model(self) -> None:
        super().configure_model()
        if self.freeze:
            for p in self.gpt.blocks[0].parameters():
                p.requires_grad_(False)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if batch_idx == 2 and self.global_rank == self.fail_on_rank:
            raise RuntimeError("failed on this rank only")
        return super().training_step(batch, batch_idx)


def _fit(
    tmp: str, rank: int, world: int, *, steps: int, freeze: bool, mode: str, **layout: Any
) -> dict[str, Tensor]:
    """Fit ``steps`` steps; ``mode`` "flash" snapshots every 2 steps (resuming from the newest),
    "save" writes a checkpoint at the end, "load" starts from it."""
    pl.seed_everything(1)
    module = FreezableGPT(**GPT_KW, max_steps=STEPS)
    module.freeze = freeze
    probe = Probe()
    callbacks: list[pl.Callback] = [probe]
    if mode == "flash":
        shm = Path(tmp) / f"shm{world}_{rank}"
        callbacks.append(
            FlashCheckpoint(Path(tmp) / "flash", every_n_steps=2, persist_every_n_steps=2, shm_dir=shm)
        )
    trainer = _trainer(HybridParallelStrategy(**layout), world, tmp, callbacks, max_steps=steps)
    ckpt = Path(tmp) / "saved"
    trainer.fit(module, DataLoader(Tokens(16), batch_size=2), ckpt_path=str(ckpt) if mode == "load" else None)
    if mode == "save":
        trainer.save_checkpoint(ckpt)
    return probe.export


def _refusals(rank: int, world: int, tmp: str) -> dict[str, str]:
    out = {}
    layouts: dict[str, dict[str, Any]] = {
        "zero3": {"zero_stage": 3, "meta_init": False},
        "pp2_zero1": {"zero_stage": 1, "pipeline_parallel_size": 2, "num_microbatches": 2},
    }
    for name, layout in layouts.items():
        run = str(Path(tmp) / name)
        _fit(run, rank, world, steps=4, freeze=False, mode="flash", **layout)
        try:
            _fit(run, rank, world, steps=STEPS, freeze=True, mode="flash", **layout)
            out[name] = "resumed"
        except ValueError as exc:
            out[name] = str(exc)
    return out


def _one_rank_fails(rank: int, world: int, tmp: str) -> str:
    pl.seed_everything(1)
    module = FreezableGPT(**GPT_KW, max_steps=STEPS)
    module.fail_on_rank = 1
    trainer = _trainer(HybridParallelStrategy(zero_stage=3, meta_init=False), world, tmp, [], max_steps=STEPS)
    try:
        trainer.fit(module, DataLoader(Tokens(16), batch_size=2))
    except RuntimeError as exc:
        return str(exc)
    return "finished"


def _resharded(rank: int, world: int, tmp: str, *, steps: int, freeze: bool, mode: str) -> dict[str, Tensor]:
    return _fit(tmp, rank, world, steps=steps, freeze=freeze, mode=mode, zero_stage=3, meta_init=False)


def _first(rank: int, world: int, tmp: str, mode: str) -> dict[str, Tensor]:
    return _resharded(rank, world, tmp, steps=4, freeze=False, mode=mode)


def _second(rank: int, world: int, tmp: str, mode: str) -> dict[str, Tensor]:
    return _resharded(rank, world, tmp, steps=STEPS, freeze=True, mode=mode)


def test_a_changed_frozen_set_is_refused_on_every_rank_and_one_rank_errors_surface(tmp_path: Path) -> None:
    results = run_distributed(_refusals, 2, str(tmp_path / "refusals"), init_group=False, timeout=240)
    for name in ("zero3", "pp2_zero1"):
        for found in results:
            assert "trained in the snapshot, frozen now" in found[name], found[name]
            assert "model.blocks.0." in found[name] and "trainer.save_checkpoint" in found[name]
    # the failing rank's own error, and a communication error on its peer instead of a hang
    errors = run_distributed(_one_rank_fails, 2, str(tmp_path / "fails"), init_group=False, timeout=90)
    assert errors[1] == "failed on this rank only"
    assert errors[0] != "finished", errors[0]


def test_a_resharded_snapshot_takes_another_frozen_set_as_a_saved_checkpoint_does(tmp_path: Path) -> None:
    """dp 2 -> 1 at ZeRO-3: the snapshot (step 4, at an epoch's end) resumed with block 0 frozen equals
    the resume from ``trainer.save_checkpoint`` at step 4, and block 0 keeps its step-4 values."""
    exports = {}
    for mode, then in (("flash", "flash"), ("save", "load")):
        run = str(tmp_path / mode)
        first = run_distributed(_first, 2, run, mode, init_group=False)[0]
        exports[mode] = run_distributed(_second, 1, run, then, init_group=False)[0]
        frozen = [k for k in first if k.startswith("model.blocks.0.")]
        assert frozen
        for k in frozen:
            torch.testing.assert_close(exports[mode][k], first[k], rtol=0, atol=0)
    torch.testing.assert_close(exports["flash"], exports["save"], rtol=0, atol=0)


def test_fingerprint_differences_name_the_frozen_set_and_the_stage_with_their_fixes() -> None:
    saved = {"strategy": "HybridParallelStrategy", "zero_stage": 2, "frozen": ["a", "b"]}
    now = {"strategy": "HybridParallelStrategy", "zero_stage": 3, "frozen": ["b", "c"]}
    found = differences(saved, now)
    assert found[0].startswith("parameters trained in the snapshot, frozen now: ['c']"), found
    assert found[1] == "parameters frozen in the snapshot, trainable now: ['a']", found
    assert "loads by name" in found[2]
    assert found[3].startswith("ZeRO stage: snapshot 2, now 3") and "loads at any stage" in found[3]
    # an optimizer over the trainable parameters follows the frozen set (ZeRO-0 has no frozen record)
    adam = {"class": "AdamW", "param_names": [["a", "b"]]}
    moved = differences({"optimizers": [adam]}, {"optimizers": [{**adam, "param_names": [["b", "c"]]}]})
    assert moved[0].startswith("optimizer 0: parameters left it: ['a']; joined it: ['c']"), moved
    assert "trainer.save_checkpoint" in moved[0]
    assert differences({"optimizers": [adam]}, {"optimizers": []}) == [
        "optimizers: the snapshot has 1, this run 0"
    ]
    # a snapshot written before the frozen set was recorded (or at ZeRO-0) is not judged by it
    old = {k: v for k, v in saved.items() if k != "frozen"}
    assert differences({**old, "zero_stage": 3}, now) == []
