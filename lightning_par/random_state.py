"""One random state per model replica.

The ranks of a tensor-parallel group compute one model on one batch: dropout on replicated activations
(the residual stream after a row-parallel layer) must mask alike on each of them, or the replicated
weights (norms, biases) drift apart while every rank believes it holds the same model. The ranks of a
pipeline keep their generators moving alike too (:func:`lightning_par.pipeline.steps.stage_random_state`),
so a random augmentation in a Lightning hook gives every stage one batch. Both hold only if the ranks
*start* with the same state, which seeding per rank (nanoGPT's ``manual_seed(1337 + rank)``) breaks: at
tp2 such a run's norm weights were 2.9e-3 apart after 3 steps, silently.

:func:`agree_random_state` gives every rank of the groups the state of the groups' first rank: torch's
CPU generator and, on a GPU, this device's generator, and the host generators of Python's ``random`` and
NumPy's global ``np.random`` (Hugging Face's SpecAugment masks of Wav2Vec2 / HuBERT / WavLM are drawn
with NumPy inside the forward: with per-rank seeds the tp ranks masked apart, the replicated weights
7.4e-3 apart after 4 steps). One broadcast of each per group, at setup; the data-parallel ranks keep their
own states, as under DDP. Code that later draws on some ranks only (a
rank-zero-only sample in a callback) parts them again: draw such numbers from a generator of its own.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["agree_random_state"]


def _agree(state: torch.Tensor, groups: Sequence[ProcessGroup], device: torch.device) -> torch.Tensor:
    """``state`` (a generator's byte state) as the groups' first rank holds it, through ``device``."""
    buffer = state.to(device)  # NCCL broadcasts device tensors only
    for group in groups:
        dist.broadcast(buffer, src=dist.get_global_rank(group, 0), group=group)
    return buffer.cpu()  # set_rng_state takes a CPU ByteTensor: one host copy, at setup


def agree_random_state(*, groups: Sequence[ProcessGroup], device: torch.device) -> None:
    """Give every rank of ``groups`` (applied in order; groups of one rank skipped) the random state of
    their first rank (module docstring). Collective over each group."""
    groups = [g for g in groups if dist.get_world_size(g) > 1]
    if not groups:
        return
    torch.random.set_rng_state(_agree(torch.random.get_rng_state(), groups, device))
    if device.type == "cuda":
        torch.cuda.set_rng_state(_agree(torch.cuda.get_rng_state(device), groups, device), device)
    np_random = _numpy_random()
    host: list[Any] = [(random.getstate(), np_random.get_state() if np_random is not None else None)]
    for group in groups:  # pickled through ``device`` (NCCL broadcasts device tensors only)
        dist.broadcast_object_list(host, src=dist.get_global_rank(group, 0), group=group, device=device)
    py_state, np_state = host[0]
    random.setstate(py_state)
    if np_random is not None:
        np_random.set_state(np_state)


def _numpy_random() -> Any:
    """NumPy's global ``np.random``, or None where NumPy is not installed (torch does not need it)."""
    try:
        import numpy as np
    except ImportError:
        return None
    return np.random
