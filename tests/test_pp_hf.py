"""``hf_pipeline_layers``: Hugging Face causal LMs under pipeline parallelism without hand-written wrappers.

The pieces chained in one process compute the model's own training forward (``use_cache=False``)
bitwise, without a mask, with left and right padding, and on packed rows (restarting ``position_ids``),
for GPT-2, the fifteen Llama-like families (Llama, Mistral, Mixtral, Qwen2 / 3 and their MoE forms,
Phi-3, Starcoder2, OLMo 1 / 2, StableLM, Helium, GLM, SmolLM3), GPT-NeoX and Gemma 1 / 2 / 3, with eager
attention and with sliding windows shorter than the sequences, in fp32 and bf16; refusals name the fix
(an unknown attention type, the routers' auxiliary loss, Gemma's bidirectional attention or an old
transformers, a replaced module, an unsupported model, a malformed first input); and a Llama behind the
pipeline protocol, pp2 with 1F1B and with zb, pp2 x tp2 (the shipped llama plan) with zb, pp2 from a
``save_pretrained`` directory, and a PEFT LoRA model (the ``PeftModel`` itself) at pp2 with 1F1B and with zb
(Hugging Face's activation checkpointing on; under zb the LM head also trained as a ``modules_to_save``
copy), trains as the single-process Trainer running the model's own ``forward``: per-step losses,
validation loss and weights; a prompt-learning PEFT model is refused with the fix."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import Tensor, nn
from torch.utils.data import DataLoader
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from lightning_par import HybridParallelStrategy
from lightning_par.pipeline import hf_pipeline_layers
from lightning_par.pipeline.hf_masks import mask_call
from tests.distributed import run_distributed
from tests.probes import COMPILED_CALLS, counting_backend
from tests.test_pp_trainer import GLOBAL, SEED, N, _reference, _trainer
from tests.test_strategy import LossRecorder, Tokens
from tests.third_party import add_lora, checkpoint_layers

Family = str  # a model_type: "gpt2", "llama", "gemma2", ...
_CLASSES: dict[str, tuple[Any, Any]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "gemma": (GemmaConfig, GemmaForCausalLM),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM),
    "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM),
}
# the other Llama-like families, by transformers' class names
_LLAMA_LIKE = {
    "mixtral": "Mixtral",
    "qwen2_moe": "Qwen2Moe",
    "qwen3_moe": "Qwen3Moe",
    "phi3": "Phi3",
    "starcoder2": "Starcoder2",
    "olmo": "Olmo",
    "olmo2": "Olmo2",
    "stablelm": "StableLm",
    "helium": "Helium",
    "glm": "Glm",
    "smollm3": "SmolLM3",
    "gpt_neox": "GPTNeoX",  # Pythia: its own attribute names, partial rotary, embedding dropout
}
_CLASSES |= {
    family: (getattr(transformers, f"{name}Config"), getattr(transformers, f"{name}ForCausalLM"))
    for family, name in _LLAMA_LIKE.items()
}
# Gemma: small heads (their default is 256 wide), windows shorter than the sequences, tied tables; Gemma 2
# has no sdpa path in transformers (its attention soft-caps); Gemma 3 with a global layer between local ones
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 16}
_EXTRA: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": 16},  # the window covers the test's sequences
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "shared_expert_intermediate_size": 16} | _MOE,
    "qwen3_moe": {"num_experts": 4} | _MOE,
    "phi3": {"pad_token_id": 0},  # the default pad id lies outside the small vocabulary
    "smollm3": {"pad_token_id": 0},
    "glm": {"pad_token_id": 0, "head_dim": 8},
    "helium": {"head_dim": 8},
    "gpt_neox": {"rotary_pct": 0.25},
    "gemma": {"head_dim": 8},
    "gemma2": {"head_dim": 8, "sliding_window": 5, "attn_implementation": "eager"},
    "gemma3_text": {
        "head_dim": 8,
        "sliding_window": 5,
        "layer_types": ["sliding_attention", "full_attention"],
        "final_logit_softcapping": 30.0,  # off by default for Gemma 3; on here, to be tested
    },
}
_DECODER = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=16,
)  # fmt: skip


def build(family: Family, *, seed: int = SEED, **options: Any) -> PreTrainedModel:
    """A small seeded model of ``family`` (dropout off, sdpa attention unless ``options`` say otherwise)."""
    torch.manual_seed(seed)
    if family == "gpt2":
        kw: dict[str, Any] = dict(
            vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, tie_word_embeddings=True, attn_implementation="sdpa",
        )  # fmt: skip
        return GPT2LMHeadModel(GPT2Config(**(kw | options)))
    config, model = _CLASSES[family]
    extra = _EXTRA.get(family, {})
    return model(config(**(_DECODER | {"attn_implementation": "sdpa"} | extra | options)))


class HFCausalLM(pl.LightningModule):
    """A Hugging Face causal LM of ``family`` with the pipeline protocol from ``hf_pipeline_layers``; its
    ``training_step`` runs the model's own ``forward`` (what the single-process reference runs)."""

    def __init__(self, family: Family = "gpt2", seed: int = SEED, lora: bool | str = False) -> None:
        super().__init__()
        self.family, self.seed, self.lora = family, seed, lora
        self.model: nn.Module | None = None
        self._layers: list[nn.Module] = []

    def configure_model(self) -> None:
        if self.model is None:  # with lora, a PEFT model (LoRA adapters in the projections, base frozen)
            model = build(self.family, seed=self.seed)
            # lora="saved": the LM head trained as a whole copy too (PEFT's modules_to_save)
            saved = ["lm_head"] if self.lora == "saved" else None
            self.model = add_lora(model, modules_to_save=saved) if self.lora else model

    def pipeline_layers(self) -> list[nn.Module]:
        # built at the first call, after a tensor-parallel plan swapped modules; the same list after
        if not self._layers:
            assert self.model is not None
            self._layers = hf_pipeline_layers(self.model)
        return self._layers

    def pipeline_loss(self, output: Tensor, batch: Any) -> Tensor:
        return F.cross_entropy(output.flatten(0, 1), batch[1].flatten())

    def _loss(self, batch: Any) -> Tensor:
        assert self.model is not None
        return self.pipeline_loss(self.model(batch[0]).logits, batch)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.3, momentum=0.9)


def module_factory(family: Family, seed: int = SEED, lora: bool | str = False) -> Any:
    def make() -> HFCausalLM:
        pl.seed_everything(SEED)
        module = HFCausalLM(family, seed, lora)
        module.configure_model()
        return module

    return make


def _padding(side: str) -> Tensor | None:
    """A padding mask for 3 sequences of 16 tokens: the first and the last padded on ``side``."""
    if side == "none":
        return None
    mask = torch.ones(3, 16, dtype=torch.long)
    pads = {0: 5, 2: 11}
    for row, n in pads.items():
        if side == "left":
            mask[row, :n] = 0
        else:
            mask[row, 16 - n :] = 0
    return mask


# sliding windows shorter than the sequences (eager, sdpa), eager attention: the pieces build the model's
# own masks for all of them
VARIANTS: list[tuple[Family, dict[str, Any]]] = [
    ("gpt2", {}),
    ("llama", {}),
    ("mistral", {}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("gpt2", {"attn_implementation": "eager"}),
    ("llama", {"attn_implementation": "eager"}),
    ("mistral", {"sliding_window": 5}),
    ("mistral", {"sliding_window": 5, "attn_implementation": "eager"}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
    *[(family, {}) for family in _LLAMA_LIKE],
    # sliding windows of the families that slide every layer when the config sets one
    ("mixtral", {"sliding_window": 5}),
    ("phi3", {"sliding_window": 5}),
    ("starcoder2", {"sliding_window": 5}),
    ("qwen3_moe", {"sliding_window": 5}),
    ("gemma", {}),
    ("gemma2", {}),  # final logit soft-capping, local and global layers
    ("gemma3_text", {}),  # a rotary table per attention type
    ("gemma3_text", {"attn_implementation": "eager"}),
]


TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
# before transformers 5: refused (the models' forwards scale embeddings or hand rotary tables otherwise);
# packed rows refused (the models' own masks ignore the positions)
REFUSED_BEFORE_5 = {"gemma", "gemma2", "gemma3_text"}
PACKED_REFUSED_BEFORE_5 = {"qwen2_moe", "stablelm"}


def assert_same_logits(got: Tensor, want: Tensor, mask: Tensor | None, what: Any) -> None:
    """Bitwise equal logits; before transformers 5 at the valid positions only: some 4.x models (Qwen2-MoE,
    StableLM) give the padding's query positions, whose logits no loss reads, another fully-masked-row
    rule (checked with transformers 4.57)."""
    if mask is None or TRANSFORMERS_5:
        assert torch.equal(got, want), what
    else:
        valid = mask.bool()
        assert torch.equal(got[valid], want[valid]), what


@pytest.mark.parametrize(("family", "options"), VARIANTS, ids=lambda v: str(v))
def test_the_pieces_compute_the_models_own_forward(family: Family, options: dict[str, Any]) -> None:
    model = build(family, **options).train()  # training mode: dropout is off, nothing else differs
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))
    if family in REFUSED_BEFORE_5 and not TRANSFORMERS_5:
        with pytest.raises(ValueError, match=r"\(transformers before 5\.0\).* install transformers>=5"):
            hf_pipeline_layers(model)
        return
    pieces = hf_pipeline_layers(model)
    for side in ("none", "left", "right"):
        mask = _padding(side)
        x: Any = ids if mask is None else (ids, mask)
        for piece in pieces:
            x = piece(x)
        assert_same_logits(x, model(ids, attention_mask=mask).logits, mask, side)
    # packed sequences (a flattening collator's position_ids, restarting at every document), without and
    # with a padding mask, as a dict from the default input
    packed = torch.cat([torch.arange(n) for n in (5, 7, 4)]).expand(3, 16)
    for mask in (None, _padding("right")):
        batch = {"input_ids": ids, "position_ids": packed} | (
            {} if mask is None else {"attention_mask": mask}
        )
        if family in PACKED_REFUSED_BEFORE_5 and not TRANSFORMERS_5:
            with pytest.raises(ValueError, match=r"packed documents attend to each other"):
                pieces[0](batch)
            continue
        z: Any = batch
        for piece in pieces:
            z = piece(z)
        assert_same_logits(
            z, model(**batch, use_cache=False).logits, mask, f"packed, mask {mask is not None}"
        )
        assert not torch.allclose(z, model(ids, attention_mask=mask).logits)  # the positions matter
        if side == "left":  # the case is not trivial: without the mask the pieces compute other logits
            y: Any = ids
            for piece in pieces:
                y = piece(y)
            assert not torch.allclose(y[0], x[0]), family
    # the pieces are views: the model's parameters, each held by exactly one piece (the tied GPT-2 table
    # by the first and the last)
    held = [p for piece in pieces for p in piece.parameters()]
    assert {id(p) for p in held} == {id(p) for p in model.parameters()}
    keys = ("input_ids", "attention_mask", "position_ids")
    assert pieces[0].pipeline_input_keys == keys  # type: ignore[comparison-overlap]


def test_the_pieces_compute_the_models_own_forward_in_bf16() -> None:
    """bf16 weights (``precision="bf16-true"``): the masks are built in the activations' dtype, as the
    model builds them; every variant, unpadded and left-padded."""
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))
    for family, options in VARIANTS:
        if family in REFUSED_BEFORE_5 and not TRANSFORMERS_5:
            continue  # refused, as the test above checks
        model = build(family, **options).train().to(torch.bfloat16)
        pieces = hf_pipeline_layers(model)
        for mask in (None, _padding("left")):
            x: Any = ids if mask is None else (ids, mask)
            for piece in pieces:
                x = piece(x)
            assert x.dtype == torch.bfloat16
            want = model(ids, attention_mask=mask, use_cache=False).logits
            assert_same_logits(x, want, mask, (family, options))


def test_the_pieces_of_a_peft_model_compute_its_forward() -> None:
    peft_model = add_lora(build("llama")).train()
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))
    x: Any = ids
    pieces = hf_pipeline_layers(peft_model)
    for piece in pieces:
        x = piece(x)
    assert torch.equal(x, peft_model(ids).logits)
    held = {name for piece in pieces for name, p in piece.named_parameters() if p.requires_grad}
    assert held and all("lora_" in name for name in held), held  # the adapters, inside the blocks


def test_a_piece_refuses_to_run_a_module_the_model_replaced() -> None:
    model = build("llama")
    pieces = hf_pipeline_layers(model)
    ids = torch.randint(0, 64, (1, 8))
    pieces[0](ids)
    model.model.embed_tokens = nn.Embedding(64, 32)  # what a tensor-parallel plan does to the table
    with pytest.raises(RuntimeError, match=r"LlamaModel.embed_tokens was replaced .* first pipeline_layers"):
        pieces[0](ids)
    model.model.layers[1] = nn.Identity()
    with pytest.raises(RuntimeError, match=r"ModuleList.1 was replaced"):
        pieces[2](torch.zeros(1, 8, 32))


def test_bad_models_are_refused_with_the_fix() -> None:
    with pytest.raises(
        TypeError, match=r"model_type gpt2, llama, .* got Linear with model_type=None.* write"
    ):
        hf_pipeline_layers(nn.Linear(2, 2))
    # a supported family with another head, or none (before: a bare KeyError 'lm_head' / AttributeError)
    import transformers

    llama_config = LlamaConfig(**(_DECODER | {"num_labels": 3, "pad_token_id": 0}))
    for other in (
        transformers.LlamaForSequenceClassification(llama_config),
        transformers.LlamaForTokenClassification(llama_config),
        transformers.LlamaModel(llama_config),
        transformers.GPT2Model(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)),
    ):
        with pytest.raises(
            TypeError, match=rf"builds the pieces of a causal LM .* got {type(other).__name__}\."
        ):
            hf_pipeline_layers(other)
    from peft import PromptTuningConfig, get_peft_model

    prompted = get_peft_model(build("llama"), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    with pytest.raises(ValueError, match=r"prompt learning .* virtual tokens .* \(LoRA, IA3, ...\)"):
        hf_pipeline_layers(prompted)
    model = build("qwen2")
    model.config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match=r"layer 1 has attention type 'chunked_attention'.* yourself"):
        hf_pipeline_layers(model)
    old_gemma = build("gemma")
    old_gemma.model.embed_tokens = nn.Embedding(64, 32)  # before transformers 5 the forward scaled it
    with pytest.raises(ValueError, match=r"gemma model scales its embeddings in the model's forward"):
        hf_pipeline_layers(old_gemma)
    with pytest.raises(ValueError, match=r"use_bidirectional_attention=True .* causal attention"):
        hf_pipeline_layers(build("gemma3_text", use_bidirectional_attention=True))
    with pytest.raises(ValueError, match=r"mixtral model has output_router_logits=True.* = False"):
        hf_pipeline_layers(build("mixtral", output_router_logits=True))
    # a whole-model compile would not apply to the pieces (and hides the modules): compile the blocks
    with pytest.raises(TypeError, match=r"compile'd model \(LlamaForCausalLM .* model.model.layers\[i\]"):
        hf_pipeline_layers(torch.compile(build("llama")))  # type: ignore[arg-type]
    # what transformers 4.x models look like (checked with 4.57): Gemma 3's separate local rotary table;
    # a decoder building its masks without the positions, whose packed rows are refused (padding is not)
    gemma3 = build("gemma3_text")
    gemma3.model.rotary_emb_local = gemma3.model.rotary_emb
    with pytest.raises(ValueError, match=r"local rotary table apart .* install transformers>=5"):
        hf_pipeline_layers(gemma3)
    legacy = build("qwen2")
    legacy.model._update_causal_mask = lambda *args: None
    first = hf_pipeline_layers(legacy)[0]
    ids = torch.zeros(1, 4, dtype=torch.long)
    first({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    with pytest.raises(ValueError, match=r"Qwen2Model builds its attention masks without the positions"):
        first({"input_ids": ids, "position_ids": torch.arange(4)[None]})
    embed = hf_pipeline_layers(build("llama"))[0]
    with pytest.raises(TypeError, match=r"a pair \(input_ids, attention_mask\), or a mapping .* got dict"):
        embed({"ids": torch.zeros(1, 4, dtype=torch.long)})
    with pytest.raises(TypeError, match=r"position_ids must be integers, got torch.float32"):
        embed({"input_ids": torch.zeros(1, 4, dtype=torch.long), "position_ids": torch.zeros(1, 4)})


def test_gpt_neox_with_its_head_named_as_before_transformers_5() -> None:
    """GPT-NeoX's LM head was ``embed_out`` before transformers 5 (checked with 4.57: the pieces equal the
    model there); a model with that name is cut with it."""
    model = build("gpt_neox").train()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    want = model(ids).logits
    if "lm_head" in model._modules:  # transformers 5: renamed as before
        model._modules["embed_out"] = model._modules.pop("lm_head")
    assert "embed_out" in model._modules and "lm_head" not in model._modules
    x: Any = ids
    for piece in hf_pipeline_layers(model):
        x = piece(x)
    assert torch.equal(x, want)


def test_the_mask_builders_are_called_with_each_transformers_versions_argument_names() -> None:
    """transformers 4.53-4.57 name the arguments ``input_embeds`` and ``past_key_values`` and need
    ``cache_position``; 5.x renamed them (``inputs_embeds``, ``cache``, no ``cache_position``)."""
    hidden, padding = torch.zeros(2, 5, 8), torch.ones(2, 5, dtype=torch.long)

    def old(config: Any, input_embeds: Tensor, attention_mask: Any, cache_position: Tensor,
            past_key_values: Any, position_ids: Any = None) -> Any:  # fmt: skip
        return input_embeds, attention_mask, cache_position.tolist(), past_key_values, position_ids

    def new(
        config: Any, inputs_embeds: Tensor, attention_mask: Any, cache: Any, position_ids: Any = None
    ) -> Any:
        return inputs_embeds, attention_mask, cache, position_ids

    got = mask_call(old, config=None, hidden=hidden, padding=padding)
    assert got[0] is hidden and got[1] is padding and got[2:] == ([0, 1, 2, 3, 4], None, None)
    got = mask_call(new, config=None, hidden=hidden, padding=None)
    assert got[0] is hidden and got[1:] == (None, None, None)


def _run(rank: int, world: int, tmp: str, kw: dict[str, Any]) -> dict[str, Any]:
    rec = LossRecorder()
    seed = SEED
    if kw.get("pretrained"):  # the reference's weights come from the file, this model's own are others
        kw = kw | {"pretrained": str(Path(tmp) / "pretrained")}
        seed = SEED + 1
    lora, reentrant, compiled = kw.get("lora", False), kw.get("checkpointing"), kw.get("compile_blocks")
    family = kw.get("family", "llama")
    kw = {k: v for k, v in kw.items() if k not in ("lora", "checkpointing", "compile_blocks", "family")}
    strategy = HybridParallelStrategy(pipeline_parallel_size=2, num_microbatches=2, **kw)
    trainer = _trainer(strategy, world, tmp, [rec])
    train = DataLoader(Tokens(N), batch_size=GLOBAL, shuffle=True)
    module = module_factory(family, seed, lora=lora)()
    if reentrant is not None:  # Hugging Face's activation checkpointing in the blocks the pieces run
        assert module.model is not None
        checkpoint_layers(module.model, reentrant=reentrant)
    if compiled:  # the user compiles each decoder layer (the pieces then call the compiled layers)
        layers: Any = module.model.model.layers  # type: ignore[union-attr]
        for i, layer in enumerate(layers):
            layers[i] = torch.compile(layer, backend=counting_backend)
    before = COMPILED_CALLS[0]
    trainer.fit(module, train, DataLoader(Tokens(8), batch_size=8))
    state = trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]
    return {
        "losses": rec.losses,
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "state": {k.replace("._orig_mod", ""): v.clone() for k, v in state.items()},
        "compiled_calls": COMPILED_CALLS[0] - before,
    }


LLAMA_CASES = [
    (2, dict(pipeline_schedule="1f1b")),
    (2, dict(pipeline_schedule="zb")),  # W of the Llama's nn.Linear layers
    # 3-D on a model we did not write: the shipped llama plan's column/row-parallel layers inside the
    # pipeline pieces, their weight gradients deferred by zb
    (4, dict(pipeline_schedule="zb", tensor_parallel_size=2, tp_plan="llama")),
    # fine-tuning a checkpoint: a save_pretrained directory read lazily into the stages (meta init)
    (2, dict(pipeline_schedule="1f1b", pretrained=True)),
    # a PEFT LoRA model handed over as it is: frozen base, adapters inside the blocks' projections; zb
    # defers the adapters' weight gradients (their A and B are nn.Linear) and skips the frozen bases.
    # Both with Hugging Face's activation checkpointing (the reference without): reentrant under 1f1b,
    # non-reentrant under zb (zb refuses the reentrant kind); under zb with the LM head trained as a
    # whole copy as well (modules_to_save)
    (2, dict(pipeline_schedule="1f1b", lora=True, checkpointing=True)),
    (2, dict(pipeline_schedule="zb", lora="saved", zero_stage=1, checkpointing=False)),
    # LoRA at pp2 x tp2: the A of a column-parallel projection is replicated and its gradient summed over
    # the tp group by a hook, so zb keeps it in B (a deferred W would skip the sum); the head's copy and
    # its original are both column-parallel
    (4, dict(pipeline_schedule="zb", lora="saved", tensor_parallel_size=2, tp_plan="llama")),
    # Gemma 3 at pp2 x tp2: its scaled embedding sharded by vocabulary (the pieces accept the scale the
    # sharded layer carries; before, refused as a transformers 4 model), per-head q/k norms whose gradients
    # are summed over tp, the MLP's region input at pre_feedforward_layernorm (tensor_parallel/family.py)
    (4, dict(pipeline_schedule="zb", tensor_parallel_size=2, tp_plan="llama", family="gemma3_text")),
    # the decoder layers torch.compile'd one by one (as torchtitan compiles blocks): the pieces run the
    # compiled layers, zb's split included (its hooks on the layers' nn.Linear run eagerly, between graphs)
    (2, dict(pipeline_schedule="zb", compile_blocks=True)),
]


@pytest.mark.parametrize(
    ("world", "kw"),
    LLAMA_CASES,
    ids=[
        "1f1b",
        "zb",
        "zb-tp2",
        "pretrained",
        "lora-1f1b",
        "lora-zb",
        "lora-zb-tp2",
        "gemma3-zb-tp2",
        "zb-compiled",
    ],
)
def test_hf_pipeline_matches_single_process(world: int, kw: dict[str, Any], tmp_path: Path) -> None:
    if kw.get("pretrained"):
        build("llama").save_pretrained(tmp_path / "pretrained")  # the reference's initial weights
    results = run_distributed(_run, world, str(tmp_path), kw, init_group=False, timeout=400)
    ref_losses, reference, ref_val = _reference(
        tmp_path, make=module_factory(kw.get("family", "llama"), lora=kw.get("lora", False))
    )
    for r in results:  # every pipeline (and tensor-parallel) rank reports the same loss
        torch.testing.assert_close(torch.tensor(r["losses"]), ref_losses)
        if kw.get("compile_blocks"):  # each stage ran its compiled layers
            assert r["compiled_calls"] > 0, r["compiled_calls"]
        assert r["val_loss"] == pytest.approx(ref_val, rel=1e-5)
    state = results[0]["state"]
    assert set(reference) <= set(state), sorted(set(reference) - set(state))
    for name, value in reference.items():
        torch.testing.assert_close(state[name], value.detach(), msg=name)


def test_a_stages_blocks_share_one_mask_per_micro_batch() -> None:
    """The blocks of a stage receive the same padding tensor for a micro-batch and build its attention
    mask once; a new micro-batch (a new padding tensor) builds it again."""
    pieces = hf_pipeline_layers(build("llama", num_hidden_layers=4))
    masks = pieces[1].__dict__["_masks"]
    builds = []
    full = masks.functions["full_attention"]

    @functools.wraps(full)  # the builder's signature, which mask_call reads
    def counted(**kwargs: Any) -> Any:
        builds.append(kwargs["attention_mask"])
        return full(**kwargs)

    masks.functions["full_attention"] = counted
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        x: Any = (ids, _padding("left"))
        for piece in pieces:
            x = piece(x)
    assert len(builds) == 2 and builds[0] is not builds[1]
