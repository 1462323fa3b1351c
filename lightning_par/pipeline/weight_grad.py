"""The split backward of the zero-bubble schedule: input gradients now (``B``), weight gradients later
(``W``).

A chunk's backward does two jobs: the gradient of its input, which the previous stage waits for, and the
gradients of its weights, which nobody waits for. :class:`WeightGradSplit` separates them for the layers
whose output is one matrix product with a trainable weight, where nearly all of a transformer's
weight-gradient work is (:func:`weight_layout`): ``nn.Linear`` and our tensor-parallel linears
(``y = x Wᵀ + b``, ``W`` stored ``(out, in)``) and Hugging Face's ``Conv1D`` of GPT-2 and its kin
(``y = x W + b``, ``W`` stored ``(in, out)``):

* during ``F``, a forward hook on each such layer keeps its input ``x`` (a reference: autograd keeps it
  anyway) and puts a hook on its output that records the output gradient ``dy`` when ``B`` computes it;
* ``B`` runs autograd only towards the chunk's input and the *other* parameters (norms, embeddings):
  ``torch.autograd.backward(out, grad, inputs=...)``, which skips the weight-gradient matrix products of
  the layers left out;
* ``W`` adds ``dW = dyᵀ x`` (``xᵀ dy`` for an ``(in, out)`` weight) and ``db = Σ dy`` for each recorded
  layer, the same products autograd would have computed, into the gradient the engine accumulates
  (``grad_of(param)``) or ``param.grad``, as one ``addmm_`` where the dtypes agree.

Why the tensor-parallel layers qualify: a column-parallel layer's input passes through an identity
forward (its all-reduce is in backward) and, without ``gather_output``, its output is the local product;
a row-parallel layer's all-reduce has an identity backward, so without sequence parallelism its output
gradient is the local product's. With ``gather_output`` or sequence parallelism the layer's output
gradient is not the product's, and it stays in ``B``.

A layer whose parameter is shared with another module, whose input needs no gradient in a given
forward (its output gradient would then not be computed by ``B``), or whose forward did not run in a
given micro-batch (``nn.MultiheadAttention`` multiplies by ``out_proj.weight`` without calling
``out_proj``), stays in ``B``. Not detected: a weight used both by its layer's forward and directly in
the same micro-batch (``F.linear(x, layer.weight)`` in another module's code); ``W`` would add only the
forward's share. Register such a weight as a parameter of both modules (shared, it stays in ``B``), or
use ``1f1b``. Reentrant activation checkpointing (``use_reentrant=True``) runs a region's backward as
a nested pass that ``inputs=`` cannot restrict, which torch refuses: the split refuses Hugging Face's
reentrant flag when built and at every step, and names the fix if torch raises for another. The hooks are
registered for a step and removed after it (:meth:`attached`); they run eagerly inside a
``torch.compile``d block (a graph break at each deferrable layer). Chunks with none of these layers have
empty ``W`` passes, which leaves zero bubble with 1F1B's work in a schedule built for less: a warning
says so when the split is built.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_par.pipeline.mail import backward_args, grad_leaves
from lightning_par.tensor_parallel.layers import SUMMED_ATTR, ColumnParallelLinear, RowParallelLinear

GradOf = Callable[[nn.Parameter], Tensor | None]
Key = tuple[int, int]  # (virtual stage, micro-batch)
Layout = Literal["out_in", "in_out"]  # how a deferrable layer stores its weight


def weight_layout(module: nn.Module) -> Layout | None:
    """``"out_in"`` for a layer computing ``x Wᵀ + b``, ``"in_out"`` for ``x W + b`` (transformers'
    ``Conv1D``), ``None`` for a layer whose weight gradient the split cannot defer (module docstring).
    A layer with a parameter whose gradient a hook sums over the tensor-parallel group (a LoRA ``A``
    beside a column-parallel ``B``) is not deferred: ``W`` adds into the gradient past tensor hooks."""
    if getattr(module, SUMMED_ATTR, None):
        return None
    if isinstance(module, nn.Linear):
        return "out_in"
    if isinstance(module, ColumnParallelLinear):
        return None if module.gather_output else "out_in"
    if isinstance(module, RowParallelLinear):
        return None if module.sequence_parallel else "out_in"
    # looked up, not imported: a model holding Conv1D layers has imported transformers already
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    if conv1d is not None and isinstance(module, conv1d):
        return "in_out"
    return None


_REENTRANT_FIX = (
    " The zero-bubble schedules split each backward with torch.autograd.backward(inputs=...), which"
    " reentrant activation checkpointing refuses. Checkpoint with use_reentrant=False (Hugging Face:"
    " model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}), the"
    " default from transformers 5), or use pipeline_schedule='1f1b' / 'interleaved_1f1b'."
)


def checkpointable(chunks: Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    """The modules of ``chunks`` Hugging Face's activation checkpointing can switch on: those with a
    ``gradient_checkpointing`` attribute (it only flags modules that have one), named within their chunk."""
    return [
        (name or type(m).__name__, m)
        for c in chunks
        for name, m in c.named_modules()
        if hasattr(m, "gradient_checkpointing")
    ]


def reentrant_checkpointed(modules: Sequence[tuple[str, nn.Module]]) -> list[str]:
    """The names among ``modules`` (:func:`checkpointable`) that Hugging Face's activation checkpointing
    runs reentrantly: flagged ``gradient_checkpointing`` with a checkpoint function bound to
    ``use_reentrant=True`` (torch's default when unset; transformers 4 binds it)."""
    found = []
    for name, m in modules:
        func = getattr(m, "_gradient_checkpointing_func", None)
        if (
            getattr(m, "gradient_checkpointing", False) is True
            and isinstance(func, functools.partial)
            and func.keywords.get("use_reentrant", True)
        ):
            found.append(name)
    return found


class WeightGradSplit:
    """Defers the weight gradients of ``chunks``' matrix-product layers from ``B`` to ``W`` (module
    docstring). ``rank`` only names this rank in the warning about chunks with nothing to defer."""

    def __init__(self, chunks: Sequence[nn.Module], *, rank: int | None = None) -> None:
        uses = Counter(id(p) for c in chunks for m in c.modules() for p in m.parameters(recurse=False))
        self._layout: dict[nn.Module, Layout] = {}
        for m in (m for c in chunks for m in c.modules()):
            layout = weight_layout(m)
            weight = getattr(m, "weight", None)
            if (
                layout is not None
                and isinstance(weight, nn.Parameter)
                and weight.requires_grad
                and all(uses[id(p)] == 1 for p in m.parameters(recurse=False))
            ):
                self._layout[m] = layout
        self._linears = list(self._layout)
        if not self._linears:
            where = "this rank's chunks have" if rank is None else f"pipeline rank {rank}'s chunks have"
            warnings.warn(
                f"The zero-bubble split backward found nothing to defer: {where} no trainable, unshared"
                " nn.Linear, transformers Conv1D or tensor-parallel linear layer, so its W passes are"
                " empty and the schedule's idle slots stay idle. Use pipeline_schedule='1f1b' (or"
                " 'interleaved_1f1b') for such a model.",
                stacklevel=2,
            )
        self._chunks = list(chunks)
        mine = [{id(m) for m in c.modules()} for c in self._chunks]
        self._chunk_linears = [[m for m in self._linears if id(m) in ids] for ids in mine]
        self._eager: list[list[nn.Parameter]] = []  # per chunk, what B differentiates besides the input
        self._key: Key | None = None
        self._stash: dict[Key, list[tuple[nn.Module, Tensor, Tensor]]] = {}
        self._kept: dict[Key, list[nn.Parameter]] = {}  # linear parameters that stay in B this time
        self._hooked: dict[Key, set[nn.Module]] = {}  # layers whose forward ran (recorded or kept)
        # found once, checked at every step (the flag can be switched on after the split is built)
        self._checkpointable = checkpointable(self._chunks)
        self._refuse_reentrant()  # at setup already, where the model came with checkpointing on

    def _refuse_reentrant(self) -> None:
        reentrant = reentrant_checkpointed(self._checkpointable)
        if reentrant:
            raise ValueError(
                f"{len(reentrant)} layer(s) of this pipeline rank use reentrant activation checkpointing"
                f" ({', '.join(reentrant[:3])}{', ...' if len(reentrant) > 3 else ''})." + _REENTRANT_FIX
            )

    @contextmanager
    def attached(self) -> Iterator[None]:
        """Hooks on the deferrable layers for one step; removed after it, with anything left unapplied.
        Refuses reentrant activation checkpointing first (turned on since construction), before the
        step's first transfer."""
        self._refuse_reentrant()
        # eager inside a torch.compile'd block: traced into the graph, its per-micro-batch bookkeeping
        # (the key, the output-gradient hooks) went wrong: zb on compiled Llama layers drifted from one
        # process after the first step (tests/test_pp_hf.py, zb-compiled)
        hook = torch.compiler.disable(self._on_forward)
        handles = [m.register_forward_hook(hook) for m in self._linears]
        # the parameters are read at every step, not kept from construction: an engine that materialises
        # meta parameters (ZeRO-3 meta init) replaces the parameter objects after the split is built
        deferred = {id(p) for m in self._linears for p in m.parameters(recurse=False)}
        self._eager = [
            [p for p in c.parameters() if p.requires_grad and id(p) not in deferred] for c in self._chunks
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._stash, self._kept, self._hooked, self._key = {}, {}, {}, None

    @contextmanager
    def forward(self, key: Key) -> Iterator[None]:
        """The forward of ``key`` (virtual stage, micro-batch): its deferrable layers record for ``W``."""
        self._key = key
        try:
            yield
        finally:
            self._key = None

    def _on_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        key = self._key
        if key is None or not torch.is_grad_enabled() or not isinstance(output, Tensor):
            return  # evaluation, or a recomputation inside backward (activation checkpointing)
        self._hooked.setdefault(key, set()).add(module)
        x = args[0] if args else None
        if not isinstance(x, Tensor) or not x.requires_grad:
            # B would not compute this output's gradient: the layer's weights stay in B
            self._kept.setdefault(key, []).extend(module.parameters(recurse=False))
            return
        x = x.detach()

        def record(dy: Tensor) -> None:
            self._stash.setdefault(key, []).append((module, x, dy.detach()))

        output.register_hook(record)

    def backward(self, out: Any, grads: Sequence[Tensor] | None, x: Any, *, chunk: int, key: Key) -> None:
        """``B``: the gradients of the chunk's input ``x`` and of every parameter but the deferred ones.
        ``out`` and ``grads`` as the runtime passes them (``mail.backward_args``): the loss and ``None`` on
        the last stage, else the output (a tensor or a tuple) and one gradient per floating-point part."""
        outs, dys = backward_args(out, grads)
        if not outs:  # nothing in the output needs a gradient: no backward, nothing for W
            self._stash.pop(key, None)
            return
        # a layer whose forward did not run has nothing recorded for W, yet its weight may have been
        # used (nn.MultiheadAttention applies out_proj.weight without calling out_proj): B computes it
        hooked = self._hooked.pop(key, set())
        unhooked = [
            p
            for m in self._chunk_linears[chunk]
            if m not in hooked
            for p in m.parameters(recurse=False)
            if p.requires_grad
        ]
        inputs: list[Tensor] = [*self._eager[chunk], *self._kept.pop(key, []), *unhooked, *grad_leaves(x)]
        if inputs:
            try:
                torch.autograd.backward(outs, dys, inputs=inputs)
            except RuntimeError as error:  # a reentrant checkpoint called directly, not flagged
                if "use_reentrant=True" not in str(error):
                    raise
                raise RuntimeError(
                    "Reentrant activation checkpointing inside a pipeline chunk." + _REENTRANT_FIX
                ) from error
        else:  # nothing but deferred weights: one ordinary backward, nothing left for W
            torch.autograd.backward(outs, dys)
            self._stash.pop(key, None)

    @torch.no_grad()
    def weights(self, key: Key, grad_of: GradOf | None = None) -> None:
        """``W``: the deferred weight (and bias) gradients of ``key``, added where gradients accumulate."""
        for module, x, dy in self._stash.pop(key, []):
            dy2 = dy.reshape(-1, dy.shape[-1])
            x2 = x.reshape(-1, x.shape[-1]).to(dy2.dtype)
            # dW = dyᵀ x for an (out, in) weight, xᵀ dy for an (in, out) one
            a, b = (dy2.t(), x2) if self._layout[module] == "out_in" else (x2.t(), dy2)
            weight: Tensor = module.weight  # type: ignore[assignment]
            target = _target(weight, grad_of)
            if target is not None and target.dtype == dy2.dtype:
                # fused multiply-add into the accumulated gradient: a separate dW = dyᵀx followed by
                # target += dW costs a temporary and another pass over it, which made the split
                # backward ~5% slower than autograd's fused one on CPU
                target.addmm_(a, b)
            else:
                _add(weight, target, a.mm(b))
            bias = getattr(module, "bias", None)
            if isinstance(bias, Tensor):
                _add(bias, _target(bias, grad_of), dy2.sum(0))


def _target(param: Tensor, grad_of: GradOf | None) -> Tensor | None:
    """Where ``param``'s gradient accumulates: the engine's buffer (``grad_of``), else ``param.grad``."""
    target = grad_of(param) if grad_of is not None else None  # type: ignore[arg-type]
    return target if target is not None else param.grad


def _add(param: Tensor, target: Tensor | None, value: Tensor) -> None:
    if target is not None:
        target.add_(value)
    else:
        param.grad = value.to(param.dtype)
