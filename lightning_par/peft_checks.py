"""PEFT adapters a layout cannot train, refused at setup, naming the fix.

ZeRO 1-3: adapters whose training reads ``param.grad`` outside the step.

AdaLoRA prunes its ranks by importance scores: ``model.base_model.update_and_allocate(step)``, which
PEFT asks users to call after each optimizer step, multiplies every ``lora_A`` / ``lora_B`` / ``lora_E``
by its ``param.grad``. At ZeRO stages 1-3 the gradients live in each rank's shards and ``param.grad``
is None, so that call failed inside PEFT with ``unsupported operand type(s) for *: 'Parameter' and
'NoneType'`` after the first step (and at ZeRO-3 its masking writes would meet sharded placeholders).
Training AdaLoRA without that call is plain LoRA with an SVD-shaped update, so the adapter is refused
before anything runs, naming the fix. The check reads PEFT's configs from the modules (``peft_config``
dicts), without importing PEFT.

Tensor parallelism: prefix tuning hands every attention layer virtual keys and values of all its heads
(PEFT's ``past_key_values``), while each tp rank's attention holds ``1/t`` of them; it failed inside
transformers' cache with a size mismatch. Prompt tuning and P-tuning prepend embeddings and work.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def peft_configs(root: nn.Module) -> dict[str, Any]:
    """Each PEFT adapter's config by name, from the PEFT models and tuners inside ``root``."""
    found: dict[str, Any] = {}
    for m in root.modules():
        configs = getattr(m, "peft_config", None)
        if isinstance(configs, dict):
            for adapter, config in configs.items():
                found.setdefault(str(adapter), config)
    return found


def _adapters_of(module: nn.Module, peft_type: str) -> list[str]:
    return [
        name
        for name, config in peft_configs(module).items()
        if getattr(getattr(config, "peft_type", None), "value", None) == peft_type
    ]


def refuse_grad_reading_adapters(module: nn.Module, *, zero_stage: int) -> None:
    """Raise ``ValueError`` if ``module`` holds a PEFT AdaLoRA adapter and ``zero_stage`` is 1-3."""
    if zero_stage < 1:
        return
    # only adapters that train: a frozen one (PeftModel.from_pretrained's default) allocates nothing
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    adalora = [a for a in _adapters_of(module, "ADALORA") if any(f"lora_E.{a}" in n for n in trainable)]
    if adalora:
        raise ValueError(
            f"PEFT AdaLoRA adapter(s) {adalora} at ZeRO stage {zero_stage}: AdaLoRA's"
            " update_and_allocate() scores its ranks from param.grad of the lora_A/lora_B/lora_E"
            " parameters after the backward, and at ZeRO stages 1-3 param.grad is None (the gradients"
            " live in each rank's shards), so it cannot run. Train AdaLoRA with zero_stage=0 (param.grad"
            " then holds the averaged gradient, as under DDP), or use a LoRA adapter (LoraConfig) at ZeRO"
            " 1-3."
        )


def refuse_prefix_tuning(module: nn.Module, *, tp_size: int) -> None:
    """Raise ``ValueError`` if ``module`` holds a PEFT prefix-tuning adapter and ``tp_size`` > 1."""
    prefix = _adapters_of(module, "PREFIX_TUNING") if tp_size > 1 else []
    if prefix:
        raise ValueError(
            f"PEFT prefix tuning {prefix} under tensor parallelism (tensor_parallel_size={tp_size}): its"
            " virtual keys and values hold every attention head, while each tensor-parallel rank's"
            f" attention holds 1/{tp_size} of them. Train it with tensor_parallel_size=1 (ZeRO shards it),"
            " or use prompt tuning or P-tuning (PromptTuningConfig, PromptEncoderConfig), which work"
            " under tensor parallelism."
        )


__all__ = ["peft_configs", "refuse_grad_reading_adapters", "refuse_prefix_tuning"]
