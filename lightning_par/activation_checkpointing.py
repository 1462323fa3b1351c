"""Activation checkpointing per layer: keep only each layer's inputs, recompute its inside in backward.

``apply_activation_checkpointing(module, policy=None)`` wraps the ``forward`` of every module the policy
selects (by default each child of an ``nn.ModuleList``, i.e. each transformer block; or module classes /
``fnmatch`` name patterns, as for ZeRO-3 units) in ``torch.utils.checkpoint`` with
``use_reentrant=False``, the kind that composes with gradient hooks: memory for activations drops from
all of a block's intermediates to its input, for one extra forward of the block in backward. Module
hooks still run around the outer call (ZeRO-3 gathers there); the recomputation calls the original
``forward`` directly.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_par.zero.units import UnitPolicy, match_modules


def apply_activation_checkpointing(module: nn.Module, *, policy: UnitPolicy = None) -> list[str]:
    """Checkpoint the modules ``policy`` selects; returns their names (idempotent)."""
    modules = dict(module.named_modules())
    names = match_modules(module, policy)
    for name in names:
        target = modules[name]
        if getattr(target, "_lightning_par_checkpointed", False):
            continue
        inner = target.forward

        @functools.wraps(inner)
        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        target.forward = forward
        target._lightning_par_checkpointed = True
    return names
