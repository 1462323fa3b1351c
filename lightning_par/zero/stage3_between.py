"""ZeRO-3: reads of sharded parameters between the first two training steps are refused.

Why
---
Outside a step a ZeRO-3 parameter is a NaN placeholder of its shape; only the step (its forwards and
backwards) and :meth:`gathered_params` make it whole. Code that reads weights from a Lightning hook or
callback between steps computed with the placeholders, silently: an EMA of the weights kept in buffers
and updated in ``on_train_batch_end`` (the latent-diffusion idiom) turned NaN in its first update while
the model itself trained normally, so the failure surfaced only when sampling from the EMA weights;
a weight norm logged in ``on_before_optimizer_step`` logged NaN.

How
---
When the engine's first training step ends (its step context exits), :meth:`BetweenSteps.start` enters a
torch function mode (:class:`~lightning_par.torch_modes.CheckedCalls`) that looks at the arguments
of every torch function and tensor method: a parameter of any unit, the root included, whose unit is not
gathered is refused with ``RuntimeError`` naming it, its unit, the function and the fix. The window
covers what Lightning runs after ``training_step`` returns: that step's backward, ``on_after_backward``,
``on_before_optimizer_step``, the optimizer step, ``on_train_batch_end`` (module and callbacks), and the
next batch's hooks, until the next step context is entered (a training or validation step), where
:meth:`BetweenSteps.stop` leaves the mode for good; later steps pay nothing there. The fit-, epoch- and
batch-level hooks the LightningModule and user callbacks override (an epoch's end, ``on_train_batch_end``,
``on_validation_batch_end``, ``on_save_checkpoint``) run under the same guard each time
(``Stage3Engine.reads_refused``, set up by the Trainer strategy with a ``where`` for the message), and
a Fabric loop's code from ``fabric.setup`` to its first step (``Stage3Engine.refuse_reads_until_step``:
an init after sharding, torchtitan's order, failed in torch with "more than one element of the
written-to tensor refers to a single memory location", a weight read computed NaN). The
strategies' own reads (checkpoints, exports,
snapshots: :class:`~lightning_par.state_guard.OwnReads`) and everything inside
:meth:`gathered_params` pass; so does metadata (shapes, ``.data``, ``.grad``: the same exemptions as the
first-step guard, :data:`~lightning_par.zero.stage3_calls.NOT_READS`). Tensors on a placeholder's
storage count as the parameter (``p.data`` read by an EMA's ``add_``, written by ``p.data[rows] = v``:
before, NaN or a lost write, silently), but for the ``clone(memory_format=torch.preserve_format)`` of a
``copy.deepcopy`` of the model, whose copy is refused at its first use instead.

The mode lives on torch's thread-local function-mode stack; if user code entered a mode of its own
after it and is still inside it when the window ends, the modes above are lifted, this one removed and
the others put back in their order (:func:`~lightning_par.torch_modes.leave_mode`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lightning_par.state_guard import OwnReads
from lightning_par.torch_modes import CheckedCalls, leave_mode
from lightning_par.zero.stage3_calls import param_owners, params_read, placeholder_owners
from lightning_par.zero.unit import Unit

__all__ = ["BetweenSteps", "ReadWindows"]


class BetweenSteps:
    """The between-steps reads guard of a ZeRO-3 engine (module docstring)."""

    def __init__(self, units: Sequence[Unit], own_reads: OwnReads, *, where: str | None = None) -> None:
        self._owners = param_owners(units)
        # placeholder storages: reads and writes through param.data (an EMA's add_(p.data), a dead-code
        # restart's p.data[rows] = v: before, NaN or lost, silently)
        self._storages = placeholder_owners(units)
        self._own_reads = own_reads
        # where the reads are refused, for the message (default: the window after the first step)
        self._where = where
        self._mode: TorchFunctionMode | None = None
        self._refused = False  # a read was refused: the mode passes everything through until stop()

    @property
    def active(self) -> bool:
        return self._mode is not None

    def start(self) -> None:
        if self._mode is None:
            self._mode = CheckedCalls(self._check_read)
            self._mode.__enter__()

    def stop(self) -> None:
        mode, self._mode = self._mode, None
        self._refused = False  # a later start() watches again
        if mode is not None:
            leave_mode(mode)

    def _check_read(self, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        if self._own_reads.active or self._refused:
            return
        # a deepcopy of the model clones param.data with preserve_format: passed, its copy is refused at
        # its first use with the fix (PlaceholderCopies)
        if getattr(func, "__name__", "") == "clone" and kwargs.get("memory_format") is torch.preserve_format:
            return
        for unit, param in params_read(func, args, kwargs, self._owners, storages=self._storages):
            if unit.state != "gathered":
                name = getattr(func, "__name__", "")
                in_place = name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))
                target = args[0] if args else None  # an in-place method's self is what it writes
                written = in_place and any(
                    params_read(func, (target,), {}, self._owners, storages=self._storages)
                )
                verb = "written" if written else "read"
                # torch restores the mode after this raise: inert from here until stop() takes it off
                self._refused = True
                where = self._where or (
                    "between training steps (in a Lightning hook or callback such as"
                    " on_train_batch_end or on_before_optimizer_step)"
                )
                raise RuntimeError(
                    f"ZeRO-3: parameter {param!r} of unit {unit.name or '<root>'!r} was {verb} by"
                    f" {name or func!r} {where}, where ZeRO-3's parameters are"
                    " placeholders (NaN), so this would compute NaN, silently. Enter"
                    " `with trainer.strategy.gathered_params():` (`fabric.strategy.gathered_params()` in"
                    " Fabric) on every rank around code that reads"
                    " weights (logging their norms), or `gathered_params(writeback=True)` for code that"
                    " also writes them or keeps an average of them (an EMA in buffers: this reads the fp32"
                    " masters), or do the work inside the step (training_step, or in Fabric between the"
                    " forward and optimizer.step(); in 16-bit mixed precision, an EMA"
                    " there too goes inside gathered_params(writeback=True): a step gathers in 16 bits)."
                    + ("" if self._where else " (Checked between the first two training steps only.)")
                )


class ReadWindows:
    """Mixin of :class:`~lightning_par.zero.stage3.Stage3Engine`: the windows, besides the one after the
    first training step, in which a read of a parameter whose unit is not gathered is refused."""

    units: list[Unit]
    own_reads: OwnReads
    _before_first: BetweenSteps | None  # refuse_reads_until_step's window
    _fabric_between: BetweenSteps | None  # refuse_reads_between_steps' window
    _hook_guards: dict[str, BetweenSteps]  # reads_refused's guards by hook: built once, run at every batch

    @contextmanager
    def reads_refused(self, where: str) -> Iterator[None]:
        """Inside, a read of a parameter whose unit is not gathered raises (``where`` says where, in the
        message): for user hooks the strategy runs while the parameters are placeholders, such as
        ``on_save_checkpoint`` or ``on_train_batch_end`` (:mod:`lightning_par.zero.stage3_between`). The
        guard of each ``where`` is kept (its tables follow the units, which do not change); one already
        running (a hook entered again from inside itself) gets a fresh one."""
        guard = self._hook_guards.get(where)
        if guard is None or guard.active:
            guard = BetweenSteps(self.units, self.own_reads, where=where)
            self._hook_guards.setdefault(where, guard)
        guard.start()
        try:
            yield
        finally:
            guard.stop()

    def refuse_reads_until_step(self, where: str) -> None:
        """From now until the next step starts (the next forward of a unit, or a step context), a read of
        a parameter whose unit is not gathered raises (``where`` in the message): a Fabric loop's code
        between ``fabric.setup`` and its first step, where an init after sharding (torchtitan's
        ``init_weights()``) or a weight read would meet the placeholders
        (:mod:`lightning_par.zero.stage3_between`)."""
        if self._before_first is None:
            self._before_first = BetweenSteps(self.units, self.own_reads, where=where)
            self._before_first.start()

    def refuse_reads_between_steps(self, where: str) -> None:
        """From an optimizer step of a Fabric loop to the model's next forward, a read of a parameter
        whose unit is not gathered raises (``where`` in the message), as
        :meth:`refuse_reads_until_step` does before the first step. The window closes at the next
        forward of any unit, so the forward and backward of a step run without the check."""
        if self._fabric_between is None:
            self._fabric_between = BetweenSteps(self.units, self.own_reads, where=where)
        self._fabric_between.start()

    def end_read_windows(self) -> None:
        """A step starts (a step context, a pipeline step, a unit's forward) or a Fabric run is done (its
        last ``optimizer.step`` opened a window no forward closes): the windows of refused reads outside
        the steps end, the one before the first step for good."""
        guard, self._before_first = self._before_first, None
        if guard is not None:
            guard.stop()
        if self._fabric_between is not None:
            self._fabric_between.stop()
