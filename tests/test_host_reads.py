"""Reads of tensors to the host made by lightning_par's own code in steady training steps.

On a GPU each such read (``.item()``, ``.tolist()``, ``.cpu()``, ``bool(t)``, ``float(t)``, ``int(t)``,
``.nonzero()``) makes the host wait for every queued kernel, so the next step cannot be queued ahead.
The README promises none in a step for ``32-true`` / ``bf16-mixed``, one per optimizer step for the
fp16 overflow verdict (as torch's ``GradScaler`` under ``"ddp"``), and one per window for
``find_unused_parameters=True``. A callback replaces those methods from the third optimizer step on (the
first steps run one-time checks) and counts the calls whose immediate caller is a line of lightning_par.
2 Gloo ranks, a Hugging Face Llama, accumulation 2, 6 steps; the reads are counted on CPU, where they are
cheap, so that a GPU never has to find them.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

import lightning_par
from lightning_par import HybridParallelStrategy, ParallelPrecision
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state
from tests.third_party import LoraLlama, Tokens

PACKAGE = str(Path(lightning_par.__file__).resolve().parent)
READS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__", "nonzero")
FROM_STEP, STEPS = 2, 6


class HostReads(pl.Callback):
    """Counts host reads by lightning_par's lines during optimizer steps ``FROM_STEP..STEPS``."""

    def __init__(self) -> None:
        self.sites: collections.Counter[str] = collections.Counter()
        self._saved: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= FROM_STEP and not self._saved:
            for name in READS:
                self._saved[name] = getattr(Tensor, name)
                setattr(Tensor, name, self._counting(name, self._saved[name]))

    def on_train_end(self, *args: Any) -> None:
        for name, method in self._saved.items():
            setattr(Tensor, name, method)

    def _counting(self, name: str, method: Any) -> Any:
        sites = self.sites

        def read(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(PACKAGE):
                sites[f"{name} {Path(caller).relative_to(PACKAGE)}"] += 1
            return method(tensor, *args, **kwargs)

        return read


class WithUnused(LoraLlama):
    """A head the loss never uses (``find_unused_parameters=True``)."""

    def __init__(self) -> None:
        super().__init__(lora=False)
        self.unused = nn.Linear(4, 4)


def _fit(strategy: HybridParallelStrategy, module: LoraLlama, **options: Any) -> dict[str, int]:
    torch.manual_seed(0)
    counter = HostReads()
    trainer = cpu_trainer(
        strategy, max_steps=STEPS, accumulate_grad_batches=2, callbacks=[counter], **options
    )
    trainer.fit(module, DataLoader(Tokens(64), batch_size=2))
    assert trainer.global_step == STEPS
    final_state(module, strategy)  # releases the process groups for the next fit
    return dict(counter.sites)


def _job(rank: int, world: int) -> dict[str, dict[str, int]]:
    fp16 = {"plugins": [ParallelPrecision("16-mixed")]}  # real fp16 on CPU
    return {
        "z1_bf16_clip": _fit(
            HybridParallelStrategy(zero_stage=1),
            LoraLlama(lora=False),
            precision="bf16-mixed",
            gradient_clip_val=1.0,
        ),
        "z2_fp32": _fit(HybridParallelStrategy(zero_stage=2), LoraLlama(lora=False)),
        "z3_bf16_clip": _fit(
            HybridParallelStrategy(zero_stage=3),
            LoraLlama(lora=False),
            precision="bf16-mixed",
            gradient_clip_val=1.0,
        ),
        "tp2_clip": _fit(
            HybridParallelStrategy(tensor_parallel_size=2, tp_plan="llama"),
            LoraLlama(lora=False),
            gradient_clip_val=1.0,
        ),
        "z2_fp16_clip": _fit(
            HybridParallelStrategy(zero_stage=2), LoraLlama(lora=False), gradient_clip_val=1.0, **fp16
        ),
        "z2_unused": _fit(HybridParallelStrategy(zero_stage=2, find_unused_parameters=True), WithUnused()),
    }


def test_steady_steps_read_the_host_only_for_verdicts() -> None:
    steps = STEPS - FROM_STEP
    for rank, r in enumerate(run_distributed(_job, 2, init_group=False, timeout=400)):
        for name in ("z1_bf16_clip", "z2_fp32", "z3_bf16_clip", "tp2_clip"):
            assert r[name] == {}, (rank, name, r[name])
        # the overflow verdict, once per optimizer step (torch's GradScaler reads one under "ddp")
        assert r["z2_fp16_clip"] == {"item loss_scaler.py": steps}, (rank, r["z2_fp16_clip"])
        # the count of the parameters no rank used, once per window
        assert r["z2_unused"] == {"tolist zero/unused.py": steps}, (rank, r["z2_unused"])
