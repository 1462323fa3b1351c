"""Weights a user's ``configure_model()`` loads while its parameters are created on the meta device.

Under meta init (ZeRO-3, or ``pretrained=``) ``configure_model()`` runs inside
:func:`~lightning_par.zero.meta_build.params_on_meta`: every parameter it creates is a meta tensor, filled
later, unit by unit, by the engine. Code that loads values into the model there, as it would on a real
device, wrote into meta tensors, which keep nothing: ``model.load_state_dict(torch.load(...))``,
``PeftModel.from_pretrained(base, adapter_dir)`` (PEFT's ``load_state_dict``), a ``param.copy_(x)`` or
``param.data.copy_(x)`` (pretrained word vectors into an embedding, the classic way), or
a ``load_state_dict(..., assign=True)`` (whose new parameters the meta context turned back into meta
tensors). The engine then initialised those parameters afresh, silently: a LoRA adapter loaded so was
0.33 away from the file at ZeRO-3 (measured), a whole Llama loaded so 0.13.

:class:`MetaLoads` records such values while ``configure_model()`` runs: the write recorder of
:func:`params_on_meta` (:mod:`lightning_par.zero.meta_writes`) reports every whole ``Tensor.copy_`` into
a meta parameter (or into its ``.data``) from a real tensor, and a real parameter that replaces an
existing one (an assignment of values, where construction registers each parameter once). Writes made
after a load (a head re-initialised) are replayed after it. :meth:`MetaLoads.by_name` gives them by parameter
name afterwards; the strategy loads them as it loads ``pretrained=`` weights, into this rank's shards and
slices. Values are kept as CPU copies until then (what the user's code held anyway).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class MetaLoads:
    """Values loaded into meta parameters (see the module docstring), by parameter object."""

    def __init__(self) -> None:
        self._values: dict[int, tuple[nn.Parameter, Tensor]] = {}

    def record(self, param: nn.Parameter, source: Tensor) -> None:
        """``param`` (a meta parameter) takes ``source``'s values (broadcast to its shape, as ``copy_``)."""
        value = torch.broadcast_to(source.detach(), param.shape).to("cpu", copy=True)
        self._values[id(param)] = (param, value)

    def copied(self, source: nn.Parameter, copy: nn.Parameter) -> None:
        """``copy``, a deep copy of the meta parameter ``source``, holds what was loaded into it."""
        held = self._values.get(id(source))
        if held is not None and held[0] is source and copy is not source:
            self._values[id(copy)] = (copy, held[1])

    def __len__(self) -> int:
        return len(self._values)

    def by_name(self, module: nn.Module) -> dict[str, Tensor]:
        """The recorded values of ``module``'s parameters that are still meta, by every name they have
        (tied parameters under each); parameters no longer in the module are left out."""
        out: dict[str, Tensor] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            held = self._values.get(id(param))
            if held is not None and held[0] is param and param.is_meta:
                out[name] = held[1]
        return out
