"""Tensor parallelism inside the Trainer: tp=2 (world 2) and tp=2 x dp=2 with ZeRO-1 (world 4) train like
the single-process model, with clipping (the norm counts tp-replicated parameters once). At ZeRO-3 with
sequence parallelism, a model the strategy builds on the meta device (``configure_model()`` left to it)
starts as its one-process twin, bitwise (each slice drawn from its full-size layer, the tied embedding
and head sharded alike), and trains like the single-process model started there; before, its slices
were refused without ``pretrained=``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_par import HybridParallelStrategy
from lightning_par.models import GPTModule
from lightning_par.zero.meta_build import params_on_meta
from lightning_par.zero.meta_init import materialize_model
from tests.distributed import run_distributed
from tests.test_strategy import LossRecorder, Tokens
from tests.test_tensor_parallel import gather_full

KW: dict[str, Any] = dict(
    vocab_size=64,
    block_size=16,
    n_layer=2,
    n_head=4,
    n_embd=32,
    learning_rate=3e-3,
    warmup_steps=2,
    max_steps=8,
)
MICRO, ACCUM, N = 2, 2, 32


class Gather(pl.Callback):
    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.state = gather_full(module, trainer.strategy.mesh.tp_group)  # type: ignore[attr-defined]


class SGDGPT(GPTModule):
    """SGD: tensor parallelism re-associates fp32 sums (partial products over tp ranks); Adam would turn
    that round-off into sign flips of near-zero-gradient elements (see tests/reference.py)."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.3, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _module() -> GPTModule:
    pl.seed_everything(5)
    m = SGDGPT(**KW)
    m.configure_model()
    return m


def _trainer(strategy: Any, devices: int, tmp: str, callbacks: list[pl.Callback]) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=1,
        accumulate_grad_batches=ACCUM,
        gradient_clip_val=0.5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp,
        callbacks=callbacks,
    )


def _run(rank: int, world: int, tmp: str, tp: int, stage: int, sp: bool) -> dict[str, Any]:
    rec, gather = LossRecorder(), Gather()
    strategy = HybridParallelStrategy(
        zero_stage=stage, tensor_parallel_size=tp, tp_plan="gpt", sequence_parallel=sp
    )
    dp = world // tp
    trainer = _trainer(strategy, world, tmp, [rec, gather])
    trainer.fit(_module(), DataLoader(Tokens(N), batch_size=MICRO * 2 // dp, shuffle=True))
    assert trainer.strategy.distributed_sampler_kwargs["num_replicas"] == dp
    return {"losses": rec.losses, "state": gather.state}


def _reference(
    tmp: Path, start: dict[str, torch.Tensor] | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    # global micro-batch = 2 * MICRO samples (as in test_strategy with 2 data-parallel ranks)
    rec = LossRecorder()
    module = _module()
    if start is not None:
        module.load_state_dict(start)
    # DistributedSampler's permutation cut in global micro-batches: the union of the dp ranks' k-th
    # batches is block k of the permutation, whatever the dp size
    perm = list(DistributedSampler(Tokens(N), num_replicas=1, rank=0, shuffle=True, seed=5))
    order = [perm[i : i + 2 * MICRO] for i in range(0, N, 2 * MICRO)]
    _trainer("auto", 1, str(tmp / "ref"), [rec]).fit(module, DataLoader(Tokens(N), batch_sampler=order))
    return torch.tensor(rec.losses), {k: v.detach() for k, v in module.named_parameters()}


@pytest.mark.parametrize(
    ("world", "tp", "stage", "sp"), [(2, 2, 0, False), (2, 2, 2, True), (4, 2, 1, False)]
)
def test_tensor_parallel_trainer_matches_single_process(
    world: int, tp: int, stage: int, sp: bool, tmp_path: Path
) -> None:
    results = run_distributed(_run, world, str(tmp_path), tp, stage, sp, init_group=False)
    ref_losses, ref_state = _reference(tmp_path)
    dp = world // tp
    # a tp group sees the same samples; its dp groups split the global batch
    losses = torch.tensor([r["losses"] for r in results]).view(dp, tp, -1)
    assert torch.equal(losses[:, 0], losses[:, -1])
    torch.testing.assert_close(losses[:, 0].mean(0), ref_losses)
    for rank, r in enumerate(results):
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, msg=f"rank {rank} {k}")


class Consolidated(pl.Callback):
    """The full weights when training starts and ends, and the seed meta parameters were drawn from."""

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.initial = trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]
        self.seed = trainer.strategy.engine.init_seed  # type: ignore[attr-defined]

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.final = trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]


def _from_meta(rank: int, world: int, tmp: str) -> dict[str, Any]:
    rec, seen = LossRecorder(), Consolidated()
    strategy = HybridParallelStrategy(
        zero_stage=3, tensor_parallel_size=2, tp_plan="gpt", sequence_parallel=True
    )
    trainer = _trainer(strategy, world, tmp, [rec, seen])
    pl.seed_everything(5)
    module = SGDGPT(**KW)  # built by the strategy, on the meta device
    trainer.fit(module, DataLoader(Tokens(N), batch_size=MICRO * 2, shuffle=True))
    return {"losses": rec.losses, "initial": seen.initial, "final": seen.final, "seed": seen.seed}


def test_tensor_parallel_zero3_from_the_meta_device(tmp_path: Path) -> None:
    results = run_distributed(_from_meta, 2, str(tmp_path), init_group=False)
    seed = results[0]["seed"]
    assert results[1]["seed"] == seed and results[1]["initial"] == {}  # consolidated on rank 0
    twin = SGDGPT(**KW)
    with params_on_meta():
        twin.configure_model()
    materialize_model(twin, seed=seed, device=torch.device("cpu"))
    initial = results[0]["initial"]
    assert initial.keys() == twin.state_dict().keys()
    for k, v in twin.state_dict().items():
        torch.testing.assert_close(initial[k], v, rtol=0, atol=0, msg=k)
    ref_losses, ref_state = _reference(tmp_path, start=initial)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), ref_losses)
    for k, v in ref_state.items():
        torch.testing.assert_close(results[0]["final"][k], v, msg=k)
    assert not torch.equal(results[0]["final"]["model.embed.tok.weight"], initial["model.embed.tok.weight"])


class Export(pl.Callback):
    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.state = trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]


def _save_tp(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """tp=2 x dp=2, ZeRO-1: one epoch, checkpoint; then the consolidated export of the same run."""
    rec, export = LossRecorder(), Export()
    strategy = HybridParallelStrategy(zero_stage=1, tensor_parallel_size=2, tp_plan="gpt")
    trainer = _trainer(strategy, world, tmp, [rec, export])
    trainer.fit(_module(), DataLoader(Tokens(N), batch_size=MICRO, shuffle=True))
    trainer.save_checkpoint(os.path.join(tmp, "tp.ckpt"))
    return {"losses": rec.losses, "export": export.state}


def _resume(rank: int, world: int, tmp: str, tp: int, stage: int) -> dict[str, Any]:
    rec, gather = LossRecorder(), Gather()
    strategy = HybridParallelStrategy(
        zero_stage=stage, tensor_parallel_size=tp, tp_plan="gpt" if tp > 1 else None
    )
    trainer = _trainer(strategy, world, tmp, [rec, gather])
    trainer.fit_loop.max_epochs = 2
    dp = world // tp
    trainer.fit(
        _module(),
        DataLoader(Tokens(N), batch_size=MICRO * 2 // dp, shuffle=True),
        ckpt_path=os.path.join(tmp, "tp.ckpt"),
    )
    return {"losses": rec.losses, "state": gather.state}


def test_tensor_parallel_checkpoint_reshards_across_tp_sizes(tmp_path: Path) -> None:
    saved = run_distributed(_save_tp, 4, str(tmp_path), init_group=False)
    # reference: two epochs single-process (the second epoch uses the sampler's epoch-1 permutation)
    rec = LossRecorder()
    module = _module()
    trainer = _trainer("auto", 1, str(tmp_path / "ref"), [rec])  # one pass over both epochs' batches
    orders = []
    for epoch in range(2):
        sampler = DistributedSampler(Tokens(N), num_replicas=1, rank=0, shuffle=True, seed=5)
        sampler.set_epoch(epoch)
        perm = list(sampler)
        orders += [perm[i : i + 2 * MICRO] for i in range(0, N, 2 * MICRO)]
    trainer.fit(module, DataLoader(Tokens(N), batch_sampler=orders))
    ref_losses = torch.tensor(rec.losses)
    ref_state = {k: v.detach() for k, v in module.named_parameters()}
    half = len(ref_losses) // 2
    first = torch.tensor([r["losses"] for r in saved]).view(2, 2, -1)[:, 0].mean(0)
    torch.testing.assert_close(first, ref_losses[:half])
    # the consolidated export (global rank 0) is the full model after epoch 1
    export = saved[0]["export"]
    assert saved[1]["export"] == {} and export["model.embed.tok.weight"].shape == (64, 32)
    epoch1 = _module()
    epoch1.load_state_dict(export)
    # resume on tp=1 x dp=2 (ZeRO-2) and on tp=2 x dp=1 (stage 0): the same second epoch
    for world, tp, stage in ((2, 1, 2), (2, 2, 0)):
        results = run_distributed(_resume, world, str(tmp_path), tp, stage, init_group=False)
        dp = world // tp
        losses = torch.tensor([r["losses"] for r in results]).view(dp, tp, -1)[:, 0].mean(0)
        torch.testing.assert_close(losses, ref_losses[half:], msg=f"tp={tp} stage={stage}")
        for r in results:
            for k, v in ref_state.items():
                torch.testing.assert_close(r["state"][k], v, msg=f"tp={tp} stage={stage} {k}")
