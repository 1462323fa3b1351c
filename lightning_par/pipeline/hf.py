"""Pipeline layers for Hugging Face causal language models, so that a ``transformers`` model needs no
hand-written wrappers to run under pipeline parallelism.

:func:`hf_pipeline_layers` cuts a model into the ordered list the pipeline protocol's
``pipeline_layers()`` returns: the embedding, one layer per decoder block, then the final norm with the
LM head. Each piece maps one tensor to one tensor (token ids -> hidden states -> ... -> logits): only the
hidden states cross a pipeline stage. Chaining the pieces computes the model's own ``forward(ids).logits``
(tested bitwise for both families): causal attention without a padding mask, positions ``0..T-1``, no
cache, as in pretraining or fine-tuning on packed, unpadded sequences.

Supported, by ``config.model_type``:

* ``gpt2``: ``transformer.wte`` + ``transformer.wpe``, the blocks ``transformer.h``, ``transformer.ln_f``
  with ``lm_head`` (tied to ``wte`` by default: the pipeline sums the tied table's gradient over the
  stages holding it);
* the Llama family, ``llama``, ``mistral``, ``qwen2`` and ``qwen3``: ``model.embed_tokens``, the decoder
  layers ``model.layers``, ``model.norm`` with ``lm_head``. The rotary position embedding is recomputed
  in every block from the hidden states' length (a few hundred flops per position), so nothing but the
  hidden states crosses a stage; it is the model's own ``rotary_emb`` module, referenced, not copied, so
  it follows the model to its device. A model with sliding-window attention (Mistral's default, Qwen's
  ``use_sliding_window``) equals its pieces for sequences no longer than the window, where the window
  masks nothing; a longer sequence is refused at the block's forward.

A PEFT model (``get_peft_model(model, LoraConfig(...))``) is cut as the transformers model it wraps:
adapters injected into the layers (LoRA, IA3, ...) sit inside the blocks and train there; prompt learning,
whose virtual tokens the PEFT model's own forward adds, is refused.

The attention kernel must be causal without a mask (``attn_implementation="sdpa"``, the default, or
flash attention); eager attention is refused, since without a mask it would attend to later positions.
Anything else is refused with the list above and the protocol to write by hand.

:func:`hf_causal_lm_loss` is the matching ``pipeline_loss``: the model's own loss (``model(input_ids,
labels=labels).loss``: position ``t`` predicts label ``t + 1``, ``-100`` ignored, the mean over the valid
targets) in the pipeline's token-exact form, so that training under pp with micro-batches, accumulation
and data parallelism takes the gradient of that mean over all of the window's samples, as one process
feeding the whole window to the model would. With it, a ``LightningModule`` holding a Hugging Face model
needs three one-line methods (``pipeline_input`` defaults to ``batch["input_ids"]`` for a dict batch).

The pieces wrap the model's modules (parameters are not copied). Build them in the first
``pipeline_layers()`` call and return the same list after: the strategy calls it after its tensor-parallel
plan has swapped modules (the embedding and the LM head become vocabulary-parallel), and a piece built
before that would run the replaced module. Each piece checks at its forward that the modules it wraps are
still the model's (a few identity comparisons) and raises with that fix otherwise.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_par.loss import token_loss_sum

SUPPORTED = ("gpt2", "llama", "mistral", "qwen2", "qwen3")
# attention kernels that are causal when given no mask; eager attention without a mask attends to the
# future, so the pieces would silently compute another model
CAUSAL_WITHOUT_MASK = ("sdpa", "flash_attention_2", "flash_attention_3")


def hf_pipeline_layers(model: nn.Module) -> list[nn.Module]:
    """The pipeline layers of the Hugging Face causal LM ``model`` (module docstring), or of the model a
    PEFT ``PeftModel`` wraps: adapters injected into the layers (LoRA, IA3, ...) are part of the blocks."""
    model = _unwrap_peft(model)
    hf: Any = model  # transformers' attributes, looked up by name (no import of transformers here)
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    attention = getattr(config, "_attn_implementation", None)
    if kind in SUPPORTED and attention not in CAUSAL_WITHOUT_MASK:
        raise ValueError(
            f"hf_pipeline_layers needs an attention kernel that is causal without a mask"
            f" ({', '.join(CAUSAL_WITHOUT_MASK)}), got attn_implementation={attention!r}: build the model"
            " with attn_implementation='sdpa' (from_pretrained(..., attn_implementation='sdpa'), or"
            " model.set_attn_implementation('sdpa'))."
        )
    if kind == "gpt2":
        t = hf.transformer
        blocks = [_Block((t.h, str(i)), None) for i in range(len(t.h))]
        return [_GPT2Embed(t), *blocks, _Head((t, "ln_f"), (hf, "lm_head"))]
    if kind in SUPPORTED:
        m = hf.model
        blocks = [_Block((m.layers, str(i)), m.rotary_emb, _window(config)) for i in range(len(m.layers))]
        return [_Embed((m, "embed_tokens")), *blocks, _Head((m, "norm"), (hf, "lm_head"))]
    raise TypeError(
        f"hf_pipeline_layers supports Hugging Face causal LMs of model_type {', '.join(SUPPORTED)}; got"
        f" {type(model).__name__} with model_type={kind!r}. For another model, write pipeline_layers()"
        " yourself: an ordered list of modules, each mapping a tensor or a flat tuple of tensors to the"
        " next one, whose chain computes the model's logits."
    )


def hf_causal_lm_loss(logits: Tensor, labels: Tensor, *, ignore_index: int = -100) -> dict[str, Tensor]:
    """A Hugging Face causal LM's loss on ``logits`` ``(B, T, V)`` for ``labels`` ``(B, T)`` (the labels as
    passed to the model: not yet shifted) as ``{"loss_sum", "tokens"}``: ``Σ_{b, t < T-1} CE(logits[b, t],
    labels[b, t + 1])`` over the targets that are not ``ignore_index``, and their number. The pipeline
    divides the gradient by the window's total (:mod:`lightning_par.pipeline.lightning`), which gives the
    gradient of the model's own mean loss over the window's samples."""
    loss_sum, tokens = token_loss_sum(logits[:, :-1], labels[:, 1:], ignore_index=ignore_index)
    return {"loss_sum": loss_sum, "tokens": tokens}


def _unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT model (its attribute forwarding would otherwise resolve
    ``model.model`` to the causal LM instead of its decoder); other models unchanged."""
    base = getattr(model, "get_base_model", None)
    if not callable(base):
        return model
    if getattr(getattr(model, "active_peft_config", None), "is_prompt_learning", False):
        raise ValueError(
            "hf_pipeline_layers: this PEFT model uses prompt learning (prompt, prefix or p-tuning), whose"
            " virtual tokens are added in the PEFT model's own forward, which the pipeline pieces do not run."
            " Use an adapter that lives inside the layers (LoRA, IA3, ...), or write pipeline_layers()"
            " yourself."
        )
    unwrapped: nn.Module = base()
    return unwrapped


def _window(config: Any) -> int | None:
    """The sliding-window length of a Llama-family config, ``None`` for full causal attention."""
    window = getattr(config, "sliding_window", None)
    if config.model_type == "mistral":
        return window
    sliding = getattr(config, "use_sliding_window", False) or "sliding_attention" in (
        getattr(config, "layer_types", None) or ()
    )
    return window if sliding else None


Origin = tuple[nn.Module, str]  # (parent module, name of the wrapped child in it)


class _Piece(nn.Module):
    """A view of some of the model's modules, each registered here under the name it has in its parent,
    with a check that the parent still holds it (module docstring)."""

    def __init__(self, *origins: Origin) -> None:
        super().__init__()
        self.__dict__["_origins"] = origins
        for parent, name in origins:
            self.add_module(_attr(name), parent._modules[name])

    def check(self) -> None:
        for parent, name in self.__dict__["_origins"]:
            if parent._modules.get(name) is not self._modules[_attr(name)]:
                raise RuntimeError(
                    f"The model's {type(parent).__name__}.{name} was replaced after hf_pipeline_layers built"
                    " its pieces (a tensor-parallel plan swaps modules), so a piece would run the old one."
                    " Build the pieces in the first pipeline_layers() call, not in configure_model(), and"
                    " return the same list after."
                )

    def child(self, name: str) -> nn.Module:
        """The wrapped module named ``name`` in its parent."""
        module = self._modules[_attr(name)]
        assert module is not None
        return module


def _attr(name: str) -> str:
    return f"layer_{name}" if name.isdigit() else name


class _GPT2Embed(_Piece):
    """Token plus learnt position embeddings, then the embedding dropout, as ``GPT2Model.forward``."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__((transformer, "wte"), (transformer, "wpe"), (transformer, "drop"))

    def forward(self, ids: Tensor) -> Tensor:
        self.check()
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.child("drop")(self.child("wte")(ids) + self.child("wpe")(positions))


class _Embed(_Piece):
    def forward(self, ids: Tensor) -> Tensor:
        self.check()
        return self.child("embed_tokens")(ids)


class _Block(_Piece):
    """One decoder block on the hidden states; with ``rotary``, the block's position embeddings are
    computed here (the model computes them once for all blocks: the values are the same)."""

    def __init__(self, origin: Origin, rotary: nn.Module | None, window: int | None = None) -> None:
        super().__init__(origin)
        self.__dict__["_block"], self.__dict__["_window"] = origin[1], window
        # referenced, not registered: the model owns it (and moves it); it holds buffers only
        self.__dict__["rotary"] = rotary

    def forward(self, hidden: Tensor) -> Tensor:
        self.check()
        window = self.__dict__["_window"]
        if window is not None and hidden.shape[1] > window:
            raise ValueError(
                f"A sequence of {hidden.shape[1]} tokens is longer than the model's sliding window"
                f" ({window}): hf_pipeline_layers' blocks attend causally to every earlier token, which"
                " equals the model only within the window. Use sequences of at most the window's length."
            )
        kwargs: dict[str, Any] = {}
        rotary = self.__dict__["rotary"]
        if rotary is not None:
            positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
            kwargs = {"position_ids": positions, "position_embeddings": rotary(hidden, positions)}
        out = self.child(self.__dict__["_block"])(hidden, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class _Head(_Piece):
    """The final norm, then the LM head (whatever their names in the model)."""

    def forward(self, hidden: Tensor) -> Tensor:
        self.check()
        (_, norm), (_, head) = self.__dict__["_origins"]
        return self.child(head)(self.child(norm)(hidden))
