"""The forward side of a ZeRO-3 engine: the hooks that gather a unit before its forward and free it after.

Contract
--------
:class:`Stage3Hooks` is a base of :class:`~lightning_par.zero.stage3.Stage3Engine` and declares the
engine attributes it works on.

* Before a unit's forward (a pre-hook put ahead of the module's own, which may read the parameters) its
  gather is waited for, and, with ``prefetch``, the next unit in the recorded forward order is launched;
  the first forward records that order. A unit's forward outside a step ends the windows of refused reads.
* After it, the unit is freed unless a backward will need it (``reshard_after_forward=False`` keeps it
  gathered); a multi-grad hook on its outputs (and the bases of views among them) gathers it again
  before its backward. The root stays gathered after any forward of its own (code after a ``no_grad``
  forward reads root parameters).
* Frozen parameters are kept until the gradients of the unit's inputs are computed (their backward
  needs the weights after the trainable ones' gradients are reduced).
* A module holding root parameters called without the root's forward (``generate()``'s embedding and head)
  borrows the gathered root for the call.
* Every hook acts on its own module only (:mod:`lightning_par.owned_hooks`): a copy of the model (an EMA)
  carries the hooks and neither gathers the original's units nor computes with copies of placeholders.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_par.owned_hooks import PlaceholderCopies, for_owner
from lightning_par.zero.autograd_state import (
    alias_leaves,
    in_backward,
    in_reentrant_recompute,
    tensors_in,
    watch_input_grads,
)
from lightning_par.zero.stage3_between import ReadWindows
from lightning_par.zero.stage3_calls import CrossUnitGuard
from lightning_par.zero.stage3_load import load_into_shards
from lightning_par.zero.stage3_reduce import Stage3Reduce
from lightning_par.zero.stage3_state import guard_unit_state_dicts
from lightning_par.zero.trainable import TrainableSet, refuse_unmanaged
from lightning_par.zero.unit import Unit


class Stage3Hooks(Stage3Reduce, ReadWindows):
    """Gathers and frees of a ZeRO-3 engine's units around their forwards (see the module docstring)."""

    module: nn.Module
    rank: int
    prefetch: bool
    _handles: list[RemovableHandle]
    _borrower: nn.Module | None
    _trainable: TrainableSet
    _cross_guard: CrossUnitGuard | None

    def _install_hooks(self) -> None:
        # The forward hooks run eagerly inside a torch.compile'd model (a graph break at each unit, as FSDP2
        # does without compiled autograd): traced, their `p.data =` swaps would become in-graph mutations of
        # tensors the compiled backward saved ("modified by an inplace operation").
        # The gathers run before the module's own forward pre-hooks (prepend), which may read the
        # parameters: torch.nn.utils.weight_norm computes the weight from weight_g and weight_v there (run
        # ahead of the gather, it read NaN placeholders). The reshards run after the module's forward hooks.
        # Every hook acts on its own module only: a copy of the model (an EMA) carries the hooks, and must
        # neither gather the original's units nor compute with copies of placeholders (owned_hooks.py).
        copies = PlaceholderCopies()
        for unit in self.units:
            module = unit.module
            pre = for_owner(module, self._make_pre_forward(unit), on_copy=copies, eager=True)
            self._handles.append(module.register_forward_pre_hook(pre, prepend=True))
            if unit.has_frozen:
                watch = for_owner(module, self._make_watch_inputs(unit), eager=True)
                self._handles.append(module.register_forward_pre_hook(watch, with_kwargs=True))
            post = for_owner(module, self._make_post_forward(unit), eager=True)
            self._handles.append(module.register_forward_hook(post))
            for p in unit.params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._handles += guard_unit_state_dicts(self.module, self.units, self.own_reads, on_copy=copies)
        self._handles += load_into_shards(self.module, self.units, self.rank)  # load_state_dict works
        if self.root is not None:  # the modules holding root parameters, called without the root's forward
            mine = {id(p) for part in self.root.parts for p in part.params}
            for m in self.module.modules():
                if m is not self.module and any(id(p) in mine for p in m.parameters(recurse=False)):
                    borrow = for_owner(m, self._borrow_root, on_copy=copies, eager=True)
                    self._handles.append(m.register_forward_pre_hook(borrow, prepend=True))
                    self._handles.append(m.register_forward_hook(for_owner(m, self._return_root, eager=True)))

    def _borrow_root(self, module: nn.Module, args: Any) -> None:
        """Gather the root unit for a call of ``module`` (it holds root parameters) while nothing else
        holds it: no step, no forward of the root module. Hugging Face's ``generate()`` in a Lightning
        hook calls the embedding and the head that way; placeholders would give NaN logits."""
        if self.root is not None and self.root.state == "sharded":
            self._wait(self.root)
            self._borrower = module

    def _return_root(self, module: nn.Module, args: Any, output: Any) -> None:
        """The borrower's call is over: free the root, unless a backward will need it (as in a step)."""
        if module is self._borrower and self.root is not None:
            self._borrower = None
            if not torch.is_grad_enabled() and not in_backward():
                self._free(self.root)

    # ------------------------------------------------------------------ forward hooks
    def _make_pre_forward(self, unit: Unit) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if unit is self.root:
                self._check_trainable()
            self._pre_forward(unit)

        return hook

    def _make_watch_inputs(self, unit: Unit) -> Callable[..., tuple[Any, Any] | None]:
        """A forward pre-hook run after the module's own (which may replace the inputs): frozen weights are
        needed until the input gradients are computed, after the trainable ones' are reduced: in the
        backward of this forward, or of a reentrant recomputation's."""

        def hook(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
            if not torch.is_grad_enabled() or (in_backward() and not in_reentrant_recompute()):
                return None
            aliased = alias_leaves(args, kwargs)  # leaves cannot be watched inside autograd.grad()
            self._watch_inputs(unit, aliased or (args, kwargs))
            return aliased

        return hook

    def _check_trainable(self) -> None:
        """Refuse, before a training forward, parameters made trainable since setup (the optimizer holds
        shards of the parameters trainable then; :mod:`lightning_par.zero.trainable`)."""
        if torch.is_grad_enabled() and not in_backward():
            new = self._trainable.unmanaged()
            if new:
                refuse_unmanaged([n for n, _ in new], stages="3")

    def _watch_inputs(self, unit: Unit, inputs: Any) -> None:
        """Mark the unit's backward as done when the gradients of all its inputs are computed."""

        def done() -> None:
            unit.backward_done = True
            self._free_if_done(unit)

        # without inputs that require grad there is no backward path through the frozen weights
        unit.backward_done = not watch_input_grads(inputs, done)

    def _pre_forward(self, unit: Unit) -> None:
        backward = in_backward()
        if not backward:  # a step starts: the windows of refused reads outside the steps end
            self.end_read_windows()
        if self._recording and not backward and unit is not self.root and unit not in self._order:
            self._order.append(unit)
        self._wait(unit)
        if self.prefetch and not backward and unit in self._order and not self._recording:
            i = self._order.index(unit)
            if i + 1 < len(self._order):
                self._gather(self._order[i + 1])

    def _make_post_forward(self, unit: Unit) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            return self._post_forward(unit, output)

        return hook

    def _post_forward(self, unit: Unit, output: Any) -> Any:
        if torch.is_grad_enabled():
            tensors = [t for t in tensors_in(output) if t.requires_grad]
            if not in_backward():
                unit.needs_backward = bool(tensors)
            if tensors:
                # the bases of views too: an in-place write through another view of an output's base (a
                # head's `b = proj(h).squeeze(-1); b += c`, Hugging Face's negative-binomial output) moves
                # the backward onto the base's history, past the output's own node (before: the unit's
                # backward read its freed weights, "setStorage: ... out of bounds for storage of size 0")
                hooked = {id(t): t for t in tensors}
                for t in tensors:
                    if t._base is not None and t._base.requires_grad:
                        hooked.setdefault(id(t._base), t._base)
                torch.autograd.graph.register_multi_grad_hook(
                    list(hooked.values()), lambda grads: self._pre_backward(unit), mode="any"
                )
        if unit is self.root:
            if self._order:
                self._recording = False  # the first full forward has been seen
                if not self._in_step:  # outside the Trainer's steps (Fabric): the guard ends with it,
                    self._end_guard_after(training=torch.is_grad_enabled())  # or with its backward
            # the root stays gathered after a forward without gradients too, as FSDP2's root does: the code
            # after it reads root parameters (a temperature or logit scale scoring the outputs; freed here,
            # they were NaN placeholders, silently). The step's end frees it (forward_context), else the
            # next optimizer step, load or backward's reduction (after_step, masters_changed, _reduce_all)
            return output
        if (self.reshard_after_forward or not torch.is_grad_enabled()) and not in_backward():
            self._free(unit)
        return output

    def _pre_backward(self, unit: Unit) -> None:
        self._settle_before(unit)  # before this unit's gathers, on every rank alike
        self._queue_callback()
        self._hold_for_graph()
        self._wait(unit)
        if self.prefetch and unit in self._order:
            i = self._order.index(unit)
            previous = self._order[i - 1] if i > 0 else None
            if previous is not None and previous.needs_backward and not previous.reduced:
                self._gather(previous)

    def _end_guard(self) -> None:
        """The cross-unit guard's end: after the first training step's backward, the first evaluation
        step (:meth:`forward_context`), or, outside the Trainer's steps, the root's first forward."""
        self._guard_through_backward = False
        if self._cross_guard is not None:
            self._cross_guard.remove()
            self._cross_guard = None

    def _end_guard_after(self, *, training: bool) -> None:
        """The first forward is over. After a training one its call checks stay for the backward that
        follows and end with it (``_finalize_backward``; at the next step if none comes): a custom
        autograd Function calling a unit's submodules in its backward (reversible layers: Reformer,
        RevNets) computed with NaN placeholders there, and trained to NaN without a word."""
        if training:
            self._guard_through_backward = True
        else:
            self._end_guard()
