"""ZeRO-3 with pipeline stages on a model we did not write: Hugging Face's ``GPT2LMHeadModel`` (token table
tied to the LM head) behind the pipeline protocol (``hf_pipeline_layers``), world 4 (pp2 x dp2), 1F1B and
zb (whose weight passes defer GPT-2's ``Conv1D`` weights into ZeRO-3's buffers) with clipping, against the
single-process Trainer running the model's own ``forward``: per-step losses, validation loss and the
consolidated weights (the tied table's gradient summed over the first and the last stage, then
reduce-scattered over dp once per step)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.test_pp_hf import module_factory
from tests.test_pp_trainer import GLOBAL, N, _reference, _trainer, assert_equals_reference
from tests.test_strategy import LossRecorder, Tokens

WORLD, DP = 4, 2


def _run(rank: int, world: int, tmp: str, schedule: str) -> dict[str, Any]:
    rec = LossRecorder()
    strategy = HybridParallelStrategy(
        zero_stage=3, pipeline_parallel_size=2, num_microbatches=2, pipeline_schedule=schedule
    )
    trainer = _trainer(strategy, world, tmp, [rec])
    train = DataLoader(Tokens(N), batch_size=GLOBAL // DP, shuffle=True)
    trainer.fit(module_factory("gpt2")(), train, DataLoader(Tokens(8), batch_size=8 // DP))
    state = trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]
    return {
        "losses": rec.losses,
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "state": {k: v.clone() for k, v in state.items()},
    }


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])  # zb: W of GPT-2's Conv1D into ZeRO-3's buffers
def test_zero3_pipeline_on_hugging_face_gpt2_matches_single_process(schedule: str, tmp_path: Path) -> None:
    results = run_distributed(_run, WORLD, str(tmp_path), schedule, init_group=False, timeout=400)
    assert_equals_reference(results, _reference(tmp_path, make=module_factory("gpt2")))
