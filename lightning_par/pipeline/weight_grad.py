"""The split backward of the zero-bubble schedule: input gradients now (``B``), weight gradients later
(``W``).

A chunk's backward does two jobs: the gradient of its input, which the previous stage waits for, and the
gradients of its weights, which nobody waits for. :class:`WeightGradSplit` separates them for the
``nn.Linear`` layers, where nearly all of a transformer's weight-gradient work is:

* during ``F``, a forward hook on each such layer keeps its input ``x`` (a reference: autograd keeps it
  anyway) and puts a hook on its output that records the output gradient ``dy`` when ``B`` computes it;
* ``B`` runs autograd only towards the chunk's input and the *other* parameters (norms, embeddings):
  ``torch.autograd.backward(out, grad, inputs=...)``, which skips the weight-gradient matrix products of
  the layers left out;
* ``W`` adds ``dW = dyᵀ x`` (and ``db = Σ dy``) for each recorded layer, the same products autograd would
  have computed, into the gradient the engine accumulates (``grad_of(param)``) or ``param.grad``, as
  one ``addmm_`` where the dtypes agree.

A linear layer whose parameter is shared with another module, or whose input needs no gradient in a
given forward (its output gradient would then not be computed by ``B``), stays in ``B``. The hooks are
registered for a step and removed after it (:meth:`attached`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

GradOf = Callable[[nn.Parameter], Tensor | None]
Key = tuple[int, int]  # (virtual stage, micro-batch)


class WeightGradSplit:
    """Defers the weight gradients of ``chunks``' linear layers from ``B`` to ``W`` (module docstring)."""

    def __init__(self, chunks: Sequence[nn.Module]) -> None:
        uses = Counter(id(p) for c in chunks for m in c.modules() for p in m.parameters(recurse=False))
        self._linears = [
            m
            for c in chunks
            for m in c.modules()
            if isinstance(m, nn.Linear)
            and m.weight.requires_grad
            and all(uses[id(p)] == 1 for p in m.parameters(recurse=False))
        ]
        deferred = {id(p) for m in self._linears for p in m.parameters(recurse=False)}
        self._eager = [
            [p for p in c.parameters() if p.requires_grad and id(p) not in deferred] for c in chunks
        ]
        self._key: Key | None = None
        self._stash: dict[Key, list[tuple[nn.Linear, Tensor, Tensor]]] = {}
        self._kept: dict[Key, list[nn.Parameter]] = {}  # linear parameters that stay in B this time

    @contextmanager
    def attached(self) -> Iterator[None]:
        """Hooks on the linear layers for one step; removed after it, with anything left unapplied."""
        handles = [m.register_forward_hook(self._on_forward) for m in self._linears]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._stash, self._kept, self._key = {}, {}, None

    @contextmanager
    def forward(self, key: Key) -> Iterator[None]:
        """The forward of ``key`` (virtual stage, micro-batch): its linear layers record for ``W``."""
        self._key = key
        try:
            yield
        finally:
            self._key = None

    def _on_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        key = self._key
        if key is None or not torch.is_grad_enabled() or not isinstance(output, Tensor):
            return  # evaluation, or a recomputation inside backward (activation checkpointing)
        x = args[0] if args else None
        if not isinstance(x, Tensor) or not x.requires_grad:
            # B would not compute this output's gradient: the layer's weights stay in B
            self._kept.setdefault(key, []).extend(module.parameters(recurse=False))
            return
        x = x.detach()

        def record(dy: Tensor) -> None:
            self._stash.setdefault(key, []).append((module, x, dy.detach()))  # type: ignore[arg-type]

        output.register_hook(record)

    def backward(self, out: Tensor, grad: Tensor | None, x: Any, *, chunk: int, key: Key) -> None:
        """``B``: the gradients of the chunk's input ``x`` and of every parameter but the deferred ones."""
        inputs: list[Tensor] = [*self._eager[chunk], *self._kept.pop(key, [])]
        if isinstance(x, Tensor) and x.requires_grad:
            inputs.append(x)
        if inputs:
            torch.autograd.backward(out, grad, inputs=inputs)
        else:  # nothing but deferred weights: one ordinary backward, nothing left for W
            torch.autograd.backward(out, grad)
            self._stash.pop(key, None)

    @torch.no_grad()
    def weights(self, key: Key, grad_of: GradOf | None = None) -> None:
        """``W``: the deferred weight (and bias) gradients of ``key``, added where gradients accumulate."""
        for module, x, dy in self._stash.pop(key, []):
            dy2 = dy.reshape(-1, dy.shape[-1])
            x2 = x.reshape(-1, x.shape[-1]).to(dy2.dtype)
            target = _target(module.weight, grad_of)
            if target is not None and target.dtype == dy2.dtype:
                # fused multiply-add into the accumulated gradient: a separate dW = dyᵀx followed by
                # target += dW costs a temporary and another pass over it, which made the split
                # backward ~5% slower than autograd's fused one on CPU
                target.addmm_(dy2.t(), x2)
            else:
                _add(module.weight, target, dy2.t().mm(x2))
            if module.bias is not None:
                _add(module.bias, _target(module.bias, grad_of), dy2.sum(0))


def _target(param: Tensor, grad_of: GradOf | None) -> Tensor | None:
    """Where ``param``'s gradient accumulates: the engine's buffer (``grad_of``), else ``param.grad``."""
    target = grad_of(param) if grad_of is not None else None  # type: ignore[arg-type]
    return target if target is not None else param.grad


def _add(param: Tensor, target: Tensor | None, value: Tensor) -> None:
    if target is not None:
        target.add_(value)
    else:
        param.grad = value.to(param.dtype)
