"""Where autograd is, as ZeRO-3's hooks need to know it: inside a backward pass, inside a reentrant
checkpoint's recomputation, and when the input gradients of a module's call are all computed.

``watch_input_grads`` tells when backward has passed a module's inputs (so its frozen weights, which
compute those gradients, may be freed). It uses torch's multi-gradient hook, which cannot watch a leaf
tensor inside ``torch.autograd.grad`` (an input that requires grad: a PINN's coordinates, a gradient
penalty's interpolated samples); :func:`alias_leaves` gives the module a view of each such leaf instead,
whose gradient is the leaf's, summed over the module's uses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import CheckpointFunction

__all__ = ["alias_leaves", "in_backward", "in_reentrant_recompute", "tensors_in", "watch_input_grads"]


def in_backward() -> bool:
    return bool(torch._C._current_graph_task_id() != -1)


def in_reentrant_recompute() -> bool:
    """Whether a reentrant checkpoint (``use_reentrant=True``) is recomputing its region: that forward
    runs inside the backward, and a nested backward pass through the recomputed graph follows. (The
    non-reentrant kind recomputes inside the node that needs a saved tensor, with no pass of its own.)"""
    node = torch._C._current_autograd_node()
    return node is not None and type(node) is CheckpointFunction._backward_cls


def tensors_in(value: Any) -> list[Tensor]:
    """The tensors in ``value``, in order, looking into lists, tuples, mappings and dataclasses: a unit's
    outputs (a module returning a dataclass or a ``UserDict``: before, its tensors went unseen, no hook
    re-gathered the unit for backward, and torch failed on its freed storage) and a batch's (Hugging
    Face's ``BatchEncoding``, a ``UserDict`` torch's pytree takes for a leaf)."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    if isinstance(value, Mapping):
        return [t for item in value.values() for t in tensors_in(item)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in tensors_in(getattr(value, f.name))]
    return []


def _watched_leaf(value: Any) -> bool:
    return isinstance(value, Tensor) and value.requires_grad and value.is_leaf


Call = tuple[tuple[Any, ...], dict[str, Any]]  # a module call's (args, kwargs)


def alias_leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call | None:
    """``(args, kwargs)`` with each top-level leaf tensor that requires grad replaced by a view of it;
    ``None`` when there is none (the call goes on unchanged)."""
    if not any(_watched_leaf(a) for a in (*args, *kwargs.values())):
        return None
    alias: Callable[[Any], Any] = lambda v: v.view_as(v) if _watched_leaf(v) else v  # noqa: E731
    return tuple(alias(a) for a in args), {k: alias(v) for k, v in kwargs.items()}


def watch_input_grads(inputs: Any, done: Callable[[], None]) -> bool:
    """Call ``done()`` in the backward pass once the gradients of every tensor in ``inputs`` that requires
    grad are computed; False (and no hook) when none requires grad."""
    tensors = [t for t in tensors_in(inputs) if t.requires_grad]
    if not tensors:
        return False
    torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: done(), mode="all")
    return True
