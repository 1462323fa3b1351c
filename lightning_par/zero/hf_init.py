"""Hugging Face models materialised from the meta device get their own initialisation, not torch's.

A ``transformers.PreTrainedModel`` built on a real device is initialised twice: each torch layer's
constructor runs its ``reset_parameters()``, then the model's ``post_init()`` applies the model's
``_init_weights(module)`` to every module, children before parents, each module with the nearest model
above it (a composite model dispatches its sub-models' own). That second pass is what the model's authors
chose: ``N(0, initializer_range)`` for linear layers and embeddings (torch's default embedding is
``N(0, 1)``, 50 times wider at GPT-2's 0.02), ones for RMSNorm (which has no ``reset_parameters()``),
GPT-2's residual projections scaled by ``1 / sqrt(2 n_layer)`` from their parent attention or MLP module.
On the meta device both passes run on tensors without storage, so ZeRO-3, materialising a unit's
parameters later, must replay them: :func:`hf_initialisers` lists the second pass's calls for the
parameters being materialised.

A call is listed for a module whose subtree holds at least one of those parameters and whose parameters
are all still on the meta device, so no call writes a parameter materialised (and sharded) with an earlier
unit; on meta tensors the calls do nothing. A parent spanning several units (the model itself, a block
list) is therefore not called, which matters only for a model whose ``_init_weights`` sets a child's
parameter from such a parent; ``materialize_unit`` names any parameter left unset.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from torch import nn

Initialiser = Callable[[nn.Module], None]


def _pretrained_model_class() -> type | None:
    """``transformers.PreTrainedModel`` if ``transformers`` is imported (a Hugging Face model is an
    instance of it only then); never imports it."""
    module = sys.modules.get("transformers")
    found = getattr(module, "PreTrainedModel", None) if module is not None else None
    return found if isinstance(found, type) else None


def hf_initialisers(root: nn.Module, todo: set[int]) -> list[tuple[nn.Module, Initialiser]]:
    """``(module, model._init_weights)`` in ``post_init()``'s order (children first) for the modules of
    ``root`` inside a Hugging Face model that hold a parameter whose id is in ``todo`` (module
    docstring). Empty without Hugging Face models."""
    base = _pretrained_model_class()
    if base is None or not todo:
        return []
    calls: list[tuple[nn.Module, Initialiser]] = []

    def visit(module: nn.Module, init: Initialiser | None) -> None:
        if isinstance(module, base):
            init = getattr(module, "_init_weights")  # noqa: B009  (nn.Module's __getattr__ types it wrongly)
        for child in module.children():
            visit(child, init)
        if init is not None:
            params = list(module.parameters())
            if any(id(p) in todo for p in params) and all(p.is_meta for p in params):
                calls.append((module, init))

    visit(root, None)
    return calls
