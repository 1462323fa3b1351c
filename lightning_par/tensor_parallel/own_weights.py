"""Tensor parallelism slices a layer's own weight parameters: a weight computed from other tensors is refused.

Why
---
torch's reparametrisations replace a layer's ``weight`` parameter with a tensor computed before each
forward from others: ``torch.nn.utils.prune`` (``weight_orig * weight_mask``), the hook forms of
``weight_norm`` (``g * v / ||v||``) and ``spectral_norm``, and ``torch.nn.utils.parametrize`` (with
``parametrizations.weight_norm``, ``orthogonal``, ...). At tp > 1, before:

* such a layer named by the plan was sliced from its computed weight, and the hooks computing it were
  carried to the slice without their tensors: pruning and ``weight_norm`` failed in the first forward
  ("'ColumnParallelLinear' object has no attribute 'weight_mask'"), and a parametrization was dropped
  without a word (the slice trained a plain weight; the export's names changed);
* pruning a tensor-parallel layer during the fit ranked each rank's slice on its own, a mask unlike the
  whole model's, and the export held one slice's mask beside the whole weight.

How
---
:func:`refuse_derived` refuses such a layer at the conversion, :func:`check_own` (called first in each
tensor-parallel layer's forward: two dict lookups) a slice reparametrised later, before it computes
anything. Both name the tensor, what computes it and how to make it permanent.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn.utils import parametrize, prune

__all__ = ["check_own", "refuse_derived"]

_TENSORS = ("weight", "bias")


def _computed(module: nn.Module) -> tuple[str, str, str] | None:
    """The first of ``weight`` / ``bias`` that ``module`` computes instead of holding as a parameter,
    what computes it, and the call that makes it a plain parameter again; None when it holds both."""
    name = next(
        (n for n in _TENSORS if n not in module._parameters and isinstance(getattr(module, n, None), Tensor)),
        None,
    )
    if name is None:
        return None
    hooks = list(module._forward_pre_hooks.values())
    if parametrize.is_parametrized(module, name):
        how, fix = (
            "torch.nn.utils.parametrize",
            f"torch.nn.utils.parametrize.remove_parametrizations(module, {name!r})",
        )
    elif any(isinstance(h, prune.BasePruningMethod) for h in hooks):
        how, fix = "torch.nn.utils.prune", f"torch.nn.utils.prune.remove(module, {name!r})"
    elif f"{name}_g" in module._parameters:
        how, fix = "torch.nn.utils.weight_norm", "torch.nn.utils.remove_weight_norm(module)"
    elif f"{name}_orig" in module._parameters:
        how, fix = "torch.nn.utils.spectral_norm", "torch.nn.utils.remove_spectral_norm(module)"
    else:
        how, fix = "a forward pre-hook", f"register {name!r} as a parameter of the module"
    return name, how, fix


def refuse_derived(module: nn.Module, *, name: str) -> None:
    """Refuse converting ``module`` (the plan's ``name``) when its weight or bias is computed."""
    found = _computed(module)
    if found is None:
        return
    tensor, how, fix = found
    raise ValueError(
        f"tp_plan converts {name or type(module).__name__!r}, whose {tensor} is computed before each"
        f" forward by {how}: tensor parallelism slices a layer's own parameters, so the slice would lose"
        f" that computation. Make it permanent before the fit ({fix}), leave the module out of tp_plan,"
        " or use tensor_parallel_size=1 (ZeRO keeps such layers whole)."
    )


def check_own(layer: nn.Module) -> None:
    """Refuse a tensor-parallel ``layer`` whose weight or bias was reparametrised after the conversion."""
    found = _computed(layer)
    if found is None:
        return
    tensor, how, fix = found
    raise RuntimeError(
        f"A tensor-parallel {type(layer).__name__} had its {tensor} reparametrised by {how} after the"
        " conversion: each rank holds a slice of it, so pruning would rank each slice on its own (a mask"
        " unlike the whole model's) and exports would hold one slice's mask. Prune or reparametrise the"
        f" model before the fit and make it permanent ({fix}), or prune during the fit without tensor"
        " parallelism (ZeRO keeps the layers whole)."
    )
