"""The points of a gradient window that other parts of the engine listen to.

Contract
--------
:class:`SyncEvents` is a base of :class:`~lightning_par.zero.grad_sync.GradSync`: it keeps one list of
callbacks per event and calls them in registration order, synchronously, on the thread that runs the
backward (or the forward pre-hook). The events, in the order a window meets them:

* ``before_accumulate``: before gradients may accumulate (each training forward; the start of a backward
  the strategy runs, before any of its gradients);
* ``on_pass_start``: the first gradient of any backward pass, before anything of it is folded or reduced;
* ``on_pass_end``: the end of a non-final pass of the window (``no_sync``);
* ``on_reduced`` then ``on_synchronized``: the window's final pass has reduced every gradient; the first
  hand the gradients to whoever reads them, the second see them attached;
* ``on_relayout``: the layout (parameter order) changed, at any point outside a reduction.

Listeners must not raise for control flow: an exception propagates out of the backward (or forward).
"""

from __future__ import annotations

from collections.abc import Callable

Listener = Callable[[], None]


class SyncEvents:
    """Callback lists of a gradient window (see the module docstring)."""

    def __init__(self) -> None:
        self._relayout_listeners: list[Listener] = []
        self._attachers: list[Listener] = []
        self._sync_listeners: list[Listener] = []
        self._pass_listeners: list[Listener] = []
        self._pass_end_listeners: list[Listener] = []
        self._before_listeners: list[Listener] = []

    @staticmethod
    def _emit(listeners: list[Listener]) -> None:
        for listener in listeners:
            listener()

    def on_relayout(self, listener: Listener) -> None:
        """Call ``listener()`` after the layout (parameter order) changes."""
        self._relayout_listeners.append(listener)

    def on_pass_start(self, listener: Listener) -> None:
        """Call ``listener()`` when the first gradient of a backward pass arrives, before anything of the
        pass is folded or reduced, in any pass: the one the strategy runs and one user code starts itself
        (``loss.backward()`` in manual optimization or a callback, ``torch.autograd.backward(params,
        grads)``, a validation step's backward)."""
        self._pass_listeners.append(listener)

    def on_pass_end(self, listener: Listener) -> None:
        """Call ``listener()`` at the end of each non-final pass of a window (``no_sync``)."""
        self._pass_end_listeners.append(listener)

    def before_accumulate(self, listener: Listener) -> None:
        """Call ``listener()`` before gradients may accumulate: before each training forward, and when a
        backward the strategy runs starts (``watch_backward``), before any gradient of it."""
        self._before_listeners.append(listener)

    def on_reduced(self, attach: Listener) -> None:
        """Call ``attach()`` when a window's gradients are reduced, before any :meth:`on_synchronized`
        listener: it hands them to whoever reads them (the sharded optimizer's masters)."""
        self._attachers.append(attach)

    def on_synchronized(self, listener: Listener) -> None:
        """Call ``listener()`` when the final backward of a window has reduced all gradients and they have
        been attached (``param.grad``, then the :meth:`on_reduced` attachers)."""
        self._sync_listeners.append(listener)


__all__ = ["Listener", "SyncEvents"]
