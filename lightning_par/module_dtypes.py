"""Dtype changes the precision plugin makes to a user's module, and their undoing at teardown: norm layers
computing in fp32 where their parameters are 16-bit (:func:`compute_in_fp32`), spectral normalisation's
power iteration in fp32 beside its fp32 ``u`` / ``v`` buffers (:func:`spectral_norms_in_fp32`),
parametrizations from fp32 originals (:func:`parametrizations_in_fp32`), all undone by
:func:`restore_norms`; frozen parameters stored in the plugin's frozen dtype
(:func:`cast_frozen`)."""

from __future__ import annotations

import functools
import re
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.parametrizations import _SpectralNorm
from torch.nn.utils.parametrize import ParametrizationList
from torch.nn.utils.spectral_norm import SpectralNorm

_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)
# torch layers whose op CPU autocast leaves alone, mixing the weight with the inputs' dtype
_UNCAST = (nn.Bilinear, nn.EmbeddingBag)


def is_norm(module: nn.Module) -> bool:
    """A norm layer whose statistics want fp32: torch's LayerNorm, GroupNorm, BatchNorm and InstanceNorm,
    and any module whose class name ends in ``RMSNorm`` or ``LayerNorm`` (Hugging Face's, litgpt's and
    torch's own RMS norms; ConvNeXt's channels-first ``ConvNextLayerNorm``, which upcasts its input) and
    holds no submodules (an adaptive norm computing its scale with linear layers would feed them fp32
    inputs outside autocast)."""
    name = type(module).__name__.lower()
    named = name.endswith(("rmsnorm", "layernorm")) and next(module.children(), None) is None
    return isinstance(module, _NORMS) or named


def compute_in_fp32(module: nn.Module) -> None:
    """Run ``module``'s forward on fp32 copies of its floating inputs and parameters; the output goes back
    to the first floating input's dtype (kept fp32 without one, as an integer-indexed ``EmbeddingBag``).

    The copies are made by a differentiable cast and put in the module's parameter slots for the call: the
    graph keeps the copies and the gradients flow back through the cast to the parameters. (Swapping
    ``p.data`` for the call instead left the graph holding the parameters themselves, whose storage was
    16-bit again by the backward: BatchNorm's and GroupNorm's backward refused it, "mixed dtype".) The
    wrapper is a module-level function partially applied to ``module``, reading everything from it when
    called, so a deep copy of the model (an EMA) computes with its own parameters (before, a closure over
    the original: the copy's norm layers ran the live model's weights, silently), and a pickled copy loads
    (a bound method of another name would not). The module's floating buffers (a norm's running
    statistics) are kept in fp32, the dtype it computes in (under ``"bf16-true"`` without masters the
    module was cast whole: BatchNorm then failed, "expected scalar type Float but found BFloat16")."""
    if _FP32_ATTR in module.__dict__:
        return
    previous = module.__dict__.get("forward")  # an instance forward of its own (kept for the restore)
    setattr(module, _FP32_ATTR, (previous,))
    module.forward = functools.partial(_fp32_forward, module)
    _cast_own_buffers(module, torch.float32)


def _cast_own_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    """``module``'s own floating buffers (not its children's) in ``dtype``; meta ones are left to be built."""
    for name, buffer in module._buffers.items():
        if buffer is not None and buffer.is_floating_point() and not buffer.is_meta:
            module._buffers[name] = buffer.to(dtype)


def _fp32_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    (previous,) = self.__dict__[_FP32_ATTR]
    inner = previous if previous is not None else types.MethodType(type(self).forward, self)
    slots = self._parameters
    floats = [t for t in (*args, *kwargs.values()) if isinstance(t, Tensor) and t.is_floating_point()]
    if all(t.dtype == torch.float32 for t in floats) and all(
        p is None or not p.is_floating_point() or p.dtype == torch.float32 for p in slots.values()
    ):
        return inner(*args, **kwargs)
    wide = [t.float() if isinstance(t, Tensor) and t.is_floating_point() else t for t in args]
    wide_kw = {
        k: v.float() if isinstance(v, Tensor) and v.is_floating_point() else v for k, v in kwargs.items()
    }
    device = next((t.device for t in (*floats, *slots.values()) if t is not None), torch.device("cpu"))
    with torch.autocast(device.type, enabled=False), _fp32_slots(self):
        out = inner(*wide, **wide_kw)
    return out.to(floats[0].dtype) if floats and isinstance(out, Tensor) else out


@contextmanager
def _fp32_slots(module: nn.Module) -> Iterator[None]:
    """``module``'s own floating parameters replaced in its slots by differentiable fp32 casts for the
    duration (see :func:`compute_in_fp32`), put back after."""
    slots = module._parameters
    saved = dict(slots)
    try:
        for name, p in saved.items():
            if p is not None and p.is_floating_point() and p.dtype != torch.float32:
                slots[name] = p.float()  # type: ignore[assignment]
        yield
    finally:
        slots.update(saved)


_FP32_ATTR = "_lightning_par_fp32"  # on a module compute_in_fp32 changed: (its own instance forward,)


def autocast_gaps_in_fp32(module: nn.Module, *, mixed: bool) -> None:
    """Run in fp32 the parts of ``module`` that would mix a 16-bit weight with fp32 tensors outside
    autocast's reach: torch's ``Bilinear`` and ``EmbeddingBag`` (fp32 ``per_sample_weights``), through
    :func:`compute_in_fp32` (before, "All tensors must have the same dtype" where ``"ddp"`` trains), and
    spectral normalisation (:func:`spectral_norms_in_fp32`). In mixed precision (``mixed``) also every
    parametrization (:func:`parametrizations_in_fp32`)."""
    for m in module.modules():
        if isinstance(m, _UNCAST):
            compute_in_fp32(m)
    spectral_norms_in_fp32(module)
    if mixed:
        parametrizations_in_fp32(module)


def parametrizations_in_fp32(module: nn.Module) -> None:
    """Compute every parametrized tensor of ``module`` (``torch.nn.utils.parametrize``: ``weight_norm``,
    ``orthogonal``, a user's own) from fp32 casts of its originals, as under ``"ddp"``'s mixed precision,
    whose originals stay fp32; autocast is left as it is (the parametrization runs as under ``"ddp"``).
    From the 16-bit compute copies, torch's ``orthogonal`` (``matrix_exp``) gave NaN gradients and the
    others trained 1e-3 to 7e-2 off ``"ddp"``, silently; a read of the weight outside a step mixed the
    16-bit original with an fp32 buffer (``orthogonal``'s ``base``: "expected m1 and m2 to have the same
    dtype"). Spectral norm's parametrization, already run in fp32 by :func:`compute_in_fp32`, is left."""
    for m in module.modules():
        if isinstance(m, ParametrizationList) and _FP32_ATTR not in m.__dict__:
            setattr(m, _FP32_ATTR, (m.__dict__.get("forward"),))
            m.forward = functools.partial(_fp32_originals, m)  # type: ignore[method-assign]


def _fp32_originals(self: nn.Module) -> Any:
    (previous,) = self.__dict__[_FP32_ATTR]
    inner = previous if previous is not None else types.MethodType(type(self).forward, self)
    with _fp32_slots(self):
        return inner()


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


def cast_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    """``"bf16-true"`` with fp32 masters: floating buffers in ``dtype``, as Lightning's ``HalfPrecision``
    leaves them (the engine casts only the parameters; before, a float mask or running mean stayed fp32 and
    met the bf16 weights: "expected m1 and m2 to have the same dtype"). Those of norm layers computing in
    fp32 (:func:`compute_in_fp32`) stay fp32, their statistics' precision; meta buffers are left to be
    built."""
    for m in module.modules():
        if _FP32_ATTR not in m.__dict__:
            _cast_own_buffers(m, dtype)


def cast_frozen(module: nn.Module, dtype: torch.dtype | None) -> None:
    """Frozen floating parameters (the engine casts the trainable ones) are stored in ``dtype`` (None:
    left as they are; see ``ParallelPrecision.frozen_storage_dtype``)."""
    if dtype is None:
        return
    for p in module.parameters():
        if not p.requires_grad and p.is_floating_point() and not p.is_meta:
            p.data = p.data.to(dtype)


# torch's words for two operands of different floating dtypes (CPU and CUDA kernels, autograd)
_DTYPE_CLASH = re.compile(
    r"same dtype|same scalar type|same type as tensor|expected scalar type|mixed dtype|expected dtype"
    r"|should have same dtype|must have the same dtype|and (?:weight|bias) type"
)


@contextmanager
def explained_dtype_errors(
    *, enabled: bool, dtype: torch.dtype, precision: str, hook: str | None = None
) -> Iterator[None]:
    """Inside (a step's forward under a mixed precision with fp32 masters), a ``RuntimeError`` in torch's
    words for operands of two dtypes gets a note saying what may cause it here and what fixes it: the
    parameters a module computes with are ``dtype`` copies, where Lightning's ``"ddp"`` keeps fp32
    parameters under autocast, so an op autocast leaves alone (on the CPU ``mv``, ``lerp``, ``index_add_``,
    ``tensordot``, ``cross``, a custom norm's ``F.layer_norm`` of an upcast input, ...) may meet a 16-bit
    weight and an fp32 tensor (before, torch's message alone). ``hook``: inside that Lightning hook, which
    runs outside any autocast (a diffusion model sampled in ``on_validation_epoch_end``: every layer meets
    the fp32 input; an EMA's ``lerp_`` of its fp32 copy towards the weights). The exception is the same
    object, of the same type, with its traceback: a note (Python 3.11+; before that, the message is left
    as it is)."""
    if not enabled:
        yield
        return
    try:
        yield
    except RuntimeError as error:
        add_note = getattr(error, "add_note", None)
        noted = any(note.startswith(_NOTE) for note in getattr(error, "__notes__", ()))
        if add_note is None or noted or not _is_16_bit_clash(str(error), dtype):
            raise
        name = str(dtype).removeprefix("torch.")
        where = (
            f" and {hook} runs outside the step's autocast. Run the module there inside"
            " `with self.trainer.precision_plugin.forward_context():` (autocast, as in a step), or compute"
            " with the fp32 weights inside `with self.trainer.strategy.gathered_params(writeback=True):` on"
            " every rank (where an EMA's lerp_ towards them belongs too)"
            if hook is not None
            else " and this op is one autocast does not cast. Cast in the layer (the other operand to the"
            " weight's dtype, or the weight .float())"
        )
        add_note(
            f"{_NOTE}: if one of the operands is a module's weight: at ZeRO stages 1-3 with fp32 master"
            f" weights the parameters a module computes with are {name} copies (the masters stay in the"
            f" shards), where Lightning's 'ddp' keeps fp32 parameters{'' if hook else ' under autocast'},"
            f"{where}, or keep fp32 parameters as 'ddp' does:"
            f" plugins=[ParallelPrecision({precision!r}, master_weights=False)], at the memory of unsharded"
            " fp32 parameters and gradients."
        )
        raise


_NOTE = "lightning_par"
# how torch's messages name the 16-bit compute dtypes (c10's names, Python's)
_DTYPE_WORDS = {torch.bfloat16: ("BFloat16", "bfloat16"), torch.float16: ("Half", "float16")}


def _is_16_bit_clash(message: str, dtype: torch.dtype) -> bool:
    """Whether ``message`` is torch's for two dtypes, one of them ``dtype`` (or CPU's "mixed dtype", which
    names neither): a float against double, or a user's own "expected dtype" message, gets no note."""
    if not _DTYPE_CLASH.search(message):
        return False
    return "mixed dtype" in message or any(word in message for word in _DTYPE_WORDS.get(dtype, ()))
