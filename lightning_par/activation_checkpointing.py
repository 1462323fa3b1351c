"""Activation checkpointing per layer: keep only each layer's inputs, recompute its inside in backward.

``apply_activation_checkpointing(module, policy=None)`` wraps the ``forward`` of every module the policy
selects (by default each child of an ``nn.ModuleList``, i.e. each transformer block; or module classes /
``fnmatch`` name patterns, as for ZeRO-3 units) in ``torch.utils.checkpoint`` with
``use_reentrant=False``, the kind that composes with gradient hooks: memory for activations drops from
all of a block's intermediates to its input, for one extra forward of the block in backward. Module
hooks still run around the outer call (ZeRO-3 gathers there); the recomputation calls the original
``forward`` directly.

A key/value cache handed to a checkpointed layer (a Hugging Face decoder layer called with the model's
default ``use_cache=True``) would take the layer's keys and values twice, the recomputation appending
them again, and the backward would fail on mismatched sizes (or, with a cache of fixed size, compute
gradients against other keys). While training with gradients on, the wrapper calls the layer without it
(``use_cache=False``, the cache argument ``None``), as Hugging Face's own gradient checkpointing does,
unless the layer declares that it only reads the cache (``_can_checkpoint_with_cache``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_par.zero.units import UnitPolicy, match_modules

log = logging.getLogger(__name__)
_CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past")  # names across model families


def apply_activation_checkpointing(module: nn.Module, *, policy: UnitPolicy = None) -> list[str]:
    """Checkpoint the modules ``policy`` selects; returns their names (idempotent)."""
    modules = dict(module.named_modules())
    names = match_modules(module, policy)
    warned: set[str] = set()  # layer classes whose cache was left out, warned about once
    for name in names:
        target = modules[name]
        if getattr(target, "_lightning_par_checkpointed", False):
            continue
        inner = target.forward

        @functools.wraps(inner)
        def forward(*args: Any, _inner: Any = inner, _target: nn.Module = target, **kwargs: Any) -> Any:
            if _target.training and torch.is_grad_enabled():
                kwargs = _without_cache(_target, kwargs, warned)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        target.forward = forward
        target._lightning_par_checkpointed = True
    return names


def _without_cache(layer: nn.Module, kwargs: dict[str, Any], warned: set[str]) -> dict[str, Any]:
    """``kwargs`` without a key/value cache for a checkpointed layer's training call (module docstring):
    ``use_cache`` False, and a cache argument that holds one (an object with ``get_seq_length``, the
    Hugging Face cache API; or a tuple of tensors, the older form) ``None``. Warns once per layer class
    of one model (``warned``)."""
    if getattr(layer, "_can_checkpoint_with_cache", False):
        return kwargs
    dropped = [name for name in _CACHE_ARGS if _is_cache(kwargs.get(name))]
    caching = bool(kwargs.get("use_cache"))
    if not dropped and not caching:
        return kwargs
    kind = type(layer).__name__
    if kind not in warned:
        warned.add(kind)
        log.warning(
            "Activation checkpointing of %s: its key/value cache is left out while training"
            " (use_cache=False), since the recomputation in backward would append the keys and values again.",
            kind,
        )
    return {**kwargs, **dict.fromkeys(dropped), **({"use_cache": False} if "use_cache" in kwargs else {})}


def _is_cache(value: Any) -> bool:
    if value is None:
        return False
    if callable(getattr(value, "get_seq_length", None)):
        return True
    return (
        isinstance(value, tuple) and bool(value) and all(isinstance(v, (torch.Tensor, tuple)) for v in value)
    )
