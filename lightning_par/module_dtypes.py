"""Dtype changes the precision plugin makes to a user's module, and their undoing at teardown: norm layers
computing in fp32 where their parameters are 16-bit (:func:`compute_in_fp32`), spectral normalisation's
power iteration in fp32 beside its fp32 ``u`` / ``v`` buffers (:func:`spectral_norms_in_fp32`), both
undone by :func:`restore_norms`; frozen parameters stored in the plugin's frozen dtype
(:func:`cast_frozen`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.parametrizations import _SpectralNorm
from torch.nn.utils.spectral_norm import SpectralNorm

_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)


def is_norm(module: nn.Module) -> bool:
    """A norm layer whose statistics want fp32: torch's LayerNorm, GroupNorm and BatchNorm, and any module
    whose class name ends in ``RMSNorm`` (Hugging Face's, litgpt's and torch's own)."""
    return isinstance(module, _NORMS) or type(module).__name__.lower().endswith("rmsnorm")


def compute_in_fp32(module: nn.Module) -> None:
    """Run ``module``'s forward on fp32 copies of its inputs and parameters, cast back on the way out.

    The copies are made by a differentiable cast and put in the module's parameter slots for the call: the
    graph keeps the copies and the gradients flow back through the cast to the parameters. (Swapping
    ``p.data`` for the call instead left the graph holding the parameters themselves, whose storage was
    16-bit again by the backward: BatchNorm's and GroupNorm's backward refused it, "mixed dtype".)"""
    if _FP32_ATTR in module.__dict__:
        return
    previous = module.__dict__.get("forward")  # an instance forward of its own (kept for the restore)
    inner = module.forward
    slots = module._parameters

    def forward(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if x.dtype == torch.float32 and all(p is None or p.dtype == torch.float32 for p in slots.values()):
            return inner(x, *args, **kwargs)
        saved = dict(slots)
        with torch.autocast(x.device.type, enabled=False):
            try:
                for name, p in saved.items():
                    if p is not None and p.is_floating_point():
                        slots[name] = p.float()  # type: ignore[assignment]
                out = inner(x.float(), *args, **kwargs)
            finally:
                slots.update(saved)
        return out.to(x.dtype)

    module.forward = forward
    setattr(module, _FP32_ATTR, (previous,))


_FP32_ATTR = "_lightning_par_fp32"  # on a module compute_in_fp32 changed: (its own instance forward,)


def spectral_norms_in_fp32(module: nn.Module) -> None:
    """Run every spectral normalisation in ``module`` in fp32, both of torch's forms: the parametrization
    (``parametrizations.spectral_norm``: its ``_SpectralNorm`` module through :func:`compute_in_fp32`) and
    the hook (``utils.spectral_norm``: its pre-hook replaced by :class:`_Fp32SpectralNorm`). Its power
    iteration multiplies the weight by the ``u`` / ``v`` buffers, which stay fp32 while the engine makes
    the weight a 16-bit compute copy; torch's ``mv`` refuses the mix outside autocast (CPU autocast does not
    cover it): "addmv input tensors must have the same dtype". In fp32, as under ``"ddp"``'s mixed
    precision, whose parameters stay fp32."""
    for m in module.modules():
        if isinstance(m, _SpectralNorm):
            compute_in_fp32(m)
        for key, hook in list(m._forward_pre_hooks.items()):
            if type(hook) is SpectralNorm:
                m._forward_pre_hooks[key] = _Fp32SpectralNorm(hook)


class _Fp32SpectralNorm(SpectralNorm):
    """torch's spectral-norm pre-hook, computing the normalised weight from an fp32 (differentiable) cast
    of ``<name>_orig`` and handing the module the weight in ``<name>_orig``'s dtype. A ``SpectralNorm``
    with the hook's settings, so ``remove_spectral_norm`` still finds it."""

    def __init__(self, inner: SpectralNorm) -> None:
        self.__dict__.update(inner.__dict__)
        self.inner = inner

    def __call__(self, module: nn.Module, inputs: Any) -> None:
        slots, key = module._parameters, self.name + "_orig"
        original = slots[key]
        if original is None or original.dtype == torch.float32:
            return self.inner(module, inputs)
        try:
            slots[key] = original.float()  # type: ignore[assignment]
            self.inner(module, inputs)
        finally:
            slots[key] = original
        setattr(module, self.name, getattr(module, self.name).to(original.dtype))
        return None


def restore_norms(module: nn.Module) -> None:
    """Undo :func:`compute_in_fp32` in ``module`` (the strategy's teardown): each norm layer's forward is
    its class's again (or the instance forward it had), so the model after ``fit`` is the user's as it
    was (before, the wrapper stayed: ``torch.save(model)`` failed, "Can't pickle local object")."""
    for m in module.modules():
        for key, hook in list(m._forward_pre_hooks.items()):
            if isinstance(hook, _Fp32SpectralNorm):
                m._forward_pre_hooks[key] = hook.inner
        saved = m.__dict__.pop(_FP32_ATTR, None)
        if saved is None:
            continue
        (previous,) = saved
        if previous is None:
            m.__dict__.pop("forward", None)
        else:
            m.forward = previous


def cast_frozen(module: nn.Module, dtype: torch.dtype | None) -> None:
    """Frozen floating parameters (the engine casts the trainable ones) are stored in ``dtype`` (None:
    left as they are; see ``ParallelPrecision.frozen_storage_dtype``)."""
    if dtype is None:
        return
    for p in module.parameters():
        if not p.requires_grad and p.is_floating_point() and not p.is_meta:
            p.data = p.data.to(dtype)
