"""Host reads by lightning_par's own lines in steady Trainer steps, for the layouts that
``tests/test_device_guards.py`` (ZeRO 0/2/3 with our GPT in each precision) leaves out: ZeRO-1 and tensor
parallelism with clipping, and ``find_unused_parameters=True`` with a parameter no rank uses, on a Hugging
Face Llama, and two pipeline stages on our GPT. The README promises no read in a step in ``32-true`` /
``bf16-mixed``, one per window for the unused-parameter count (its all-reduced flags), and under a
pipeline one per batch on the stages after the first (the input signature's id). Counted with
``tests.probes.HostSyncs`` from the third optimizer step on (the first steps run one-time checks); 2 Gloo
ranks, accumulation 2, 6 steps.
"""

from __future__ import annotations

import collections
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.models import GPTModule
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state
from tests.probes import HostSyncs
from tests.third_party import LoraLlama, Tokens

FROM_STEP, STEPS = 2, 6


class HostReads(pl.Callback):
    """``file`` of each host read by lightning_par during optimizer steps ``FROM_STEP..STEPS``."""

    def __init__(self) -> None:
        self.probe = HostSyncs()
        self.sites: collections.Counter[str] = collections.Counter()

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= FROM_STEP:
            self.probe.reset()
            self.probe.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.probe.__exit__()
        self.sites.update(f"{name} {where.split(':')[0]}" for name, where in self.probe.calls)
        self.probe.reset()


class WithUnused(LoraLlama):
    """A head the loss never uses (``find_unused_parameters=True``)."""

    def __init__(self) -> None:
        super().__init__(lora=False)
        self.unused = nn.Linear(4, 4)


def _fit(strategy: HybridParallelStrategy, module: pl.LightningModule, **options: Any) -> dict[str, int]:
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
    return {
        "z1_bf16_clip": _fit(
            HybridParallelStrategy(zero_stage=1),
            LoraLlama(lora=False),
            precision="bf16-mixed",
            gradient_clip_val=1.0,
        ),
        "tp2_clip": _fit(
            HybridParallelStrategy(tensor_parallel_size=2, tp_plan="llama"),
            LoraLlama(lora=False),
            gradient_clip_val=1.0,
        ),
        "tp2_z3_bf16_clip": _fit(
            HybridParallelStrategy(tensor_parallel_size=2, tp_plan="llama", zero_stage=3),
            LoraLlama(lora=False),
            precision="bf16-mixed",
            gradient_clip_val=1.0,
        ),
        "z2_unused": _fit(HybridParallelStrategy(zero_stage=2, find_unused_parameters=True), WithUnused()),
        "pp2": _fit(
            HybridParallelStrategy(pipeline_parallel_size=2, num_microbatches=2),
            _pipeline_gpt(),
            gradient_clip_val=1.0,
        ),
    }


def _pipeline_gpt() -> GPTModule:
    torch.manual_seed(0)
    module = GPTModule(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, max_steps=STEPS)
    module.configure_model()
    return module


def test_steady_steps_read_the_host_only_for_verdicts() -> None:
    steps = STEPS - FROM_STEP
    for rank, r in enumerate(run_distributed(_job, 2, init_group=False, timeout=400)):
        for name in ("z1_bf16_clip", "tp2_clip", "tp2_z3_bf16_clip"):
            assert r[name] == {}, (rank, name, r[name])
        # the count of the parameters no rank used, once per window
        assert r["z2_unused"] == {"tolist zero/unused.py": steps}, (rank, r["z2_unused"])
        # per batch: every stage reads the seed of its random state, drawn from the CPU generator (host
        # memory: no device sync), and the second stage the input signature's id (it sizes the receive
        # buffers: one device read)
        expected = {"__int__ pipeline/steps.py": 2 * steps}
        if rank == 1:
            expected["item pipeline/runtime.py"] = 2 * steps
        assert r["pp2"] == expected, (rank, r["pp2"])
