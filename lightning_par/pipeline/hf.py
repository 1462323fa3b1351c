"""Pipeline layers for Hugging Face causal language models, so that a ``transformers`` model needs no
hand-written wrappers to run under pipeline parallelism.

:func:`hf_pipeline_layers` cuts a model into the ordered list the pipeline protocol's
``pipeline_layers()`` returns: the embedding, one layer per decoder block, then the final norm with the
LM head. The pieces map token ids to hidden states to ... to logits; only the hidden states cross a
pipeline stage, with the batch's padding mask and positions beside them when it has them. Chaining the
pieces computes the model's own training forward ``forward(ids, attention_mask=mask, position_ids=pos,
use_cache=False).logits`` (tested bitwise for every family: without a mask, left- and right-padded, and
on packed rows), as in pretraining or fine-tuning.

Masks and positions. The first piece takes the token ids, ``(ids, attention_mask)``, or a mapping with
``input_ids`` and optionally ``attention_mask`` (a collator's 2D padding mask) and ``position_ids``
(packed rows from a flattening collator: positions restart at every document); it declares
``pipeline_input_keys = ("input_ids", "attention_mask", "position_ids")``, so the pipeline's default
input hands it those a dict batch has (:mod:`.lightning`). Between stages the hidden states travel with
the mask as ``bool`` and the positions as integers (told apart by their dtype). Each block builds its
attention mask as the model's forward does, with the same ``transformers.masking_utils`` function (causal,
or sliding-window causal for the layers the config declares sliding; documents of packed rows attend
only within themselves), so every attention kernel gets the mask format it expects: eager attention and
sliding windows shorter than the sequences work as in the model. Rotary positions come from
``position_ids`` when given, else ``0..T-1``. The blocks of one stage share the mask they built for a
micro-batch (one build per stage and micro-batch, not per block): a build reads one flag on the host
when the batch has a padding mask (whether it pads anything) or positions (whether they restart), as the
model's own forward does once; with neither, nothing is read and the mask is built once per sequence
length.

Supported, by ``config.model_type``:

* ``gpt2``: ``transformer.wte`` + ``transformer.wpe``, the blocks ``transformer.h``, ``transformer.ln_f``
  with ``lm_head`` (tied to ``wte`` by default: the pipeline sums the tied table's gradient over the
  stages holding it);
* the Llama-like families, ``llama``, ``mistral``, ``mixtral``, ``qwen2``, ``qwen2_moe``, ``qwen3``,
  ``qwen3_moe``, ``phi3``, ``starcoder2``, ``olmo``, ``olmo2``, ``stablelm``, ``helium``, ``glm`` and
  ``smollm3``: ``model.embed_tokens``, the decoder layers ``model.layers``, ``model.norm`` with
  ``lm_head``. The rotary position embedding is recomputed in every block from the positions (a few
  hundred flops per position), so nothing but the hidden states (and the mask and positions) cross a
  stage; it is the model's own ``rotary_emb`` module, referenced, not copied, so it follows the model to
  its device. A mixture-of-experts model whose config adds the routers' load-balancing loss to the
  model's loss (``output_router_logits=True``) is refused: the pieces compute the logits only;
* ``gpt_neox`` (Pythia and its kin) the same way, under its own names: ``gpt_neox.embed_in`` with
  ``emb_dropout``, ``gpt_neox.layers``, ``gpt_neox.final_layer_norm``, ``lm_head`` (``embed_out``
  before transformers 5);
* the Gemma family, ``gemma``, ``gemma2`` and ``gemma3_text`` (``Gemma3ForCausalLM``), the same way: the
  embedding's scale lives in ``embed_tokens`` (transformers 5; an older version, whose forward scaled
  it, is refused), the head soft-caps the logits where the config says so, Gemma 3's blocks take the
  rotary table of their attention type, and its ``use_bidirectional_attention`` is refused. The token
  table is tied to the LM head by default, as GPT-2's.

A PEFT model (``get_peft_model(model, LoraConfig(...))``) is cut as the transformers model it wraps:
adapters injected into the layers (LoRA, IA3, ...) sit inside the blocks and train there; prompt learning,
whose virtual tokens the PEFT model's own forward adds, is refused. Anything else is refused with the list
above and the protocol to write by hand. The masks need ``transformers.masking_utils`` (transformers
4.53 or later); an older version is refused with that fix. With transformers 4.53-4.x (checked with 4.57):
the Gemma family is refused (its forwards scale the embeddings or hand the rotary tables otherwise), and
Qwen2-MoE and StableLM, whose decoders still build their masks without the positions, refuse packed rows
(their own forwards let the documents attend to each other); the logits of padding positions, which no
loss reads, may differ there.

:func:`hf_causal_lm_loss` is the matching ``pipeline_loss``: the model's own loss (``model(input_ids,
labels=labels).loss``: position ``t`` predicts label ``t + 1``, ``-100`` ignored, the mean over the valid
targets) in the pipeline's token-exact form, so that training under pp with micro-batches, accumulation
and data parallelism takes the gradient of that mean over all of the window's samples, as one process
feeding the whole window to the model would. With it, a ``LightningModule`` holding a Hugging Face model
needs three one-line methods (``pipeline_input`` defaults to ``batch["input_ids"]``, with
``attention_mask`` and ``position_ids`` when the batch has them, for a dict batch).

The pieces wrap the model's modules (parameters are not copied). Build them in the first
``pipeline_layers()`` call and return the same list after: the strategy calls it after its tensor-parallel
plan has swapped modules (the embedding and the LM head become vocabulary-parallel), and a piece built
before that would run the replaced module. Each piece checks at its forward that the modules it wraps are
still the model's (a few identity comparisons) and raises with that fix otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_par.loss import token_loss_sum
from lightning_par.pipeline.hf_masks import Masks, attention_type
from lightning_par.pipeline.pieces import Origin, Piece, refuse_compiled, softcap
from lightning_par.tensor_parallel.family import scale_of

# the decoder families whose pieces are tested bitwise against the model (tests/test_pp_hf.py)
LLAMA_LIKE = (
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "starcoder2", "olmo",
    "olmo2", "stablelm", "helium", "glm", "smollm3",
)  # fmt: skip
SUPPORTED = ("gpt2", *LLAMA_LIKE, "gpt_neox", "gemma", "gemma2", "gemma3_text")
# where a Llama-like causal LM keeps its parts: the decoder's attribute, then the decoder's embedding,
# embedding dropout (or None), blocks and final norm, then the causal LM's head
_PARTS: dict[str, tuple[str, str, str | None, str, str, str]] = {
    "gpt_neox": ("gpt_neox", "embed_in", "emb_dropout", "layers", "final_layer_norm", "lm_head"),
}
_LLAMA_PARTS = ("model", "embed_tokens", None, "layers", "norm", "lm_head")
GEMMA = ("gemma", "gemma2", "gemma3_text")
# what the first piece takes from a dict batch (lightning.default_input): the ids, and the padding mask
# and the positions (packed sequences) when the batch has them
INPUT_KEYS = ("input_ids", "attention_mask", "position_ids")


def hf_pipeline_layers(model: nn.Module) -> list[nn.Module]:
    """The pipeline layers of the Hugging Face causal LM ``model`` (module docstring), or of the model a
    PEFT ``PeftModel`` wraps: adapters injected into the layers (LoRA, IA3, ...) are part of the blocks."""
    refuse_compiled(model, builder="hf_pipeline_layers", blocks="model.model.layers")
    model = _unwrap_peft(model)
    hf: Any = model  # transformers' attributes, looked up by name (imported for its mask builders only)
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        raise TypeError(
            f"hf_pipeline_layers supports Hugging Face causal LMs of model_type {', '.join(SUPPORTED)}; got"
            f" {type(model).__name__} with model_type={kind!r}. For another model, write pipeline_layers()"
            " yourself: an ordered list of modules, each mapping a tensor or a flat tuple of tensors to the"
            " next one, whose chain computes the model's logits."
        )
    _check_causal_lm(model, kind)
    if kind in GEMMA:
        _check_gemma(hf, config)
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            f"hf_pipeline_layers: this {kind} model has output_router_logits=True, which adds the routers'"
            " load-balancing loss in the model's forward; the pieces compute the logits only. Set"
            " model.config.output_router_logits = False (the loss is then the causal-LM loss,"
            " hf_causal_lm_loss), or write pipeline_layers() yourself."
        )
    masks = Masks(config)
    if kind == "gpt2":
        t = hf.transformer
        blocks = [_Block((t.h, str(i)), masks, "full_attention") for i in range(len(t.h))]
        return [_GPT2Embed(t), *blocks, _Head((t, "ln_f"), (hf, "lm_head"))]
    decoder, embed, dropout, layers, norm, head = _PARTS.get(kind, _LLAMA_PARTS)
    if head not in hf._modules and "embed_out" in hf._modules:  # GPT-NeoX's head before transformers 5
        head = "embed_out"
    m = getattr(hf, decoder)
    # Gemma 3 keeps one rotary table per attention type (local and global bases)
    per_type = kind == "gemma3_text"
    blocks = [
        _Block(
            (m._modules[layers], str(i)),
            masks,
            attention_type(config, i),
            m.rotary_emb,
            rope_by_type=per_type,
        )
        for i in range(len(m._modules[layers]))
    ]
    cap = getattr(config, "final_logit_softcapping", None)
    first = _Embed((m, embed), *([(m, dropout)] if dropout else []))
    if hasattr(
        m, "_update_causal_mask"
    ):  # a decoder that builds its masks the pre-5 way (Qwen2-MoE, StableLM)
        first.__dict__["_legacy"] = type(m).__name__
    return [first, *blocks, _Head((m, norm), (hf, head), cap)]


def _check_causal_lm(model: nn.Module, kind: str) -> None:
    """A supported family's other heads (sequence or token classification, a bare decoder) are refused
    by name: the pieces end with the causal LM's head (before: a bare KeyError 'lm_head' or an
    AttributeError on the decoder's attribute)."""
    decoder = "transformer" if kind == "gpt2" else _PARTS.get(kind, _LLAMA_PARTS)[0]
    head = model._modules.get("lm_head", model._modules.get("embed_out"))
    if isinstance(model._modules.get(decoder), nn.Module) and isinstance(head, nn.Module):
        return
    raise TypeError(
        f"hf_pipeline_layers builds the pieces of a causal LM (...ForCausalLM: a decoder {decoder!r} and an"
        f" lm_head); got {type(model).__name__}. For a classification head or a bare decoder, write"
        " pipeline_layers() yourself: the decoder's embedding and blocks as here, and a last layer that"
        " applies the head (pooling included) to the hidden states."
    )


def hf_causal_lm_loss(logits: Tensor, labels: Tensor, *, ignore_index: int = -100) -> dict[str, Tensor]:
    """A Hugging Face causal LM's loss on ``logits`` ``(B, T, V)`` for ``labels`` ``(B, T)`` (the labels as
    passed to the model: not yet shifted) as ``{"loss_sum", "tokens"}``: ``Σ_{b, t < T-1} CE(logits[b, t],
    labels[b, t + 1])`` over the targets that are not ``ignore_index``, and their number. The pipeline
    divides the gradient by the window's total (:mod:`lightning_par.pipeline.steps`), which gives the
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


def _check_gemma(model: Any, config: Any) -> None:
    """Refuse what the pieces would compute differently from a Gemma model's forward."""
    # transformers 5's scaled embedding, or its vocab-parallel replacement carrying the scale (tp)
    if scale_of(model.model.embed_tokens) is None:
        raise ValueError(
            f"hf_pipeline_layers: this {config.model_type} model scales its embeddings in the model's"
            " forward (transformers before 5.0), which the pieces do not run; install transformers>=5."
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(
            "hf_pipeline_layers: use_bidirectional_attention=True overlays a bidirectional mask the pieces"
            " do not build; train with causal attention or write pipeline_layers() yourself."
        )
    if hasattr(model.model, "rotary_emb_local"):
        raise ValueError(
            "hf_pipeline_layers: this gemma3_text model keeps its local rotary table apart and hands its"
            " layers both tables (transformers before 5.0), which the pieces do not do; install"
            " transformers>=5."
        )


def _first_input(x: Any) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The first piece's input as ``(ids, padding mask, positions)``: the ids, ``(ids, attention_mask)``,
    or a mapping with ``input_ids`` and optionally ``attention_mask`` and ``position_ids`` (what the
    default input hands over). The mask goes on as ``bool`` (what the mask builders turn it into), which
    is what tells it from the positions between stages."""
    if isinstance(x, Mapping) and isinstance(x.get("input_ids"), Tensor):
        ids, padding, positions = x["input_ids"], x.get("attention_mask"), x.get("position_ids")
    elif isinstance(x, Tensor):
        ids, padding, positions = x, None, None
    elif isinstance(x, (tuple, list)) and len(x) == 2 and all(isinstance(t, Tensor) for t in x):
        (ids, padding), positions = x, None
    else:
        raise TypeError(
            "hf_pipeline_layers' first piece takes the token ids, a pair (input_ids, attention_mask), or a"
            f" mapping with 'input_ids' (and optionally 'attention_mask', 'position_ids'); got"
            f" {type(x).__name__}: return one of them from pipeline_input."
        )
    if positions is not None and (positions.dtype == torch.bool or positions.is_floating_point()):
        raise TypeError(f"position_ids must be integers, got {positions.dtype}.")
    return ids, None if padding is None else padding.to(torch.bool), positions


def _unpack(x: Any) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """A later piece's input as ``(hidden states, padding mask, positions)``: the hidden states alone or
    followed by the ``bool`` mask and/or the integer positions (:func:`_pack`)."""
    if isinstance(x, Tensor):
        return x, None, None
    hidden, *extras = x
    padding = next((t for t in extras if t.dtype == torch.bool), None)
    positions = next((t for t in extras if t.dtype != torch.bool), None)
    return hidden, padding, positions


def _pack(out: Tensor, padding: Tensor | None, positions: Tensor | None) -> Tensor | tuple[Tensor, ...]:
    extras = tuple(t for t in (padding, positions) if t is not None)
    return (out, *extras) if extras else out


class _Piece(Piece):
    def __init__(self, *origins: Origin) -> None:
        super().__init__(*origins, builder="hf_pipeline_layers")


class _GPT2Embed(_Piece):
    """Token plus learnt position embeddings, then the embedding dropout, as ``GPT2Model.forward``."""

    pipeline_input_keys = INPUT_KEYS

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__((transformer, "wte"), (transformer, "wpe"), (transformer, "drop"))

    def forward(self, x: Any) -> Tensor | tuple[Tensor, ...]:
        self.check()
        ids, padding, positions = _first_input(x)
        where = torch.arange(ids.shape[1], device=ids.device) if positions is None else positions
        hidden = self.child("drop")(self.child("wte")(ids) + self.child("wpe")(where))
        return _pack(hidden, padding, positions)


class _Embed(_Piece):
    """The token embedding, then the embedding dropout where the model has one (GPT-NeoX)."""

    pipeline_input_keys = INPUT_KEYS

    def forward(self, x: Any) -> Tensor | tuple[Tensor, ...]:
        self.check()
        ids, padding, positions = _first_input(x)
        legacy = self.__dict__.get("_legacy")
        if positions is not None and legacy is not None:
            raise ValueError(
                f"hf_pipeline_layers: {legacy} builds its attention masks without the positions (transformers"
                " before 5.0), so its own forward lets packed documents attend to each other, which the"
                " pieces do not: the two would train different models. Install transformers>=5, or pass"
                " padded batches without position_ids."
            )
        names = [name for _, name in self.__dict__["_origins"]]
        hidden = self.child(names[0])(ids)
        if len(names) > 1:
            hidden = self.child(names[1])(hidden)
        return _pack(hidden, padding, positions)


class _Block(_Piece):
    """One decoder block on the hidden states, with the attention mask of its type (``masks``); with
    ``rotary``, the block's position embeddings are computed here (the model computes them once for all
    blocks: the values are the same)."""

    def __init__(
        self,
        origin: Origin,
        masks: Masks,
        attention: str,
        rotary: nn.Module | None = None,
        *,
        rope_by_type: bool = False,
    ) -> None:
        super().__init__(origin)
        self.__dict__["_rope_type"] = attention if rope_by_type else None
        self.__dict__["_block"], self.__dict__["_attention"] = origin[1], attention
        # referenced, not registered: the model owns it (and moves it); it holds buffers only
        self.__dict__["rotary"], self.__dict__["_masks"] = rotary, masks

    def forward(self, x: Any) -> Tensor | tuple[Tensor, ...]:
        self.check()
        hidden, padding, positions = _unpack(x)
        masks, attention = self.__dict__["_masks"], self.__dict__["_attention"]
        kwargs: dict[str, Any] = {"attention_mask": masks(hidden, padding, positions, attention)}
        rotary = self.__dict__["rotary"]
        if rotary is not None:
            where = (
                positions if positions is not None else torch.arange(hidden.shape[1], device=hidden.device)
            )
            where = where.view(-1, hidden.shape[1])  # (1, T) or (B, T), as the model's position_ids
            by_type = () if self.__dict__["_rope_type"] is None else (self.__dict__["_rope_type"],)
            kwargs |= {"position_ids": where, "position_embeddings": rotary(hidden, where, *by_type)}
        out = self.child(self.__dict__["_block"])(hidden, **kwargs)
        return _pack(out[0] if isinstance(out, tuple) else out, padding, positions)


class _Head(_Piece):
    """The final norm, then the LM head (whatever their names in the model), then the final logit
    soft-capping of configs that have it (Gemma 2 and 3: ``cap * tanh(logits / cap)``, in the causal LM's
    order of operations); the padding mask ends here."""

    def __init__(self, norm: Origin, head: Origin, cap: float | None = None) -> None:
        super().__init__(norm, head)
        self.__dict__["_cap"] = cap

    def forward(self, x: Any) -> Tensor:
        self.check()
        hidden, _, _ = _unpack(x)
        (_, norm), (_, head) = self.__dict__["_origins"]
        return softcap(self.child(head)(self.child(norm)(hidden)), self.__dict__["_cap"])
