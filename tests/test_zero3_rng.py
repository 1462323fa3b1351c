"""ZeRO-3 leaves the user's random streams alone, on 2 Gloo ranks.

Stage 3 draws the seed its meta-initialised parameters come from at setup. It drew it from torch's global
generator, which moved every later draw: dropout masks, random crops, anything seeded by
``seed_everything``. A Hugging Face BERT (dropout 0.1) trained at ZeRO-3 then left the run of Lightning's
``"ddp"`` (and of stages 0-2) by 0.08 within 4 steps, though nothing was wrong with its gradients. The
seed is now drawn with the generator's state restored after.

* A BERT masked LM with its default dropout, 4 AdamW steps: ZeRO-3's final weights (consolidated) equal
  ``"ddp"``'s; the model with dropout 0 first shows the comparison is exact without randomness too.
* Building a ``Stage3Engine`` (seed drawn, agreed over the group) leaves the CPU generator's state as it
  was.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.zero.stage3 import Stage3Engine
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state
from tests.third_party import Tokens, hf_model

WORLD = 2
BERT: dict[str, Any] = dict(
    vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
)


class MaskedLM(pl.LightningModule):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.model = hf_model(
            "BertForMaskedLM",
            "BertConfig",
            **BERT,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
        )

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.model(input_ids=x).logits.flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(strategy: Any, dropout: float) -> dict[str, Tensor]:
    pl.seed_everything(0, verbose=False)
    module = MaskedLM(dropout)
    trainer = cpu_trainer(strategy, max_steps=4)
    trainer.fit(module, DataLoader(Tokens(64), batch_size=4))
    return final_state(module, strategy)


def _engine_draws(rank: int, world: int) -> dict[str, Any]:
    """Whether building an engine left the generator's state as it was."""
    torch.manual_seed(5)
    model = hf_model("BertForMaskedLM", "BertConfig", **BERT)
    before = torch.get_rng_state()
    engine = Stage3Engine(model, group=dist.group.WORLD)
    after = torch.get_rng_state()
    engine.remove()
    return {"unchanged": bool(torch.equal(before, after))}


def _runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for dropout in (0.0, 0.1):
        out[f"ddp_{dropout}"] = _fit("ddp", dropout)
        out[f"zero3_{dropout}"] = _fit(HybridParallelStrategy(zero_stage=3), dropout)
    return out


def test_zero3_keeps_the_random_streams_of_ddp() -> None:
    assert all(r["unchanged"] for r in run_distributed(_engine_draws, WORLD))
    out = run_distributed(_runs, WORLD, init_group=False, timeout=300)[0]
    for dropout in (0.0, 0.1):
        reference, zero3 = out[f"ddp_{dropout}"], out[f"zero3_{dropout}"]
        assert zero3.keys() == reference.keys()
        for key, value in reference.items():
            torch.testing.assert_close(zero3[key], value, msg=lambda m, k=key, d=dropout: f"{d} {k}: {m}")
    # dropout matters here: the two references differ
    a, b = out["ddp_0.1"], out["ddp_0.0"]
    assert max(float((a[k] - b[k]).abs().max()) for k in a if a[k].is_floating_point()) > 1e-3
