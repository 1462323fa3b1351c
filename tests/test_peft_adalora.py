"""PEFT AdaLoRA, whose ``update_and_allocate`` reads ``param.grad`` after each optimizer step, on 2 Gloo
ranks: at ZeRO-0 it equals Lightning's ``"ddp"`` (the losses, the pruned rank patterns and the final
weights); at ZeRO 1-3, where ``param.grad`` is None, it is refused at setup, in the Trainer and in Fabric,
naming the fix (before: PEFT's ``TypeError`` on ``Parameter * None`` after the first step); a frozen
AdaLoRA adapter under a trained head is not refused (equal to ``"ddp"`` at ZeRO-1)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.fabric import HybridParallelStrategy as FabricStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, fabric_setup_refused, final_state
from tests.third_party import LoraLlama, Tokens, llama

pytest.importorskip("peft")

WORLD, STEPS = 2, 4


def _adalora(seed: int = 0) -> torch.nn.Module:
    from peft import AdaLoraConfig, get_peft_model

    config = AdaLoraConfig(
        init_r=6, target_r=2, tinit=0, tfinal=1, deltaT=1, total_step=STEPS, lora_alpha=8,
        target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
    )  # fmt: skip
    return get_peft_model(llama(seed), config)


class AdaLlama(LoraLlama):
    """AdaLoRA as PEFT documents it: ``update_and_allocate`` after each optimizer step."""

    def __init__(self) -> None:
        super().__init__(lora=False)
        self.patterns: list[dict[str, list[bool]]] = []
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is None:
            self.model = _adalora()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss.detach()))
        return loss

    def on_train_batch_end(self, *args: Any) -> None:
        assert self.model is not None
        self.model.base_model.update_and_allocate(self.global_step)
        pattern = self.model.peft_config["default"].rank_pattern or {}
        self.patterns.append({k: [bool(b) for b in v] for k, v in pattern.items()})

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Tokens(WORLD * STEPS * 2), batch_size=2)


class FrozenAda(AdaLlama):
    """A frozen AdaLoRA adapter (``PeftModel.from_pretrained``'s default) under a trained LM head: nothing
    allocates ranks, so every layout trains it."""

    def configure_model(self) -> None:
        super().configure_model()
        assert self.model is not None
        for name, p in self.model.named_parameters():
            p.requires_grad = "lm_head" in name

    def on_train_batch_end(self, *args: Any) -> None:
        pass


def _fit(strategy: Any, frozen: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    module = FrozenAda() if frozen else AdaLlama()
    trainer = cpu_trainer(strategy, devices=WORLD, max_steps=STEPS)
    try:
        trainer.fit(module)
    except ValueError as error:
        strategy.destroy_process_groups()
        return {"error": str(error)}
    return {"state": final_state(module, strategy), "patterns": module.patterns, "losses": module.losses}


def _fabric(rank: int) -> str:
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=FabricStrategy(zero_stage=2))
    fabric.launch()
    model = _adalora()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    refused = fabric_setup_refused(fabric, model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    return refused or "not refused"


def _runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {
        "ddp": _fit(DDPStrategy()),
        "zero0": _fit(HybridParallelStrategy(zero_stage=0)),
        "zero1": _fit(HybridParallelStrategy(zero_stage=1)),
        "zero3": _fit(HybridParallelStrategy(zero_stage=3, meta_init=False)),
        "fabric": _fabric(rank),
        "frozen/ddp": _fit(DDPStrategy(), frozen=True),
        "frozen/zero1": _fit(HybridParallelStrategy(zero_stage=1), frozen=True),
    }


def test_adalora_equals_ddp_at_zero0_and_is_refused_at_zero_1_to_3() -> None:
    out = run_distributed(_runs, WORLD, init_group=False, timeout=300)[0]
    ddp, zero0 = out["ddp"], out["zero0"]
    assert len(ddp["patterns"]) == STEPS and any(not all(v) for v in ddp["patterns"][-1].values())
    assert zero0["patterns"] == ddp["patterns"]  # the same ranks pruned
    torch.testing.assert_close(zero0["losses"], ddp["losses"])
    assert zero0["state"].keys() == ddp["state"].keys()
    for name, value in ddp["state"].items():
        torch.testing.assert_close(zero0["state"][name], value, msg=name)
    frozen = out["frozen/zero1"]
    assert "error" not in frozen, frozen
    for name, value in out["frozen/ddp"]["state"].items():
        torch.testing.assert_close(frozen["state"][name], value, msg=f"frozen: {name}")
    for key, stage in (("zero1", 1), ("zero3", 3), ("fabric", 2)):
        message = out[key] if key == "fabric" else out[key].get("error", "")
        assert f"AdaLoRA adapter(s) ['default'] at ZeRO stage {stage}" in message, (key, message)
        assert "update_and_allocate" in message and "zero_stage=0" in message, (key, message)
