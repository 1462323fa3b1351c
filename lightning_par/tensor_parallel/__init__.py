"""Tensor parallelism: Megatron-style sharded layers, their communication, and plans that apply them
(PEFT-style LoRA layers included, see :mod:`lightning_par.tensor_parallel.lora`)."""

from lightning_par.tensor_parallel.layers import (
    SOURCE_ATTR,
    TP_DIM_ATTR,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from lightning_par.tensor_parallel.lora import is_lora_wrapper
from lightning_par.tensor_parallel.plan import TP_STATE_ATTR, apply_tensor_parallel
from lightning_par.tensor_parallel.plans import PLANS, STYLES, resolve_plan
from lightning_par.tensor_parallel.vocab_loss import vocab_parallel_cross_entropy

__all__ = [
    "PLANS",
    "SOURCE_ATTR",
    "STYLES",
    "TP_DIM_ATTR",
    "TP_STATE_ATTR",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "apply_tensor_parallel",
    "is_lora_wrapper",
    "resolve_plan",
    "vocab_parallel_cross_entropy",
]
