"""``save_distributed_checkpoint=False``: one ordinary Lightning checkpoint file from tp2 x dp2 (a Hugging
Face Llama, ZeRO-1, 4 ranks) and from pp2 (the package's GPT, 2 ranks). Each file equals the
consolidation of a distributed checkpoint of the same run (weights and torch-format optimizer state),
``LightningModule.load_from_checkpoint`` in one process gives the outputs the parallel model gave, and
``Trainer.fit(ckpt_path=...)`` resumes it at another layout exactly as from the distributed checkpoint.
``ModelCheckpoint(save_weights_only=True)`` writes no optimizer state in either format."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.checkpoint import consolidate, consolidate_cli, is_sharded_checkpoint
from lightning_par.checkpoint.sharded import _payloads
from lightning_par.models import GPTModule
from tests.distributed import run_distributed
from tests.third_party import LoraLlama, Tokens

SEED, N = 6, 16
GPT_KW: dict[str, Any] = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, bias=False)


def _llama() -> LoraLlama:
    pl.seed_everything(SEED)
    return LoraLlama(lora=False, lr=1e-3)


def _gpt() -> GPTModule:
    pl.seed_everything(SEED)
    module = GPTModule(**GPT_KW, max_steps=4)
    module.configure_model()
    return module


def _trainer(
    strategy: Any, devices: int, tmp: str, callbacks: list[pl.Callback], epochs: int = 1
) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=tmp,
        callbacks=callbacks,
    )


def _save_both(trainer: pl.Trainer, tmp: str, name: str) -> None:
    """The same state as one file and as a distributed directory."""
    strategy = trainer.strategy
    assert isinstance(strategy, HybridParallelStrategy)
    strategy.save_distributed_checkpoint = False
    trainer.save_checkpoint(os.path.join(tmp, f"{name}_full.ckpt"))
    strategy.save_distributed_checkpoint = True
    trainer.save_checkpoint(os.path.join(tmp, f"{name}_dir.ckpt"))


def _save_tp(rank: int, world: int, tmp: str) -> Any:
    strategy = HybridParallelStrategy(
        zero_stage=1, tensor_parallel_size=2, tp_plan="llama", save_distributed_checkpoint=False
    )
    weights = ModelCheckpoint(dirpath=os.path.join(tmp, "tp_weights"), save_weights_only=True)
    trainer = _trainer(strategy, world, tmp, [weights])
    module = _llama()
    trainer.fit(module, DataLoader(Tokens(N), batch_size=4, shuffle=True))
    _save_both(trainer, tmp, "tp")
    strategy.save_distributed_checkpoint = True
    trainer.save_checkpoint(os.path.join(tmp, "tp_weights_dir.ckpt"), weights_only=True)
    with torch.no_grad():  # the tensor-parallel model, called directly on every rank (full logits)
        return [module(Tokens(4, seed=9).data[:, :-1])]


def _pp_and_resume(rank: int, world: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    strategy = HybridParallelStrategy(
        zero_stage=1, pipeline_parallel_size=2, num_microbatches=2, save_distributed_checkpoint=False
    )
    weights = ModelCheckpoint(dirpath=os.path.join(tmp, "pp_weights"), save_weights_only=True)
    trainer = _trainer(strategy, world, tmp, [weights])
    module = _gpt()
    trainer.fit(module, DataLoader(Tokens(N), batch_size=4, shuffle=True))
    _save_both(trainer, tmp, "pp")
    out["pp_predict"] = trainer.predict(module, DataLoader(Tokens(4, seed=9), batch_size=4))
    # resume the tp2 x dp2 checkpoints at ZeRO-3 over 2 ranks: the file and the directory alike
    for source in ("tp_full", "tp_dir"):
        pl.seed_everything(SEED)
        resumed = _llama()
        again = _trainer(HybridParallelStrategy(zero_stage=3, meta_init=False), world, tmp, [], epochs=2)
        loader = DataLoader(Tokens(N), batch_size=2, shuffle=True)
        again.fit(resumed, loader, ckpt_path=os.path.join(tmp, f"{source}.ckpt"))
        out[source] = again.strategy.consolidated_state_dict()  # type: ignore[attr-defined]
    return out


def _equal(got: Any, ref: Any, what: str) -> None:
    if isinstance(ref, dict):
        assert set(got) == set(ref), (what, sorted(set(got) ^ set(ref)))
        for key in ref:
            _equal(got[key], ref[key], f"{what}.{key}")
    elif isinstance(ref, list | tuple):
        assert len(got) == len(ref), what
        for i, (a, b) in enumerate(zip(got, ref, strict=True)):
            _equal(a, b, f"{what}[{i}]")
    elif isinstance(ref, torch.Tensor):
        torch.testing.assert_close(got, ref, msg=what)
    else:
        assert got == ref, what


def _check_file(path: str, directory: str, module_cls: Any, predictions: list[torch.Tensor]) -> None:
    full = torch.load(path, weights_only=False)
    assert not is_sharded_checkpoint(path) and full["lightning_par"]["format"] == "full"
    assert {"state_dict", "optimizer_states", "loops", "callbacks", "lr_schedulers"} <= set(full)
    merged = consolidate(directory)
    _equal(full["state_dict"], merged["state_dict"], "state_dict")
    _equal(full["optimizer_states"], merged["optimizer_states"], "optimizer_states")
    assert len(full["optimizer_states"][0]["state"]) > 0
    # Lightning's own loader, one process: the outputs the parallel model gave
    loaded = module_cls.load_from_checkpoint(path)
    loaded.eval()
    with torch.no_grad():
        loader = DataLoader(Tokens(4, seed=9), batch_size=len(predictions[0]))
        outputs = [loaded(batch[0]) for batch in loader]
    for got, ref in zip(outputs, predictions, strict=True):
        torch.testing.assert_close(got, ref)
    # a plain optimizer takes the optimizer state as it is
    plain = loaded.configure_optimizers()
    optimizer = plain["optimizer"] if isinstance(plain, dict) else plain
    optimizer.load_state_dict(full["optimizer_states"][0])


def test_single_file_checkpoints_from_tp_and_pp(tmp_path: Path) -> None:
    tmp = str(tmp_path)
    tp_predictions = run_distributed(_save_tp, 4, tmp, init_group=False)[0]
    results = run_distributed(_pp_and_resume, 2, tmp, init_group=False)
    _check_file(str(tmp_path / "tp_full.ckpt"), str(tmp_path / "tp_dir.ckpt"), LoraLlama, tp_predictions)
    pp_predictions = results[0]["pp_predict"]
    _check_file(str(tmp_path / "pp_full.ckpt"), str(tmp_path / "pp_dir.ckpt"), GPTModule, pp_predictions)
    # resuming the file or the directory at another layout continues alike
    _equal(results[0]["tp_full"], results[0]["tp_dir"], "resumed")
    # weights only: no optimizer state in the file, none in the directory's rank files
    for layout in ("tp", "pp"):
        (saved,) = (tmp_path / f"{layout}_weights").iterdir()
        ckpt = torch.load(saved, weights_only=False)
        assert "optimizer_states" not in ckpt and ckpt["lightning_par"]["format"] == "full", layout
        full = torch.load(tmp_path / f"{layout}_full.ckpt", weights_only=False)
        assert set(ckpt["state_dict"]) == set(full["state_dict"]), layout
    assert all(payload["optimizers"] == [] for payload in _payloads(tmp_path / "tp_weights_dir.ckpt"))
    # such a weights-only directory consolidates to a file without optimizer state, as Lightning's
    lean = tmp_path / "lean.ckpt"
    assert consolidate_cli.main([str(tmp_path / "tp_weights_dir.ckpt"), str(lean)]) == 0
    merged = torch.load(lean, weights_only=False)
    assert "optimizer_states" not in merged
    _equal(
        merged["state_dict"], torch.load(tmp_path / "tp_full.ckpt", weights_only=False)["state_dict"], "lean"
    )
