"""Cutting an ordered layer list into contiguous pipeline pieces.

Given per-layer costs ``w_0 .. w_{L-1}`` and a number of pieces ``k`` (``p`` stages, or ``p * v`` chunks
when interleaving), :func:`partition` returns boundaries ``0 = b_0 < b_1 < ... < b_k = L`` minimising the
largest piece cost ``max_j sum(w[b_j : b_{j+1}])`` (the pipeline's bottleneck), every piece non-empty
(exact dynamic programme, ``O(k L^2)``; ties prefer earlier cuts). Costs by method:

* ``"uniform"``: every layer 1 (equal layer counts);
* ``"parameters"``: the layer's parameter count (tied parameters counted where first seen);
* ``"profile"``: measured forward + backward seconds of each layer on a sample input
  (:func:`profile_costs`).

The first piece always holds layer 0 (the embedding) and the last piece the last layer (the head).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn

PartitionMethod = Literal["uniform", "parameters", "profile"]
METHODS: tuple[str, ...] = ("uniform", "parameters", "profile")


def partition(costs: Sequence[float], pieces: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` ranges of ``costs`` into ``pieces`` non-empty parts, minimising the max."""
    n = len(costs)
    if pieces < 1:
        raise ValueError(f"pieces must be >= 1, got {pieces}.")
    if n < pieces:
        raise ValueError(
            f"Cannot cut {n} layers into {pieces} pipeline pieces (stages x virtual stages): each piece"
            f" needs a layer. Use at most {n} pieces or expose finer layers from pipeline_layers()."
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[j][i]: minimal bottleneck of the first i layers in j pieces; cut[j][i]: where piece j starts
    best = [[inf] * (n + 1) for _ in range(pieces + 1)]
    cut = [[0] * (n + 1) for _ in range(pieces + 1)]
    best[0][0] = 0.0
    for j in range(1, pieces + 1):
        for i in range(j, n - (pieces - j) + 1):
            for s in range(j - 1, i):
                value = max(best[j - 1][s], prefix[i] - prefix[s])
                if value < best[j][i]:
                    best[j][i], cut[j][i] = value, s
    bounds = [n]
    for j in range(pieces, 0, -1):
        bounds.append(cut[j][bounds[-1]])
    bounds.reverse()
    return [(bounds[j], bounds[j + 1]) for j in range(pieces)]


def parameter_costs(layers: Sequence[nn.Module]) -> list[float]:
    seen: set[int] = set()
    costs = []
    for layer in layers:
        total = 0
        for p in layer.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        costs.append(float(max(total, 1)))
    return costs


def profile_costs(layers: Sequence[nn.Module], sample: Tensor, *, repeats: int = 2) -> list[float]:
    """Forward + backward seconds per layer on ``sample`` (the first layer's input), median of repeats."""
    costs = []
    x = sample
    for layer in layers:
        times = []
        out = x
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = layer(inp)
            out.float().sum().backward()
            times.append(time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
        costs.append(sorted(times)[len(times) // 2])
        x = out.detach()
    return costs


def layer_costs(
    layers: Sequence[nn.Module], method: PartitionMethod, *, sample: Tensor | None = None
) -> list[float]:
    if method not in METHODS:
        raise ValueError(f"partition method must be one of {METHODS}, got {method!r}.")
    if method == "uniform":
        return [1.0] * len(layers)
    if method == "parameters":
        return parameter_costs(layers)
    if sample is None:
        raise ValueError("partition method 'profile' needs a sample input for the first layer.")
    with torch.random.fork_rng(devices=[]):
        return profile_costs(layers, sample)
