"""Parameters that became trainable after an engine was built.

Contract
--------
An engine manages the parameters that require gradients when it is built (their buckets, hooks, optimizer
shards). :class:`TrainableSet` reports, before each training forward, the parameters that require
gradients now without being managed: Lightning's ``BackboneFinetuning`` freezes a backbone at setup and
unfreezes it at a chosen epoch (handing it to ``optimizer.add_param_group``), and Fabric loops do the same
by hand.

* ZeRO stage 0 takes them in (:meth:`~lightning_par.zero.grad_sync.GradSync.prepare_window` rebuilds its
  buckets at the next step), so their gradients are averaged over the data-parallel group like the others.
  Torch's DDP registers its gradient hooks once and leaves them out: each rank trains them on its own
  gradients and the replicas drift apart.
* ZeRO 1-3 build the optimizer over shards of the parameters trainable at setup and refuse them at the
  next training forward, before any of their gradients is lost (:func:`refuse_unmanaged`).

Freezing a managed parameter is not a change of the set: it gets no gradient, which the unused-parameter
verdict handles as DDP does (:mod:`lightning_par.zero.unused`; ``find_unused_parameters=True`` when it
is meant), so ``toggle_optimizer``'s freezes inside a step cost nothing here. Checking costs one attribute
read per parameter and step; nothing is communicated. Every rank runs the same code between steps, so
every rank sees the same change (as DDP assumes of a model's structure).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NoReturn

from torch import nn

__all__ = ["TrainableSet", "name_list", "refuse_unmanaged"]


class TrainableSet:
    """``named_params`` (meta placeholders left out) and which of them the engine manages."""

    def __init__(
        self, named_params: Sequence[tuple[str, nn.Parameter]], managed: Iterable[nn.Parameter]
    ) -> None:
        self._named = [(n, p) for n, p in named_params if not p.is_meta]
        self._managed = {id(p) for p in managed}

    def unmanaged(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters that require gradients but are not managed, in registration order."""
        return [(n, p) for n, p in self._named if p.requires_grad and id(p) not in self._managed]

    def manage(self, params: Iterable[nn.Parameter]) -> None:
        self._managed.update(id(p) for p in params)


def name_list(names: list[str]) -> str:
    """Up to four quoted names, then how many more."""
    shown = ", ".join(repr(n) for n in names[:4])
    return shown + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def refuse_unmanaged(names: list[str], *, stages: str) -> NoReturn:
    """Raise the error for parameters made trainable after setup, which ZeRO ``stages`` (``"1/2"``,
    ``"3"``) cannot take in."""
    raise RuntimeError(
        f"requires_grad was set after setup on {name_list(names)}, which did not train at setup. ZeRO stage"
        f" {stages} built the optimizer over shards of the parameters trainable at setup and cannot add"
        " parameters later. Use zero_stage=0, which takes them in (e.g. Lightning's BackboneFinetuning), or"
        " make them trainable before fit and hold them still with lr=0 in a param group of their own."
    )
