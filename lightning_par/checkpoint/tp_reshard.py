"""Tensor-parallel checkpoints that load at another tensor-parallel size.

Every rank saves records in the coordinates of its *local* parameters (see
:mod:`lightning_par.checkpoint.optimizer_state`) together with its tensor-parallel coordinates
``{"rank": r, "size": t, "dims": {name: d}, "segments": {name: sizes}}``: parameter ``name`` is the
concatenation along dimension ``d`` of the ``t`` ranks' local pieces (for a fused projection listed in
``segments``: of each segment's pieces, see :mod:`lightning_par.tensor_parallel.slices`); parameters
without a dimension are replicated over the tp group. Checkpoints written before segments existed have
none.

:func:`globalize` turns the records of all ranks into pieces of the *full* parameters: for a sharded
parameter, each tp rank's local tensor is assembled from its records (any dp layout) and the ``t``
tensors are concatenated along ``d`` (one parameter at a time); a replicated parameter keeps tp rank 0's
records. :func:`localize` cuts full pieces down to what one rank of the current layout holds, so the rest
of the loading code works in local coordinates whatever the saved and current tp sizes are.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_par.checkpoint.optimizer_state import Pieces, cut
from lightning_par.tensor_parallel.layers import TP_DIM_ATTR
from lightning_par.tensor_parallel.slices import join, piece, segments_by_name

Record = tuple[str, int, int, dict[str, Any]]
TPInfo = dict[str, Any]


def tp_info(module: nn.Module, *, rank: int, size: int) -> TPInfo:
    """This rank's tensor-parallel coordinates and the tp dimension (and segments) of each sharded
    parameter."""
    dims = {n: int(getattr(p, TP_DIM_ATTR)) for n, p in module.named_parameters() if hasattr(p, TP_DIM_ATTR)}
    if size == 1:
        return {"rank": rank, "size": size, "dims": {}, "segments": {}}
    segments = segments_by_name([(n, p) for n, p in module.named_parameters() if n in dims])
    return {"rank": rank, "size": size, "dims": dims, "segments": segments}


def _segments(info: TPInfo, name: str) -> list[int] | None:
    found: list[int] | None = info.get("segments", {}).get(name)
    return found


def global_shapes(module: nn.Module, info: TPInfo) -> dict[str, list[int]]:
    """Shapes of the full (unsharded) parameters."""
    out = {}
    for name, p in module.named_parameters():
        shape = list(p.shape)
        if name in info["dims"]:
            shape[info["dims"][name]] *= info["size"]
        out[name] = shape
    return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def globalize(
    records_by_rank: Iterable[tuple[TPInfo, Sequence[Record]]], shapes: Mapping[str, Sequence[int]]
) -> Pieces:
    """Pieces of the full parameters from every rank's local records (see the module docstring)."""
    by_name: dict[str, dict[int, list[tuple[int, int, dict[str, Any]]]]] = {}
    dims: dict[str, tuple[int, int]] = {}
    segments: dict[str, list[int] | None] = {}
    for info, records in records_by_rank:
        for name, lo, hi, state in records:
            by_name.setdefault(name, {}).setdefault(info["rank"], []).append((lo, hi, state))
            if name in info["dims"]:
                dims[name] = (info["dims"][name], info["size"])
                segments[name] = _segments(info, name)
    out: Pieces = {}
    for name, per_tp in by_name.items():
        if name not in dims:
            out[name] = per_tp.get(0) or next(iter(per_tp.values()))
            continue
        dim, size = dims[name]
        full_shape = list(shapes[name])
        local_shape = list(full_shape)
        local_shape[dim] //= size
        local_numel = _numel(local_shape)
        locals_ = [cut(per_tp.get(r, []), 0, local_numel) for r in range(size)]
        if any(state is None for state in locals_):
            continue  # no state for this parameter (e.g. not in the optimizer)
        merged: dict[str, Any] = {}
        for key, value in locals_[0].items():  # type: ignore[union-attr]
            if isinstance(value, Tensor) and value.dim() > 0:
                parts = [s[key].view(local_shape) for s in locals_]  # type: ignore[index]
                merged[key] = join(parts, dim=dim, segments=segments[name]).reshape(-1)
            else:
                merged[key] = value
        out[name] = [(0, _numel(full_shape), merged)]
    return out


def localize(pieces: Pieces, shapes: Mapping[str, Sequence[int]], info: TPInfo) -> Pieces:
    """Pieces of this rank's local parameters from pieces of the full ones (identity when tp size is 1)."""
    if info["size"] == 1 or not info["dims"]:
        return pieces
    out: Pieces = dict(pieces)
    for name, dim in info["dims"].items():
        if name not in pieces:
            continue
        full_shape = list(shapes[name])
        full = cut(pieces[name], 0, _numel(full_shape))
        if full is None:
            continue
        local: dict[str, Any] = {}
        for key, value in full.items():
            if isinstance(value, Tensor) and value.dim() > 0:
                block = piece(
                    value.view(full_shape),
                    dim=dim,
                    rank=info["rank"],
                    size=info["size"],
                    segments=_segments(info, name),
                    what=name,
                )
                local[key] = block.reshape(-1).clone()
            else:
                local[key] = value
        out[name] = [(0, _numel(full_shape) // info["size"], local)]
    return out


def localize_state_dict(state: Mapping[str, Any], module: nn.Module, info: TPInfo) -> dict[str, Any]:
    """A full state dict cut to this rank's tensor-parallel pieces (also under tied aliases)."""
    if info["size"] == 1 or not info["dims"]:
        return dict(state)
    names = {id(p): n for n, p in module.named_parameters() if n in info["dims"]}
    out = dict(state)
    for alias, p in module.named_parameters(remove_duplicate=False):
        name = names.get(id(p))
        if name is not None and alias in state:
            out[alias] = piece(
                state[alias],
                dim=info["dims"][name],
                rank=info["rank"],
                size=info["size"],
                segments=_segments(info, name),
                what=alias,
            ).clone()
    return out


def gather_tensor_parallel(
    state: Mapping[str, Tensor], module: nn.Module, info: TPInfo, *, group: Any
) -> dict[str, Tensor]:
    """Full tensors from this tp group's local pieces (every rank of the group calls it, in the same
    order; one all-gather per sharded parameter)."""
    out = dict(state)
    names = {id(p): n for n, p in module.named_parameters() if n in info["dims"]}
    for alias, p in module.named_parameters(remove_duplicate=False):
        name = names.get(id(p))
        if name is None or alias not in state:
            continue
        local = state[alias].contiguous()
        parts = [torch.empty_like(local) for _ in range(info["size"])]
        dist.all_gather(parts, local, group=group)
        out[alias] = join(parts, dim=info["dims"][name], segments=_segments(info, name))
    return out
