"""Saving a Hugging Face or PEFT model from a callback at ZeRO-3 and under tensor parallelism, on 2 Gloo
ranks.

Users save their model as training goes, e.g. ``pl_module.model.save_pretrained(dir)`` on rank 0 at each
epoch's end. At ZeRO-3 the parameters outside a forward are NaN placeholders; before, that call wrote a
checkpoint whose 21 tensors were all NaN (a Llama), without a word. Under tensor parallelism it wrote
rank 0's slices, found out only by ``from_pretrained`` ("ignore_mismatched_sizes"). Checked, for a Llama
and a PEFT LoRA Llama at ZeRO-3 and a Llama at tp2 (the ``llama`` plan), each trained one epoch under the
Trainer:

* during training, ``save_pretrained`` on rank 0 only raises a ``RuntimeError`` naming the module and
  ``consolidated_state_dict()``, and writes no weights file; so does ``pl_module.state_dict()`` (the
  whole model: before, NaN placeholders at ZeRO-3, rank 0's slices at tp2, silently);
* ``trainer.strategy.consolidated_state_dict()`` on every rank, then ``save_pretrained(dir,
  state_dict=...)`` on rank 0, writes the weights the run ends with (read back with ``safetensors``, they
  equal the consolidated state after ``fit`` exactly);
* after ``fit`` a ZeRO-3 model is whole again and a plain ``save_pretrained`` writes the same values; a
  tensor-parallel one stays sliced, so the plain save (and the whole model's state dict, also of a
  ``copy.deepcopy`` of it) is refused again and the consolidated save is used.
"""

from __future__ import annotations

import copy
import os
import tempfile
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.third_party import LoraLlama, Tokens

WORLD = 2


class SaveEachEpoch(pl.Callback):
    """Rank 0 alone tries the plain save; then every rank consolidates and rank 0 saves that."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.error = self.whole_error = ""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model: Any = pl_module.model  # type: ignore[union-attr]
        if trainer.is_global_zero:
            with pytest.raises(RuntimeError) as info:
                model.save_pretrained(os.path.join(self.root, "plain"))
            self.error = str(info.value)
            try:  # torch.save(pl_module.state_dict()): the whole model, refused while ZeRO-3 shards it
                pl_module.state_dict()
            except RuntimeError as error:
                self.whole_error = str(error)
        full = trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]
        if trainer.is_global_zero:
            mine = {k.removeprefix("model."): v for k, v in full.items()}
            model.save_pretrained(os.path.join(self.root, "consolidated"), state_dict=mine)


def _weights(directory: str) -> dict[str, Tensor]:
    names = [n for n in os.listdir(directory) if n.endswith(".safetensors")]
    assert len(names) == 1, names
    return load_file(os.path.join(directory, names[0]))


LAYOUTS: dict[str, dict[str, Any]] = {
    "zero3": dict(zero_stage=3),
    "tp2": dict(tensor_parallel_size=2, tp_plan="llama"),
}


def _run(rank: int, world: int, layout: str, lora: bool, root: str) -> dict[str, Any] | None:
    torch.set_num_threads(1)
    pl.seed_everything(1)
    module, saver = LoraLlama(lora=lora), SaveEachEpoch(root)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=HybridParallelStrategy(**LAYOUTS[layout]),
        max_epochs=1,
        callbacks=[saver],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(Tokens(16), batch_size=4))
    final = trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]
    if rank != 0:
        return None
    model: Any = module.model
    after = os.path.join(root, "after")
    refused_after = ""
    if layout == "tp2":  # still sliced after fit: the submodule's save, the whole model's and a copy's
        with pytest.raises(RuntimeError) as info:
            model.save_pretrained(after)
        refused_after = str(info.value)
        for whole in (module, copy.deepcopy(module)):
            with pytest.raises(RuntimeError, match="tensor-parallel slices"):
                whole.state_dict()
        model.save_pretrained(after, state_dict={k.removeprefix("model."): v for k, v in final.items()})
    else:
        model.save_pretrained(after)
        whole_after = module.state_dict()  # whole again: the same values, not refused
        for name, value in final.items():
            torch.testing.assert_close(whole_after[name], value, rtol=0, atol=0, msg=name)
    plain = os.path.join(root, "plain")
    left = [n for n in os.listdir(plain) if n.endswith(".safetensors")] if os.path.isdir(plain) else []
    return {
        "error": saver.error,
        "whole_error": saver.whole_error,
        "refused_after": refused_after,
        "plain_weights": left,
        "consolidated": _weights(os.path.join(root, "consolidated")),
        "after": _weights(os.path.join(root, "after")),
        "final": {k: v.clone() for k, v in final.items()},
    }


def _saved_name(key: str, lora: bool) -> str:
    """A consolidated key as ``save_pretrained`` writes it (PEFT drops the adapter's name)."""
    key = key.removeprefix("model.")
    return key.replace(".default", "") if lora else key


@pytest.mark.parametrize(
    ("layout", "lora"),
    [("zero3", False), ("zero3", True), ("tp2", False)],
    ids=["zero3", "zero3-lora", "tp2"],
)
def test_save_pretrained_from_pieces_is_refused_and_the_consolidated_save_is_exact(
    layout: str, lora: bool
) -> None:
    with tempfile.TemporaryDirectory() as root:
        out = run_distributed(_run, WORLD, layout, lora, root, init_group=False, timeout=120)[0]
    assert out is not None
    what = "ZeRO-3 shards" if layout == "zero3" else "tensor-parallel slices"
    assert what in out["error"] and "consolidated_state_dict()" in out["error"], out["error"]
    assert (what in out["refused_after"]) == (layout == "tp2"), out["refused_after"]
    # the whole model's state dict: refused too (before, at tp2 it returned rank 0's slices silently)
    assert "state_dict() of the whole model (LoraLlama)" in out["whole_error"], out["whole_error"]
    assert what in out["whole_error"], out["whole_error"]
    assert out["plain_weights"] == [], "the refused save wrote weights"
    final = out["final"]
    for saved in ("consolidated", "after"):
        weights = out[saved]
        wanted = {_saved_name(k, lora): v for k, v in final.items() if not lora or "lora_" in k}
        assert set(weights) == set(wanted), (saved, sorted(set(weights) ^ set(wanted))[:6])
        for name, value in weights.items():
            assert not torch.isnan(value).any(), (saved, name)
            torch.testing.assert_close(value, wanted[name], rtol=0, atol=0, msg=f"{saved}: {name}")
