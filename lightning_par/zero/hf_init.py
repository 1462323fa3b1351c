"""Hugging Face models materialised from the meta device get their own initialisation, not torch's.

A ``transformers.PreTrainedModel`` built on a real device is initialised twice: each torch layer's
constructor runs its ``reset_parameters()``, then the model's ``post_init()`` applies the model's
``_init_weights(module)`` to every module, children before parents, each module with the nearest model
above it (a composite model dispatches its sub-models' own). That second pass is what the model's authors
chose: ``N(0, initializer_range)`` for linear layers and embeddings (torch's default embedding is
``N(0, 1)``, 50 times wider at GPT-2's 0.02), ones for RMSNorm (which has no ``reset_parameters()``),
GPT-2's residual projections scaled by ``1 / sqrt(2 n_layer)`` from their parent attention or MLP module,
T5's shared table set from the model itself. On the meta device both passes run on tensors without
storage, so ZeRO-3, materialising one unit's parameters at a time, replays them on that unit.

:func:`hf_initialisers` lists the second pass's calls for a unit: every module inside a Hugging Face model
whose subtree holds one of the unit's parameters, in ``post_init()``'s order. :func:`replay` runs them
with every other real parameter below the called module (those of units materialised, and sharded,
before) replaced by a meta stand-in for the duration of the call, so a parent spanning several units
writes only this unit's parameters; on meta tensors the init functions do nothing. Buffers are left
visible: those the models' inits write (rotary tables, BatchNorm statistics) get values that do not
depend on the random state.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

Initialiser = Callable[[nn.Module], None]


def pretrained_model_class() -> type | None:
    """``transformers.PreTrainedModel`` if ``transformers`` is imported (a Hugging Face model is an
    instance of it only then); never imports it."""
    module = sys.modules.get("transformers")
    found = getattr(module, "PreTrainedModel", None) if module is not None else None
    return found if isinstance(found, type) else None


def hf_initialisers(
    root: nn.Module, unit: set[int], *, buffers: set[int] | None = None
) -> list[tuple[str, nn.Module, Initialiser]]:
    """``(path, module, model._init_weights)`` in ``post_init()``'s order (children first) for the modules
    of ``root`` inside a Hugging Face model whose subtree holds a parameter whose id is in ``unit`` (or a
    buffer whose id is in ``buffers``). Empty without Hugging Face models."""
    base = pretrained_model_class()
    buffers = buffers or set()
    if base is None or not (unit or buffers):
        return []
    calls: list[tuple[str, nn.Module, Initialiser]] = []

    def visit(path: str, module: nn.Module, init: Initialiser | None) -> None:
        if isinstance(module, base):
            init = getattr(module, "_init_weights")  # noqa: B009  (nn.Module's __getattr__ types it wrongly)
        for name, child in module.named_children():
            visit(f"{path}.{name}" if path else name, child, init)
        held = any(id(p) in unit for p in module.parameters())
        if init is not None and (held or any(id(b) in buffers for b in module.buffers())):
            calls.append((path, module, init))

    visit("", root, None)
    return calls


def replay(
    calls: Sequence[tuple[str, nn.Module, Initialiser]], unit: set[int], *, reseed: Callable[[str], None]
) -> None:
    """Run ``calls``, each after ``reseed(path)`` and seeing as real only the parameters whose ids are in
    ``unit`` (module docstring)."""
    for path, module, init in calls:
        reseed(path)
        with others_on_meta(module, unit):
            init(module)


@contextmanager
def others_on_meta(module: nn.Module, unit: set[int]) -> Iterator[None]:
    """Within: the real parameters below ``module`` outside ``unit`` are meta stand-ins; restored after."""
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    try:
        for m in module.modules():
            for attr, p in m._parameters.items():
                if p is not None and not p.is_meta and id(p) not in unit:
                    swapped.append((m, attr, p))
                    stand_in = torch.empty(p.shape, dtype=p.dtype, device="meta")  # reads no storage
                    m._parameters[attr] = nn.Parameter(stand_in, requires_grad=p.requires_grad)
        yield
    finally:
        for m, attr, p in swapped:
            m._parameters[attr] = p
