"""Regression tests for the two silent mixed-precision failures measured before the single precision path:

1. Tied weights under pipeline parallelism with ZeRO-1 in ``bf16-mixed`` drifted apart (the tied
   gradients were read from ``param.grad``, which the engine leaves ``None`` when the compute and
   reduction dtypes differ, and the masters were re-read from their bf16 copies when the bucket order was
   rebuilt): now the copies on the first and last stage are bitwise equal after each of 20 steps.
2. A Hugging Face Llama under tp=2 at ZeRO stage 0 in ``bf16-mixed`` with clipping kept Lightning's own
   plugin, which clipped by each tp rank's local norm: now clipping agrees with the unsharded model, the
   clipped run ends within the bf16 tolerance of tests/precision_matrix.py of its single-process twin.

3. Token-exact normalisation with a low-precision ``reduce_dtype`` rescaled the reduction buffer after
   its values had been copied into the fp32 masters (listener order), so the rescale was lost: the
   gradient pipeline is now explicit (attach, then rescale what was attached).

Also the stage-0 precision mapping: Lightning's strings become ParallelPrecision without masters, fp32
masters at stage 0 are refused, and a plugin that is not ours is refused under tensor parallelism.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import HalfPrecision
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.precision import ParallelPrecision
from tests.distributed import run_distributed
from tests.precision_matrix import KW, SEED, Combo, MatrixGPT, Record, Tokens, initial_state, run, tolerance
from tests.third_party import LoraLlama
from tests.third_party import Tokens as LlamaTokens

TIED_STEPS, LLAMA_STEPS, CLIP = 20, 6, 0.05
CPU = torch.device("cpu")


class SGDLlama(LoraLlama):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _trainer(
    strategy: Any, devices: int, precision: str, callbacks: list[pl.Callback], **kw: Any
) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        plugins=[ParallelPrecision(precision)],  # type: ignore[arg-type]
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callbacks,
        **kw,
    )


def _tied(rank: int, world: int) -> dict[str, Any]:
    pl.seed_everything(SEED, verbose=False)
    module = MatrixGPT(token=False, poison=False, **KW, max_steps=TIED_STEPS)
    module.configure_model()
    record = Record(every=1)
    strategy = HybridParallelStrategy(zero_stage=1, pipeline_parallel_size=2, num_microbatches=2)
    trainer = _trainer(strategy, world, "bf16-mixed", [record], gradient_clip_val=1.0)
    trainer.fit(module, DataLoader(Tokens(4 * TIED_STEPS, masked=False), batch_size=4, shuffle=True))
    return {"tied": record.tied}


def _llama(world: int, *, tp: int, clip: float | None) -> dict[str, torch.Tensor]:
    pl.seed_everything(SEED, verbose=False)
    module = SGDLlama(lora=False)
    kw: dict[str, Any] = {"tensor_parallel_size": tp, "tp_plan": "llama"} if tp > 1 else {}
    export: dict[str, torch.Tensor] = {}

    class Export(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            export.update(trainer.strategy.consolidated_state_dict())  # type: ignore[attr-defined]

    trainer = _trainer(HybridParallelStrategy(**kw), world, "bf16-mixed", [Export()], gradient_clip_val=clip)
    trainer.fit(module, DataLoader(LlamaTokens(2 * LLAMA_STEPS), batch_size=2))  # tp ranks: same samples
    return export


def _regressions(rank: int, world: int) -> dict[str, Any]:
    out = _tied(rank, world)
    # 3. token-exact normalisation with bf16 gradient reduction: the rescale reaches the fp32 masters
    out["token_bf16"] = {
        stage: run(
            Combo(stage, 1, 1, "bf16-mixed", True), world=world, dp_rank=rank, reduce_dtype="bf16", clip=None
        )
        for stage in (2, 3)
    }
    out["llama"] = {clip: _llama(world, tp=2, clip=clip) for clip in (None, CLIP)}
    # a plugin that is not ours under tensor parallelism: refused at setup, with the reason
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=HybridParallelStrategy(tensor_parallel_size=2, tp_plan="llama"),
        plugins=[HalfPrecision("16-true")],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(ValueError, match=r"HalfPrecision.*local gradient norm"):
        trainer.fit(SGDLlama(lora=False), DataLoader(LlamaTokens(4), batch_size=2))
    assert trainer.global_step == 0
    return out


def _references(rank: int, world: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {clip: _llama(1, tp=1, clip=clip) for clip in (None, CLIP)}
    # no clipping: it would hide a lost rescale (a clipped gradient has the same norm at any scale)
    out["token"] = run(Combo(1, 1, 1, "bf16-mixed", True), world=1, dp_rank=0, clip=None)
    return out


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in b)


def test_tied_copies_and_tensor_parallel_clipping_in_bf16() -> None:
    results = run_distributed(_regressions, 2, init_group=False, timeout=600.0)
    references = run_distributed(_references, 1, init_group=False, timeout=600.0)[0]
    # 1. pp=2 (ranks 0 and 1 are the first and the last stage): the tied copies after every step
    first, last = results[0]["tied"], results[1]["tied"]
    assert len(first) == TIED_STEPS and first == last, [
        i for i, (a, b) in enumerate(zip(first, last, strict=True)) if a != b
    ]
    assert len(set(first)) == TIED_STEPS  # and they did change every step
    # 2. tp=2 bf16-mixed with clipping: within the matrix's bf16 tolerance (8 u max|W_T - W_0|) of the
    # unsharded twin; a per-rank local norm clips less and ends about 17x beyond it
    pl.seed_everything(SEED, verbose=False)
    module = SGDLlama(lora=False)
    module.configure_model()
    initial = {k: v.detach().clone() for k, v in module.state_dict().items()}
    clipped = _max_diff(results[0]["llama"][CLIP], references[CLIP])
    tol = tolerance("bf16-mixed", references[CLIP], initial, stored_low=False)
    assert clipped <= tol, (clipped, tol)
    assert _max_diff(references[CLIP], references[None]) > 100 * tol  # clipping bit: it changed the result
    # 3. token-exact with gradients reduced in bf16 (dp=2, stages 2 and 3) against the fp32-reduced
    # single-process run: the bf16 reduction adds one rounding per step, well inside the tolerance
    ref = references["token"]
    tol = tolerance("bf16-mixed", ref["export"], initial_state(), stored_low=False)
    for stage, got in results[0]["token_bf16"].items():
        assert _max_diff(got["export"], ref["export"]) <= tol, (
            stage,
            _max_diff(got["export"], ref["export"]),
        )


def test_stage0_precision_mapping() -> None:
    """Lightning's strings become ParallelPrecision at stage 0 too (fp32 parameters under autocast);
    asking for fp32 masters at stage 0, or for frozen parameters stored beside masters the run does not
    keep, is refused with the alternative."""
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="zero0", precision="bf16-mixed", logger=False)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, ParallelPrecision) and plugin.precision == "bf16-mixed"
    plugin.configure(zero_stage=0, device=CPU)
    assert not plugin.uses_masters
    masters = ParallelPrecision("bf16-mixed", master_weights=True)
    with pytest.raises(ValueError, match=r"master_weights=True.*zero_stage=0.*use zero_stage=1"):
        masters.configure(zero_stage=0, device=CPU)
    with pytest.raises(ValueError, match=r"reduce_dtype=.*fp32 parameters"):
        ParallelPrecision("bf16-mixed", reduce_dtype="bf16").configure(zero_stage=0, device=CPU)
    # frozen parameters in the compute dtype need masters beside them: without, accepted and ignored before
    with pytest.raises(ValueError, match=r"frozen_dtype='compute'.*zero_stage=0.*would do nothing"):
        ParallelPrecision("16-mixed", frozen_dtype="compute").configure(zero_stage=0, device=CPU)
    with pytest.raises(ValueError, match=r"frozen_dtype='compute'.*master_weights=False"):
        ParallelPrecision("bf16-mixed", frozen_dtype="compute", master_weights=False).configure(
            zero_stage=2, device=CPU
        )
    kept = ParallelPrecision("bf16-mixed", frozen_dtype="compute")
    kept.configure(zero_stage=1, device=CPU)
    assert kept.frozen_storage_dtype() == torch.bfloat16
