"""PEFT LoRA adapters initialised on the meta device as PEFT initialises them (used by
:mod:`lightning_par.zero.meta_init` after a unit's modules ran their own initialisers)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_par.peft_checks import peft_configs

# PEFT's initialisations of an adapter that read the base layer's weights or data (PiSSA, CorDA, OLoRA,
# MiCA, LoftQ, orthogonal, LoRA-GA): not there on the meta device
_BASE_READING = ("pissa", "corda", "olora", "mica", "loftq", "orthogonal", "lora_ga")


def reset_lora(root: nn.Module, initialised: set[int], *, reseed: Callable[[str], None]) -> None:
    """PEFT LoRA layers whose adapter weights were just initialised, as PEFT's ``update_layer`` does for
    the adapter's ``init_lora_weights`` (each adapter after ``reseed`` with the path of its ``lora_A``
    layer): ``True`` (and EVA's start) A as nn.Linear and B zero (``"gaussian"``'s A is the recorded
    write, replayed after); ``False`` both layers' own nn.Linear init (before: B zeroed, A drawn by the
    enclosing model's ``_init_weights``); an init that reads the base weights is refused (before: PiSSA
    silently became the default)."""
    configs = peft_configs(root)
    for name, m in root.named_modules():
        reset = getattr(m, "reset_lora_parameters", None)
        lora_a, lora_b = getattr(m, "lora_A", None), getattr(m, "lora_B", None)
        if not callable(reset) or not isinstance(lora_a, nn.ModuleDict):
            continue
        prefix = f"{name}." if name else ""
        for adapter, layer in lora_a.items():
            fresh = [  # the adapter's layers initialised in this unit
                (f"{prefix}{kind}.{adapter}", own)
                for kind, own in (("lora_A", layer), ("lora_B", _get(lora_b, adapter)))
                if own is not None and any(id(p) in initialised for p in own.parameters())
            ]
            if not fresh:
                continue
            init = getattr(configs.get(adapter), "init_lora_weights", True)
            if isinstance(init, str) and init.lower().startswith(_BASE_READING):
                raise ValueError(
                    f"PEFT adapter {adapter!r} of {name or '<root>'!r} is initialised with"
                    f" init_lora_weights={init!r}, which reads the base layer's weights (or data); built on"
                    " the meta device (ZeRO-3's meta init) they are not there, so the adapter would start"
                    " from another init. Build the model with meta_init=False, or load the adapter's"
                    " weights (pretrained=, or load_state_dict in configure_model())."
                )
            if init is False:  # each layer's own nn.Linear init (not the enclosing model's _init_weights)
                for path, own in fresh:
                    if callable(getattr(own, "reset_parameters", None)):
                        reseed(path)
                        own.reset_parameters()  # type: ignore[operator]
                continue
            if fresh[0][1] is layer:
                reseed(f"{prefix}lora_A.{adapter}")
                reset(adapter, True)


def _get(layers: Any, key: str) -> nn.Module | None:
    return layers[key] if isinstance(layers, nn.ModuleDict) and key in layers else None
