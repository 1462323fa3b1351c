"""Torch function modes for the first-step watches (a ZeRO-3 parameter read where it is a placeholder, a
``param.grad`` read that finds nothing at ZeRO 1-3): a mode that checks every torch call before running
it, and leaving torch's thread-local mode stack wherever the mode sits on it; and the storage address
the watches match views by (``p.data``, ``.detach()`` of a watched tensor share it).

A mode watches only while it is on the stack of the thread that entered it (the main thread: Lightning's
hooks, a Fabric loop); torch runs autograd's nodes and hooks outside it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["Check", "CheckedCalls", "leave_mode", "mode_entered", "on_stack", "storage_address"]

Check = Callable[[Callable[..., Any], Sequence[Any], dict[str, Any]], None]


class CheckedCalls(TorchFunctionMode):
    """Calls ``check(func, args, kwargs)`` before every torch function and tensor method (property
    access included: ``func`` is then the descriptor's ``__get__`` / ``__set__``)."""

    def __init__(self, check: Check) -> None:
        super().__init__()
        self._check = check

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        self._check(func, args, kwargs)
        return func(*args, **kwargs)


@contextmanager
def mode_entered(mode: TorchFunctionMode | None) -> Iterator[None]:
    """Within: ``mode`` on torch's function-mode stack (None: nothing). At the exit it leaves wherever it
    sits (:func:`leave_mode`), where ``with mode:`` would pop the top of the stack: another watch entered
    inside and still on (the first step's ``param.grad`` watch, armed by a backward inside a
    manual-optimization step) would be popped in its place, and this one stranded for good."""
    if mode is None:
        yield
        return
    mode.__enter__()
    try:
        yield
    finally:
        leave_mode(mode)


def leave_mode(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off torch's function-mode stack wherever it is, keeping the order of the others (a
    mode the user entered after it stays)."""
    above: list[Any] = []
    while torch._C._len_torch_function_stack() > 0:
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)


def on_stack(mode: TorchFunctionMode) -> bool:
    """Whether ``mode`` is on torch's function-mode stack now (anywhere in it)."""
    depth = torch._C._len_torch_function_stack()
    return any(torch._C._get_function_stack_at(i) is mode for i in range(depth))


def storage_address(tensor: Tensor) -> int | None:
    """Where ``tensor``'s storage starts; None for tensors without one of their own (functorch's batched
    and gradient-tracking wrappers under ``torch.vmap`` / ``torch.func``, wrapper subclasses) and inside
    a compiled region, which does not trace storage access (a placeholder read there is not seen)."""
    if torch.compiler.is_compiling():
        return None
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
