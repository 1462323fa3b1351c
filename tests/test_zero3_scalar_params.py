"""Scalar (0-dimensional) parameters at ZeRO-3, on 2 Gloo ranks: Hugging Face's CLIP.

CLIP's contrastive loss is scaled by ``logit_scale``, a learnable ``nn.Parameter`` of shape ``()`` (SigLIP
adds ``logit_bias``; temperatures and ReZero gates are the same kind). Between uses ZeRO-3 points each
sharded parameter at a placeholder, one element expanded to the parameter's shape; the element had shape
``(1,)``, which cannot expand to ``()``, so building the engine failed ("expand(torch.FloatTensor{[1]},
size=[]) ... must be greater or equal to the number of dimensions") and CLIP could not train at ZeRO-3.

* CLIP (text and vision towers, 3 AdamW steps) at ZeRO-3 ends with the weights of Lightning's ``"ddp"``,
  ``logit_scale`` included (it moved).
* The run's distributed checkpoint, consolidated, holds the same weights with ``logit_scale`` of shape
  ``()``; resuming from it at ZeRO-3 for 2 more steps equals ``"ddp"`` resumed from its own checkpoint of
  the same step (Lightning restarts the epoch's data on a mid-epoch resume, on both sides).
* ``"ddp"``'s own checkpoint (torch's optimizer format) resumed at ZeRO-2 and ZeRO-3 equals ``"ddp"``
  resumed from it. Before, the scalar's Adam state (``exp_avg`` of shape ``()``, like ``step``) was taken
  for a step-like scalar and dropped: ``logit_scale`` ended 1.9e-3 away, everything else equal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_par import HybridParallelStrategy
from lightning_par.checkpoint import consolidate
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state
from tests.third_party import hf_model

WORLD = 2
TOWER = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, projection_dim=16
)
CLIP: dict[str, Any] = dict(
    text_config=dict(vocab_size=64, max_position_embeddings=16, **TOWER),
    vision_config=dict(image_size=16, patch_size=4, **TOWER),
    projection_dim=16,
)
SCALE = "model.logit_scale"


class Pairs(Dataset[dict[str, Tensor]]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        g = torch.Generator().manual_seed(i)
        return {
            "ids": torch.randint(0, 64, (12,), generator=g),
            "pixels": torch.randn(3, 16, 16, generator=g),
        }


class Contrastive(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = hf_model("CLIPModel", "CLIPConfig", **CLIP)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        out = self.model(input_ids=batch["ids"], pixel_values=batch["pixels"], return_loss=True)
        return out.loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(
    strategy: Any, steps: int, *, save: Path | None = None, resume: Path | None = None
) -> dict[str, Tensor]:
    pl.seed_everything(0, verbose=False)
    module = Contrastive()
    trainer = cpu_trainer(strategy, max_steps=steps)
    trainer.fit(module, DataLoader(Pairs(), batch_size=4), ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    return final_state(module, strategy)


def _runs(rank: int, world: int, root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    ours, theirs = Path(root) / "zero3.ckpt", Path(root) / "ddp.ckpt"
    return {
        "ddp3": _fit("ddp", 3, save=theirs),
        "ddp_resumed": _fit("ddp", 5, resume=theirs),
        "zero3": _fit(HybridParallelStrategy(zero_stage=3), 3, save=ours),
        "resumed": _fit(HybridParallelStrategy(zero_stage=3), 5, resume=ours),
        # torch's format (a "ddp" file) into shards: the scalar's Adam state must come along
        "zero2_from_ddp": _fit(HybridParallelStrategy(zero_stage=2), 5, resume=theirs),
        "zero3_from_ddp": _fit(HybridParallelStrategy(zero_stage=3), 5, resume=theirs),
    }


def _assert_equal(state: dict[str, Tensor], reference: dict[str, Tensor], what: str) -> None:
    assert state.keys() == reference.keys(), what
    for key, value in reference.items():
        torch.testing.assert_close(state[key], value, msg=lambda m, k=key: f"{what} {k}: {m}")


def test_clip_logit_scale_trains_saves_and_resumes_at_zero3(tmp_path: Path) -> None:
    out = run_distributed(_runs, WORLD, str(tmp_path), init_group=False, timeout=300)[0]
    initial = Contrastive().state_dict()
    assert initial[SCALE].shape == ()
    _assert_equal(out["zero3"], out["ddp3"], "ZeRO-3")
    assert out["zero3"][SCALE].shape == ()
    assert float((out["zero3"][SCALE] - initial[SCALE]).abs()) > 1e-3  # the scalar trained
    saved = consolidate(tmp_path / "zero3.ckpt")["state_dict"]
    _assert_equal(saved, out["ddp3"], "checkpoint")
    assert saved[SCALE].shape == ()
    _assert_equal(out["resumed"], out["ddp_resumed"], "resumed")
    _assert_equal(out["zero2_from_ddp"], out["ddp_resumed"], "ZeRO-2 from ddp's checkpoint")
    _assert_equal(out["zero3_from_ddp"], out["ddp_resumed"], "ZeRO-3 from ddp's checkpoint")
