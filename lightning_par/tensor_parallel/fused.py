"""Fused projections: one ``nn.Linear`` whose output rows are several projections side by side.

* litgpt's ``attn.qkv`` (:mod:`~lightning_par.tensor_parallel.litgpt_family`) and Hugging Face Phi-3's
  ``self_attn.qkv_proj``: the rows of all query heads, then the key/value heads' keys, then their values.
* Phi-3's ``mlp.gate_up_proj``: the gate rows, then the up rows (the forward ``chunk(2)``s its output).

A column-parallel cut of such a layer takes block ``r`` of each segment
(:mod:`~lightning_par.tensor_parallel.slices`), so rank ``r`` holds its heads' queries, the key/value
heads they read, and its gate and up features, in the layout the module's own forward splits. The
attention forwards read the full head counts from a config the whole model shares (litgpt:
``config.n_head`` / ``n_query_groups``; Phi-3: ``config.num_attention_heads`` for the query width), so
each converted attention gets its own shallow copy of the config with ``1/t`` of the heads; the model's
config keeps the full counts. Head counts that ``t`` does not divide are refused before any change.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from lightning_par.tensor_parallel.litgpt_family import check_attention, is_litgpt_attention

__all__ = ["check_heads", "divide_config_heads", "fused_segments"]

_HF_HEADS = ("num_attention_heads", "num_key_value_heads")


def _is_hf_fused_attention(module: nn.Module) -> bool:
    """A Hugging Face attention with one ``qkv_proj`` (Phi-3's) and its head counts in ``config``."""
    config = getattr(module, "config", None)
    return (
        isinstance(getattr(module, "qkv_proj", None), nn.Module)
        and isinstance(getattr(module, "head_dim", None), int)
        and all(isinstance(getattr(config, a, None), int) for a in _HF_HEADS)
    )


def fused_segments(parent: nn.Module, child: str) -> list[int] | None:
    """The full row counts of the segments of ``parent.<child>``, or None for a plain layer."""
    if child == "qkv" and is_litgpt_attention(parent):
        config: Any = parent.config
        q, kv = config.n_head * config.head_size, config.n_query_groups * config.head_size
        return [q, kv, kv]
    if child == "qkv_proj" and _is_hf_fused_attention(parent):
        config = parent.config
        head_dim = int(parent.head_dim)  # type: ignore[arg-type]
        q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        return [q, kv, kv]
    if child == "gate_up_proj" and isinstance(getattr(parent, "down_proj", None), nn.Module):
        rows = getattr(getattr(parent, child), "out_features", None)
        if isinstance(rows, int) and rows % 2 == 0:
            return [rows // 2, rows // 2]
    return None


def _head_counts(attention: nn.Module) -> tuple[str, str] | None:
    """The config's (query heads, key/value heads) attribute names of an attention with a fused
    projection, or None for any other module."""
    if is_litgpt_attention(attention):
        return ("n_head", "n_query_groups")
    return _HF_HEADS if _is_hf_fused_attention(attention) else None


def check_heads(parent: nn.Module, name: str, t: int) -> None:
    """Refuse an attention with a fused projection whose head counts ``t`` does not divide (and what
    :func:`~lightning_par.tensor_parallel.litgpt_family.check_attention` refuses in litgpt's)."""
    counts = _head_counts(parent)
    if counts is None:
        return
    config: Any = parent.config
    for attr in counts:
        value = getattr(config, attr)
        if value % t:
            values = " and ".join(f"{a} ({getattr(config, a)})" for a in counts)
            raise ValueError(
                f"{name}: the config has {attr}={value}, not divisible by tensor_parallel_size={t} (each"
                " rank holds whole query heads and the key/value heads they read from the fused"
                f" projection); choose a tensor_parallel_size that divides {values}."
            )
    if is_litgpt_attention(parent):
        check_attention(parent, name)


def divide_config_heads(attention: nn.Module, t: int) -> None:
    """Give an attention with a fused projection its own config with ``1/t`` of the heads."""
    counts = _head_counts(attention)
    if counts is None:
        return
    local = copy.copy(attention.config)
    for attr in counts:
        setattr(local, attr, getattr(local, attr) // t)
    attention.config = local
