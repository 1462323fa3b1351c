"""Writes a user's code makes into meta parameters while the model is built, replayed when ZeRO-3 fills them.

Under meta init (``configure_model()`` at ZeRO-3 or with ``pretrained=``, Fabric's
``init_module(empty_init=True)``) every parameter is a meta tensor: an in-place write keeps nothing. The
layers' own initialisers are run again when the engine gives each unit storage (their
``reset_parameters()``, a Hugging Face model's ``_init_weights``, PEFT's adapter init:
:mod:`lightning_par.zero.meta_init`), but a model's custom init was lost: nanoGPT's
``self.apply(self._init_weights)`` (``N(0, 0.02)`` weights, zero biases), a zero-initialised output
projection, a scaled residual projection. At ZeRO-3 such a model started from torch's defaults instead,
silently: its embedding 50 times wider (``N(0, 1)``), its zeroed head random (measured).

:class:`WriteRecorder`, a torch function mode active while the model is built, records every write into a
meta parameter or a view of one (``.data``, ``detach()``, indexing, ``view``, ``chunk``, ...): a tensor
method ending in ``_`` (``normal_``, ``zero_``, ``mul_``, ``copy_``), an in-place operator or
``__setitem__``, an ``out=`` argument, and torch's ``nn.init`` functions, seen as one call each (those
that skip meta tensors without dispatching, ``trunc_normal_``, ``orthogonal_``, ``dirac_`` and
``sparse_``, are wrapped by :func:`visible_init_functions` for the duration). Each write is marked
*standard* when it runs inside an initialiser that materialisation runs again (a module's
``reset_parameters()``, anything a Hugging Face model's methods do, its construction included, which its
replayed ``post_init()`` supersedes): the frames of the call tell. A parameter created with values, which
the meta context turns into a meta tensor, is recorded as a write of them (:meth:`WriteRecorder.created`):
nanoGPT's ``LayerNorm`` (``nn.Parameter(torch.ones(d))``, a constant: ``fill_``),
``nn.Embedding.from_pretrained(vectors)`` (by reference, not copied); a write that overwrites the whole
parameter lets the earlier ones go, so a layer's ``torch.empty`` weight is not held once its
``reset_parameters()`` has run. The parameter keeps its :class:`Writes` (attribute ``WRITES_ATTR``) until
it is materialised.

:func:`~lightning_par.zero.meta_replay.replay_writes` then runs, on the real parameter after its standard
init, the writes made after the last standard one: what the user's code did to it once the layers had
initialised it (earlier custom writes were overwritten by a later standard init, as on a real device). A
parameter loaded in ``configure_model()`` (:mod:`lightning_par.zero.meta_loads`) replays every write made
after the load (a head re-initialised after ``load_state_dict``). Random writes are drawn under a seed of
the run's seed and the parameter's name, the same on every rank and for any layout, so a sharded model
equals its unsharded twin; like the layers' own init, the values are not those of the user's global
generator. A write that reads another meta tensor (one parameter copied into another) has nothing to
replay and is refused, naming the parameter and the fixes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_par.zero.hf_init import pretrained_model_class

WRITES_ATTR = "_lp_meta_writes"

# compared with ==: each access makes a new method-wrapper
_DATA_GET = torch.Tensor.data.__get__  # type: ignore[attr-defined]
# tensor methods ending in "_" that change no values
_NOT_WRITES = frozenset(
    {
        "requires_grad_", "share_memory_", "detach_", "retain_grad", "resize_", "resize_as_", "set_",
        "as_strided_", "squeeze_", "unsqueeze_", "t_", "transpose_", "swapdims_", "swapaxes_", "rename_",
    }
)  # fmt: skip
_INPLACE_DUNDERS = frozenset(
    {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__ipow__"}
)
# tensor methods that set every element whatever it held (``copy_`` broadcasts its source)
_OVERWRITES = frozenset(
    {"normal_", "uniform_", "fill_", "zero_", "copy_", "random_", "bernoulli_", "exponential_",
     "geometric_", "log_normal_", "cauchy_"}
)  # fmt: skip
# torch.nn.init functions that return early on a meta tensor without dispatching to torch function modes
_SILENT_ON_META = ("trunc_normal_", "orthogonal_", "dirac_", "sparse_")
# initialisers that materialisation runs again, by frame name
# (not PEFT's reset_lora_parameters(): materialisation re-runs it with the default init only, its
# recorded writes keep the adapter's own, init_lora_weights="gaussian")
_RERUN = frozenset({"reset_parameters"})
# functions that initialise weights by convention (torch's layers, transformers' models, nanoGPT and
# litgpt scripts): a whole copy of real values made inside one is an init (Whisper's sinusoidal position
# table), not a load of weights
_INITIALISERS = frozenset(
    {
        "reset_parameters",
        "_init_weights",
        "init_weights",
        "initialize_weights",
        "_initialize_weights",
        "post_init",
    }
)
_TRANSFORMERS = f"{os.sep}transformers{os.sep}"  # in the path of transformers' own source files


class _Self:
    """Where the written tensor goes in a recorded call's arguments."""

    def __repr__(self) -> str:
        return "<written tensor>"


WRITTEN = _Self()  # the recorded calls' stand-in for the tensor they write


@dataclass(frozen=True)
class Step:
    """A view taken on the way from the parameter to the written tensor: ``func(tensor, *args, **kwargs)``,
    element ``index`` of the result when it is a tuple (``chunk``, ``split``, ``unbind``)."""

    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    index: int | None = None


@dataclass(frozen=True)
class Write:
    """One recorded write: ``func`` called with ``WRITTEN`` in ``args``/``kwargs`` standing for the parameter
    seen through ``path``; other tensors are CPU copies (the values a parameter was created with: that
    tensor itself). ``unreplayable`` says why it cannot run again."""

    path: tuple[Step, ...]
    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    standard: bool
    unreplayable: str | None = None

    @property
    def name(self) -> str:
        return str(getattr(self.func, "__name__", self.func))

    @property
    def overwrites(self) -> bool:
        """Sets the whole parameter whatever it held (every ``nn.init`` function does): earlier writes
        do not matter after it."""
        init = getattr(self.func, "__module__", None) == "torch.nn.init"
        whole = not self.path and (self.name in _OVERWRITES or init)
        return whole and self.unreplayable is None


@dataclass
class Writes:
    """A meta parameter's recorded writes (see the module docstring); ``after_load``: since a load."""

    ops: list[Write] = field(default_factory=list)
    after_load: bool = False

    def add(self, write: Write) -> None:
        """Append ``write``; one that overwrites the parameter replaces what came before (a value kept
        for an earlier write is let go: a layer's ``torch.empty`` weight once its ``reset_parameters()``
        has run)."""
        if write.overwrites:
            self.ops = [write]
        else:
            self.ops.append(write)

    def to_replay(self) -> list[Write]:
        """After a load every write; otherwise those after the last standard one."""
        if self.after_load:
            return list(self.ops)
        last = max((i for i, w in enumerate(self.ops) if w.standard), default=-1)
        return self.ops[last + 1 :]


def writes_of(param: nn.Parameter) -> Writes:
    """``param``'s record, made on first use."""
    held = param.__dict__.get(WRITES_ATTR)
    if not isinstance(held, Writes):
        held = Writes()
        param.__dict__[WRITES_ATTR] = held
    return held


def inherit_writes(source: Tensor, copy: Tensor) -> None:
    """``copy`` (a deep copy of the meta parameter ``source``: ``copy.deepcopy`` of a module, as
    ``nn.TransformerEncoder`` clones its layer) takes a copy of ``source``'s record."""
    held = source.__dict__.get(WRITES_ATTR)
    if isinstance(held, Writes) and copy is not source:
        copy.__dict__[WRITES_ATTR] = Writes(list(held.ops), held.after_load)


def constant_value(t: Tensor, *, limit: int = 1 << 20) -> float | None:
    """The value every element of the floating tensor ``t`` holds (``torch.ones(d)``, ``torch.zeros(d)``,
    ``torch.full``), or None: a parameter created with such values (nanoGPT's ``LayerNorm``: ``weight =
    nn.Parameter(torch.ones(ndim))``, a module without ``reset_parameters()``) is recorded as filled
    with it. Tensors above ``limit`` elements are not read (a layer's ``torch.empty`` weight, filled
    by its ``reset_parameters()``); one host read at construction."""
    if not t.is_floating_point() or t.is_meta or t.numel() == 0 or t.numel() > limit:
        return None
    flat = t.detach().reshape(-1)
    first = flat[0]
    return float(first) if bool((flat == first).all()) else None


def _standard(frame: FrameType | None) -> bool:
    """Whether a frame up the stack is an initialiser that materialisation runs again: a module's
    ``reset_parameters()``, or a method of a Hugging Face model in transformers' own code, whose
    ``post_init()`` init is replayed whole, its layers' constructors included (transformers may not even
    run it on meta tensors). A subclass's own code is the user's."""
    base = pretrained_model_class()
    while frame is not None:
        code = frame.f_code
        rerun = code.co_name in _RERUN
        if (rerun or (base is not None and _TRANSFORMERS in code.co_filename)) and (
            code.co_argcount and code.co_varnames[0] == "self"
        ):
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and (rerun or (base is not None and isinstance(owner, base))):
                return True
        frame = frame.f_back
    return False


def _initialising(frame: FrameType | None) -> bool:
    """Whether a frame up the stack is a weight initialiser by name (``_INITIALISERS``)."""
    while frame is not None:
        if frame.f_code.co_name in _INITIALISERS:
            return True
        frame = frame.f_back
    return False


def _capture(value: Any, written: Tensor, why: list[str]) -> Any:
    """``value`` as recorded: the written tensor as ``WRITTEN``, other tensors as CPU copies (a meta one
    noted in ``why``), containers walked, generators dropped (replays draw from the seeded default)."""
    if value is written:
        return WRITTEN
    if isinstance(value, Tensor):
        if value.is_meta:
            why.append("it reads another meta-device tensor")
            return value
        return value.detach().to("cpu", copy=True)
    if isinstance(value, torch.Generator):
        return None
    if isinstance(value, tuple | list):
        return type(value)(_capture(v, written, why) for v in value)
    return value


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    """The tensor a call writes into, if it is a write (see the module docstring)."""
    if getattr(func, "__module__", None) == "torch.nn.init":
        target = kwargs.get("tensor", args[0] if args else None)
        return target if isinstance(target, Tensor) else None
    out = kwargs.get("out")
    if isinstance(out, Tensor):
        return out
    name = getattr(func, "__name__", "")
    inplace = name in _INPLACE_DUNDERS or (
        name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES
    )
    if inplace and args and isinstance(args[0], Tensor):
        return args[0]
    return None


class WriteRecorder(TorchFunctionMode):
    """Records writes into meta parameters (module docstring). A whole-tensor ``copy_`` from a real
    tensor is a load: given to ``on_load`` when set (its values then go in as pretrained weights, and the
    parameter's record restarts after it), else recorded as a write like any other; made inside a weight
    initialiser (``reset_parameters``, ``_init_weights``, ...: transformers copies Whisper's sinusoidal
    position table so) it is an init, recorded as a write."""

    def __init__(self, on_load: Callable[[nn.Parameter, Tensor], None] | None = None) -> None:
        super().__init__()
        self._on_load = on_load
        # views of meta parameters handed out inside, by id (the view kept alive so the id is not reused)
        self._views: dict[int, tuple[Tensor, nn.Parameter, tuple[Step, ...]]] = {}

    def _origin(self, t: Any) -> tuple[nn.Parameter, tuple[Step, ...]] | None:
        if isinstance(t, nn.Parameter) and t.is_meta:
            return t, ()
        held = self._views.get(id(t)) if isinstance(t, Tensor) else None
        return (held[1], held[2]) if held is not None and held[0] is t else None

    def record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], target: Tensor) -> None:
        """Record ``func(*args, **kwargs)`` writing into ``target`` if it is a meta parameter or a view."""
        origin = self._origin(target)
        if origin is None:
            return
        param, path = origin
        source = args[1] if len(args) > 1 else kwargs.get("src")
        if (
            func is torch.Tensor.copy_
            and not path
            and self._on_load is not None
            and isinstance(source, Tensor)
            and not source.is_meta
            and not _initialising(sys._getframe(2))
        ):
            self._on_load(param, source)
            writes = writes_of(param)
            writes.ops.clear()
            writes.after_load = True
            return
        why: list[str] = []
        captured_args = _capture(args, target, why)
        captured_kwargs = {k: _capture(v, target, why) for k, v in kwargs.items()}
        write = Write(
            path, func, captured_args, captured_kwargs, _standard(sys._getframe(2)), "; ".join(why) or None
        )
        writes_of(param).add(write)

    def created(self, param: nn.Parameter, value: Tensor) -> None:
        """``param`` (meta) was created from ``value``'s real values (``nn.Parameter(torch.ones(d))``,
        ``nn.Embedding.from_pretrained(vectors)``, a layer's ``torch.empty`` weight): recorded as a write of
        them, a constant as ``fill_``, others by reference (no copy; a layer's own ``reset_parameters()``
        overwrites them at once, which lets the reference go). Values created in an initialiser that
        materialisation runs again are not kept."""
        if _standard(sys._getframe(1)):
            write = Write((), torch.Tensor.copy_, (WRITTEN, None), {}, standard=True)
        elif (constant := constant_value(value)) is not None:
            write = Write((), torch.Tensor.fill_, (WRITTEN, constant), {}, standard=False)
        else:
            write = Write((), torch.Tensor.copy_, (WRITTEN, value.detach()), {}, standard=False)
        writes_of(param).add(write)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        target = _written(func, args, kwargs)
        if target is not None:
            self.record(func, args, kwargs, target)
        result = func(*args, **kwargs)
        if target is None and args and (origin := self._origin(args[0])) is not None:
            self._track(func, args, kwargs, result, origin)
        return result

    def _track(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        result: Any,
        origin: tuple[nn.Parameter, tuple[Step, ...]],
    ) -> None:
        param, path = origin
        if func == _DATA_GET or func is torch.Tensor.detach:  # the same values: the same path
            if isinstance(result, Tensor):
                self._views[id(result)] = (result, param, path)
            return
        why: list[str] = []
        rest = _capture(args[1:], args[0], why)
        kw = {k: _capture(v, args[0], why) for k, v in kwargs.items()}
        if why:
            return  # a view chosen by meta tensors: writes through it are not tracked
        if isinstance(result, Tensor) and result.is_meta and result._is_view():
            self._views[id(result)] = (result, param, (*path, Step(func, rest, kw)))
        elif isinstance(result, tuple | list):
            for i, part in enumerate(result):
                if isinstance(part, Tensor) and part.is_meta and part._is_view():
                    self._views[id(part)] = (part, param, (*path, Step(func, rest, kw, i)))


@contextmanager
def visible_init_functions(recorder: WriteRecorder) -> Iterator[None]:
    """Within: ``torch.nn.init``'s functions that skip meta tensors silently (``_SILENT_ON_META``) record
    their call first; the originals are back after (a wrapper that code imported within bound, as
    transformers binds torch's init functions at import, then only calls the original). Code that bound
    them by name before (``from torch.nn.init import trunc_normal_``) calls the original, unrecorded."""
    originals = {name: getattr(nn.init, name) for name in _SILENT_ON_META}
    live = [True]  # a wrapper bound by code imported inside (a module-level alias) records nothing after

    def wrap(original: Callable[..., Tensor]) -> Callable[..., Tensor]:
        def recorded(*args: Any, **kwargs: Any) -> Tensor:
            target = kwargs.get("tensor", args[0] if args else None)
            if live[0] and isinstance(target, Tensor):
                recorder.record(original, args, kwargs, target)
            return original(*args, **kwargs)

        recorded.__wrapped__ = original  # type: ignore[attr-defined]
        return recorded

    try:
        for name, original in originals.items():
            setattr(nn.init, name, wrap(original))
        yield
    finally:
        live[0] = False
        for name, original in originals.items():
            setattr(nn.init, name, original)
