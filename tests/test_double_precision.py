"""``precision="64-true"`` (Lightning's ``DoublePrecision``) at every layout, against Lightning's own.

Before, ZeRO 1-3 refused it ("DoublePrecision('64-true') cannot be used with ZeRO stage ..."), and tensor
parallelism refused it at stage 0 (its clip norm would have been each rank's local one); Fabric's strategy
refused it at every stage. Now it maps onto ``ParallelPrecision("64-true")``: the model is built (in
``configure_model``) and converted to float64, inputs are cast, torch's default dtype is float64 inside a
step, the shards, gradients and their reduction are fp64, and the clip norm is accumulated in fp64 (the
fp32 accumulator refused fp64 gradients: "the dtype of the input (Double) should be convertible without
narrowing").

A Hugging Face Llama, 3 SGD steps with momentum and gradient clipping (at 0.5, which clips): ZeRO 1, 2
and 3 (units per decoder layer) on 2 Gloo ranks equal Lightning's ``"ddp"`` in ``64-true`` (1e-12; with
the norm accumulated in fp32 they were 5e-9 apart); tp2 and 2 pipeline stages (zero bubble; dp 1) equal
one process; a Fabric loop at
ZeRO-3 equals Fabric's ``"ddp"`` (losses and weights). Every run's state is float64 and the step's
``torch.randn`` was float64.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.fabric import HybridParallelStrategy as FabricHybridParallelStrategy
from lightning_par.memory import estimate_memory
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state
from tests.test_pp_hf import module_factory
from tests.third_party import Tokens, llama

STEPS, CLIP = 3, 0.5


class DoubleLlama(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model: torch.nn.Module | None = None
        self.step_dtypes: set[torch.dtype] = set()
        self.report: dict[str, int] = {}

    def configure_model(self) -> None:
        if self.model is None:  # under the precision's init context: float64 from the start
            self.model = llama()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        assert self.model is not None
        ids = batch[0]
        self.step_dtypes.add(torch.randn(()).dtype)  # a tensor the step creates
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)

    def on_train_end(self) -> None:
        report = getattr(self.trainer.strategy, "memory_report", None)
        self.report = dict(report()) if report is not None else {}


def _strategy(name: str) -> Any:
    if name == "ddp":
        return "ddp"
    if name == "tp2":
        return HybridParallelStrategy(zero_stage=1, tensor_parallel_size=2, tp_plan="llama")
    units = {"zero3_units": ["LlamaDecoderLayer"], "meta_init": False} if name == "z3" else {}
    return HybridParallelStrategy(zero_stage=int(name[1]), **units)


def _fit(strategy: Any, module: pl.LightningModule, world: int, batch: int) -> pl.Trainer:
    """``STEPS`` steps in ``64-true`` with clipping that bites."""
    options: dict[str, Any] = dict(max_steps=STEPS, limit_val_batches=0, gradient_clip_val=CLIP)
    trainer = cpu_trainer(strategy, devices=world, precision="64-true", **options)
    trainer.fit(module, DataLoader(Tokens(16), batch_size=batch))
    return trainer


def _fits(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        strategy = _strategy(name)
        module = DoubleLlama()
        _fit(strategy, module, world, 2)
        out[name] = {"state": final_state(module, strategy), "step_dtypes": module.step_dtypes}
        if name in ("z1", "z3"):  # 8-byte parameters, gradients and momentum, as predicted
            assert module.model is not None
            stage = int(name[1])
            options = dict(zero_stage=stage, dp=world, precision="64-true", optimizer="sgd_momentum")
            out[name] |= {"report": module.report, "estimate": estimate_memory(module.model, **options)}
    return out


def _pipeline(rank: int, world: int) -> dict[str, Tensor]:
    """2 pipeline stages (zero-bubble schedule) of a Hugging Face Llama (``hf_pipeline_layers``), or with
    one rank the same model unpipelined."""
    strategy: Any = "ddp"
    if world > 1:
        strategy = HybridParallelStrategy(
            pipeline_parallel_size=2, num_microbatches=2, pipeline_schedule="zb"
        )
    module = module_factory("llama")()
    trainer = _fit(strategy, module, world, 4)
    if world > 1:
        return trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined,no-any-return]
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _fabric(rank: int, world: int, name: str) -> dict[str, Any]:
    strategy: Any = "ddp" if name == "ddp" else FabricHybridParallelStrategy(zero_stage=3, meta_init=False)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="64-true")
    fabric.launch()
    with fabric.init_module():
        model = llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    wrapped, optimizer = fabric.setup(model, optimizer)
    data = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (2, 9), generator=data)
        loss = wrapped(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        fabric.clip_gradients(wrapped, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    if name == "ddp":
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:
        state = fabric.strategy.consolidated_state_dict()  # type: ignore[attr-defined]
        fabric.strategy.destroy_process_groups()  # type: ignore[attr-defined]
    return {"state": state, "losses": torch.stack(losses), "loss_dtype": losses[0].dtype}


def _assert_double_and_equal(got: dict[str, Tensor], want: dict[str, Tensor], what: str) -> None:
    assert {v.dtype for v in got.values()} == {torch.float64}, what
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m: f"{what}: {m}")


def test_64_true_at_every_layout_equals_lightnings() -> None:
    runs = run_distributed(_fits, 2, ["ddp", "z1", "z2", "z3", "tp2"], init_group=False, timeout=600)[0]
    one = run_distributed(_fits, 1, ["ddp"], init_group=False, timeout=300)[0]["ddp"]
    ddp = runs["ddp"]
    assert ddp["step_dtypes"] == {torch.float64}
    # the model moved: a mapping that did nothing would not compare equal by accident
    assert not torch.allclose(ddp["state"]["model.lm_head.weight"], llama().double().lm_head.weight)
    for name in ("z1", "z2", "z3"):
        assert runs[name]["step_dtypes"] == {torch.float64}, name
        _assert_double_and_equal(runs[name]["state"], ddp["state"], name)
    for name in ("z1", "z3"):
        report, estimate = runs[name]["report"], runs[name]["estimate"]
        for key in ("parameters", "gradients", "optimizer_state"):
            assert report[key] == pytest.approx(estimate[key], rel=0.05), (name, key, report, estimate)
    _assert_double_and_equal(runs["tp2"]["state"], one["state"], "tp2 against one process")
    pipelined = run_distributed(_pipeline, 2, init_group=False, timeout=300)[0]
    _assert_double_and_equal(pipelined, run_distributed(_pipeline, 1, init_group=False)[0], "pp2")
    fabric = {name: run_distributed(_fabric, 2, name, init_group=False)[0] for name in ("ddp", "zero3")}
    # Fabric hands outputs back in the default dtype (its own DoublePrecision too)
    assert fabric["zero3"]["loss_dtype"] == fabric["ddp"]["loss_dtype"] == torch.float32
    torch.testing.assert_close(fabric["zero3"]["losses"], fabric["ddp"]["losses"], rtol=1e-12, atol=1e-12)
    _assert_double_and_equal(fabric["zero3"]["state"], fabric["ddp"]["state"], "Fabric ZeRO-3")


class AdamLlama(DoubleLlama):
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _resumes(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Saved in ``32-true`` after 2 steps, resumed in ``64-true`` for 2 more (and the other way round)."""
    out: dict[str, Any] = {}
    for name in ("ddp", "z1", "z3"):
        for first, then in (("32-true", "64-true"), ("64-true", "32-true")):
            path = str(Path(tmp) / f"{name}_{first}.ckpt")
            for precision, steps, resume in ((first, 2, None), (then, 4, path)):
                strategy = _strategy(name)
                module = AdamLlama()  # its moments are what the resume casts (SGD's buffer worked uncast)
                options: dict[str, Any] = dict(max_steps=steps, limit_val_batches=0)
                trainer = cpu_trainer(strategy, devices=world, precision=precision, **options)
                trainer.fit(module, DataLoader(Tokens(16), batch_size=2), ckpt_path=resume)
                if resume is None:
                    trainer.save_checkpoint(path)
                    if name != "ddp":
                        strategy.destroy_process_groups()
            out[f"{name} {first} -> {then}"] = final_state(module, strategy)
    return out


def test_a_checkpoint_moves_between_32_true_and_64_true(tmp_path: Path) -> None:
    """torch's ``load_state_dict`` casts an optimizer's saved state to its parameters' dtype; before, our
    sharded optimizers kept the saved dtype and the first step after the resume failed at ZeRO 1-3 on
    the mixed dtypes (a probe). Now ZeRO-1 and ZeRO-3 resume as ``"ddp"`` does, both ways."""
    r = run_distributed(_resumes, 2, str(tmp_path), init_group=False, timeout=600)[0]
    for name in ("z1", "z3"):
        for first, then in (("32-true", "64-true"), ("64-true", "32-true")):
            got, want = r[f"{name} {first} -> {then}"], r[f"ddp {first} -> {then}"]
            what = f"{name} {first} -> {then}"
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=lambda m, w=what: f"{w}: {m}")
