"""Every reader of a ``region_input``'s output gets the gradient sum it needs, whoever reads it.

Why
---
``region_input`` on a module (a norm) puts ``copy_to`` on its output: one all-reduce in the backward sums
the partial input gradients of all the column-parallel layers that read it (each rank computed its own
output columns only). That is right where those layers are the output's only readers: a pre-LN block
(Llama's ``input_layernorm``, GPT-2's ``ln_1``). Where something else reads it too, its gradient is whole
on every rank already, and the all-reduce summed it ``t`` times, on every rank alike (the replica check
sees nothing): in a post-LN block, ``h = LN(h + sublayer(h))`` (BERT, DistilBERT, BART), the norm's output
is the next residual stream (a probe: DistilBERT at tp2, weights 0.70 off one process after 4 SGD steps);
a value head on a causal LM's final norm (TRL's ``AutoModelForCausalLMWithValueHead``, PPO), read beside
the column-parallel ``lm_head`` of the shipped plans, doubled every gradient below that norm at tp2.
Whether another reader contributes can change from step to step (a zero-initialised value head, an
auxiliary loss warmed up from 0, alternating tasks, a second forward without the head before one
backward), so nothing is decided once: every backward corrects every region output.

How
---
Each backward that reaches a region's output hands a tensor hook the gradient arriving there, ``g`` (the
sum over all its readers), before ``copy_to``'s all-reduce; the column-parallel readers (and PEFT LoRA
``A`` layers, which read it for column-parallel ``B`` layers) send theirs, ``g_c``, back through a view of
their input, tapped. A reader that takes the output through a few one-input operations (Hugging Face's
``lm_head`` reads ``hidden_states[:, slice]``; PEFT's LoRA dropout; a cast) is tapped where the last of
them sends its gradient to the output (a hook on its backward node: nothing is recomputed, and a
checkpointed layer's saved tensors are unpacked once). The hook hands the all-reduce
``(g + (t - 1) g_c) / t``: with ``g = g_c + g_o`` (``g_o``, the other readers' share, the same on every
rank) it sums to ``sum_r g_c,r + g_o``, what one process computes; with no other reader it is ``g``.
The direct readers of one output share one view, so autograd sums their gradients as it would anyway;
the cost is one pass over each region output's gradient per backward (and one per reader through such
operations), in the gradient's dtype, no communication, no host read. In a backward with
``create_graph`` (a gradient penalty) the hook hands ``g - (1 - 1/t) (g - g_c)``, the same value with
its derivative through all of ``g``, so the other readers' second-order share is summed as their first.
A column-parallel layer whose input no region output reaches (directly or through such operations)
would never have its input gradient summed: it is refused in that forward, before its backward, naming
the fix. A deep copy of the converted model carries the hooks, and is corrected by the same check (each
output keyed apart). The hooks run eagerly (a ``torch.compile``'d model breaks its graph at them).
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["RegionCheck", "check_regions"]

_UNARY_DEPTH = 4  # one-input autograd nodes allowed between a region's output and a column-parallel reader
_MAX_FORWARDS = 8  # outputs of a region held at once (forwards no backward reached: dropped, oldest first)

Last = tuple[Any, int] | None  # the backward node nearest a region's output on a reader's way, its input


class RegionCheck:
    """The correction of one apply_tensor_parallel call's regions (see the module docstring)."""

    def __init__(self, regions: dict[str, nn.Module], readers: dict[str, nn.Module], *, size: int) -> None:
        self._size = size
        # outputs in flight: key -> (region, its output's autograd node, held weakly where it can be: a
        # recomputation's output, which no backward reaches, then keeps no graph alive), the keys by node
        # and by region (at most _MAX_FORWARDS of a region: forwards no backward reached, oldest first)
        self._watched: dict[int, tuple[int, Callable[[], Any], int]] = {}
        self._by_node: dict[int, int] = {}
        self._by_region: dict[int, deque[int]] = {}
        self._keys = itertools.count()
        self._tapped: dict[int, Tensor] = {}  # key -> its column-parallel readers' summed gradient
        # key -> the view its direct readers share (autograd sums their gradients into it: one tap), held
        # weakly: where it is not kept for the backward (activation checkpointing), each read taps its own
        self._shared: dict[int, weakref.ref[Tensor]] = {}
        self._hooked: dict[int, set[int]] = {}  # key -> the chain nodes whose gradient is tapped
        self._handles: list[RemovableHandle] = []
        # a deep copy of the model (a critic or a student made from the converted policy) carries these
        # hooks, the same functions, and its copy_to all-reduces: its regions and readers are corrected by
        # this check too, each output keyed apart (a copy's readers never reach the original's outputs)
        disable = torch.compiler.disable
        for module in regions.values():
            self._handles.append(module.register_forward_hook(disable(self._watch)))
        for name, reader in readers.items():
            tap = functools.partial(self._tap, name=name)
            self._handles.append(reader.register_forward_pre_hook(disable(tap)))

    def _watch(self, module: nn.Module, _args: Any, output: Any) -> None:
        region = id(module)
        if not isinstance(output, Tensor) or output.grad_fn is None:
            return
        held = self._by_region.setdefault(region, deque())
        while len(held) >= _MAX_FORWARDS:  # forwards no backward reached
            self._drop(held.popleft())
        # every forward (one may run with an adapter disabled, a recomputation may repeat one, two may
        # run before one backward): each output is corrected by its own readers
        key, node = next(self._keys), output.grad_fn
        try:  # copy_to's and the SP gather's nodes (autograd Functions) can be referenced weakly
            ref: Callable[[], Any] = weakref.ref(node)
        except TypeError:
            ref = lambda: node  # noqa: E731
        self._watched[key] = (region, ref, id(node))
        self._by_node[id(node)] = key
        held.append(key)
        output.register_hook(lambda grad: self._on_grad(key, grad))

    def _drop(self, key: int) -> None:
        held = self._watched.pop(key, None)
        self._shared.pop(key, None)
        self._hooked.pop(key, None)
        if held is not None and self._by_node.get(held[2]) == key:
            del self._by_node[held[2]]

    def _tap(self, _module: nn.Module, args: tuple[Any, ...], *, name: str) -> tuple[Any, ...] | None:
        x = args[0] if args else None
        if not isinstance(x, Tensor) or not x.requires_grad:
            return None
        found = self._origin(x)
        if found is None:
            raise RuntimeError(
                f"Tensor parallelism: the column-parallel layer {name!r} reads an input that no"
                " region_input module's output reaches directly or through a dropout, cast or view (not"
                " through an operation of several inputs, or inside a torch.compile'd graph): the plan has"
                " region_input entries, so column-parallel layers leave the sum of their input gradients"
                " over the tensor-parallel group to those regions, and this one's would never be summed"
                " (the model would train wrong). Mark the module whose output it reads region_input, read"
                " that output directly, or leave region_input out of the plan (each column-parallel layer"
                " then sums its own). Checked in every forward, before its backward."
            )
        key, last_op = found
        if last_op is not None:  # the gradient the last operation before the output sends it, once per node
            last, index = last_op
            hooked = self._hooked.setdefault(key, set())
            if id(last) not in hooked:
                hooked.add(id(last))
                last.register_hook(lambda inputs, _outputs: self._add(key, inputs[index]))
            return None
        shared = self._shared.get(key)
        view = shared() if shared is not None else None
        if view is None:
            view = x.view_as(x)
            view.register_hook(lambda grad: self._add(key, grad))
            self._shared[key] = weakref.ref(view)
        return (view, *args[1:])

    def _origin(self, x: Tensor) -> tuple[int, Last] | None:
        """The key of the watched region output that ``x`` is, or comes from through one-input operations
        only (a dropout, a cast, a view: up to ``_UNARY_DEPTH`` autograd nodes with one differentiable
        input each), with the last of those operations' backward nodes and the index of its input (None
        for ``x`` itself)."""
        node: Any = x.grad_fn
        last: Last = None
        for _ in range(_UNARY_DEPTH + 1):
            if node is None:
                return None
            key = self._by_node.get(id(node))
            if key is not None and self._watched[key][1]() is node:
                return key, last
            inputs = [(f, i) for i, (f, _) in enumerate(node.next_functions) if f is not None]
            if len(inputs) != 1:
                return None
            last = (node, inputs[0][1])
            node = inputs[0][0]
        return None

    def _add(self, key: int, grad: Tensor | None) -> None:
        if grad is None:
            return
        held = self._tapped.get(key)
        self._tapped[key] = grad.detach() if held is None else held + grad.detach()

    def _on_grad(self, key: int, grad: Tensor) -> Tensor:
        self._drop(key)
        readers = self._tapped.pop(key, None)
        t = self._size
        if torch.is_grad_enabled():
            # a backward with create_graph (a gradient penalty): the same value, with the derivative through
            # the whole gradient, whose other readers' share is then summed as their first-order one
            other = grad.detach() if readers is None else grad.detach() - readers.to(grad.dtype)
            return grad - (1 - 1 / t) * other
        if readers is None:  # no column-parallel layer read it: all of it is the other readers' (equal)
            return grad / t
        # the all-reduce then sums the column-parallel shares once and the other readers' (equal) once
        return torch.add(grad, readers.to(grad.dtype), alpha=t - 1).div_(t)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._watched.clear()
        self._by_node.clear()
        self._by_region.clear()
        self._shared.clear()
        self._hooked.clear()


def check_regions(
    regions: dict[str, nn.Module], readers: dict[str, nn.Module], *, size: int
) -> RegionCheck | None:
    """Start the correction of ``regions`` (name -> the module marked ``region_input``) read by ``readers``
    (name -> the column-parallel layers that skip their own input copy, and LoRA ``A`` layers beside
    them), over a tensor-parallel group of ``size`` ranks."""
    return RegionCheck(regions, readers, size=size) if regions else None
