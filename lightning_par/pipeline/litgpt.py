"""Pipeline layers for litgpt's ``GPT``, so that a litgpt model needs no hand-written wrappers to run
under pipeline parallelism.

:func:`litgpt_pipeline_layers` cuts a ``litgpt.model.GPT`` (or a subclass that keeps its ``forward``:
``litgpt.lora.GPT``, the adapter models) into the ordered list the pipeline protocol's ``pipeline_layers()``
returns: the token embedding (scaled by ``sqrt(n_embd)`` where the config says so, as Gemma's), one piece
per block, then ``ln_f`` with the LM head (and the final logit soft-capping of configs that have it).
Chaining the pieces computes the model's own ``forward(idx)`` for a training or evaluation forward
(no KV cache: ``input_pos`` is not taken), bitwise (tested on Pythia-, Llama-, Gemma-2- and
Gemma-3-shaped configs, the Gemmas with sliding-window layers, scaled embeddings, soft-capping or
``rope_indices``, and on litgpt's LoRA and adapter models).

Only the hidden states cross a pipeline stage: each block reads the rotary tables from the model's
``cos`` / ``sin`` buffers for the hidden states' length (the model's forward slices the same tables once
for all blocks), looked up on the model at every call, so a model moved to another device or whose tables
were rebuilt (``reset_parameters``, a new ``max_seq_length``) is followed. A sequence longer than the
model's ``max_seq_length`` is refused as the model refuses it.

The pieces wrap the model's modules (parameters are not copied) and, like
:func:`~lightning_par.pipeline.hf.hf_pipeline_layers`' pieces, check at their forward that the model still
holds them. litgpt's training scripts shift the targets in the data (``input_ids = data[:, :-1]``,
``targets = data[:, 1:]``), so the matching ``pipeline_loss`` is a plain cross-entropy, or
``lightning_par.loss.token_loss_sum(logits, targets)`` in the token-exact form.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_par.pipeline.pieces import Origin, Piece, refuse_compiled, softcap


def litgpt_pipeline_layers(model: nn.Module) -> list[nn.Module]:
    """The pipeline layers of litgpt's ``GPT`` ``model`` (module docstring)."""
    refuse_compiled(model, builder="litgpt_pipeline_layers", blocks="model.transformer.h")
    try:
        from litgpt.model import GPT
    except ImportError as error:
        raise ImportError("litgpt_pipeline_layers needs litgpt: pip install litgpt.") from error
    if not isinstance(model, GPT) or type(model).forward is not GPT.forward:
        what = "overrides GPT.forward" if isinstance(model, GPT) else "is not a litgpt.model.GPT"
        raise TypeError(
            f"litgpt_pipeline_layers cuts litgpt's GPT and the subclasses that keep its forward;"
            f" {type(model).__name__} {what}. For another model, write pipeline_layers() yourself: an"
            " ordered list of modules, each mapping a tensor or a flat tuple of tensors to the next one,"
            " whose chain computes the model's logits."
        )
    t: Any = model.transformer
    blocks = [_Block((t.h, str(i)), model, i) for i in range(len(t.h))]
    return [_Embed((t, "wte"), model), *blocks, _Head((t, "ln_f"), (model, "lm_head"), model)]


class _LitPiece(Piece):
    """A piece that reads the model's config and rotary tables (the model referenced, not registered:
    it owns the pieces' modules)."""

    def __init__(self, *origins: Origin, model: nn.Module) -> None:
        super().__init__(*origins, builder="litgpt_pipeline_layers")
        self.__dict__["gpt"] = model

    @property
    def gpt(self) -> Any:
        return self.__dict__["gpt"]


class _Embed(_LitPiece):
    def __init__(self, origin: Origin, model: nn.Module) -> None:
        super().__init__(origin, model=model)

    def forward(self, idx: Tensor) -> Tensor:
        self.check()
        if idx.size(1) > self.gpt.max_seq_length:
            raise ValueError(
                f"Cannot forward a sequence of length {idx.size(1)}: the litgpt model's max_seq_length is"
                f" {self.gpt.max_seq_length}."
            )
        x = self.child("wte")(idx)
        if self.gpt.config.scale_embeddings:
            # as GPT.forward: the factor rounded to the activations' dtype; a 0-dim CPU tensor enters a
            # CUDA multiplication as a scalar (no copy, no sync), and reaches no collective
            x = x * torch.tensor(self.gpt.config.n_embd**0.5, dtype=x.dtype)
        return x


class _Block(_LitPiece):
    """Block ``index`` with the rotary tables of the hidden states' length (``rope_indices`` applied as
    the model's forward applies them)."""

    def __init__(self, origin: Origin, model: nn.Module, index: int) -> None:
        super().__init__(origin, model=model)
        self.__dict__["_index"] = index

    def forward(self, x: Tensor) -> Tensor:
        self.check()
        index, length = self.__dict__["_index"], x.size(1)
        cos, sin = self.gpt.cos[:length].unsqueeze(0), self.gpt.sin[:length].unsqueeze(0)
        rope = self.gpt.config.rope_indices
        if rope is not None:
            cos, sin = cos[..., rope[index]], sin[..., rope[index]]
        out: Tensor = self.child(str(index))(x, cos, sin, None, None, None)
        return out


class _Head(_LitPiece):
    def __init__(self, norm: Origin, head: Origin, model: nn.Module) -> None:
        super().__init__(norm, head, model=model)

    def forward(self, x: Tensor) -> Tensor:
        self.check()
        # litgpt's do_softcapping computes the same operations in the same order
        return softcap(self.child("lm_head")(self.child("ln_f")(x)), self.gpt.config.final_logit_softcapping)
