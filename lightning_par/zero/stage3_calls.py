"""ZeRO-3: a module of one unit called from outside that unit's forward is refused (first forward only).

Why
---
A unit's parameters are whole only around its own forward and backward (and, under a pipeline, across a
step's micro-batches); in between they are NaN placeholders. A model whose layer calls a submodule of
another layer (``self.peer.fc(x)``: layers sharing a projection by calling it, not by tying weights)
computed with those placeholders: NaN losses, and no error saying why. FSDP2 refuses such a call
through its DTensor parameters; here a guard names it.

How
---
During the engine's first forward (train or eval), a forward pre-hook sits on every module that holds a
non-root unit's parameters directly (the unit's own module excluded: calling it gathers the unit), and
the units' forwards are tracked as they run. A call while its unit's forward is not running and its
parameters are not gathered raises ``RuntimeError`` naming the module, its unit and the calling unit,
with the fix. The guard is removed when the engine's first training step's backward ends (a fit's
sanity-check validation steps come before it; an engine that only evaluates: its first step; Fabric,
outside the Trainer's steps: the backward of the root's first forward), so later steps pay nothing; a call
that appears only in a later step is not caught. In backward the call checks catch a custom autograd
Function that recomputes part of a unit by calling its submodules (reversible layers): the unit is
sharded there, and the run trained to NaN. The root unit needs no guard: it is gathered for the whole
step, and outside a step its modules borrow it (``Stage3Engine._borrow_root``).

A unit's parameters may also be *read* without their module being called: ``nn.MultiheadAttention``
passes ``out_proj.weight`` to its functional form and never calls ``out_proj``, so a policy that makes
every ``nn.Linear`` a unit trained ``out_proj`` from NaN placeholders, silently. So during those first steps
a torch function mode (:meth:`CrossUnitGuard.reads`) also looks at the arguments of every torch function
and tensor method: a parameter of a non-root unit that is not gathered, outside its unit's forward, is
refused the same way, as is code outside any forward that reads such a parameter (a weight penalty in
``training_step``: before, NaN). Metadata (shapes, ``.data``, ``.grad``, data pointers) is not a read.

A torch function mode on the stack makes ``torch.overrides.has_torch_function`` true for every tensor, so
torch's own transformer modules (``nn.TransformerEncoder``, ``nn.TransformerEncoderLayer``,
``nn.MultiheadAttention``) leave their inference fast paths while it is entered: the first evaluation
batch of each loop gave other outputs than ``"ddp"`` (a padded encoder's nested-tensor path returns zeros
at the padding; without it, 2.6 there). Their forwards run with the mode left (:func:`fast_path_modules`)
where every parameter they read is gathered whenever they run: no unit's module lies inside them, but
for an encoder's own layers, which it calls (and so gathers), with no unit inside those.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from lightning_par.owned_hooks import for_owner
from lightning_par.torch_modes import CheckedCalls, leave_mode, on_stack, storage_address
from lightning_par.zero.autograd_state import in_backward
from lightning_par.zero.unit import Unit

__all__ = ["NOT_READS", "CrossUnitGuard", "param_owners", "params_read", "placeholder_owners"]

# what a torch function may do with a sharded parameter without reading its values: property access
# (.data, .grad, .shape, ._version: getset descriptors), metadata, new tensors shaped like it, and hook
# registration, and autograd's entry points (parameters passed as the inputs whose gradients to compute)
NOT_READS = frozenset(
    {
        "__get__",
        "__set__",
        "__delete__",
        "data_ptr",
        "dim",
        "ndimension",
        "numel",
        "nelement",
        "size",
        "stride",
        "storage_offset",
        "untyped_storage",
        "element_size",
        "is_contiguous",
        "is_floating_point",
        "is_complex",
        "requires_grad_",
        "backward",  # torch.autograd.backward / grad(..., inputs=params): which gradients, not values
        "grad",
        "get_device",
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
        "rand_like",
        "randn_like",
        "new_zeros",
        "new_ones",
        "new_empty",
        "new_full",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "__len__",
        "__hash__",
        "__repr__",
        "__format__",
    }
)


class CrossUnitGuard:
    """The first-forward guard of a ZeRO-3 engine (module docstring); :meth:`remove` ends it."""

    def __init__(self, units: Sequence[Unit], root: Unit | None) -> None:
        self._running: list[Unit] = []  # units whose forward is running, innermost last
        self._handles: list[RemovableHandle] = []
        # id(parameter) -> (non-root unit, name)
        self._owners = {k: owner for k, owner in param_owners(units).items() if owner[0] is not root}
        # placeholder storage -> (non-root unit, name): reads through param.data or .detach() views
        self._storages = {k: o for k, o in placeholder_owners(units).items() if o[0] is not root}
        self._entered: set[Unit] = set()  # units whose forward has started
        self._mode: CheckedCalls | None = None  # the reads mode of the running step
        self._fast_depth = 0  # fast-path module forwards running (module docstring)
        self._left = False  # the mode was left for them
        for unit in units:
            if unit is root:
                continue
            module = unit.module
            enter, leave = partial(self._enter, unit), partial(self._leave, unit)
            self._handles.append(module.register_forward_pre_hook(for_owner(module, enter, eager=True)))
            self._handles.append(
                module.register_forward_hook(for_owner(module, leave, eager=True), always_call=True)
            )
            mine = {id(p) for part in unit.parts for p in part.params}
            for name, m in module.named_modules():
                if m is not module and any(id(p) in mine for p in m.parameters(recurse=False)):
                    where = f"{unit.name}.{name}" if unit.name else name
                    hook = for_owner(m, partial(self._check, unit, where), eager=True)
                    self._handles.append(m.register_forward_pre_hook(hook))
        for m in fast_path_modules(units, root):
            self._handles.append(m.register_forward_pre_hook(for_owner(m, self._leave_reads, eager=True)))
            self._handles.append(
                m.register_forward_hook(for_owner(m, self._enter_reads, eager=True), always_call=True)
            )

    def _leave_reads(self, module: nn.Module, args: Any) -> None:
        self._fast_depth += 1
        if self._fast_depth == 1 and self._mode is not None and on_stack(self._mode):
            leave_mode(self._mode)
            self._left = True

    def _enter_reads(self, module: nn.Module, args: Any, output: Any) -> None:
        self._fast_depth -= 1
        if self._fast_depth == 0 and self._left:
            self._left = False
            assert self._mode is not None
            self._mode.__enter__()

    def _enter(self, unit: Unit, module: nn.Module, args: Any) -> None:
        self._running.append(unit)
        self._entered.add(unit)

    def _leave(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        if self._running and self._running[-1] is unit:
            self._running.pop()

    def _check(self, unit: Unit, name: str, module: nn.Module, args: Any) -> None:
        if unit in self._running or unit.state == "gathered":
            return
        if in_backward():
            raise RuntimeError(
                f"ZeRO-3: {name!r}, a module of unit {unit.name!r}, was called in a backward pass outside"
                " that unit's forward and backward, where its parameters are NaN placeholders: a custom"
                " autograd Function recomputing part of a layer in its backward (reversible layers, as"
                " Reformer's and RevNets') calls it. Make every module such a backward calls a unit of its"
                f" own: zero3_units=[...] naming their classes ({type(module).__name__!r} here, and its"
                " siblings the backward calls), or use zero_stage 0-2."
            )
        caller = f" from the forward of unit {self._running[-1].name!r}" if self._running else ""
        raise RuntimeError(
            f"ZeRO-3: {name!r}, a module of unit {unit.name!r}, was called{caller} outside that unit's"
            " forward. A unit's parameters are whole only around the forward and backward of its own"
            " module (NaN placeholders elsewhere), so this call would compute NaN. Choose units whose"
            " module's forward runs and contains every call of their parameters: zero3_units=[...] naming"
            " such modules (parameters of modules no unit contains stay in the root unit, whole for the"
            " whole step; an nn.ModuleList is no such unit, its forward never runs), or use zero_stage 0-2."
        )

    def reads(self) -> TorchFunctionMode:
        """The mode that refuses reads of a sharded unit's parameters (module docstring); entered by the
        engine around its first step."""
        self._mode = CheckedCalls(self._check_read)
        return self._mode

    def _check_read(self, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        for unit, name in params_read(func, args, kwargs, self._owners, storages=self._storages):
            if unit.state == "gathered" or unit in self._running:
                continue
            caller = f" in the forward of unit {self._running[-1].name!r}" if self._running else ""
            why = (
                "after its module's forward: code outside that module reads it, as a parent's forward"
                " applying the weight itself (F.linear(x, block.fc.weight)) or a weight penalty in"
                " training_step does"
                if unit in self._entered
                else "its module has not run: a parent module reads the parameter itself, as"
                " nn.MultiheadAttention reads out_proj.weight"
            )
            raise RuntimeError(
                f"ZeRO-3: parameter {name!r} of unit {unit.name!r} was read by"
                f" {getattr(func, '__name__', func)!r}{caller} outside that unit's forward ({why})."
                " A unit's parameters are whole only around the forward and backward of its own module"
                " (NaN placeholders elsewhere), so this would compute NaN. Read it inside the forward of"
                f" {unit.name!r} or of a module within it, or choose units that contain every use of their"
                " parameters (zero3_units=[...] naming the reading module, e.g. nn.MultiheadAttention or"
                " the transformer layer; parameters outside every unit stay whole for the step); for a"
                " weight penalty, the optimizer's weight_decay; to read weights outside a forward"
                " (logging their norms), strategy.gathered_params() entered by every rank, and"
                " gathered_params(writeback=True) to write them (a clamp, an EMA: without it the writes"
                " are dropped); or use zero_stage 0-2."
            )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._running = []  # (the reads mode, if still entered, keeps _entered until the step ends)


# torch modules whose forward has an inference fast path that a torch function mode on the stack disables
FAST_PATH_MODULES = (nn.TransformerEncoder, nn.TransformerEncoderLayer, nn.MultiheadAttention)


def fast_path_modules(units: Sequence[Unit], root: Unit | None) -> list[nn.Module]:
    """The fast-path modules (:data:`FAST_PATH_MODULES`) whose forward reads only parameters gathered
    while it runs: no non-root unit's module lies strictly inside them, except an encoder's own layers
    (it calls them), with none inside those. The outermost such modules only: the mode stays left for
    everything they run."""
    unit_modules = {id(u.module) for u in units if u is not root}

    def units_inside(module: nn.Module) -> list[nn.Module]:
        return [m for m in module.modules() if m is not module and id(m) in unit_modules]

    def fits(module: nn.Module) -> bool:
        allowed = (
            {id(layer) for layer in module.layers} if isinstance(module, nn.TransformerEncoder) else set()
        )
        inside = units_inside(module)
        return all(id(m) in allowed and not units_inside(m) for m in inside)

    candidates = {
        id(m): m for unit in units for m in unit.module.modules() if isinstance(m, FAST_PATH_MODULES)
    }
    chosen = [m for m in candidates.values() if fits(m)]
    # only the outermost ones: a layer inside a chosen encoder runs with the mode already left
    inner = {id(c) for m in chosen for c in m.modules() if c is not m}
    return [m for m in chosen if id(m) not in inner]


def param_owners(units: Sequence[Unit]) -> dict[int, tuple[Unit, str]]:
    """``id(parameter) -> (its unit, its name)`` over every part of every unit (trainable and frozen)."""
    return {
        id(p): (unit, name)
        for unit in units
        for part in unit.parts
        for name, p in zip(part.names, part.params, strict=True)
    }


def placeholder_owners(units: Sequence[Unit]) -> dict[int, tuple[Unit, str]]:
    """``placeholder storage address -> (its unit, its parameter's name)``: a tensor on one of them is a
    sharded parameter's ``.data`` (or a view of it), which holds NaN; a gathered parameter's storage is
    another."""
    return {
        ph.untyped_storage().data_ptr(): (unit, name)
        for unit in units
        for part in unit.parts
        for name, ph in zip(part.names, part.placeholders, strict=True)
    }


def params_read(
    func: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    owners: dict[int, tuple[Unit, str]],
    *,
    storages: dict[int, tuple[Unit, str]] | None = None,
) -> Iterator[tuple[Unit, str]]:
    """``(unit, name)`` of each parameter in ``owners`` that a torch call reads: its arguments, one level
    into lists and tuples; none for a call that does not read values (:data:`NOT_READS`). With
    ``storages`` (:func:`placeholder_owners`) also plain tensors on a placeholder's storage: a read through
    ``param.data``, which is no Parameter (before, such a read computed with NaN, silently)."""
    if getattr(func, "__name__", "") in NOT_READS:
        return
    for value in (*args, *kwargs.values()):
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, nn.Parameter):
                owner = owners.get(id(item))
            elif storages and isinstance(item, Tensor) and item.layout == torch.strided and not item.is_meta:
                address = storage_address(item)
                owner = storages.get(address) if address is not None else None
            else:
                owner = None
            if owner is not None:
                yield owner
