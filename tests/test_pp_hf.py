"""``hf_pipeline_layers``: Hugging Face causal LMs under pipeline parallelism without hand-written wrappers.

The pieces chained in one process compute the model's own ``forward(ids).logits`` bitwise (GPT-2, Llama,
Mistral within its sliding window, Qwen2, Qwen3; training mode); refusals name the fix (eager attention,
a sequence longer than a sliding window, a replaced module, an unsupported model); and a Llama behind the
pipeline protocol, pp2 with 1F1B and with zb, pp2 x tp2 (the shipped llama plan) with zb, pp2 from a
``save_pretrained`` directory, and a PEFT LoRA model (the ``PeftModel`` itself) at pp2 with 1F1B and with zb,
trains as the single-process Trainer running the model's own ``forward``: per-step losses, validation loss
and weights; a prompt-learning PEFT model is refused with the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader
from transformers import (
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
from tests.distributed import run_distributed
from tests.test_pp_trainer import GLOBAL, SEED, N, _reference, _trainer
from tests.test_strategy import LossRecorder, Tokens
from tests.third_party import add_lora

Family = Literal["gpt2", "llama", "mistral", "qwen2", "qwen3"]
_CLASSES: dict[str, tuple[Any, Any]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
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
    extra = {"sliding_window": 16} if family == "mistral" else {}  # the window covers the test's sequences
    return model(config(**(_DECODER | {"attn_implementation": "sdpa"} | extra | options)))


class HFCausalLM(pl.LightningModule):
    """A Hugging Face causal LM of ``family`` with the pipeline protocol from ``hf_pipeline_layers``; its
    ``training_step`` runs the model's own ``forward`` (what the single-process reference runs)."""

    def __init__(self, family: Family = "gpt2", seed: int = SEED, lora: bool = False) -> None:
        super().__init__()
        self.family, self.seed, self.lora = family, seed, lora
        self.model: nn.Module | None = None
        self._layers: list[nn.Module] = []

    def configure_model(self) -> None:
        if self.model is None:  # with lora, a PEFT model (LoRA adapters in the projections, base frozen)
            model = build(self.family, seed=self.seed)
            self.model = add_lora(model) if self.lora else model

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


def module_factory(family: Family, seed: int = SEED, lora: bool = False) -> Any:
    def make() -> HFCausalLM:
        pl.seed_everything(SEED)
        module = HFCausalLM(family, seed, lora)
        module.configure_model()
        return module

    return make


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "qwen2", "qwen3"])
def test_the_pieces_compute_the_models_own_forward(family: Family) -> None:
    model = build(family).train()  # training mode: dropout is off, nothing else differs
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))
    x: Any = ids
    for piece in hf_pipeline_layers(model):
        x = piece(x)
    assert torch.equal(x, model(ids).logits)
    # the pieces are views: the model's parameters, each held by exactly one piece (the tied GPT-2 table
    # by the first and the last)
    held = [p for piece in hf_pipeline_layers(model) for p in piece.parameters()]
    assert {id(p) for p in held} == {id(p) for p in model.parameters()}


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
    with pytest.raises(ValueError, match=r"causal without a mask .* got attn_implementation='eager'.*'sdpa'"):
        hf_pipeline_layers(build("llama", attn_implementation="eager"))
    sliding = hf_pipeline_layers(
        build("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    )
    with pytest.raises(
        ValueError, match=r"sequence of 16 tokens is longer than the model's sliding window \(8\)"
    ):
        sliding[1](torch.zeros(1, 16, 32))
    with pytest.raises(
        TypeError, match=r"model_type gpt2, llama, .* got Linear with model_type=None.* write"
    ):
        hf_pipeline_layers(nn.Linear(2, 2))
    from peft import PromptTuningConfig, get_peft_model

    prompted = get_peft_model(build("llama"), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    with pytest.raises(ValueError, match=r"prompt learning .* virtual tokens .* \(LoRA, IA3, ...\)"):
        hf_pipeline_layers(prompted)


def _run(rank: int, world: int, tmp: str, kw: dict[str, Any]) -> dict[str, Any]:
    rec = LossRecorder()
    seed = SEED
    if kw.get("pretrained"):  # the reference's weights come from the file, this model's own are others
        kw = kw | {"pretrained": str(Path(tmp) / "pretrained")}
        seed = SEED + 1
    lora, kw = kw.get("lora", False), {k: v for k, v in kw.items() if k != "lora"}
    strategy = HybridParallelStrategy(pipeline_parallel_size=2, num_microbatches=2, **kw)
    trainer = _trainer(strategy, world, tmp, [rec])
    train = DataLoader(Tokens(N), batch_size=GLOBAL, shuffle=True)
    make = module_factory("llama", seed, lora=lora)
    trainer.fit(make(), train, DataLoader(Tokens(8), batch_size=8))
    state = trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]
    return {
        "losses": rec.losses,
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "state": {k: v.clone() for k, v in state.items()},
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
    # defers the adapters' weight gradients (their A and B are nn.Linear) and skips the frozen bases
    (2, dict(pipeline_schedule="1f1b", lora=True)),
    (2, dict(pipeline_schedule="zb", lora=True, zero_stage=1)),
]


@pytest.mark.parametrize(
    ("world", "kw"), LLAMA_CASES, ids=["1f1b", "zb", "zb-tp2", "pretrained", "lora-1f1b", "lora-zb"]
)
def test_llama_pipeline_matches_single_process(world: int, kw: dict[str, Any], tmp_path: Path) -> None:
    if kw.get("pretrained"):
        build("llama").save_pretrained(tmp_path / "pretrained")  # the reference's initial weights
    results = run_distributed(_run, world, str(tmp_path), kw, init_group=False, timeout=400)
    ref_losses, reference, ref_val = _reference(
        tmp_path, make=module_factory("llama", lora=kw.get("lora", False))
    )
    for r in results:  # every pipeline (and tensor-parallel) rank reports the same loss
        torch.testing.assert_close(torch.tensor(r["losses"]), ref_losses)
        assert r["val_loss"] == pytest.approx(ref_val, rel=1e-5)
    state = results[0]["state"]
    assert set(reference) <= set(state), sorted(set(reference) - set(state))
    for name, value in reference.items():
        torch.testing.assert_close(state[name], value.detach(), msg=name)
