"""The attention masks of :mod:`.hf`'s decoder pieces, built as the Hugging Face model's own forward
builds them: the ``transformers.masking_utils`` function of each layer's attention type (causal, or
sliding-window causal), from the hidden states, the batch's 2D padding mask and its positions (packed
rows). The blocks of one stage share one build per micro-batch (:class:`Masks`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def attention_type(config: Any, index: int) -> str:
    """The attention of decoder layer ``index`` as the model's forward picks its mask: from the config's
    per-layer ``layer_types`` where it has them (Qwen, Gemma 2 / 3, SmolLM3), else sliding for every layer
    when the config sets a ``sliding_window`` (Mistral, Mixtral, Phi-3, Starcoder2, Qwen3-MoE), else
    full."""
    types = getattr(config, "layer_types", None)
    if types:
        kind = types[index]
    else:
        kind = "full_attention" if getattr(config, "sliding_window", None) is None else "sliding_attention"
    if kind not in ("full_attention", "sliding_attention"):
        raise ValueError(
            f"hf_pipeline_layers: decoder layer {index} has attention type {kind!r}; the pieces build"
            " 'full_attention' and 'sliding_attention' masks only. Write pipeline_layers() yourself."
        )
    return str(kind)


class Masks:
    """The attention masks of one model's blocks, built by the ``transformers.masking_utils`` function
    the model's forward uses for each attention type, from the hidden states, the 2D padding mask and the
    positions (each or none). The last mask of each type is kept with the padding mask and positions it
    came from (held, so their identities stay unique): the blocks of a stage receive the same tensors for
    a micro-batch and share one build (:mod:`.hf`'s docstring)."""

    def __init__(self, config: Any) -> None:
        try:
            from transformers import masking_utils
        except ImportError as error:  # older than 4.53
            raise ImportError(
                "hf_pipeline_layers builds the model's attention masks with transformers.masking_utils,"
                " which this transformers version lacks: install transformers>=4.53."
            ) from error
        self.config = config
        self.functions = {
            "full_attention": masking_utils.create_causal_mask,
            "sliding_attention": masking_utils.create_sliding_window_causal_mask,
        }
        self._last: dict[str, tuple[Tensor | None, Tensor | None, tuple[Any, ...], Any]] = {}

    def __call__(self, hidden: Tensor, padding: Tensor | None, positions: Tensor | None, kind: str) -> Any:
        key = (tuple(hidden.shape[:2]), hidden.dtype, hidden.device)
        last = self._last.get(kind)
        if last is not None and last[0] is padding and last[1] is positions and last[2] == key:
            return last[3]
        mask = mask_call(
            self.functions[kind], config=self.config, hidden=hidden, padding=padding, positions=positions
        )
        self._last[kind] = (padding, positions, key, mask)
        return mask


def mask_call(
    function: Callable[..., Any],
    *,
    config: Any,
    hidden: Tensor,
    padding: Tensor | None,
    positions: Tensor | None = None,
) -> Any:
    """``function`` (a ``masking_utils`` mask builder) for a forward without cache, under the argument
    names of the installed transformers: ``inputs_embeds`` (``input_embeds`` before 5.0), ``cache``
    (``past_key_values``), and ``cache_position`` where the builder needs it. ``position_ids`` are passed
    only when the batch has them (packed sequences, found by the builder where positions restart): for
    positions ``0..T-1`` the builder's result is the same without them, and it saves the host read that
    looks for restarts."""
    names = inspect.signature(function).parameters
    kwargs: dict[str, Any] = {"config": config, "attention_mask": padding}
    if positions is not None or "position_ids" in names:
        kwargs["position_ids"] = positions
    kwargs["inputs_embeds" if "inputs_embeds" in names else "input_embeds"] = hidden
    kwargs["cache" if "cache" in names else "past_key_values"] = None
    if "cache_position" in names:
        kwargs["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
    return function(**kwargs)
