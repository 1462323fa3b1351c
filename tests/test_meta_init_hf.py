"""Hugging Face models trained from their config at ZeRO-3 under meta init get the model's own
initialisation, as they would on a real device.

Before, ZeRO-3 materialised a meta parameter with its module's ``reset_parameters()`` only: every model
below was refused at its first module without one (Llama's RMSNorm, GPT-2's ``Conv1D``, ``T5LayerNorm``,
BERT's prediction-head bias), so a Hugging Face model could be meta-initialised only from pretrained
weights, and a model without such a module would have got torch's defaults instead of its own (an
embedding ``N(0, 1)`` against Hugging Face's ``N(0, 0.02)``, GPT-2's residual projections unscaled).

* One process: GPT-2 (tied table, ``Conv1D``, projections scaled by ``1 / sqrt(2 n_layer)``) and Llama
  (RMSNorm, rotary buffers) built under ``params_on_meta()`` (the strategies' context) and materialised by
  ``materialize_model`` (ZeRO-3's unsharded twin; ``tests/test_zero3.py`` checks the shards equal it)
  against the same model built on the CPU: the constant parameters (norm weights, biases) equal, every
  random one with the real init's mean and spread, buffers equal, the tie kept. The same for Gemma 3,
  Qwen3, Phi-3, GPT-NeoX, Mixtral, BERT and T5, whose inits differ. A PEFT LoRA model on a Llama from its
  config: base as above, B zero and A as PEFT makes them.
* A parameter that no initialiser sets (inside a Hugging Face model without ``reset_parameters()``, or
  outside with one that forgets it) is refused, named.
* A model built under ``torch.device("meta")`` (buffers too): its buffers are computed as on a real device
  (rotary frequencies, BatchNorm statistics, BERT's position ids, litgpt's rope cache; with transformers 4
  the Hugging Face ones are refused, named), and a buffer no initialiser sets, or sets in part, is refused.
* The init depends on the run's seed and each module's path only: unit policies give the same model, seeds
  differ, blocks alike are drawn apart, and the caller's random state is left as it was.
* Two ranks, Fabric at ZeRO-3, ``fabric.init_module(empty_init=True)`` around ``LlamaForCausalLM(config)``,
  each rank in a different random state: at dp2 the gathered initial weights are the model's own init as
  above; at tp2 they are the same weights bitwise (each slice drawn from its full-size layer; before,
  refused), and so are they for the model built under ``torch.device("meta")``; a PEFT LoRA Llama at
  tp2 equals its one-process twin (``materialize_model`` with the run's seed) bitwise. Each trains 3
  steps of AdamW with gradient accumulation and clipping equal to one process starting from those
  weights (the LoRA one needs the gradient sums of its replicated ``lora_A`` to follow the parameters
  meta init replaces; before, their hooks stayed on the discarded meta ones).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import peft
import pytest
import torch
import transformers
from lightning.fabric import Fabric
from torch import nn

from lightning_par.fabric import HybridParallelStrategy
from lightning_par.tensor_parallel import SOURCE_ATTR
from lightning_par.zero.meta_buffers import materialize_buffers
from lightning_par.zero.meta_build import params_on_meta
from lightning_par.zero.meta_init import materialize_model
from tests.distributed import run_distributed
from tests.test_batchnorm import ResNetModule
from tests.test_fabric_tp import STEPS, _adamw, _loop
from tests.test_pp_litgpt import build as litgpt_build
from tests.third_party import LLAMA, LORA_TARGETS, T5, add_lora, gpt2, hf_model, llama

SEED = 11

SPREAD_RTOL = 0.15  # two samples' std over >= 512 draws: 5.4 % apart at most here (a wrong init: 2-50x)


def assert_own_init(state: dict[str, torch.Tensor], real: nn.Module, what: str) -> None:
    """``state`` is distributed as ``real``'s init: constants equal, random tensors with its mean and
    standard deviation (a different draw, so not bitwise)."""
    expected = real.state_dict()
    assert set(state) == set(expected), what
    for name, want in expected.items():
        got = state[name]
        assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {name}"
        spread = float(want.std()) if want.numel() > 1 else 0.0
        if spread == 0.0:
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{what}: {name} (constant)")
            continue
        big = want.numel() >= 512  # smaller ones (a router, a bias table; 8.9 % apart at most here)
        rtol = SPREAD_RTOL if big else 0.5
        assert abs(float(got.mean()) - float(want.mean())) < (0.2 if big else 0.5) * spread, f"{what}: {name}"
        torch.testing.assert_close(
            got.std(), want.std(), rtol=rtol, atol=0, msg=lambda m, n=name: f"{what}: std of {n}\n{m}"
        )


def _materialized(build: Any, seed: int = 7, units: list[str] | None = None) -> nn.Module:
    with params_on_meta():
        model = build()
    assert all(p.is_meta for p in model.parameters())
    materialize_model(model, units=units, seed=seed, device=torch.device("cpu"))
    return model


def test_the_init_depends_on_the_seed_and_the_modules_only() -> None:
    """Each module's initialisers run under a seed of the run's seed and its path: the unit policy does not
    change the model (nor, therefore, the pipeline stage or the world size); the seed does, and blocks
    alike are drawn apart. The caller's random state is left as it was."""
    with params_on_meta():
        model = gpt2()
    before = torch.get_rng_state()
    materialize_model(model, seed=7, device=torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), before)
    base = model.state_dict()
    for units in (["*.c_proj"], ["transformer.h.0", "transformer.h.1.mlp"]):
        for k, v in _materialized(gpt2, units=units).state_dict().items():
            torch.testing.assert_close(v, base[k], rtol=0, atol=0, msg=f"{units}: {k}")
    other = _materialized(gpt2, seed=8).state_dict()
    weights = [k for k, v in base.items() if k.endswith("weight") and v.std() > 0]
    assert weights and all(not torch.equal(other[k], base[k]) for k in weights)
    assert not torch.equal(
        base["transformer.h.0.attn.c_attn.weight"], base["transformer.h.1.attn.c_attn.weight"]
    )


def test_hf_models_get_their_own_init_from_the_meta_device() -> None:
    for build in (gpt2, llama):
        model, real = _materialized(build), build()
        name = type(real).__name__
        assert_own_init(model.state_dict(), real, name)
        for (key, got), (_, want) in zip(model.named_buffers(), real.named_buffers(), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{name}: buffer {key}")
    model = _materialized(gpt2)
    assert model.lm_head.weight is model.transformer.wte.weight  # the tie survives
    # GPT-2's residual projections: std 0.02 / sqrt(2 n_layer) = 0.01 here, the other Conv1D 0.02; an
    # embedding as torch initialises it would have std 1
    proj = torch.cat([b.attn.c_proj.weight.flatten() for b in model.transformer.h])
    torch.testing.assert_close(proj.std(), torch.tensor(0.01), rtol=0.1, atol=0)
    torch.testing.assert_close(model.transformer.wte.weight.std(), torch.tensor(0.02), rtol=0.1, atol=0)


ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", LLAMA | dict(head_dim=8)),  # RMSNorm as 1 + w
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", LLAMA | dict(head_dim=8)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", LLAMA | dict(pad_token_id=None, eos_token_id=None)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", LLAMA),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", LLAMA | dict(num_local_experts=4)),
    "bert": ("BertConfig", "BertForMaskedLM", LLAMA | dict(type_vocab_size=2)),
    "t5": ("T5Config", "T5ForConditionalGeneration", T5),
}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_more_architectures_get_their_own_init(arch: str) -> None:
    """Each model's own ``_init_weights`` differs (Gemma's norms start at 0 for ``1 + w``, T5 scales by
    ``d_model``, BERT has LayerNorms and a token-type table, Mixtral a router and experts)."""
    config_name, model_name, options = ARCHITECTURES[arch]
    build = partial(hf_model, model_name, config_name, **options)
    assert_own_init(_materialized(build).state_dict(), build(), arch)


def test_peft_lora_on_a_model_from_its_config() -> None:
    model = _materialized(lambda: add_lora(llama()))
    torch.manual_seed(3)
    real = peft.get_peft_model(
        llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, lora_dropout=0.0)
    )
    state = model.state_dict()
    assert any("lora_B" in k for k in state)
    for k in state:
        if "lora_B" in k:
            assert not state[k].any(), k  # the adapter starts as the identity
    # lora_A: PEFT's kaiming init (std 1 / sqrt(3 * 32) = 0.10), not the model's N(0, 0.02); checked over
    # all adapters at once, each being below 512 draws
    a_got = torch.cat([v.flatten() for k, v in state.items() if "lora_A" in k])
    a_want = torch.cat([v.flatten() for k, v in real.state_dict().items() if "lora_A" in k])
    torch.testing.assert_close(a_got.std(), a_want.std(), rtol=SPREAD_RTOL, atol=0)
    base = {k: v for k, v in state.items() if "lora_" not in k}
    real_base = llama()
    assert_own_init(
        {k.removeprefix("base_model.model.").replace(".base_layer", ""): v for k, v in base.items()},
        real_base,
        "LoRA base",
    )


class Gain(nn.Module):
    """A parameter held directly, created on the meta device (no values to replay; one created with
    values is kept: ``tests/test_meta_writes.py``), and no ``reset_parameters()``."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.empty(4, device="meta"))


class Half(nn.Module):
    """A ``reset_parameters()`` that sets one parameter of two (both created on the meta device)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.empty(4, device="meta"))
        self.b = nn.Parameter(torch.empty(4, device="meta"))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.a)


def test_parameters_no_initialiser_sets_are_refused() -> None:
    def llama_with_gain() -> nn.Module:
        model = llama()
        model.model.layers[0].gain = Gain()  # the model's _init_weights does not know it
        return model

    with pytest.raises(ValueError, match=r"\['model\.layers\.0\.gain\.gain'\] were left unset"):
        _materialized(llama_with_gain)
    with pytest.raises(ValueError, match=r"\['1\.b'\] were left unset.*reset_parameters\(\)"):
        _materialized(lambda: nn.Sequential(nn.Linear(4, 4), Half()))
    with params_on_meta():
        plain = nn.Sequential(nn.Linear(4, 4), Gain())
    with pytest.raises(ValueError, match=r"'1' \(Gain\).*no reset_parameters\(\)"):
        materialize_model(plain, seed=0, device=torch.device("cpu"))  # outside a Hugging Face model


def test_parametrization_originals_a_model_init_writes_are_explained() -> None:
    """Wav2Vec2's own ``_init_weights`` writes its positional conv's computed weight, which a weight_norm
    parametrization turns into ``original0/1`` on a real device only: the refusal says so and leads with
    ``meta_init=False`` (before, the generic advice to give the module a ``reset_parameters()``)."""
    tiny = dict(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(2, 2), conv_kernel=(3, 3), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, vocab_size=12,
    )  # fmt: skip
    build = partial(hf_model, "Wav2Vec2ForCTC", "Wav2Vec2Config", **tiny)
    with pytest.raises(
        ValueError,
        match=r"parametrizations\.weight\.original0.*originals of a torch parametrization.*meta_init=False",
    ):
        _materialized(build)


# --------------------------------------------------------------------- buffers of models built on meta
def _buffer_builds() -> dict[str, Any]:
    """Models with buffers of every kind: rotary frequencies (Hugging Face decoders, litgpt's rope cache),
    BatchNorm statistics (Hugging Face's ResNet, a plain net), BERT's position ids."""
    builds: dict[str, Any] = {"llama": llama}
    for arch in ("gemma3", "gpt_neox", "bert"):
        config_name, model_name, options = ARCHITECTURES[arch]
        builds[arch] = partial(hf_model, model_name, config_name, **options)
    builds["resnet"] = lambda: ResNetModule().net
    builds["batchnorm"] = lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    builds["litgpt"] = partial(litgpt_build, "llama")
    return builds


def test_buffers_of_a_model_built_on_the_meta_device() -> None:
    """A model built under ``torch.device("meta")`` (the FSDP2 / torchtitan idiom) gets its buffers
    computed as on a real device, bitwise; before, the engine failed with torch's "Cannot copy out of meta
    tensor". transformers 4 computes rotary frequencies and BERT's position ids only in ``__init__``:
    refused, named."""
    hf_computes_buffers = int(transformers.__version__.split(".")[0]) >= 5
    for name, build in _buffer_builds().items():
        real = build()
        with torch.device("meta"):
            model = build()
        meta = [k for k, b in model.named_buffers() if b.is_meta]
        assert meta, name
        if name in ("llama", "gemma3", "gpt_neox", "bert") and not hf_computes_buffers:
            with pytest.raises(
                ValueError, match=r"Buffers \[.*(inv_freq|position_ids).*\] are on the meta.*meta'\)"
            ):
                materialize_buffers(model, device=torch.device("cpu"))
            assert all(b.is_meta for b in model.buffers()), name  # left as they were
            continue
        assert materialize_buffers(model, device=torch.device("cpu")) == meta, name
        for (key, got), (_, want) in zip(model.named_buffers(), real.named_buffers(), strict=True):
            assert torch.equal(got, want), f"{name}: {key}"
        assert all(p.is_meta for p in model.parameters()), name  # the parameters are the engine's


class Frequencies(nn.Module):
    """A buffer computed in ``__init__`` only; ``half`` resets half of it."""

    def __init__(self, half: bool = False) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.register_buffer("freq", torch.arange(4.0))
        if half:
            self.reset_parameters = lambda: self.freq[:2].zero_()  # type: ignore[method-assign]


def test_buffers_no_initialiser_sets_are_refused() -> None:
    for half in (False, True):  # no initialiser, or one that sets part of the buffer
        with torch.device("meta"):
            model = nn.Sequential(nn.BatchNorm1d(4), Frequencies(half))
        with pytest.raises(ValueError, match=r"Buffers \['1\.freq'\] are on the meta device"):
            materialize_buffers(model, device=torch.device("cpu"))
        assert all(b.is_meta for b in model.buffers())  # nothing replaced, the BatchNorm's included


# ---------------------------------------------------------------------------------------------- Fabric
def _zero3_from_config(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    # dp2 x ZeRO-3, then tp2 x ZeRO-3 from the same seed: the same model, its slices drawn from it; the
    # same model built by the user under torch.device("meta") (buffers too); a PEFT LoRA model at tp2 x
    # ZeRO-3 (adapters sharded with their base layers)
    tp = dict(tensor_parallel_size=world, tp_plan="llama")
    layouts = {
        "dp": ({}, llama, False),
        "tp": (tp, llama, False),
        "meta_device": ({}, llama, True),
        "tp_lora": (tp, lambda: add_lora(llama()), False),
    }
    for name, (kw, build, on_meta) in layouts.items():
        strategy = HybridParallelStrategy(zero_stage=3, **kw)  # type: ignore[arg-type]
        fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
        fabric.launch()
        with torch.device("meta") if on_meta else fabric.init_module(empty_init=True):
            model = build()
        assert all(p.is_meta for p in model.parameters())
        assert all(b.is_meta for b in model.buffers()) == on_meta
        torch.manual_seed(SEED + rank)  # the init's seed: drawn by the first rank, agreed by all
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(_adamw(model))
        initial = {k: v.clone() for k, v in strategy.consolidated_state_dict().items()}
        dp_rank, dp = strategy.mesh.dp_rank, strategy.mesh.dp_size
        losses = _loop(fabric, model, optimizer, dp_rank=dp_rank, dp=dp, steps=range(STEPS), norms=[])
        final = {k: v.clone() for k, v in strategy.consolidated_state_dict().items()}
        sources = [n for n, m in model.named_modules() if SOURCE_ATTR in m.__dict__]
        strategy.destroy_process_groups()
        seed = strategy.engine.init_seed  # type: ignore[union-attr]
        out[name] = {"initial": initial, "losses": losses, "final": final, "sources": sources, "seed": seed}
    return out


def test_fabric_zero3_meta_init_of_a_model_from_its_config() -> None:
    runs = run_distributed(_zero3_from_config, 2, init_group=False)
    initial = runs[0]["dp"]["initial"]
    assert_own_init(initial, llama(), "Fabric ZeRO-3 meta init")
    # tensor parallelism draws each slice from the full matrix: the same model, bitwise (before, refused)
    # and so does a model built under torch.device("meta"), its buffers computed (before, refused by
    # torch: "Cannot copy out of meta tensor")
    for layout in ("tp", "meta_device"):
        assert initial.keys() == runs[0][layout]["initial"].keys()
        for k, v in initial.items():
            torch.testing.assert_close(runs[0][layout]["initial"][k], v, rtol=0, atol=0, msg=f"{layout}: {k}")
    torch.set_num_threads(1)
    reference = llama()
    reference.load_state_dict(initial)
    # the LoRA model's twin: built on the meta device, materialised in one process with the run's seed
    with params_on_meta():
        lora_twin = add_lora(llama())
    materialize_model(lora_twin, seed=runs[0]["tp_lora"]["seed"], device=torch.device("cpu"))
    lora_initial = runs[0]["tp_lora"]["initial"]
    assert lora_initial.keys() == lora_twin.state_dict().keys()
    for k, v in lora_twin.state_dict().items():
        torch.testing.assert_close(lora_initial[k], v, rtol=0, atol=0, msg=f"tp_lora initial: {k}")
    lora_b = [v for k, v in lora_initial.items() if "lora_B" in k]
    assert lora_b and all(not v.any() for v in lora_b)  # PEFT's init: each adapter starts as the identity
    # one process from each starting model; dp2 and tp2 started from the same one
    for layouts, model in ((("dp", "tp", "meta_device"), reference), (("tp_lora",), lora_twin)):
        fabric = Fabric(accelerator="cpu", devices=1)
        model, optimizer = fabric.setup(model, _adamw(model))
        start = {k: v.clone() for k, v in model.state_dict().items()}
        losses = _loop(fabric, model, optimizer, dp_rank=0, dp=1, steps=range(STEPS), norms=[])
        state = model.state_dict()
        assert max(float((state[k] - start[k]).abs().max()) for k in state) > 1e-3, layouts  # it trained
        for layout in layouts:
            for run in runs:
                torch.testing.assert_close(
                    torch.tensor(run[layout]["losses"]), torch.tensor(losses), msg=layout
                )
                assert run[layout]["sources"] == [], layout  # released once the slices are drawn
            for k, v in state.items():
                torch.testing.assert_close(runs[0][layout]["final"][k], v, msg=f"{layout} final: {k}")
