"""Where a tensor-parallel rank's piece of a full parameter lies, and how the pieces join again.

A sharded parameter carries ``_lp_tp_dim`` ``d``: along ``d`` the full tensor is cut into ``t`` equal
blocks and rank ``r`` holds block ``r``. A *fused* projection (litgpt's ``attn.qkv``: the rows of all
query heads, then of the key groups, then of the value groups) cannot be cut that way: block ``r`` of
the whole would give rank 0 every query head and rank 1 the keys and values. Such a parameter also
carries ``_lp_tp_segments`` ``(s_1, ..., s_k)``, the full sizes of its consecutive segments along ``d``
(summing to the full size), and rank ``r`` holds block ``r`` of *each* segment, concatenated in segment
order. So its local tensor has the fused layout of a model with ``1/t`` of the heads, which is what the
module's own forward splits.

:func:`piece` and :func:`join` are inverse to each other: ``join([piece(x, r) for r in range(t)]) == x``.
Every place that cuts or assembles tensor-parallel parameters (checkpoints, pretrained loading, meta
init, gradient-norm bookkeeping) goes through them, so a segmented parameter is handled alike
everywhere; without segments they are ``chunk`` and ``cat``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["SEGMENTS_ATTR", "join", "piece", "segments_by_name", "segments_of"]

SEGMENTS_ATTR = "_lp_tp_segments"


def segments_of(param: Tensor) -> tuple[int, ...] | None:
    """The full segment sizes along the tensor-parallel dimension, or None for a plain split."""
    found = getattr(param, SEGMENTS_ATTR, None)
    return tuple(int(s) for s in found) if found is not None else None


def segments_by_name(named: Mapping[str, Tensor] | Sequence[tuple[str, Tensor]]) -> dict[str, list[int]]:
    """``{name: segment sizes}`` of the segmented parameters among ``named``."""
    items = named.items() if isinstance(named, Mapping) else named
    out: dict[str, list[int]] = {}
    for name, p in items:
        found = segments_of(p)
        if found is not None:
            out[name] = list(found)
    return out


def _check(full_size: int, size: int, segments: Sequence[int] | None, what: str) -> Sequence[int]:
    parts = list(segments) if segments is not None else [full_size]
    if sum(parts) != full_size or any(s % size for s in parts):
        raise ValueError(
            f"{what}: segments {parts} of a dimension of size {full_size} cannot each be split into"
            f" {size} equal blocks; choose a tensor_parallel_size that divides every segment."
        )
    return parts


def piece(
    full: Tensor,
    *,
    dim: int,
    rank: int,
    size: int,
    segments: Sequence[int] | None = None,
    what: str = "tensor",
) -> Tensor:
    """Rank ``rank``'s piece of ``full`` (a view where the layout allows; ``.clone()`` to own it)."""
    parts = _check(full.shape[dim], size, segments, what)
    if len(parts) == 1:
        block = parts[0] // size
        return full.narrow(dim, rank * block, block)
    pieces = []
    start = 0
    for s in parts:
        block = s // size
        pieces.append(full.narrow(dim, start + rank * block, block))
        start += s
    return torch.cat(pieces, dim=dim)


def join(parts: Sequence[Tensor], *, dim: int, segments: Sequence[int] | None = None) -> Tensor:
    """The full tensor from the ranks' pieces ``parts`` (in rank order); the inverse of :func:`piece`."""
    if segments is None or len(segments) == 1:
        return torch.cat(list(parts), dim=dim)
    size = len(parts)
    local_sizes = [s // size for s in segments]
    split = [p.split(local_sizes, dim=dim) for p in parts]
    return torch.cat([split[r][k] for k in range(len(segments)) for r in range(size)], dim=dim)
