"""Tensor-parallel slices initialised from the meta device as slices of one full-size init.

A tensor-parallel layer holds one rank's slice of a matrix. Initialising the slice itself would be wrong
twice over: under one seed every tp rank would draw the same slice (duplicate heads), and an init that
depends on the layer's shape (``kaiming_uniform_``'s fan-in, a Hugging Face model's ``isinstance(module,
nn.Linear)`` dispatch) would see the slice, not the layer. So a layer converted from a meta-device layer
keeps that layer as its source (``SOURCE_ATTR``, :mod:`lightning_par.tensor_parallel.layers`), and
:func:`sources_in_place` puts every source back in its layer's place in the model while a unit is
initialised. The initialisers then run on the model the user built, with full-size storage, and
:func:`slice_of` takes each rank's part of the result: the rank's row block (dim 0), column block
(dim 1), or the whole tensor for a replicated parameter (a row-parallel bias). Every tp rank draws the
same full values (:func:`lightning_par.zero.init_seeds.module_seed`), so the slices are parts of one matrix
and equal the unsharded model's init, sliced. A rank holds the unit's parallel layers in full for the
duration, as ZeRO-3 holds every unit in full while it initialises it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_par.tensor_parallel.layers import SOURCE_ATTR, TP_DIM_ATTR
from lightning_par.tensor_parallel.slices import piece, segments_of


@dataclass(frozen=True)
class Swap:
    """A tensor-parallel ``layer`` registered as ``parent.<attr>``, and the full-size layer it replaced."""

    parent: nn.Module
    attr: str
    layer: nn.Module
    source: nn.Module


def parallel_layers(root: nn.Module, unit: set[int]) -> list[Swap]:
    """The places of the tensor-parallel layers of ``root`` that keep a source and hold a parameter whose
    id is in ``unit``, in the model's order (a layer registered twice is listed at both places)."""
    found: list[Swap] = []
    for parent in root.modules():
        for attr, child in parent._modules.items():
            if child is None:
                continue
            source = getattr(child, SOURCE_ATTR, None)
            if isinstance(source, nn.Module) and any(id(p) in unit for p in child.parameters(recurse=False)):
                found.append(Swap(parent, attr, child, source))
    return found


@contextmanager
def sources_in_place(swaps: Sequence[Swap]) -> Iterator[None]:
    """Within: each source registered where its layer is; the layers are back after, whatever happens.
    The sources' parameters are restored too (those given storage within are released)."""
    kept = {id(s.source): (s.source, dict(s.source._parameters)) for s in swaps}
    try:
        for s in swaps:
            s.parent._modules[s.attr] = s.source
        yield
    finally:
        for s in swaps:
            s.parent._modules[s.attr] = s.layer
        for source, params in kept.values():
            source._parameters.update(params)


def slice_of(layer: nn.Module, attr: str, full: Tensor) -> Tensor:
    """This rank's part of ``full``, the whole-layer value of ``layer``'s parameter ``attr``: block
    ``r`` of ``t`` along the parameter's tensor-parallel dimension (``r`` its rank in ``layer.group``;
    of each segment for a fused projection), or ``full`` itself for a replicated one. A copy, so the
    full tensor can be released."""
    param = layer._parameters[attr]
    assert param is not None
    if not hasattr(param, TP_DIM_ATTR):
        return full.clone()
    dim = int(getattr(param, TP_DIM_ATTR))
    group = layer.group
    assert isinstance(group, ProcessGroup)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    return piece(full, dim=dim, rank=rank, size=size, segments=segments_of(param), what=attr).clone()


def release_sources(root: nn.Module, unit: set[int]) -> None:
    """Forget the sources of the layers of ``root`` that hold a parameter whose id is in ``unit`` and no
    meta parameter any more: they are not needed again, and a model that is saved or copied should not
    carry them."""
    for m in root.modules():
        if SOURCE_ATTR not in m.__dict__:
            continue
        own = list(m.parameters(recurse=False))
        if any(id(p) in unit for p in own) and not any(p.is_meta for p in own):
            del m.__dict__[SOURCE_ATTR]
