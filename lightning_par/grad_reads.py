"""Reads of ``param.grad`` that find nothing are refused in the first optimizer step (ZeRO 1-3, and
other stages' parameters under pipeline parallelism).

Why
---
At ZeRO stages 1-3 a window's gradients are reduced into each rank's shards, and ``param.grad`` of the
module's parameters stays None. Code written for DDP that reads it between the backward and the
optimizer step did nothing, silently: ``torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)`` in
``configure_gradient_clipping`` or ``on_before_optimizer_step`` clipped nothing (a small MLP whose steps
needed the clip ended 1e12 away from ``"ddp"``), and Lightning's ``grad_norm(self, 2)`` logged nothing.
Under pipeline parallelism the same code sees this stage's gradients only (the other stages' parameters
are meta placeholders, their ``grad`` None): each stage clipped by its own norm, by a different factor
than the whole model's, silently (a pp2 GPT's losses then left the one-process run's), and
``grad_norm`` logged rank 0's stage as the total.

How
---
:meth:`GradReads.arm` (the front door calls it before the first backward it runs; under a pipeline after
the schedule, before the window's reduction) enters a torch function mode that watches ``Tensor.grad``
reads. Once the gradients of a window have been reduced (:meth:`GradReads.landed`, an engine
``on_synchronized`` listener), a read that returns None for a parameter that was trainable at setup
raises ``RuntimeError`` naming it and the fixes. The first optimizer step ends the watch for good
(:meth:`GradReads.end`, before the optimizer's own update, which reads every parameter's ``grad``, other
stages' placeholders among them: in the Trainer once ``on_before_optimizer_step`` and the clipping have
run, from ``ParallelPrecision.before_update``; also at teardown), so later steps pay nothing; a read
that first happens in a later step is caught only inside the gradient hooks the user overrides
(:func:`refuse_none_reads`, at every step). Under pipeline parallelism a ``zero_grad()`` (torch's
optimizer's or module's) walking the other stages' placeholders is no read. Reads before the window's backward
(``on_before_backward``, where DDP finds None too) and reads that find a gradient pass. With
``find_unused_parameters`` a read of a parameter no rank used in the window passes (its gradient is None
under DDP as well); every other read is refused as without it (before, the watch was off there, and a
clip of ``self.parameters()`` clipped nothing, silently). The engine's own work in backward is not
seen: torch runs autograd's nodes and hooks outside the mode; its reads in forward hooks
(``GradSync.prepare_window``) run with torch functions disabled.

The optimizer's own parameters are this rank's fragments at ZeRO 1-3, whose ``.grad`` is its shard of
the reduced gradient: element-wise changes of it are exact, but a norm of it is this rank's part only.
``clip_grad_norm_`` over ``optimizer.param_groups`` clipped each rank by its own factor, silently (a
probe: 1.4e-3 off ``"ddp"`` after 8 steps); in the first step a norm (``torch.norm``, ``Tensor.norm``,
``torch.linalg``'s, the foreach kernel) or a dot product taken of one of those gradients, or of a view
of their storage (``.data``, ``.detach()``, ``.flatten()``), is refused alike. Not seen: norms built by
hand from new tensors (``g.pow(2).sum()``, a ``torch.cat`` of the gradients). The strategies' own
clipping and ``grad_norm`` take their local parts with torch functions disabled.

A gradient cleared at ZeRO 1-3 is refused alike: ``param.grad = None`` (DDP's way of skipping one
parameter's update: a probe's layer kept for two steps so ended 0.24 off ``"ddp"``) or ``del param.grad``
of a module parameter, from the first window's reduction to the first optimizer step (not seen: a clear
between two backwards of an accumulation window, which drops the window's gradient so far under DDP, and
clears first made in a later step); the optimizer's own fragments are not watched. A tensor assigned is
refused at every step by :mod:`lightning_par.zero.grad_writes`.

Where the error is raised: the Trainer raises at the read itself (its traceback points at the user's
line); torch puts a mode back on its stack after its handler raises, and the strategy's teardown, which
Lightning runs on every failure, takes it off. A Fabric loop has no such teardown, so Fabric's watch
(``defer=True``) records the read and raises from ``optimizer.step()``, after leaving the stack and
before any update.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_par.torch_modes import CheckedCalls, leave_mode, storage_address

if TYPE_CHECKING:
    from lightning_par.zero.engine_api import Engine

__all__ = ["GradReads", "none_read_message", "refuse_none_reads"]

_GRAD = torch._C.TensorBase.__dict__["grad"]  # the getset descriptor behind ``tensor.grad``
# the torch functions (their __name__) that take a norm: torch.norm / Tensor.norm, torch.linalg's, and the
# foreach kernel torch.nn.utils.clip_grad_norm_ uses
_NORMS = frozenset(
    {"norm", "linalg_norm", "linalg_vector_norm", "linalg_matrix_norm", "frobenius_norm", "_foreach_norm"}
    | {"dot", "vdot", "inner"}  # a squared norm as a dot product
)


class GradReads:
    """The first optimizer step's watch over ``param.grad`` reads (module docstring). ``defer``: record the
    first refused read and raise it from :meth:`end` instead of from inside the read (Fabric, below)."""

    def __init__(
        self,
        module: nn.Module,
        *,
        zero_stage: int,
        pipelined: bool = False,
        defer: bool = False,
        unused: Callable[[], frozenset[int]] | None = None,
        stepped: Callable[[], list[Tensor]] | None = None,
    ) -> None:
        self._names = {id(p): name for name, p in module.named_parameters() if p.requires_grad}
        self._stepped = stepped  # the tensors the optimizers step (this rank's fragments at ZeRO 1-3)
        self._shard_grads: set[int | None] = set()  # their gradients' storages once the window landed
        self._unused = unused  # ids of the parameters no rank used in the window (find_unused_parameters)
        self.zero_stage = zero_stage
        self.pipelined = pipelined
        self.defer = defer
        self._mode: TorchFunctionMode | None = None
        self._landed = False
        self._ended = False
        self._refused: str | None = None  # the first refused read's message (deferred)

    @classmethod
    def for_engine(
        cls,
        module: nn.Module,
        engine: Engine | None,
        *,
        zero_stage: int,
        pipelined: bool,
        find_unused_parameters: bool,
        defer: bool = False,
    ) -> GradReads | None:
        """The watch a front door keeps for ``module``'s engine (its ``landed`` listener registered), or None
        where there is nothing to watch: stage 0 without a pipeline (``param.grad`` holds the gradient).
        With ``find_unused_parameters`` the parameters no rank used pass (None under DDP too)."""
        if engine is None or (zero_stage < 1 and not pipelined):
            return None
        unused = (lambda: engine.unused_param_ids) if find_unused_parameters else None

        def stepped() -> list[Tensor]:
            state = engine.sharded_state
            return state.stepped_tensors() if state is not None else []

        reads = cls(
            module, zero_stage=zero_stage, pipelined=pipelined, defer=defer, unused=unused, stepped=stepped
        )
        engine.on_synchronized(reads.landed)
        return reads

    def arm(self) -> None:
        if self._ended or self._landed:
            # after a refusal the mode is inert until it can leave the stack: here; a new backward after
            # a reduced window without an optimizer step between (a loop without one) ends the watch too
            self.end()
        elif self._mode is None:
            self._mode = CheckedCalls(self._check_call)
            self._mode.__enter__()

    def landed(self) -> None:
        if self._ended:  # every later window's end: nothing to collect (the engine keeps this listener)
            return
        self._landed = True
        if self._stepped is not None and self.zero_stage >= 1:
            grads = (t.grad for t in self._stepped())
            self._shard_grads = {storage_address(g) for g in grads if g is not None} - {None, 0}

    def end(self, *, quiet: bool = False) -> None:
        """Leave the watch for good; with ``defer``, raise the first refused read now (unless ``quiet``:
        a teardown, where nothing is left to stop)."""
        self._ended = True
        mode, self._mode = self._mode, None
        if mode is not None:
            leave_mode(mode)
        refused, self._refused = self._refused, None
        if refused is not None and not quiet:
            raise RuntimeError(refused)

    def _check_call(self, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        on_grad = getattr(func, "__self__", None) is _GRAD
        name = getattr(func, "__name__", "")
        read = _none_read(func, args)
        if read is not None:
            self._check(read)
        elif (
            on_grad
            and self.zero_stage >= 1
            and args
            and (name == "__delete__" or (name == "__set__" and args[1] is None))
        ):
            self._check_cleared(args[0])
        elif self._shard_grads and getattr(func, "__name__", "") in _NORMS:
            tensors = [a for arg in args for a in (arg if isinstance(arg, (list, tuple)) else (arg,))]
            if any(isinstance(t, Tensor) and storage_address(t) in self._shard_grads for t in tensors):
                self._refuse(
                    f"ZeRO-{self.zero_stage}: a norm of the optimizer's gradients was taken on this rank:"
                    " at ZeRO stages 1-3 the optimizer's parameters are this rank's fragments of the"
                    " flattened parameters, so the norm of their gradients"
                    " (torch.nn.utils.clip_grad_norm_ over optimizer.param_groups) is this rank's part only,"
                    " and each rank would clip by its own factor, silently. Clip with"
                    " Trainer(gradient_clip_val=...) or self.clip_gradients(optimizer, ...)"
                    " (fabric.clip_gradients in Fabric): the global norm over the shards; read the norms"
                    " with trainer.strategy.grad_norm(self)"
                    " (fabric.strategy.grad_norm(model)); or use zero_stage=0. Element-wise changes of"
                    " those gradients are fine. (Checked in the first optimizer step only.)"
                )

    def _check(self, param: Any) -> None:
        name = self._names.get(id(param))
        if name is None or not self._landed or self._ended or self._refused is not None:
            return
        if self.pipelined and param.is_meta:
            if _inside_zero_grad():  # a zero_grad() walking the other stages' placeholders: no gradient read
                return
            message = (
                f"Pipeline parallelism: {name}.grad was read after the backward and is None here: the"
                " parameter belongs to another pipeline stage's layers (on this rank it is a meta"
                " placeholder), so code that clips the gradients of self.parameters()"
                " (torch.nn.utils.clip_grad_norm_) would measure this stage's alone and clip each stage by a"
                " different factor, and Lightning's grad_norm(self, ...) would report this stage's norm as"
                " the total. Clip with Trainer(gradient_clip_val=...) or self.clip_gradients(optimizer, ...)"
                " (fabric.clip_gradients in Fabric): the global norm over every stage; read the norms with"
                " trainer.strategy.grad_norm(self)"
                " (fabric.strategy.grad_norm(model)) on every rank. (Checked in the first optimizer step"
                " only.)"
            )
        elif self.zero_stage < 1:  # this stage's own parameter without a gradient: None under DDP too
            return
        elif self._unused is not None and id(param) in self._unused():
            return  # no rank used it in the window: None under DDP too
        else:
            message = none_read_message(name, self.zero_stage, "(Checked in the first optimizer step only.)")
        self._refuse(message)

    def _check_cleared(self, param: Any) -> None:
        """``param.grad = None`` or ``del param.grad`` of a module parameter, from the first window's
        reduction to the first optimizer step: DDP's way to skip that parameter's update, which at ZeRO
        1-3 changes nothing (the optimizer steps this rank's fragments from the reduced shards). A tensor
        written there is refused at every step by :mod:`lightning_par.zero.grad_writes`."""
        name = self._names.get(id(param))
        if name is None:
            return
        self._refuse(
            f"ZeRO-{self.zero_stage}: {name}.grad was set to None (or deleted) between the backward and the"
            " optimizer step: under DDP that skips the parameter's update, but at ZeRO stages 1-3 the"
            " optimizer steps this rank's fragments from the reduced gradient shards, not from param.grad,"
            " so the parameter would be updated all the same, silently. To skip the whole step, call"
            " self.zero_grad() (the LightningModule's) or optimizer.zero_grad(); to keep parameters fixed,"
            " freeze them before the fit (requires_grad_(False)), or for some steps give them a parameter"
            " group whose lr you set to 0; or use zero_stage=0, where param.grad is the gradient the"
            " optimizer steps. (Checked from the window's reduction to the first optimizer step only.)"
        )

    def _refuse(self, message: str) -> None:
        if not self._landed or self._ended or self._refused is not None:
            return
        if self.defer:
            self._refused = message
            return
        # torch puts the mode back on its stack after this raise: it stays, inert, until end() (the
        # Trainer's teardown) takes it off
        self._ended = True
        raise RuntimeError(message)


def none_read_message(name: str, zero_stage: int, checked: str) -> str:
    """The refusal of a ``param.grad`` read that found None at ZeRO 1-3 (``checked``: where it is looked
    for)."""
    return (
        f"ZeRO-{zero_stage}: {name}.grad was read after the backward and is None: at ZeRO"
        " stages 1-3 the gradients live in each rank's shards, not in param.grad, so code that clips"
        " them (torch.nn.utils.clip_grad_norm_(self.parameters(), ...)) or logs them (Lightning's"
        " grad_norm(self, ...), a gradient histogram) would do nothing, silently. Clip with"
        " Trainer(gradient_clip_val=...) or self.clip_gradients(optimizer, ...) (fabric.clip_gradients in"
        " Fabric): the global norm over the shards (gradient_clip_algorithm='value' for a clip by value, or"
        " clip_grad_value_ over optimizer.param_groups, this rank's fragments); read the norms"
        " with trainer.strategy.grad_norm(self) (fabric.strategy.grad_norm(model)); or use"
        " zero_stage=0, where param.grad holds the averaged gradient. A submodule's zero_grad() reads"
        " them too: to drop the gradients call the LightningModule's self.zero_grad() or"
        f" optimizer.zero_grad(). {checked}"
    )


@contextmanager
def refuse_none_reads(
    names: Mapping[int, str],
    *,
    zero_stage: int,
    where: str,
    unused: Callable[[], frozenset[int]] | None = None,
) -> Iterator[None]:
    """Inside, a read of ``param.grad`` that finds None for a parameter in ``names`` (``id -> name``, the
    module's) that requires a gradient now raises (:func:`none_read_message`), except for the parameters
    ``unused()`` names (no rank used them in the window: None under DDP too): the user's gradient hooks at
    ZeRO 1-3, at every step, after the first step's watch (:class:`GradReads`) has ended. ``where`` names
    the hook."""

    def check(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        read = _none_read(func, args)
        if read is None or id(read) not in names or not read.requires_grad:
            return
        if unused is not None and id(read) in unused():
            return
        raise RuntimeError(none_read_message(names[id(read)], zero_stage, f"(Checked in {where}.)"))

    mode = CheckedCalls(check)
    mode.__enter__()
    try:
        yield
    finally:
        leave_mode(mode)


def _none_read(func: Callable[..., Any], args: Sequence[Any]) -> Any:
    """The tensor whose ``.grad`` the call ``func(*args)`` reads and finds None (the mode's handler runs
    outside the mode: reading it again here does not recurse), or None for any other call."""
    getter = getattr(func, "__self__", None) is _GRAD and getattr(func, "__name__", "") == "__get__"
    return args[0] if getter and args and args[0].grad is None else None


# the zero_grad()s that walk every parameter's .grad to clear it (torch's own functions, decorators unwrapped)
_ZERO_GRADS = frozenset(
    inspect.unwrap(f).__code__ for f in (torch.optim.Optimizer.zero_grad, nn.Module.zero_grad)
)


def _inside_zero_grad(depth: int = 8) -> bool:
    """Whether the caller runs inside torch's ``Optimizer.zero_grad`` or ``Module.zero_grad`` (looked up
    on the refusal path only: a few frames of the stack)."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code in _ZERO_GRADS:
            return True
        frame = frame.f_back
    return False
