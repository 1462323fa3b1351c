"""``load_state_dict`` on a model ZeRO-3 shards, on 2 Gloo ranks, with Hugging Face's Llama.

Before, the sharded parameters' placeholders refused torch's copy ("more than one element of the
written-to tensor refers to a single memory location"), so a user's ``self.model.load_state_dict(...)``
in a Lightning hook or after ``fabric.setup`` failed at ZeRO-3. Now each rank writes its shard from the
state dict (``lightning_par/zero/stage3_load.py``):

* Trainer: weights loaded in ``on_train_start`` (another seed's Llama), then 3 steps: the final weights
  equal Lightning's ``"ddp"`` doing the same;
* Fabric: after ``fabric.setup`` at ZeRO-3 the loaded model's logits equal the loaded weights' own in one
  process, also from a state dict of Lightning's ``lazy_load`` (litgpt's ``load_checkpoint``), whose
  tensors are read on first use (before, each was reported as a "size mismatch"); ``strict`` loading
  still names a missing key, an unexpected one and a shape mismatch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.utilities.load import _lazy_load
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.fabric import HybridParallelStrategy as FabricStrategy
from tests.distributed import run_distributed
from tests.third_party import LoraLlama, Tokens, llama

IDS = torch.tensor([[5, 9, 3, 7, 1, 2], [4, 4, 8, 1, 0, 3]])


class Reloaded(LoraLlama):
    def on_train_start(self) -> None:
        assert self.model is not None
        self.model.load_state_dict(llama(seed=7).state_dict())


def _fit(strategy: Any) -> dict[str, Tensor]:
    pl.seed_everything(1)
    module = Reloaded(lora=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(Tokens(32), batch_size=4))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _fabric(rank: int, world: int, tmp: str) -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", devices=world, strategy=FabricStrategy(zero_stage=3))
    fabric.launch()
    model = fabric.setup(llama(seed=0))
    weights = llama(seed=7).state_dict()
    model.load_state_dict(weights)
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    # Lightning's lazy_load (litgpt's load_checkpoint): tensors read on first use, not Tensor objects
    path = Path(tmp) / f"weights{rank}.pt"
    torch.save(llama(seed=3).state_dict(), path)
    model.load_state_dict(_lazy_load(path))
    with torch.no_grad():
        lazy = model(input_ids=IDS).logits
    errors = []
    for bad in (
        {k: v for k, v in weights.items() if k != "model.norm.weight"},
        {**weights, "model.extra": torch.zeros(1)},
        {**weights, "lm_head.weight": torch.zeros(3, 3)},
    ):
        with pytest.raises(RuntimeError) as refused:
            model.load_state_dict(bad)
        errors.append(str(refused.value))
    return {"logits": logits, "lazy": lazy, "errors": errors}


def _runs(rank: int, world: int, tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {
        "ddp": _fit("ddp"),
        "zero3": _fit(HybridParallelStrategy(zero_stage=3, meta_init=False)),
        **_fabric(rank, world, tmp),
    }


def test_load_state_dict_at_zero3_equals_ddp_and_one_process(tmp_path: Path) -> None:
    runs = run_distributed(_runs, 2, str(tmp_path), init_group=False)
    torch.set_num_threads(1)
    loaded = llama(seed=7)
    with torch.no_grad():
        want = loaded(input_ids=IDS).logits
    start = loaded.state_dict()
    for rank, run in enumerate(runs):
        ddp, ours = run["ddp"], run["zero3"]
        assert not torch.equal(ddp["model.lm_head.weight"], start["lm_head.weight"])  # it trained
        for name, value in ddp.items():
            torch.testing.assert_close(ours[name], value, msg=f"rank {rank} {name}")
        torch.testing.assert_close(run["logits"], want, msg=f"rank {rank} logits")
        with torch.no_grad():  # before, "size mismatch ... copying a param with shape _NotYetLoadedTensor"
            torch.testing.assert_close(
                run["lazy"], llama(seed=3)(input_ids=IDS).logits, msg=f"rank {rank} lazy"
            )
        missing, unexpected, shape = run["errors"]
        assert 'Missing key(s) in state_dict: "model.norm.weight"' in missing, missing
        assert 'Unexpected key(s) in state_dict: "model.extra"' in unexpected, unexpected
        assert "size mismatch for lm_head.weight" in shape and "(3, 3)" in shape, shape
