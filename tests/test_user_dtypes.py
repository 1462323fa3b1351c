"""Models whose parameters users put in other dtypes than fp32, on 2 Gloo ranks against ``"ddp"``.

* A LoRA fine-tune on a base cast to bf16 and frozen, with fp32 adapters, in ``"32-true"``: the base
  computes in bf16, as in the user's model. Before, ZeRO-3 gathered the frozen bf16 weights in the
  adapters' fp32 and failed in the first forward ("Expected out type to be Float but got BFloat16");
  fixed, it would still have computed the base in fp32, unlike ``"ddp"``. ZeRO 1 and 3 now equal
  ``"ddp"``: losses, final weights and every dtype.
* A model the user halved (``model.half()``) under ``"16-mixed"``: refused at setup, before any step, in
  the Trainer's fit and at Fabric's ``setup_optimizers`` (evaluating it works, as under ``"ddp"``).
  Before, ZeRO 1-3 trained the fp16 values as their own masters: AdamW's ``eps`` rounded to 0, the first
  step wrote NaN, and every later step was skipped as an overflow, so ``max_steps`` was never reached
  (``"ddp"`` refuses it in its first step: torch's ``GradScaler`` will not unscale fp16 gradients).
* A whole model cast to bf16 under ``"bf16-mixed"``: it trains its bf16 weights as under ``"ddp"``; the
  norm layers computing in fp32 (the default) are the one difference, ``norms_in_fp32=False`` removes it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy, ParallelPrecision
from lightning_par.fabric import HybridParallelStrategy as FabricStrategy
from lightning_par.memory import estimate_memory
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state
from tests.third_party import LoraLlama, Tokens, add_lora, llama

STEPS = 4


class Bf16BaseLora(LoraLlama):
    """LoRA adapters (fp32, as PEFT makes them) on a Llama cast to bf16 and frozen."""

    def __init__(self) -> None:
        super().__init__(lora=True)
        self.losses: list[float] = []
        self.seen: set[torch.dtype] = set()
        self.report: dict[str, int] = {}

    def configure_model(self) -> None:
        if self.model is None:
            self.model = add_lora(llama(0).to(torch.bfloat16).requires_grad_(False))

    def configured(self) -> Bf16BaseLora:
        self.configure_model()
        return self

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        assert self.model is not None
        self.seen.add(self.model.get_input_embeddings()(batch[0]).dtype)
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss))
        return loss

    def on_train_batch_end(self, *args: Any) -> None:
        report = getattr(self.trainer.strategy, "memory_report", None)
        self.report = dict(report()) if report is not None else {}


def _fit_lora(strategy: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    module = Bf16BaseLora()
    trainer = cpu_trainer(strategy, devices=2, max_steps=STEPS)
    trainer.fit(module, DataLoader(Tokens(32), batch_size=2))
    state = final_state(module, strategy)
    return {
        "report": module.report,
        "losses": module.losses,
        "seen": module.seen,
        "state": state,
        "dtypes": {n: p.dtype for n, p in module.named_parameters()},
    }


def _lora_runs(rank: int, world: int) -> dict[str, Any]:
    return {
        "ddp": _fit_lora("ddp"),
        "z1": _fit_lora(HybridParallelStrategy(zero_stage=1)),
        "z3": _fit_lora(HybridParallelStrategy(zero_stage=3, meta_init=False)),
    }


def test_lora_on_a_frozen_bf16_base_equals_ddp() -> None:
    for rank, r in enumerate(run_distributed(_lora_runs, 2, init_group=False, timeout=400)):
        ref = r["ddp"]
        assert ref["seen"] == {torch.bfloat16}
        assert {p for n, p in ref["dtypes"].items() if "lora_" in n} == {torch.float32}
        for name in ("z1", "z3"):
            got = r[name]
            assert got["seen"] == {torch.bfloat16}, name  # the base computes in bf16, as under "ddp"
            assert got["dtypes"] == ref["dtypes"], name
            torch.testing.assert_close(got["losses"], ref["losses"], rtol=0, atol=1e-6)
            # the shards' bytes as predicted from the model's own dtypes (the frozen base at 2 bytes)
            stage = 3 if name == "z3" else 1
            estimate = estimate_memory(Bf16BaseLora().configured(), zero_stage=stage, dp=2)
            assert got["report"]["parameters"] == pytest.approx(estimate["parameters"], rel=0.05), name
            for key, value in ref["state"].items() if rank == 0 else ():  # the whole state: on rank 0
                assert got["state"][key].dtype == value.dtype, key
                torch.testing.assert_close(got["state"][key], value, rtol=0, atol=1e-6, msg=f"{name} {key}")


class Halved(LoraLlama):
    def configure_model(self) -> None:
        if self.model is None:
            self.model = llama(0).half()


def _halved(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage in (0, 3):
        module = Halved(lora=False)
        strategy = HybridParallelStrategy(zero_stage=stage, meta_init=False)
        trainer = cpu_trainer(
            strategy, devices=world, max_steps=STEPS, plugins=[ParallelPrecision("16-mixed")]
        )
        try:
            trainer.fit(module, DataLoader(Tokens(32), batch_size=2))
            message = None
        except ValueError as error:
            message = str(error)
            strategy.destroy_process_groups()
        out[f"z{stage}"] = (message, trainer.global_step)
    fabric = Fabric(
        accelerator="cpu",
        devices=world,
        strategy=FabricStrategy(zero_stage=1),
        plugins=[ParallelPrecision("16-mixed")],
    )
    fabric.launch()
    model = fabric.setup_module(nn.Linear(4, 4).half())  # evaluation alone is fine, as under "ddp"
    with torch.no_grad():
        out["evaluated"] = bool(torch.isfinite(model(torch.ones(2, 4))).all())
    with pytest.raises(ValueError) as refused:  # training it is not
        fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    out["fabric"] = str(refused.value)
    return out


def test_a_halved_model_under_16_mixed_is_refused_at_setup() -> None:
    for r in run_distributed(_halved, 2, init_group=False, timeout=300):
        for name in ("z0", "z3", "fabric"):
            message = r[name][0] if name != "fabric" else r[name]
            assert message is not None and "trainable parameter(s) are float16 under" in message, (name, r)
            assert "drop model.half()" in message
        assert r["z0"][1] == 0 and r["z3"][1] == 0  # before any step
        assert "(weight, bias)" in r["fabric"] and r["evaluated"]


class Bf16Cast(LoraLlama):
    """A whole model the user cast to bf16 (``model.to(torch.bfloat16)``), trained whole; records the
    dtypes the optimizer steps."""

    def __init__(self) -> None:
        super().__init__(lora=False)
        self.stepped: set[torch.dtype] = set()

    def configure_model(self) -> None:
        if self.model is None:
            self.model = llama(0).to(torch.bfloat16)

    def on_train_batch_end(self, *args: Any) -> None:
        self.stepped |= {p.dtype for g in self.trainer.optimizers[0].param_groups for p in g["params"]}


def _fit_cast(strategy: Any, *, norms_in_fp32: bool = True) -> dict[str, Any]:
    module = Bf16Cast()
    options: dict[str, Any] = {"precision": "bf16-mixed"}
    if not norms_in_fp32:
        options = {"plugins": [ParallelPrecision("bf16-mixed", norms_in_fp32=False)]}
    trainer = cpu_trainer(strategy, devices=2, max_steps=STEPS, **options)
    trainer.fit(module, DataLoader(Tokens(32), batch_size=2))
    return {"stepped": module.stepped, "state": final_state(module, strategy)}


def _cast_runs(rank: int, world: int) -> dict[str, Any]:
    out = {"ddp": _fit_cast("ddp")}
    for stage in (1, 3):
        out[f"z{stage}"] = _fit_cast(HybridParallelStrategy(zero_stage=stage, meta_init=False))
        strategy = HybridParallelStrategy(zero_stage=stage, meta_init=False)
        out[f"z{stage}_bf16_norms"] = _fit_cast(strategy, norms_in_fp32=False)
    return out


def test_a_bf16_cast_model_under_bf16_mixed_trains_its_bf16_weights_as_under_ddp() -> None:
    """A model cast to bf16 has no fp32 weights to keep: at ZeRO 1-3 the optimizer steps its bf16 values
    (the masters take the parameters' dtype), as ``"ddp"`` and FSDP2 do, and they stay bf16. Its norm
    layers compute in fp32 (``norms_in_fp32``, the default), where ``"ddp"`` multiplies by the bf16 norm
    weights in bf16 (equal while those are ones, apart once trained); with ``norms_in_fp32=False``
    training equals ``"ddp"`` bitwise."""
    r = run_distributed(_cast_runs, 2, init_group=False, timeout=400)[0]  # whole states: rank 0
    ref = r["ddp"]
    assert ref["stepped"] == {torch.bfloat16}
    for name in ("z1", "z3"):
        for variant in (name, f"{name}_bf16_norms"):
            assert r[variant]["stepped"] == {torch.bfloat16}, variant
            assert {v.dtype for v in r[variant]["state"].values()} == {torch.bfloat16}, variant
        diff = max((r[name]["state"][k] - v).abs().max().item() for k, v in ref["state"].items())
        assert diff > 1e-3, (name, diff)  # the fp32 norms' output rounds apart, AdamW amplifies it
        torch.testing.assert_close(r[f"{name}_bf16_norms"]["state"], ref["state"], rtol=0, atol=0)
