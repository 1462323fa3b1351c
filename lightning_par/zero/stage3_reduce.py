"""The backward side of a ZeRO-3 engine: gradient buckets, the reduction queue and the window's end.

Contract
--------
:class:`Stage3Reduce` is a base of :class:`~lightning_par.zero.stage3.Stage3Engine` and declares the
engine attributes it works on.

* Gradient hook: a parameter's gradient is copied into its unit's gradient buffer (pooled, keyed by size)
  and ``param.grad`` released; when the unit's count of pending parameters reaches zero, reductions are
  launched.
* Ordering rule: units are reduced in one order on every rank, the reverse of the recorded forward order,
  then the units forward never reached; a unit still waiting for gradients holds back the ones after it,
  so all ranks issue the same collectives in the same order. A unit that got some of its gradients is
  launched when backward reaches the next unit (``_settle_before``), before that unit's gathers: a rank
  where some of its parameters went unused reduces it where a rank that used them all does.
* Math: a unit's buffer is SUM-reduced (reduce-scatter, or all-reduce and slice ``r``) and ``(1/N)`` of
  rank ``r``'s slice is added to the unit's ``grad_shard``; with ``comm_dtype`` (fp16/bf16) the buffer is
  divided by N and reduced in that dtype, and the slice of the mean is added. At most ``max_inflight``
  reductions stay in flight; they complete first in, first out.
* End of backward (an autograd callback): every unit not reduced yet is launched (zeros where it got no
  gradient: collectives must match across ranks), the queue is drained, every gathered unit is freed (the
  root is gathered again inside a step), and a synchronising backward settles unused parameters, attaches
  the gradients to the masters and calls the listeners.
* A pass that puts no gradient into any parameter (``torch.autograd.grad(out, x)``: an input-gradient
  penalty, a PINN residual, an adversarial example) reduces nothing and does not end the window; the
  units it gathered are freed, unless it built a graph of its gradients (``create_graph=True``): that
  graph's nodes hold views of the gathered storage and the step's backward runs them before (or
  without) the hooks that would gather again, so every unit stays whole until that backward ends, an
  optimizer step runs, or an evaluation step ends (the memory of an unsharded model for that step).
* Deferred reduction (``defer_reduction``, pipelines): gradients are added into the unit's buffer and
  nothing is launched in backward; the end of a backward frees nothing (units stay gathered for the next
  micro-batch) unless ``reshard_after_forward``; the engine's ``flush`` then runs
  :meth:`Stage3Reduce._reduce_all`: every unit launched in the common order, drained, freed, and the
  window ended, as at the end of a synchronising backward.
* Gather/free: a unit is freed after backward once its gradients are launched and, with frozen
  parameters, once backward no longer needs them. Each gather is a join round while an evaluation
  with uneven batch counts runs (:mod:`~lightning_par.zero.stage3_join`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd import Variable

from lightning_par.collectives import low_precision_mean, reduce_scatter_flat
from lightning_par.zero.grad_buckets import ReduceOp, strided
from lightning_par.zero.stage3_join import Stage3Join
from lightning_par.zero.stage3_optim import Stage3Optim
from lightning_par.zero.unit import Part, Unit
from lightning_par.zero.unused import MissingGradients


class Stage3Reduce(Stage3Join, Stage3Optim):
    """Gradient reduction of a ZeRO-3 engine's units (see the module docstring)."""

    world: int
    reduce_op: ReduceOp
    find_unused_parameters: bool
    defer_reduction: bool
    reshard_after_forward: bool
    max_inflight: int
    dtype: torch.dtype
    comm_dtype: torch.dtype | None
    device: torch.device
    root: Unit | None
    _unit_of: dict[int, tuple[Unit, int]]
    _order: list[Unit]
    _recording: bool
    _in_step: int
    _sync: bool
    _callback_queued: bool
    _inflight: list[tuple[Unit, Any, Tensor, Tensor | None]]
    _pool: dict[int, list[Tensor]]
    _touched: dict[int, bool]
    _sync_listeners: list[Callable[[], None]]
    _before_pass: Callable[[], None]  # the engine's (Stage3Optim._before_pass)
    _end_guard: Callable[[], None]  # Stage3Hooks': the cross-unit guard's end
    _guard_through_backward: bool = False  # the guard lasts until this backward ends (Stage3Hooks)
    _pass_grads: bool = False  # a parameter got a gradient in the running backward pass
    _graph_hold: bool = False  # a pass built a graph over the gathered weights: no unit is freed

    # ------------------------------------------------------------------ gather / free
    def _gather(self, unit: Unit) -> None:
        self._announce(unit)
        unit.gather(self.group)

    def _wait(self, unit: Unit) -> None:
        self._announce(unit)
        unit.wait(self.group)

    def _free(self, unit: Unit, *, keep_writes: bool = True) -> None:
        # inside gathered() every unit stays whole (stage3_join); after a create_graph pass, see below
        if not (self._holding or self._graph_hold):
            if keep_writes:  # writes since its forward (a step's code between forward and backward)
                unit.absorb_writes(self.rank, self.world)
            unit.free()

    def refuse_late_writes(self) -> None:
        """After an optimizer update: a write to a gathered unit still not absorbed was made before the
        update (absorbing it now would undo the update); refuse it rather than lose it."""
        late = [name for unit in self.units for name in unit.written()]
        if late and not self._holding:
            raise RuntimeError(
                f"ZeRO-3: parameters {late[:4]} were written in place while gathered, where the write could"
                " not reach the shards before the optimizer step (it would be lost). Write parameters inside"
                " a module's forward, before the optimizer step in training_step, or between steps inside"
                " trainer.strategy.gathered_params(writeback=True)."
            )

    def _hold_for_graph(self) -> None:
        """Called in a backward pass's hooks: a pass run with ``create_graph=True`` records nodes that
        hold views of the units' gathered storage, for a later backward (the module docstring)."""
        if torch.is_grad_enabled() and not self.defer_reduction:
            self._graph_hold = True

    def release_graph_hold(self) -> None:
        """The graph a ``create_graph`` pass built is spent (its backward ran, or the step ended): free
        the units it kept whole, but the root inside a step."""
        if self._graph_hold:
            self._graph_hold = False
            self._free_units()

    def _free_units(self) -> None:
        """Free every unit but, inside a step, the root: the step goes on and its next forward needs it
        (freeing and gathering it again would cost an all-gather and change nothing)."""
        for unit in self.units:
            if not (self._in_step and unit is self.root):
                self._free(unit)
        if self._in_step and self.root is not None:
            self._wait(self.root)  # gathered already, unless the step's context did not gather it

    def _free_if_done(self, unit: Unit) -> None:
        """Free after backward: once the unit's gradients are launched (if it has trainable parameters)
        and, for a unit with frozen parameters, once backward no longer needs them."""
        if (unit.train is None or unit.reduced) and unit.backward_done:
            self._free(unit)

    # ------------------------------------------------------------------ backward
    def watch_backward(self, root: Tensor) -> None:
        """End the backward work with the pass started from ``root``, not with a nested pass inside it
        (a reentrant checkpoint's region; see :meth:`GradSync.watch_backward`)."""
        if root.requires_grad:
            root.register_hook(lambda grad: self._queue_callback())

    def _queue_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._finalize_backward)

    def _on_grad(self, param: Tensor) -> None:
        if id(param) not in self._unit_of:  # a user's hook before this one returned a value (torch
            return  # hands it on); torch's own error ("... should return None") follows
        if not self._pass_grads:  # the pass's first gradient: see GradWindow._before_pass
            self._before_pass()
        self._queue_callback()
        self._pass_grads = True
        unit, slot = self._unit_of[id(param)]
        grad = param.grad
        if self.defer_reduction:  # summed over the window's backwards, reduced at flush
            if grad is not None:
                self._slot_view(unit, slot).add_(grad)
                param.grad = None
                self._touched[id(param)] = True
            return
        if unit.reduced:  # its reduction went out (settled as done: _settle_before): this would be lost
            raise RuntimeError(
                f"ZeRO-3: a gradient of {_train(unit).names[slot]!r} reached its unit {unit.name!r} after"
                " the unit's reduction was launched: backward had moved on to another unit (a unit whose"
                " other parameters got no gradient by then is launched there, as unused on this rank). A"
                " parameter used both inside its unit and by code that runs later in backward is not"
                " supported at ZeRO-3: call it through its own module, or use zero3_units to put both"
                " users in one unit."
            )
        if unit.grad_buf is None:  # the unit's first gradient in this backward
            unit.grad_buf = self._acquire(_train(unit).layout.numel)
            unit.pending = len(unit.params)
        if grad is not None:
            s = _train(unit).layout.slots[slot]
            unit.grad_buf[s.offset : s.end].view(s.shape).copy_(strided(grad))
            param.grad = None  # the full-size gradient is not kept
            self._touched[id(param)] = True
        unit.pending -= 1
        if unit.pending == 0:
            self._launch_in_order()

    def _settle_before(self, unit: Unit) -> None:
        """Backward has reached ``unit`` (its pre-backward hook). A unit before it in the reduction order
        that got some gradients in this backward but not all has had every gradient it will get (autograd
        runs a unit's parameter accumulations before the nodes that hand the gradient on to its inputs),
        so its others were unused on this rank (a mixture's experts no token chose here): it is launched
        now, zeros for them. Waiting for them (until backward's end) put its reduction after the gathers
        that followed on this rank, but before them on a rank that used all of its parameters: the
        collectives' order differed, and ZeRO-3 hung; without ``find_unused_parameters`` too, before
        this rank could refuse the unused parameters at backward's end."""
        if self.defer_reduction:
            return
        order = self._reduce_order()
        if unit not in order:
            return
        for before in order[: order.index(unit)]:
            if not before.reduced and before.grad_buf is not None and before.pending > 0:
                before.pending = 0
        self._launch_in_order()

    def _slot_view(self, unit: Unit, slot: int) -> Tensor:
        """``slot``'s view of the unit's gradient buffer (acquired, zero, on first use)."""
        if unit.grad_buf is None:
            unit.grad_buf = self._acquire(_train(unit).layout.numel)
        s = _train(unit).layout.slots[slot]
        return unit.grad_buf[s.offset : s.end].view(s.shape)

    def _reduce_order(self) -> list[Unit]:
        """Units with gradients, in the order their reductions are issued (the same on every rank)."""
        order = [*reversed(self._order), *(u for u in self.units if u not in self._order)]
        return [u for u in order if u.train is not None]

    def _launch_in_order(self) -> None:
        for unit in self._reduce_order():
            if unit.reduced:
                continue
            if unit.grad_buf is None or unit.pending > 0:
                return  # keep the collective order identical on every rank
            self._launch(unit)

    def _launch(self, unit: Unit) -> None:
        train = _train(unit)
        buf = unit.grad_buf if unit.grad_buf is not None else self._acquire(train.layout.numel)
        unit.grad_buf = None
        out: Tensor | None = None
        if self.comm_dtype is not None:  # the mean in fp16/bf16 (not pooled: another dtype)
            work, out = low_precision_mean(
                buf, dtype=self.comm_dtype, group=self.group, scatter=self.reduce_op == "reduce_scatter"
            )
        elif self.reduce_op == "reduce_scatter":
            out = self._acquire(train.shard.numel())
            work = reduce_scatter_flat(out, buf, group=self.group, async_op=True)
        else:
            work = dist.all_reduce(buf, group=self.group, async_op=True)
        self._inflight.append((unit, work, buf, out))
        unit.reduced = True
        self._free_if_done(unit)
        if len(self._inflight) > self.max_inflight:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        unit, work, buf, out = self._inflight.pop(0)
        work.wait()
        n = _train(unit).shard.numel()
        low = self.comm_dtype is not None  # ``out`` is then the mean (or this rank's slice of it)
        if low and self.reduce_op != "reduce_scatter":
            assert out is not None
            out = out[self.rank * n : (self.rank + 1) * n]
        mine = out if out is not None else buf[self.rank * n : (self.rank + 1) * n]
        assert unit.grad_shard is not None
        unit.grad_shard.add_(mine, alpha=1.0 if low else 1.0 / self.world)
        self._release(buf)
        if out is not None and not low:
            self._release(out)

    def _finalize_backward(self) -> None:
        self._callback_queued = False
        if self._guard_through_backward:  # the first training step's backward is over
            self._end_guard()
        self._recording = False
        if self.defer_reduction:  # the window goes on: flush() reduces
            if self.reshard_after_forward:
                for unit in self.units:
                    if unit is not self.root:
                        self._free(unit)
            return
        if not self._pass_grads:  # torch.autograd.grad(..., inputs): nothing to reduce, the window goes on
            self._free_units()
            return
        self._pass_grads = False
        self._graph_hold = False  # the graph's backward has run: _reduce_all frees every unit
        self._reduce_all(finish=self._sync)

    def _reduce_all(self, *, finish: bool) -> None:
        """Launch every unit not reduced yet (zeros where it got no gradient: collectives must match),
        drain the queue, free every unit (the root is gathered again inside a step) and, with ``finish``,
        end the window."""
        for unit in self._reduce_order():
            if not unit.reduced:
                self._launch(unit)  # every rank reduces every unit: collectives must match
        missing = None
        if finish:
            names = [n for u in self.units for n in u.names]
            params = [p for u in self.units for p in u.params]
            missing = MissingGradients(
                [self._touched[id(p)] for p in params],
                names=names,
                group=self.group,
                device=self.device,
                find_unused_parameters=self.find_unused_parameters,
                params=params,
            )
        while self._inflight:
            self._complete_oldest()
        for unit in self.units:
            unit.reduced = False
            unit.pending = 0
            unit.backward_done = True
        self._free_units()  # inside a step (manual optimization) the root stays gathered
        if missing is not None:
            self._finish_window(missing)
        else:
            self._mark_window()

    def _finish_window(self, missing: MissingGradients) -> None:
        params = [p for u in self.units for p in u.params]
        for p in params:
            self._touched[id(p)] = False
        unused = missing.finish()  # raises, naming them, if gradients are missing and not allowed
        self.unused = frozenset(id(params[i]) for i in unused)
        # the gradient pipeline (see lightning_par.precision): attach to the masters, then rescale
        self._attach_grads()
        for listener in self._sync_listeners:
            listener()

    # ------------------------------------------------------------------ buffers
    def _acquire(self, numel: int) -> Tensor:
        free = self._pool.setdefault(numel, [])
        if free:
            return free.pop().zero_()
        self._pool_bytes += numel * self.dtype.itemsize
        return torch.zeros(numel, dtype=self.dtype, device=self.device)

    def _release(self, buf: Tensor) -> None:
        self._pool[buf.numel()].append(buf)


def _train(unit: Unit) -> Part:
    """The trainable part of a unit that receives gradients."""
    assert unit.train is not None
    return unit.train
