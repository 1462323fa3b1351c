"""Tensor parallelism: Megatron-style sharded layers, their communication, and plans that apply them."""

from lightning_par.tensor_parallel.layers import (
    TP_DIM_ATTR,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from lightning_par.tensor_parallel.plan import PLANS, STYLES, apply_tensor_parallel, resolve_plan

__all__ = [
    "PLANS",
    "STYLES",
    "TP_DIM_ATTR",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "apply_tensor_parallel",
    "resolve_plan",
    "vocab_parallel_cross_entropy",
]
