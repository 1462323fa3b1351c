"""``litgpt_pipeline_layers``: litgpt's ``GPT`` under pipeline parallelism without hand-written wrappers.

The pieces chained in one process compute the model's own ``forward(idx)`` bitwise (Pythia-, Llama-,
Gemma-2- and Gemma-3-shaped configs: parallel residual, grouped queries, scaled embeddings, logit
soft-capping, sliding-window layers, ``rope_indices``; and litgpt's LoRA and adapter v1 / v2 models);
refusals name the fix (not a litgpt GPT, a subclass with its own forward, a sequence beyond
``max_seq_length``, a module replaced after the cut).
Behind the pipeline protocol, a Pythia-shaped GPT at pp2 with 1F1B, a Llama-shaped one at pp2 x dp2 with
zb and ZeRO-3, a ``litgpt.lora.GPT`` (frozen base, LoRA in the attention) at pp2 with zb, and a Llama-shaped
one at pp2 x tp2 with the ``"litgpt"`` tensor-parallel plan train as the single-process Trainer running the
model's own ``forward``: per-step losses, validation loss, weights."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import litgpt.lora as litgpt_lora
import pytest
import torch
from litgpt.config import Config
from litgpt.model import GPT
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.pipeline import litgpt_pipeline_layers
from tests.distributed import run_distributed
from tests.test_pp_hf import HFCausalLM
from tests.test_pp_trainer import GLOBAL, SEED, N, _reference, _trainer, assert_equals_reference
from tests.test_strategy import LossRecorder, Tokens

SMALL = dict(n_layer=2, block_size=16, vocab_size=64, padded_vocab_size=64, n_embd=32, n_head=4)
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "pythia": ("pythia-14m", {}),
    "llama": ("Llama-3.2-1B", dict(n_query_groups=2, intermediate_size=64)),
    "gemma2": (
        "Gemma-2-2b",
        dict(n_query_groups=2, intermediate_size=64, head_size=8, sliding_window_size=5),
    ),
    "gemma3": (
        "Gemma-3-1b-it",
        dict(n_layer=3, n_query_groups=2, intermediate_size=64, head_size=8, sliding_window_size=5),
    ),
}


def build(shape: str, *, lora: bool = False, seed: int = SEED) -> GPT:
    """A small seeded litgpt GPT of ``shape``; with ``lora``, litgpt's LoRA model (queries and values),
    only the adapters trainable."""
    name, extra = SHAPES[shape]
    torch.manual_seed(seed)
    if not lora:
        return GPT(Config.from_name(name, **(SMALL | extra)))
    config = litgpt_lora.Config.from_name(
        name, lora_r=4, lora_alpha=8, lora_query=True, lora_value=True, **(SMALL | extra)
    )
    model = litgpt_lora.GPT(config)
    litgpt_lora.mark_only_lora_as_trainable(model)
    return model


def _chain(pieces: list[nn.Module], x: Any) -> Any:
    for piece in pieces:
        x = piece(x)
    return x


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_pieces_compute_the_models_own_forward(shape: str) -> None:
    model = build(shape)
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))
    pieces = litgpt_pipeline_layers(model)
    assert torch.equal(_chain(pieces, ids), model(ids))
    assert torch.equal(_chain(pieces, ids[:, :9]), model(ids[:, :9]))  # shorter sequences: the tables' head
    held = [p for piece in pieces for p in piece.parameters()]
    assert sorted(map(id, held)) == sorted(map(id, model.parameters()))  # views, each parameter once
    lora = build(shape, lora=True)
    assert torch.equal(_chain(litgpt_pipeline_layers(lora), ids), lora(ids))


@pytest.mark.parametrize("kind", ["adapter", "adapter_v2"])
def test_the_pieces_of_litgpts_adapter_models_compute_their_forward(kind: str) -> None:
    """The adapter models keep GPT.forward and put their prompts and gates inside the blocks."""
    adapter = importlib.import_module(f"litgpt.{kind}")
    torch.manual_seed(SEED)
    config = adapter.Config.from_name("pythia-14m", adapter_prompt_length=3, adapter_start_layer=0, **SMALL)
    model = adapter.GPT(config)
    with torch.no_grad():  # the gates start at zero, which would hide the prompts
        for name, p in model.named_parameters():
            if "adapter" in name or "gating" in name:
                p.normal_()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_chain(litgpt_pipeline_layers(model), ids), model(ids))


def test_bad_models_are_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match=r"Linear is not a litgpt.model.GPT.* write pipeline_layers"):
        litgpt_pipeline_layers(nn.Linear(2, 2))

    class Custom(GPT):
        def forward(self, idx: Tensor, *args: Any, **kwargs: Any) -> Any:
            return super().forward(idx) * 2

    with pytest.raises(TypeError, match=r"Custom overrides GPT.forward"):
        litgpt_pipeline_layers(Custom(Config.from_name("pythia-14m", **SMALL)))
    model = build("pythia")
    with pytest.raises(TypeError, match=r"torch.compile'd model \(GPT .* model.transformer.h\[i\] ="):
        litgpt_pipeline_layers(torch.compile(model))  # type: ignore[arg-type]
    pieces = litgpt_pipeline_layers(model)
    with pytest.raises(ValueError, match=r"length 17: the litgpt model's max_seq_length is 16"):
        pieces[0](torch.zeros(1, 17, dtype=torch.long))
    model.lm_head = nn.Linear(32, 64)  # what a tensor-parallel plan would do
    with pytest.raises(RuntimeError, match=r"GPT.lm_head was replaced after litgpt_pipeline_layers"):
        pieces[-1](torch.zeros(1, 4, 32))


class LitGPTModule(HFCausalLM):
    """A litgpt GPT behind the pipeline protocol; ``training_step`` runs the model's own ``forward``."""

    def __init__(self, shape: str = "pythia", lora: bool = False) -> None:
        super().__init__()
        self.shape, self.lora = shape, lora

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build(self.shape, lora=self.lora)

    def pipeline_layers(self) -> list[nn.Module]:
        if not self._layers:
            assert self.model is not None
            self._layers = litgpt_pipeline_layers(self.model)
        return self._layers

    def _loss(self, batch: Any) -> Tensor:
        assert self.model is not None
        return self.pipeline_loss(self.model(batch[0]), batch)


def module_factory(shape: str, lora: bool = False) -> Any:
    def make() -> LitGPTModule:
        pl.seed_everything(SEED)
        module = LitGPTModule(shape, lora)
        module.configure_model()
        return module

    return make


# "meta": configure_model() runs in the strategy, on the meta device (ZeRO-3's meta init), and the
# initial weights come from a full state dict (pretrained=): the engine replaces the parameter objects
# after the pipeline was cut, which the split backward and the tied gradients must follow
CASES = {
    "pythia-1f1b": (2, "pythia", False, dict(pipeline_schedule="1f1b")),
    "llama-zb-zero3-dp2": (4, "llama", False, dict(pipeline_schedule="zb", zero_stage=3)),
    "llama-zb-zero3-meta": (4, "llama", False, dict(pipeline_schedule="zb", zero_stage=3, pretrained="meta")),
    "lora-zb": (2, "llama", True, dict(pipeline_schedule="zb")),
    # the "litgpt" tp plan inside each stage (fused qkv cut by segment, tensor_parallel/fused.py)
    "llama-1f1b-tp2": (
        4,
        "llama",
        False,
        dict(pipeline_schedule="1f1b", tensor_parallel_size=2, tp_plan="litgpt"),
    ),
}


def _run(rank: int, world: int, tmp: str, case: str) -> dict[str, Any]:
    _, shape, lora, kw = CASES[case]
    dp = world // (2 * kw.get("tensor_parallel_size", 1))
    rec = LossRecorder()
    meta = kw.get("pretrained") == "meta"
    if meta:
        kw = kw | {"pretrained": build(shape, lora=lora).state_dict()}
    strategy = HybridParallelStrategy(pipeline_parallel_size=2, num_microbatches=2, **kw)
    trainer = _trainer(strategy, world, tmp, [rec])
    train = DataLoader(Tokens(N), batch_size=GLOBAL // dp, shuffle=True)
    if meta:
        pl.seed_everything(SEED)
        module = LitGPTModule(shape, lora)  # built by the strategy, on the meta device
    else:
        module = module_factory(shape, lora)()
    trainer.fit(module, train, DataLoader(Tokens(8), batch_size=8 // dp))
    if meta:
        assert module.model is not None and strategy.meta_init
    state = trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]
    return {
        "losses": rec.losses,
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "state": {k: v.clone() for k, v in state.items()},
    }


@pytest.mark.parametrize("case", list(CASES))
def test_litgpt_pipeline_matches_single_process(case: str, tmp_path: Path) -> None:
    world, shape, lora, _ = CASES[case]
    results = run_distributed(_run, world, str(tmp_path), case, init_group=False, timeout=400)
    assert_equals_reference(results, _reference(tmp_path, make=module_factory(shape, lora)))


def _sequence_parallel_refused(rank: int, world: int, tmp: str) -> str:
    strategy = HybridParallelStrategy(
        pipeline_parallel_size=2,
        num_microbatches=2,
        tensor_parallel_size=2,
        tp_plan="litgpt",
        sequence_parallel=True,
    )
    trainer = _trainer(strategy, world, tmp, [])
    with pytest.raises(ValueError) as refused:
        trainer.fit(module_factory("llama")(), DataLoader(Tokens(N), batch_size=GLOBAL))
    strategy.destroy_process_groups()
    return str(refused.value)


def test_sequence_parallelism_with_the_pieces_is_refused_at_setup(tmp_path: Path) -> None:
    """The pieces size the rotary tables by the hidden states' length, which SP splits: refused on every
    rank before the pipeline communicates (before, torch's "The size of tensor a (16) must match the size
    of tensor b (8)" in the first step's rope, on the stages that got that far)."""
    for message in run_distributed(_sequence_parallel_refused, 4, str(tmp_path), init_group=False):
        assert (
            "sequence_parallel=True with pipeline pieces" in message and "sequence_parallel=False" in message
        )
