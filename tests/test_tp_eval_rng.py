"""Sampling in an evaluation run under tensor parallelism, ranks seeded apart, on 2 Gloo ranks.

A user seeds each rank differently before the Trainer (nanoGPT's ``torch.manual_seed(1337 + rank)``) and
samples text with ``generate(do_sample=True)`` in ``predict_step`` / ``validation_step``. The two ranks of
a tp group compute one model, so they must draw the same tokens. The strategy gives them tp rank 0's
random state at setup; before, only for ``fit``: under ``predict`` / ``validate`` alone they sampled
different tokens and fed them into the one sharded model, silently (rank 1's generation matched neither
rank's sample). Now each tp rank's generation equals ``"ddp"`` rank 0's with the same seeds.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer
from tests.third_party import llama

PROMPT = torch.tensor([[5, 9, 3, 7]])


class Samples(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = llama(seed=0)
        self.validated: list[Tensor] = []

    def _sample(self) -> Tensor:
        return self.model.generate(PROMPT, max_new_tokens=8, do_sample=True, top_k=10, pad_token_id=0)

    def predict_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self._sample()

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        self.validated.append(self._sample())


def _runs(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("ddp", "tp2"):
        for loop in ("predict", "validate"):
            module = Samples()
            torch.manual_seed(1337 + rank)  # seeded apart, before the Trainer
            strategy: Any = "ddp"
            if name == "tp2":
                strategy = HybridParallelStrategy(tensor_parallel_size=world, tp_plan="llama")
            trainer = cpu_trainer(strategy, devices=world, use_distributed_sampler=False)
            loader = DataLoader([PROMPT[0]], batch_size=1)
            if loop == "predict":
                out[f"{name}_{loop}"] = trainer.predict(module, loader)[0]  # type: ignore[index]
            else:
                trainer.validate(module, loader, verbose=False)
                out[f"{name}_{loop}"] = module.validated[0]
            if name == "tp2":
                strategy.destroy_process_groups()
    return out


def test_tp_ranks_seeded_apart_sample_alike_in_evaluation_runs() -> None:
    ranks = run_distributed(_runs, 2, init_group=False, timeout=300)
    assert not torch.equal(ranks[0]["ddp_predict"], ranks[1]["ddp_predict"])  # the seeds do differ
    for loop in ("predict", "validate"):
        reference = ranks[0][f"ddp_{loop}"]
        for rank, got in enumerate(ranks):
            assert torch.equal(got[f"tp2_{loop}"], reference), (loop, rank, got[f"tp2_{loop}"].tolist())
