"""A one-time check that every reader of a ``region_input``'s output needs the gradient sum it applies.

Why
---
``region_input`` on a module (a norm) puts ``copy_to`` on its output: one all-reduce in the backward sums
the partial input gradients of all the column-parallel layers that read it (each rank computed its own
output columns only). That is right where those layers are the output's only readers: a pre-LN block
(Llama's ``input_layernorm``, GPT-2's ``ln_1``). In a post-LN block, ``h = LN(h + sublayer(h))``
(BERT, DistilBERT, BART), the norm's output is also the next residual stream, whose gradient is whole on
every rank already: the all-reduce sums it ``t`` times, at every such norm, and the model trains wrong
on every rank alike (a probe: DistilBERT at tp2, weights 0.70 off one process after 4 SGD steps, no
error; the replica check sees nothing, since the ranks agree).

How
---
During the first backward that reaches a region's output, the gradient arriving there (the sum over all
its readers) is compared with the sum of what its column-parallel readers (and PEFT LoRA ``A`` layers,
which read it for column-parallel ``B`` layers) send back, tapped through a view of their input. A reader
of another kind (a residual sum) makes them differ: the backward stops there, before any optimizer step,
naming the module and the fix. Where a column-parallel reader takes the output through something else (a
dropout), its part cannot be tapped and the check stays silent rather than guess. The hooks run eagerly
(a ``torch.compile``'d model breaks its graph at them) and are removed once every region has been checked.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["RegionCheck", "check_regions"]

RTOL = 1e-2  # relative difference above which a reader other than the column-parallel ones contributed
_UNARY_DEPTH = 4  # one-input autograd nodes allowed between a region's output and a column-parallel reader
_MAX_FORWARDS = 8  # forwards of a region whose output no backward reaches before the check gives up


class RegionCheck:
    """The check of one apply_tensor_parallel call (see the module docstring)."""

    def __init__(self, regions: dict[str, nn.Module], readers: dict[str, nn.Module]) -> None:
        self._names = {id(m): n for n, m in regions.items()}
        self._reader_names = {id(m): n for n, m in readers.items()}
        self._seen: set[int] = set()  # readers whose input's origin was checked (once each)
        self._forwards: dict[int, int] = {}  # forwards of each region before a backward reached it
        self._pending = set(self._names)
        self._watched: dict[int, tuple[int, Tensor]] = {}  # id(output) -> (id(region), output)
        self._tapped: dict[int, Tensor] = {}  # id(output) -> its readers' summed gradient
        self._untapped = False
        self._handles: list[RemovableHandle] = []
        disable = torch.compiler.disable
        for module in regions.values():
            self._handles.append(module.register_forward_hook(disable(self._watch)))
        for reader in readers.values():
            self._handles.append(reader.register_forward_pre_hook(disable(self._tap)))

    def _watch(self, module: nn.Module, _args: Any, output: Any) -> None:
        key = id(module)
        if key not in self._pending or not isinstance(output, Tensor) or not output.requires_grad:
            return
        self._forwards[key] = self._forwards.get(key, 0) + 1
        if self._forwards[key] > _MAX_FORWARDS:  # its output never gets a gradient: nothing to check
            self.remove()
            return
        # every forward until the first backward reaches it (one may run with an adapter disabled, a
        # recomputation may repeat one): each output is compared with its own readers
        out = id(output)
        self._watched[out] = (key, output)
        output.register_hook(lambda grad: self._compare(key, out, grad))

    def _tap(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        x = args[0] if args else None
        if id(module) not in self._reader_names or not isinstance(x, Tensor) or not x.requires_grad:
            return None  # (a deep copy of the model carries the hooks: its layers are not checked)
        first, watched = id(module) not in self._seen, self._watched.get(id(x))
        self._seen.add(id(module))
        if watched is None or watched[1] is not x:
            self._untapped = True  # read through something else: its share cannot be told apart
            if first and not self._from_region(x):
                name = self._reader_names[id(module)]
                raise RuntimeError(
                    f"Tensor parallelism: the column-parallel layer {name!r} reads an"
                    " input that no region_input module's output reaches (directly or through a dropout, cast"
                    " or view): the plan has region_input entries, so column-parallel layers leave the sum of"
                    " their input gradients over the tensor-parallel group to those regions, and this one's"
                    " would never be summed (the model would train wrong). Mark the module whose output it"
                    " reads region_input, or leave region_input out of the plan (each column-parallel layer"
                    " then sums its own). Checked in the first forward, before any optimizer step."
                )
            return None
        out = id(x)
        view = x.view_as(x)
        view.register_hook(lambda grad: self._add(out, grad))
        return (view, *args[1:])

    def _from_region(self, x: Tensor) -> bool:
        """Whether ``x`` is a watched region output passed through one-input operations only (a dropout, a
        cast, a view: a few autograd nodes with one differentiable input each)."""
        outputs = {id(t.grad_fn) for _, t in self._watched.values() if t.grad_fn is not None}
        node = x.grad_fn
        for _ in range(_UNARY_DEPTH):
            if node is None:
                return False
            if id(node) in outputs:
                return True
            inputs = [f for f, _ in node.next_functions if f is not None]
            if len(inputs) != 1:
                return False
            node = inputs[0]
        return False

    def _add(self, output: int, grad: Tensor) -> None:
        grad = grad.detach().float()
        held = self._tapped.get(output)
        self._tapped[output] = grad if held is None else held + grad

    def _compare(self, region: int, output: int, grad: Tensor) -> None:
        self._pending.discard(region)
        self._watched.pop(output, None)
        tapped = self._tapped.pop(output, None)
        if not self._pending:
            self.remove()
        if self._untapped:
            return
        total = grad.detach().float()
        readers = tapped if tapped is not None else torch.zeros_like(total)
        # the verdict reaches the host once, in the first backward
        if bool((total - readers).norm() > RTOL * total.norm()):
            name = self._names[region]
            raise RuntimeError(
                f"Tensor parallelism: tp_plan marks {name!r} region_input, but its output is also read by"
                " something other than the column-parallel layers (in a post-LN block, h = norm(h +"
                " sublayer(h)), the next residual stream), whose gradient the region's all-reduce would sum"
                " once per tensor-parallel rank: the model would train wrong on every rank alike. Leave"
                f" {name!r} out of the plan's region_input entries (each column-parallel layer then sums"
                " its own input gradient); region_input fits pre-LN norms whose output only"
                " column-parallel layers read. Checked in the first backward, before any optimizer step."
            )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._watched.clear()


def check_regions(regions: dict[str, nn.Module], readers: dict[str, nn.Module]) -> RegionCheck | None:
    """Start the check for ``regions`` (name -> the module marked ``region_input``) read by ``readers``
    (name -> the column-parallel layers that skip their own input copy, and LoRA ``A`` layers beside
    them)."""
    return RegionCheck(regions, readers) if regions else None
