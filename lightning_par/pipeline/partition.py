"""Cutting an ordered layer list into contiguous pipeline pieces.

Given per-layer costs ``w_0 .. w_{L-1}`` and a number of pieces ``k`` (``p`` stages, or ``p * v`` chunks
when interleaving), :func:`partition` returns boundaries ``0 = b_0 < b_1 < ... < b_k = L`` minimising the
largest piece cost ``max_j sum(w[b_j : b_{j+1}])`` (the pipeline's bottleneck), every piece non-empty
(exact dynamic programme, ``O(k L^2)``; ties prefer earlier cuts). Costs by method:

* ``"compute"`` (the default): each layer's matrix-product work per token, read from its modules without
  running them (so it works on meta-device models): the weight of every ``nn.Linear``, ``nn.ConvNd``,
  transformers ``Conv1D`` and tensor-parallel linear counts its element count at each module that applies
  it (a LM head tied to the token table is a full product over the vocabulary, ``2 V d`` flops per token,
  however its weight is shared), an embedding lookup counts nothing (a gather), and any other parameter
  its element count once. Attention's sequence-length term is left out (it is the same in every block);
  a layer that multiplies by a weight outside such a module (``F.linear(x, other.weight)``) is seen as
  cheap, and a convolution's work also grows with its output's spatial size, which shrinks through a
  CNN: give those ``"profile"`` or explicit counts;
* ``"parameters"``: the layer's parameter count (tied parameters counted where first seen); it weighs a
  vocabulary-sized embedding like a head of the same size, so with a large vocabulary the first stage
  gets too few blocks and a tied head's stage too many;
* ``"uniform"``: every layer 1 (equal layer counts);
* ``"profile"``: measured forward + backward seconds of each layer on a sample input
  (:func:`profile_costs`);
* a sequence of ``k`` positive layer counts, one per piece in virtual-stage order (``[9, 5]``: layers 0-8
  on the first stage, 9-13 on the second): the cut as given, as Megatron's and torchtitan's manual
  splits.

Every rank must cut the same way, or stages would hold overlapping or missing layers. :func:`cut`
therefore averages the costs over the given process groups (the mesh's pipeline, data- and
tensor-parallel groups in turn: the mean over the whole job), which makes ``"profile"``'s per-rank
timings, and costs that differ with uneven tensor-parallel shards, one vector; a rank whose
``pipeline_layers()`` returned another number of layers is named in an error raised on every rank.

The first piece always holds layer 0 (the embedding) and the last piece the last layer (the head).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_par.pipeline.weight_grad import weight_layout
from lightning_par.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

PartitionMethod = Literal["compute", "parameters", "uniform", "profile"]
METHODS: tuple[str, ...] = ("compute", "parameters", "uniform", "profile")
Cut = PartitionMethod | tuple[int, ...]  # a method, or layer counts per piece


def as_cut(value: object) -> Cut:
    """A validated ``partition_method`` option: a method name, or a sequence of layer counts (a list, a
    tuple, an OmegaConf ``ListConfig``) returned as a tuple."""
    if isinstance(value, str):
        if value in METHODS:
            return value  # type: ignore[return-value]
    elif isinstance(value, Sequence) and value and all(_is_count(x) for x in value):
        return tuple(int(x) for x in value)
    raise ValueError(
        f"partition_method must be one of {METHODS} or a list of layer counts per pipeline piece, each"
        f" >= 1 (e.g. [9, 5]: layers 0-8 on stage 0, the next 5 on stage 1), got {value!r}."
    )


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


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


def counted_pieces(counts: Sequence[int], *, layers: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges of explicit per-piece layer counts, which must cover ``layers``."""
    if sum(counts) != layers:
        raise ValueError(
            f"partition_method={list(counts)} places {sum(counts)} layers, but pipeline_layers() returned"
            f" {layers}: the counts must add up to the number of layers."
        )
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return [(bounds[j], bounds[j + 1]) for j in range(len(counts))]


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


def _product_weight(module: nn.Module) -> Tensor | None:
    """The weight a module multiplies its input by, ``None`` if it is no matrix-product layer: the
    layers the zero-bubble split recognises (:func:`.weight_grad.weight_layout`), whatever their
    options, and convolutions."""
    products = (nn.modules.conv._ConvNd, ColumnParallelLinear, RowParallelLinear)
    if weight_layout(module) is not None or isinstance(module, products):
        weight = getattr(module, "weight", None)
        return weight if isinstance(weight, Tensor) else None
    return None


def compute_costs(layers: Sequence[nn.Module]) -> list[float]:
    """Matrix-product weights per layer, counted at every use; lookups free (the module docstring)."""
    lookups = (nn.Embedding, nn.EmbeddingBag, VocabParallelEmbedding)
    seen: set[int] = set()
    costs = []
    for layer in layers:
        total = 0
        for module in layer.modules():
            product = _product_weight(module)
            if product is not None:
                total += product.numel()  # a tied head multiplies by the table again: count it here too
            free = {id(product)} if product is not None else set()
            if isinstance(module, lookups):
                free.add(id(module.weight))
            for p in module.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    total += 0 if id(p) in free else p.numel()
        costs.append(float(max(total, 1)))
    return costs


def profile_costs(layers: Sequence[nn.Module], sample: Tensor, *, repeats: int = 3) -> list[float]:
    """Forward + backward seconds per layer on ``sample`` (the first layer's input): the median of
    ``repeats`` runs after one warm-up run (allocations, kernel selection), which is not counted.

    The sample goes to the layers' device first, a floating one in their floating dtype: a Lightning
    ``example_input_array`` stays where ``__init__`` made it (the CPU), and the strategies move the model
    before they cut it, so a CUDA model met CPU ids (and a ``"bf16-true"`` one fp32 inputs). On CUDA each
    timing waits for the device before the clock is read both times: kernels run asynchronously, and a
    host clock alone would count their launches. The layers' buffers are put back afterwards (BatchNorm's
    running statistics moved towards the sample, and its count by every run); a layer whose output needs
    no gradient (a frozen embedding of ids) is timed forward only."""
    params = [p for layer in layers for p in layer.parameters() if not p.is_meta]
    device = params[0].device if params else sample.device
    floating = next((p.dtype for p in params if p.is_floating_point()), None)
    x = sample.to(device)
    if x.is_floating_point() and floating is not None:
        x = x.to(floating)
    wait = torch.cuda.synchronize if device.type == "cuda" else None
    costs = []
    for layer in layers:
        kept = [(b, b.detach().clone()) for b in layer.buffers() if not b.is_meta]
        times = []
        out = x
        for run in range(repeats + 1):
            inp = x.detach().requires_grad_(x.is_floating_point())
            if wait is not None:
                wait(device)
            start = time.perf_counter()
            out = layer(inp)
            if out.requires_grad:
                out.float().sum().backward()
            if wait is not None:
                wait(device)
            if run > 0:  # the first run warms the layer up
                times.append(time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for buffer, value in kept:
                buffer.copy_(value)
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
    if method == "compute":
        return compute_costs(layers)
    if sample is None:
        raise ValueError("partition method 'profile' needs a sample input for the first layer.")
    # the layers' random draws (dropout) leave the run's generators as they were, the device's too
    device = next((p.device for layer in layers for p in layer.parameters() if not p.is_meta), sample.device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        return profile_costs(layers, sample)


def agree(costs: list[float], groups: Sequence[ProcessGroup]) -> list[float]:
    """The mean of every rank's ``costs`` over ``groups`` in turn (module docstring), the same list on
    every rank; raises on every rank if the ranks' layer counts differ."""
    for group in groups:
        size = dist.get_world_size(group)
        if size == 1:
            continue
        gathered: list[list[float] | None] = [None] * size
        dist.all_gather_object(gathered, costs, group=group)  # once, at setup: a list of floats per rank
        lengths = [len(c or ()) for c in gathered]
        if len(set(lengths)) > 1:
            by_rank = {dist.get_global_rank(group, r): n for r, n in enumerate(lengths)}
            raise ValueError(
                "pipeline_layers() returned different numbers of layers on different ranks"
                f" ({by_rank} by global rank): every rank must list the same layers, in the same"
                " order, for the pipeline to cut them the same way."
            )
        costs = [sum(column) / size for column in zip(*(c or () for c in gathered), strict=True)]
    return costs


def cut(
    layers: Sequence[nn.Module],
    method: Cut,
    *,
    pieces: int,
    sample: Tensor | None = None,
    groups: Sequence[ProcessGroup] = (),
) -> list[tuple[int, int]]:
    """The ``pieces`` ``[start, end)`` ranges of ``layers`` by ``method``, the same on every rank of
    ``groups`` (module docstring)."""
    if isinstance(method, tuple):
        if len(method) != pieces:
            raise ValueError(
                f"partition_method={list(method)} gives {len(method)} layer counts, but the pipeline has"
                f" {pieces} pieces (pipeline_parallel_size x virtual_stages): give one count per piece."
            )
        agree([1.0] * len(layers), groups)  # the same number of layers everywhere
        return counted_pieces(method, layers=len(layers))
    return partition(agree(layer_costs(layers, method, sample=sample), groups), pieces)
