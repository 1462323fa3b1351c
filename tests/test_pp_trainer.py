"""Pipeline parallelism inside the Trainer against the single-process Trainer: GPipe, 1F1B, interleaved
1F1B, and compositions with ZeRO-1/2 and tensor parallelism (3-D on a world of 4), with global-norm
clipping; validation through the pipeline; a checkpoint reloaded at another pipeline size."""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_par import HybridParallelStrategy
from lightning_par.fabric import HybridParallelStrategy as LitFabricStrategy
from lightning_par.models import GPTModule
from lightning_par.pipeline.apply import warn_frozen_beside
from tests.distributed import run_distributed
from tests.test_strategy import LossRecorder, Tokens
from tests.test_tensor_parallel import gather_full

KW: dict[str, Any] = dict(
    vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, bias=False, max_steps=8
)
GLOBAL, N, SEED = 8, 32, 5


class SGDGPT(GPTModule):
    """SGD: the pipeline and tp re-associate fp32 sums; Adam would amplify that (tests/reference.py)."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.3, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Collect(pl.Callback):
    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}
        self.bubble = -1.0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        stats = trainer.strategy.pipeline_stats  # type: ignore[attr-defined]
        self.bubble = stats.bubble if stats is not None else -1.0

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        local = {n: p for n, p in module.named_parameters() if not p.is_meta}
        full = gather_full(module, trainer.strategy.mesh.tp_group)  # type: ignore[attr-defined]
        self.state = {n: v for n, v in full.items() if n in local}


def _module() -> GPTModule:
    pl.seed_everything(SEED)
    m = SGDGPT(**KW)
    m.configure_model()
    return m


# a fine-tune that freezes the embedding (tied to the head) and the first block: with the cut [2, 2]
# (embedding and block 0 | block 1 and head) stage 0 trains nothing
FROZEN_PREFIXES = ("model.embed.", "model.blocks.0.")


def _frozen_module() -> GPTModule:
    m = _module()
    for name, p in m.named_parameters():
        if name.startswith(FROZEN_PREFIXES):
            p.requires_grad_(False)
    return m


def _trainer(
    strategy: Any, devices: int, tmp: str, callbacks: list[pl.Callback], epochs: int = 1, **options: Any
) -> pl.Trainer:
    """The pipeline tests' Trainer; ``options`` override its arguments."""
    kw: dict[str, Any] = dict(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=epochs,
        gradient_clip_val=0.5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        default_root_dir=tmp,
        callbacks=callbacks,
    )
    return pl.Trainer(**(kw | options))


def _run(
    rank: int,
    world: int,
    tmp: str,
    kw: dict[str, Any],
    epochs: int = 1,
    resume: str | None = None,
    save: str | None = None,
    make: Callable[[], GPTModule] = _module,
) -> dict[str, Any]:
    rec, col = LossRecorder(), Collect()
    strategy = HybridParallelStrategy(**kw)
    dp = world // (kw.get("pipeline_parallel_size", 1) * kw.get("tensor_parallel_size", 1))
    trainer = _trainer(strategy, world, tmp, [rec, col], epochs)
    train = DataLoader(Tokens(N), batch_size=GLOBAL // dp, shuffle=True)
    val = DataLoader(Tokens(8), batch_size=8 // dp)
    trainer.fit(make(), train, val, ckpt_path=resume)
    if save:
        trainer.save_checkpoint(save)
    return {
        "losses": rec.losses,
        "state": col.state,
        "bubble": col.bubble,
        "val_loss": float(trainer.callback_metrics["val_loss"]),
    }


def _reference(
    tmp: Path, epochs: int = 1, make: Callable[[], pl.LightningModule] | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor], float]:
    """One process over the global batches the dp ranks shared (``make``: the module, default ours)."""
    rec = LossRecorder()
    module = (make or _module)()
    orders = []
    for epoch in range(epochs):
        sampler = DistributedSampler(Tokens(N), num_replicas=1, rank=0, shuffle=True, seed=SEED)
        sampler.set_epoch(epoch)
        perm = list(sampler)
        orders += [perm[i : i + GLOBAL] for i in range(0, N, GLOBAL)]
    trainer = _trainer("auto", 1, str(tmp / "ref"), [rec])
    trainer.fit(module, DataLoader(Tokens(N), batch_sampler=orders), DataLoader(Tokens(8), batch_size=8))
    return (
        torch.tensor(rec.losses),
        {k: v.detach() for k, v in module.named_parameters()},
        float(trainer.callback_metrics["val_loss"]),
    )


def assert_equals_reference(results: list[dict[str, Any]], reference: tuple[Any, Any, float]) -> None:
    """Every rank's run (``losses``, ``val_loss``, rank 0's consolidated ``state``) against
    :func:`_reference`'s: the per-step losses averaged over the ranks (data-parallel ranks log their own
    halves' means; pipeline ranks the same value), each rank's validation loss, every weight."""
    ref_losses, ref_state, ref_val = reference
    torch.testing.assert_close(torch.tensor([r["losses"] for r in results]).mean(0), ref_losses)
    for r in results:
        assert r["val_loss"] == pytest.approx(ref_val, rel=1e-5)
    state = results[0]["state"]
    assert set(ref_state) <= set(state), sorted(set(ref_state) - set(state))
    for name, value in ref_state.items():
        torch.testing.assert_close(state[name], value.detach(), msg=name)


CASES = [
    (2, dict(pipeline_parallel_size=2, num_microbatches=4, pipeline_schedule="gpipe")),
    (  # an explicit cut: embedding and both blocks on stage 0, the head alone on stage 1
        2,
        dict(
            pipeline_parallel_size=2,
            num_microbatches=4,
            pipeline_schedule="1f1b",
            zero_stage=1,
            partition_method=[3, 1],
        ),
    ),
    (
        2,
        dict(
            pipeline_parallel_size=2,
            num_microbatches=4,
            pipeline_schedule="interleaved_1f1b",
            virtual_stages=2,
            partition_method="uniform",
        ),
    ),
    (  # one micro-batch of slack on the first stage
        2,
        dict(
            pipeline_parallel_size=2,
            num_microbatches=4,
            pipeline_schedule="zb",
            zero_stage=1,
            pipeline_slack=1,
        ),
    ),
    (  # zb's weight passes with blocks recomputed in backward (the recomputation records nothing)
        2,
        dict(
            pipeline_parallel_size=2,
            num_microbatches=4,
            pipeline_schedule="zb",
            activation_checkpointing=True,
        ),
    ),
    (  # the split backward over two chunks per rank, W passes into ZeRO-1's buffer
        2,
        dict(
            pipeline_parallel_size=2,
            num_microbatches=4,
            pipeline_schedule="interleaved_zb",
            virtual_stages=2,
            partition_method="uniform",
            zero_stage=1,
        ),
    ),
    (4, dict(pipeline_parallel_size=2, num_microbatches=2, zero_stage=1)),
    (4, dict(pipeline_parallel_size=2, num_microbatches=2, zero_stage=2)),
    (4, dict(pipeline_parallel_size=2, tensor_parallel_size=2, tp_plan="gpt", num_microbatches=4)),
    (  # W of the tensor-parallel linears (column and row parallel) after the split backward
        4,
        dict(
            pipeline_parallel_size=2,
            tensor_parallel_size=2,
            tp_plan="gpt",
            num_microbatches=4,
            pipeline_schedule="zb",
        ),
    ),
]


@pytest.mark.parametrize(("world", "kw"), CASES, ids=[str(sorted(kw.items())) for _, kw in CASES])
def test_pipeline_trainer_matches_single_process(world: int, kw: dict[str, Any], tmp_path: Path) -> None:
    results = run_distributed(_run, world, str(tmp_path), kw, init_group=False)
    ref_losses, ref_state, ref_val = _reference(tmp_path)
    # every rank of a pipeline (and tp group) reports the same loss, so the mean over all ranks is the mean
    # over the data-parallel replicas: the global loss
    losses = torch.tensor([r["losses"] for r in results])
    torch.testing.assert_close(losses.mean(0), ref_losses)
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        merged.update(r["state"])
        assert 0.0 <= r["bubble"] < 1.0
        assert r["val_loss"] == pytest.approx(ref_val, rel=1e-5)
    assert set(merged) == set(ref_state)
    if kw.get("partition_method") == [3, 1]:  # the cut as told: both blocks on stage 0, the head on 1
        assert any(".blocks.1." in n for n in results[0]["state"]), sorted(results[0]["state"])
        assert not any(".blocks." in n for n in results[1]["state"]), sorted(results[1]["state"])
        assert "model.head.norm.weight" in results[1]["state"]
    for k, v in ref_state.items():
        torch.testing.assert_close(merged[k], v, msg=k)


def test_pipeline_checkpoint_reloads_at_another_pipeline_size_and_cut(tmp_path: Path) -> None:
    ckpt = os.path.join(str(tmp_path), "pp.ckpt")
    first = dict(pipeline_parallel_size=2, num_microbatches=4, zero_stage=1, partition_method=[3, 1])
    saved = run_distributed(_run, 2, str(tmp_path), first, 1, None, ckpt, init_group=False)
    ref_losses, ref_state, _ = _reference(tmp_path, epochs=2)
    half = len(ref_losses) // 2
    torch.testing.assert_close(torch.tensor(saved[0]["losses"]), ref_losses[:half])
    # continue on a single pipeline stage with data parallelism over 2 ranks, and on two stages cut
    # elsewhere (the default cut, [2, 2] here: a checkpoint written before the default changed)
    pp_elsewhere = dict(pipeline_parallel_size=2, num_microbatches=4, zero_stage=1)
    for resume in (dict(zero_stage=2), pp_elsewhere):
        resumed = run_distributed(_run, 2, str(tmp_path), resume, 2, ckpt, init_group=False)
        torch.testing.assert_close(torch.tensor([r["losses"] for r in resumed]).mean(0), ref_losses[half:])
        merged = {k: v for r in resumed for k, v in r["state"].items()}
        if resume is pp_elsewhere:
            assert any(".blocks.1." in n for n in resumed[1]["state"]), sorted(resumed[1]["state"])
        for k, v in ref_state.items():
            torch.testing.assert_close(merged[k], v, msg=k)


def test_pipeline_at_stage0_resumes_its_own_checkpoint(tmp_path: Path) -> None:
    """At ZeRO-0 a stage's optimizer holds the other stage's meta placeholders. Before, a resume put
    their saved momentum on the meta device and failed ("Cannot copy out of meta tensor"), from a
    directory or a single file; now they get no state (they never step here) and the run continues as
    one process over both epochs."""
    ref_losses, ref_state, _ = _reference(tmp_path, epochs=2)
    half = len(ref_losses) // 2
    for distributed in (True, False):
        kw = dict(pipeline_parallel_size=2, num_microbatches=4, save_distributed_checkpoint=distributed)
        ckpt = os.path.join(str(tmp_path), f"pp0-{distributed}.ckpt")
        saved = run_distributed(_run, 2, str(tmp_path), kw, 1, None, ckpt, init_group=False)
        torch.testing.assert_close(torch.tensor(saved[0]["losses"]), ref_losses[:half])
        resumed = run_distributed(_run, 2, str(tmp_path), kw, 2, ckpt, init_group=False)
        torch.testing.assert_close(torch.tensor([r["losses"] for r in resumed]).mean(0), ref_losses[half:])
        merged = {k: v for r in resumed for k, v in r["state"].items()}
        for k, v in ref_state.items():
            torch.testing.assert_close(merged[k], v, msg=k)


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_a_stage_with_every_layer_frozen_trains_and_resumes_as_one_process(
    zero_stage: int, tmp_path: Path
) -> None:
    """A fine-tune freezing every layer one stage holds. Before, ZeRO 0-2 failed at setup on that stage
    ("GradSync got no parameters that require gradients") and its peer died in Gloo; now the stage
    reduces and steps nothing, and the run (and its resume from a checkpoint) equals one process."""
    ref_losses, ref_state, _ = _reference(tmp_path, epochs=2, make=_frozen_module)
    half = len(ref_losses) // 2
    kw = dict(pipeline_parallel_size=2, num_microbatches=4, zero_stage=zero_stage, partition_method=[2, 2])
    ckpt = os.path.join(str(tmp_path), f"frozen{zero_stage}.ckpt")
    saved = run_distributed(_run, 2, str(tmp_path), kw, 1, None, ckpt, _frozen_module, init_group=False)
    torch.testing.assert_close(torch.tensor(saved[0]["losses"]), ref_losses[:half])
    resumed = run_distributed(_run, 2, str(tmp_path), kw, 2, ckpt, None, _frozen_module, init_group=False)
    torch.testing.assert_close(torch.tensor([r["losses"] for r in resumed]).mean(0), ref_losses[half:])
    merged = {k: v for r in resumed for k, v in r["state"].items()}
    start = _frozen_module().state_dict()
    for k, v in ref_state.items():
        torch.testing.assert_close(merged[k], v, msg=k)
        if k.startswith(FROZEN_PREFIXES):
            assert torch.equal(merged[k], start[k]), k  # frozen: untouched


def test_pipeline_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match=r"multiple of the pipeline size.*m=3, p=2; use m=4"):
        HybridParallelStrategy(
            pipeline_parallel_size=2,
            num_microbatches=3,
            pipeline_schedule="interleaved_1f1b",
            virtual_stages=2,
        )
    with pytest.raises(ValueError, match=r"pipeline_schedule='zb' needs num_microbatches >= .* use m=4"):
        HybridParallelStrategy(pipeline_parallel_size=4, num_microbatches=2, pipeline_schedule="zb")
    with pytest.raises(ValueError, match=r"pipeline_slack=1 applies to the 1f1b and zb schedules; 'gpipe'"):
        HybridParallelStrategy(pipeline_parallel_size=2, pipeline_schedule="gpipe", pipeline_slack=1)
    with pytest.raises(ValueError, match="partition_method must be one of"):
        HybridParallelStrategy(pipeline_parallel_size=2, partition_method="random")  # type: ignore[arg-type]


def test_a_frozen_copy_beside_the_pipeline_layers_is_named() -> None:
    # an EMA copy of the model made in __init__ (frozen): the pipeline never runs it, and its update with
    # the model's parameters meets other stages' meta placeholders; before, only torch's bare "Tensor on
    # device meta is not on the expected device cpu!" at the first update
    module = _module()
    layers = list(module.pipeline_layers())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_frozen_beside(module, layers)  # the model alone: nothing beside its layers
        module.ema = copy.deepcopy(module.model).requires_grad_(True)
        warn_frozen_beside(module, layers)  # trainable: the engines name it as unused at the first step
    module.ema.requires_grad_(False)
    with pytest.warns(UserWarning, match=r"19 frozen parameter\(s\) .*\['ema.embed.tok.weight'.*ShardedEMA"):
        warn_frozen_beside(module, layers)


def test_options_that_do_nothing_at_this_layout_are_warned() -> None:
    # before, silently ignored: a run meant to be pipelined or split trained as plain data parallelism
    with pytest.warns(UserWarning, match=r"num_microbatches=8, pipeline_schedule='zb' apply under pipeline"):
        HybridParallelStrategy(num_microbatches=8, pipeline_schedule="zb")
    with pytest.warns(UserWarning, match=r"virtual_stages=2 applies .* but pipeline_parallel_size=1"):
        LitFabricStrategy(zero_stage=1, virtual_stages=2)
    with pytest.warns(UserWarning, match=r"tp_plan='llama' applies .* but tensor_parallel_size=1"):
        HybridParallelStrategy(tp_plan="llama", pipeline_parallel_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HybridParallelStrategy(zero_stage=2)  # the defaults: nothing to say
        HybridParallelStrategy(tensor_parallel_size=2, tp_plan="llama", pipeline_parallel_size=2)


def _short_last_batch(rank: int, world: int, tmp: str, max_steps: int) -> dict[str, Any]:
    """33 samples in batches of 8: the fifth batch holds 1 sample, fewer than num_microbatches=4."""
    rec, col = LossRecorder(), Collect()
    strategy = HybridParallelStrategy(pipeline_parallel_size=2, num_microbatches=4)
    trainer = _trainer(strategy, world, tmp, [rec, col], limit_val_batches=0, max_steps=max_steps)
    try:
        trainer.fit(_module(), DataLoader(Tokens(N + 1), batch_size=GLOBAL))
    except ValueError as exc:
        return {"error": str(exc)}
    return {"losses": rec.losses, "state": col.state}


def test_a_short_last_batch_the_run_never_reaches_is_not_refused(tmp_path: Path) -> None:
    # max_steps=2 ends the epoch at its second batch: before, the fifth batch's single sample was refused
    # at fit start all the same; a run that reaches it is still refused there, on every rank
    ran = run_distributed(_short_last_batch, 2, str(tmp_path), 2, init_group=False)
    refused = run_distributed(_short_last_batch, 2, str(tmp_path), 6, init_group=False)
    rec = LossRecorder()
    module = _module()
    # Lightning shuffles a training set under a distributed sampler: the same order in one process
    perm = list(DistributedSampler(Tokens(N + 1), num_replicas=1, rank=0, shuffle=True, seed=SEED))
    _trainer("auto", 1, str(tmp_path / "ref"), [rec], limit_val_batches=0, max_steps=2).fit(
        module, DataLoader(Tokens(N + 1), batch_sampler=[perm[:GLOBAL], perm[GLOBAL : 2 * GLOBAL]])
    )
    for r in ran:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(rec.losses))
    state = {k: v for r in ran for k, v in r["state"].items()}
    for name, value in module.named_parameters():
        torch.testing.assert_close(state[name], value.detach(), msg=name)
    for r in refused:
        assert "ends with a batch of 1 samples" in r["error"], r
