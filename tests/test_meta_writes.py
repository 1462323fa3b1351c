"""A model's own initialisation under meta init (ZeRO-3): writes its construction makes into the meta
parameters are replayed when the engine materialises them (``lightning_par.zero.meta_writes``).

Before, only the layers' ``reset_parameters()`` (and a Hugging Face model's ``_init_weights``) were run
again: a nanoGPT-style model built in ``configure_model()`` at ZeRO-3 started with its embedding 50 times
wider than its ``N(0, 0.02)`` init (std 1.02, measured), its zeroed output head random and its biases
non-zero (and with nanoGPT's own ``LayerNorm``, parameters created as ``torch.ones``, it was refused);
modules initialised in their constructors without a ``reset_parameters()`` (``nn.MultiheadAttention``,
and so Lightning's demo ``Transformer``; a ViT's class token) were refused. Checked here, in one process:
each model materialised from the meta device is distributed as the same model built on a real device
(constants equal, random tensors with its mean and spread), independent of the unit policy, the same for
the same seed, without touching the caller's random state; writes that cannot be replayed are refused
naming the parameter. On 2 Gloo ranks: a ZeRO-3 ``Trainer`` fit of the nanoGPT-style model equals one
process training its twin; a head zeroed after ``load_state_dict`` in ``configure_model()`` stays zero,
the rest the file's; Fabric's ``init_module(empty_init=True)`` followed by ``load_state_dict`` (before,
lost) gives the file's weights; an init after ``fabric.setup`` (torchtitan's order) is refused naming
``gathered_params(writeback=True)``, inside which it reaches the shards; Whisper, whose own
``_init_weights`` copies a sinusoidal table into a parameter, loads from ``pretrained=`` (before, that
copy was taken for a load in ``configure_model()`` and the run refused).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import transformers
from lightning.fabric import Fabric
from lightning.pytorch.demos import Transformer
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.fabric import HybridParallelStrategy as FabricStrategy
from lightning_par.zero.meta_build import params_on_meta
from lightning_par.zero.meta_init import materialize_model
from lightning_par.zero.meta_loads import MetaLoads
from lightning_par.zero.meta_writes import WRITES_ATTR
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state
from tests.test_meta_init_hf import _materialized, assert_own_init
from tests.third_party import LORA_TARGETS, LoraLlama, Tokens, llama


class LayerNorm(nn.Module):
    """nanoGPT's LayerNorm: its parameters created with their values, no ``reset_parameters()``."""

    def __init__(self, ndim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim))

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class NanoGPT(nn.Module):
    """nanoGPT's init: ``N(0, 0.02)`` weights and embeddings, zero biases, residual projections scaled by
    ``1 / sqrt(2 n_layer)``, its own LayerNorm; and a zero-initialised output head."""

    def __init__(self, vocab: int = 64, width: int = 32) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)
        self.ln_f = LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.apply(self._init_weights)
        nn.init.normal_(self.proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * 4))
        nn.init.zeros_(self.head.weight)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        hidden = self.wte(tokens)
        return self.head(self.ln_f(hidden + self.proj(torch.relu(self.fc(hidden)))))


class ViTBits(nn.Module):
    """Writes through views and the init functions that skip meta tensors: a class token set by
    ``trunc_normal_`` (a module without ``reset_parameters()``), a fused qkv weight made orthogonal chunk by
    chunk, a padding row zeroed through ``.data`` and indexing, an output scaled after its init, a bias
    set by ``__setitem__``."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.cls = nn.Parameter(torch.zeros(1, 1, width))
        self.qkv = nn.Linear(width, 3 * width)
        self.emb = nn.Embedding(40, width)
        self.out = nn.Linear(width, width)
        nn.init.trunc_normal_(self.cls, std=0.02)
        with torch.no_grad():
            for block in self.qkv.weight.chunk(3):
                nn.init.orthogonal_(block)
            self.emb.weight.data[0].zero_()
            self.out.weight.mul_(0.1)
            self.qkv.bias[:32] = 0.5


def demo_transformer() -> nn.Module:
    return Transformer(vocab_size=64, ninp=32, nhead=2, nhid=64, nlayers=1)


def gaussian_lora() -> nn.Module:
    """PEFT LoRA with ``init_lora_weights="gaussian"``: A drawn ``N(0, 1 / r)`` (materialisation's own
    adapter init is PEFT's default, A as ``nn.Linear``: the recorded writes keep the choice)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=LORA_TARGETS, init_lora_weights="gaussian")
    return get_peft_model(llama(0), config)


def uninitialised_lora() -> nn.Module:
    """PEFT LoRA with ``init_lora_weights=False``: A and B keep ``nn.Linear``'s init (before: B zero and A
    drawn by the Llama's ``_init_weights``)."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(llama(0), LoraConfig(r=4, target_modules=LORA_TARGETS, init_lora_weights=False))


def pissa_lora() -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(llama(0), LoraConfig(r=4, target_modules=LORA_TARGETS, init_lora_weights="pissa"))


def litgpt_pretrained_style() -> nn.Module:
    """litgpt's GPT with the init of its pretraining script: ``initialize_weights`` sets each linear and
    embedding's ``reset_parameters`` to ``N(0, sqrt(2 / 5 / n_embd))`` (attention's output projection
    ``1 / sqrt(n_embd) / n_layer``) and runs them, here on meta tensors. Materialisation calls the patched
    ``reset_parameters`` again, which alone gives this init; the recorded writes must agree with it."""
    from litgpt.config import Config
    from litgpt.model import GPT
    from litgpt.pretrain import initialize_weights

    config = Config(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=128, padded_vocab_size=128)
    model = GPT(config)
    initialize_weights(SimpleNamespace(strategy=None), model, n_layer=2, n_embd=64)  # type: ignore[arg-type]
    return model


BUILDERS = {
    "nanogpt": NanoGPT,
    "vit_bits": ViTBits,
    "lightning_demo_transformer": demo_transformer,
    "peft_gaussian_lora": gaussian_lora,
    "peft_uninitialised_lora": uninitialised_lora,
    "litgpt_pretrain_init": litgpt_pretrained_style,
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_the_models_own_init_is_replayed(name: str) -> None:
    build = BUILDERS[name]
    torch.manual_seed(0)
    real = build()
    with params_on_meta():
        model = build()
    before = torch.get_rng_state()
    materialize_model(model, seed=7, device=torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), before)  # the caller's stream goes on as if nothing ran
    assert_own_init(model.state_dict(), real, name)
    state = model.state_dict()
    assert all(not hasattr(p, "_lp_meta_writes") for p in model.parameters())  # nothing left on them
    # a unit per module changes nothing; another seed draws another model
    units = [n for n, m in model.named_modules() if n and any(True for _ in m.parameters(recurse=False))]
    for key, value in _materialized(build, units=units).state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0, msg=key)
    other = _materialized(build, seed=8).state_dict()
    assert any(not torch.equal(other[k], v) for k, v in state.items())
    if name == "nanogpt":  # what torch's defaults gave before: std 1 for the embedding, a random head
        torch.testing.assert_close(state["wte.weight"].std(), torch.tensor(0.02), rtol=0.1, atol=0)
        assert not state["head.weight"].any() and not state["fc.bias"].any()
    if name == "vit_bits":
        assert not state["emb.weight"][0].any() and state["emb.weight"][1:].all()
        torch.testing.assert_close(state["qkv.bias"][:32], torch.full((32,), 0.5), rtol=0, atol=0)
        for block in state["qkv.weight"].chunk(3):  # orthogonal: rows of unit length
            torch.testing.assert_close(block @ block.T, torch.eye(32), rtol=0, atol=1e-5)


class CopiesAnotherParameter(nn.Module):
    def __init__(self, reset_after: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        with torch.no_grad():
            self.head.weight.data.copy_(self.emb.weight.data)  # values ZeRO-3 does not have here
        if reset_after:
            self.head.reset_parameters()  # superseded: nothing left to replay


def test_writes_that_cannot_be_replayed_are_refused() -> None:
    with pytest.raises(ValueError, match=r"head\.weight \(copy_: it reads another meta-device tensor\)"):
        _materialized(lambda: CopiesAnotherParameter(reset_after=False))
    # PiSSA computes the adapters from the base weights (before: silently PEFT's default init instead)
    with pytest.raises(ValueError, match=r"init_lora_weights='pissa', which reads the base layer's weights"):
        _materialized(pissa_lora)
    model = _materialized(lambda: CopiesAnotherParameter(reset_after=True))
    assert model.head.weight.abs().max() <= 1 / math.sqrt(8)  # its reset_parameters() bound


class PositionalTable(nn.Module):
    """A table created with random values, no ``reset_parameters()`` (the values kept for the check)."""

    def __init__(self) -> None:
        super().__init__()
        drawn = torch.randn(1, 8, 4) * 0.02
        self.table = nn.Parameter(drawn)
        self.drawn = drawn.clone()  # not a buffer: what the table was created with


def test_values_a_parameter_is_created_with_are_kept() -> None:
    """``nn.Embedding.from_pretrained(vectors)`` (before: silently ``N(0, 1)`` at ZeRO-3, its
    ``reset_parameters()`` drew it) and a table created with values keep those values; a layer's own
    ``torch.empty`` weight is not kept once its ``reset_parameters()`` has overwritten it."""
    vectors = torch.randn(10, 4)
    with params_on_meta():
        model = nn.Sequential(
            nn.Embedding.from_pretrained(vectors, freeze=True), PositionalTable(), nn.Linear(4, 4)
        )
    kept = [w for p in model[2].parameters() for w in p.__dict__[WRITES_ATTR].ops]
    assert kept and all(w.standard and not any(isinstance(a, Tensor) for a in w.args) for w in kept)
    materialize_model(model, seed=7, device=torch.device("cpu"))
    torch.testing.assert_close(model[0].weight, vectors, rtol=0, atol=0)
    assert not model[0].weight.requires_grad
    torch.testing.assert_close(model[1].table, model[1].drawn, rtol=0, atol=0)


def test_a_deep_copy_keeps_what_its_source_recorded() -> None:
    """A module cloned after its init or its load (a teacher copied from the student inside
    ``configure_model()``) carries the writes and the loaded values of its source."""
    source = NanoGPT()
    loads = MetaLoads()
    with params_on_meta(loads):
        student = NanoGPT()
        teacher = copy.deepcopy(student)
        loaded = NanoGPT()
        loaded.load_state_dict(source.state_dict())
        twin = copy.deepcopy(loaded)
    assert teacher.wte.weight is not student.wte.weight and teacher.wte.weight.is_meta
    values = loads.by_name(twin)
    assert values.keys() == dict(twin.named_parameters()).keys()
    for key, value in source.state_dict().items():
        torch.testing.assert_close(values[key], value, rtol=0, atol=0, msg=key)
    materialize_model(teacher, seed=7, device=torch.device("cpu"))
    assert not teacher.head.weight.any() and not teacher.fc.bias.any()  # the student's init, replayed
    torch.testing.assert_close(teacher.wte.weight.std(), torch.tensor(0.02), rtol=0.1, atol=0)


class CustomInit(pl.LightningModule):
    """The nanoGPT-style model built in ``configure_model()``; with ``root``, loaded from a file there and
    its head zeroed after the load (a new task's head)."""

    def __init__(self, root: str | None = None, lr: float = 0.5) -> None:
        super().__init__()
        self.root, self.lr = root, lr
        self.net: NanoGPT | None = None
        self.seed: int | None = None
        self.batches: list[Tensor] = []  # this rank's, in order

    def configure_model(self) -> None:
        if self.net is not None:
            return
        self.net = NanoGPT()
        if self.root is not None:
            self.net.load_state_dict(torch.load(Path(self.root) / "nano.pt"))
            nn.init.zeros_(self.net.head.weight)

    def on_fit_start(self) -> None:
        self.seed = self.trainer.strategy.engine.init_seed  # type: ignore[attr-defined]

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        assert self.net is not None
        self.batches.append(batch.clone())
        return loss_of(self.net, batch)

    def train_dataloader(self) -> DataLoader[Tensor]:
        return DataLoader(tokens(), batch_size=2)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class CustomLlama(LoraLlama):
    """A Hugging Face Llama re-initialised in part after it is built: attention's query projection (a
    column-parallel layer under the "llama" plan) wider, its output projection (row-parallel) zero, the
    MLP's down projection scaled."""

    def configure_model(self) -> None:
        if self.model is not None:
            return
        super().configure_model()
        layer = self.model.model.layers[0]  # type: ignore[union-attr,index]
        nn.init.normal_(layer.self_attn.q_proj.weight, std=0.5)
        nn.init.zeros_(layer.self_attn.o_proj.weight)
        with torch.no_grad():
            layer.mlp.down_proj.weight.data.mul_(0.01)


class LoadedThenWritten(LoraLlama):
    """A Llama loaded from a file in ``configure_model()``, then a column-parallel weight zeroed."""

    def __init__(self, root: str) -> None:
        super().__init__(lora=False)
        self.root = root

    def configure_model(self) -> None:
        if self.model is not None:
            return
        model = llama(5)
        model.load_state_dict(torch.load(Path(self.root) / "llama.pt"))
        nn.init.zeros_(model.model.layers[0].self_attn.q_proj.weight)
        self.model = model


WHISPER = dict(
    vocab_size=64,
    num_mel_bins=8,
    d_model=32,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_source_positions=16,
    max_target_positions=32,
    decoder_start_token_id=1,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def whisper() -> nn.Module:
    return transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**WHISPER))


class Whisper(LoraLlama):
    """Whisper built in ``configure_model()``: its own ``_init_weights`` copies a sinusoidal table into
    the encoder's position embedding (an init, not a load of weights)."""

    def configure_model(self) -> None:
        if self.model is None:
            self.model = whisper()


def loss_of(net: nn.Module, batch: Tensor) -> Tensor:
    logits = net(batch[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def tokens() -> Tensor:
    return torch.randint(0, 64, (8, 6), generator=torch.Generator().manual_seed(3))


def _runs(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case, module in (("custom", CustomInit()), ("reinit", CustomInit(root, lr=0.0))):
        strategy = HybridParallelStrategy(zero_stage=3)
        cpu_trainer(strategy, max_steps=2).fit(module)
        out[case] = {"final": final_state(module, strategy), "seed": module.seed, "batches": module.batches}
    # transformers' own init copied a table while the model was built: pretrained= is not refused as if
    # configure_model() had loaded weights too, and the file's weights reach the shards
    strategy = HybridParallelStrategy(zero_stage=3, pretrained=str(Path(root) / "whisper"))
    whisper_module = Whisper(lora=False)
    cpu_trainer(strategy, max_steps=0).fit(whisper_module, DataLoader(Tokens(8), batch_size=2))
    out["whisper"] = final_state(whisper_module, strategy)
    strategy = HybridParallelStrategy(zero_stage=3, tensor_parallel_size=2, tp_plan="llama")
    llama_module = CustomLlama(lora=False)
    cpu_trainer(strategy, max_steps=0).fit(llama_module, DataLoader(Tokens(8), batch_size=2))
    out["tp2"] = {"final": final_state(llama_module, strategy), "seed": strategy.engine.init_seed}
    strategy = HybridParallelStrategy(zero_stage=3, tensor_parallel_size=2, tp_plan="llama")
    try:  # loaded as slices, written after the load: refused
        cpu_trainer(strategy, max_steps=0).fit(LoadedThenWritten(root), DataLoader(Tokens(8), batch_size=2))
        out["tp2_after_load"] = None
    except ValueError as error:
        out["tp2_after_load"] = str(error)
    strategy.destroy_process_groups()
    fabric = Fabric(accelerator="cpu", devices=world, strategy=FabricStrategy(zero_stage=3))
    fabric.launch()
    with fabric.init_module(empty_init=True):
        net = NanoGPT()
        net.load_state_dict(torch.load(Path(root) / "nano.pt"))
    assert all(p.is_meta for p in net.parameters())
    fabric.setup_module(net)
    out["fabric"] = {k: v.clone() for k, v in fabric.strategy.consolidated_state_dict().items()}  # type: ignore[attr-defined]
    # an init after sharding (torchtitan's order) meets placeholders: refused naming the fix; inside
    # gathered_params(writeback=True) it reaches the shards
    try:
        nn.init.zeros_(net.head.weight)
        out["refused"] = None
    except RuntimeError as error:
        out["refused"] = str(error)
    with fabric.strategy.gathered_params(writeback=True):  # type: ignore[attr-defined]
        nn.init.zeros_(net.head.weight)
    out["fabric_zeroed"] = {k: v.clone() for k, v in fabric.strategy.consolidated_state_dict().items()}  # type: ignore[attr-defined]
    fabric.strategy.destroy_process_groups()  # type: ignore[attr-defined]
    # transformers' from_pretrained inside init_module(empty_init=True): its default hub-kernels step is
    # refused with the fixes; with use_kernels=False the weights it reads reach the shards
    fabric = Fabric(accelerator="cpu", devices=world, strategy=FabricStrategy(zero_stage=3))
    fabric.launch()
    hf = Path(root) / "hf"
    try:
        with fabric.init_module(empty_init=True):
            transformers.LlamaForCausalLM.from_pretrained(hf)
        out["kernels"] = None
    except RuntimeError as error:
        out["kernels"] = str(error)
    with fabric.init_module(empty_init=True):
        hf_model = transformers.LlamaForCausalLM.from_pretrained(hf, use_kernels=False)
    fabric.setup_module(hf_model)
    out["from_pretrained"] = {k: v.clone() for k, v in fabric.strategy.consolidated_state_dict().items()}  # type: ignore[attr-defined]
    # an init written after the block, before setup (litgpt's model.apply(model._init_weights)), meets
    # placeholders nothing records: refused at setup (before, lost silently: torch's defaults trained)
    fabric.strategy.destroy_process_groups()  # type: ignore[attr-defined]
    fabric = Fabric(accelerator="cpu", devices=world, strategy=FabricStrategy(zero_stage=3))
    fabric.launch()
    with fabric.init_module(empty_init=True):
        late = NanoGPT()
    nn.init.zeros_(late.head.weight)
    try:
        fabric.setup_module(late)
        out["late"] = None
    except RuntimeError as error:
        out["late"] = str(error)
    fabric.strategy.destroy_process_groups()  # type: ignore[attr-defined]
    return out


def test_custom_init_under_zero3_trainer_and_fabric(tmp_path: Path) -> None:
    torch.manual_seed(1)
    saved = NanoGPT()
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(torch.randn_like(p))  # weights no init gives: a load shows
    torch.save(saved.state_dict(), tmp_path / "nano.pt")
    hf_source = llama(0)
    hf_source.save_pretrained(tmp_path / "hf")
    torch.manual_seed(2)
    whisper_source = whisper()
    with torch.no_grad():
        for p in whisper_source.parameters():
            p.add_(torch.rand_like(p))  # weights no init gives: a load shows
    whisper_source.save_pretrained(tmp_path / "whisper")
    torch.save(hf_source.state_dict(), tmp_path / "llama.pt")
    both = run_distributed(_runs, 2, str(tmp_path), init_group=False)
    runs = both[0]
    # ZeRO-3 trained from the model's own init: one process training the twin (same seed) ends equal
    with params_on_meta():  # the same module tree: each module's init is seeded by its path
        holder = CustomInit()
        holder.configure_model()
    materialize_model(holder, seed=runs["custom"]["seed"], device=torch.device("cpu"))
    twin = holder.net
    assert twin is not None and not twin.head.weight.any()
    optimizer = torch.optim.SGD(twin.parameters(), lr=0.5)
    for step in range(2):  # the mean of the two ranks' losses on their batches of the step
        optimizer.zero_grad()
        sum(loss_of(twin, run["custom"]["batches"][step]) / 2 for run in both).backward()  # type: ignore[union-attr]
        optimizer.step()
    final = runs["custom"]["final"]
    for key, value in twin.state_dict().items():
        torch.testing.assert_close(final[f"net.{key}"], value, msg=key)
    # loaded, then the head zeroed (lr 0: the start): the file's weights, the head zero
    expected = {f"net.{k}": v for k, v in saved.state_dict().items()}
    expected["net.head.weight"] = torch.zeros_like(expected["net.head.weight"])
    assert runs["reinit"]["final"].keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(runs["reinit"]["final"][key], value, rtol=0, atol=0, msg=key)
    # Whisper at ZeRO-3 with pretrained=: the file's weights, bitwise (before: refused at setup, the
    # sinusoidal table its _init_weights copies taken for a load in configure_model())
    for key, value in whisper_source.state_dict().items():
        torch.testing.assert_close(runs["whisper"][f"model.{key}"], value, rtol=0, atol=0, msg=key)
    # Fabric: load_state_dict inside init_module(empty_init=True) is the file's
    for key, value in saved.state_dict().items():
        torch.testing.assert_close(runs["fabric"][key], value, rtol=0, atol=0, msg=f"fabric: {key}")
    # ZeRO-3 x tp2: each re-initialised layer written in full, then sliced: the one-process twin, bitwise
    with params_on_meta():
        llama_twin = CustomLlama(lora=False)
        llama_twin.configure_model()
    materialize_model(llama_twin, seed=runs["tp2"]["seed"], device=torch.device("cpu"))
    got = runs["tp2"]["final"]
    assert got.keys() == llama_twin.state_dict().keys()
    for key, value in llama_twin.state_dict().items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=f"tp2: {key}")
    attention = "model.model.layers.0.self_attn"
    torch.testing.assert_close(got[f"{attention}.q_proj.weight"].std(), torch.tensor(0.5), rtol=0.1, atol=0)
    assert not got[f"{attention}.o_proj.weight"].any()
    # Fabric: an init after setup is refused outside gathered_params (before, torch's "more than one
    # element of the written-to tensor refers to a single memory location"), reaches the shards inside
    for run in both:
        assert run["refused"] is not None and "'head.weight'" in run["refused"], run["refused"]
        assert "fabric.strategy.gathered_params()" in run["refused"] and "writeback=True" in run["refused"]
    for key, value in saved.state_dict().items():
        want = torch.zeros_like(value) if key == "head.weight" else value
        torch.testing.assert_close(runs["fabric_zeroed"][key], want, rtol=0, atol=0, msg=f"zeroed: {key}")
    # Fabric with transformers' from_pretrained: refused naming use_kernels=False, and with it the file's
    for run in both:
        assert run["kernels"] is not None and "use_kernels=False" in run["kernels"], run["kernels"]
        assert "fabric.load_raw" in run["kernels"], run["kernels"]
        late = run["late"]
        assert late is not None and "['head.weight']" in late and "written after the block" in late, late
        assert "meta_init=False" in late and "reset_parameters without calling it" in late, late
    for key, value in hf_source.state_dict().items():
        torch.testing.assert_close(runs["from_pretrained"][key], value, rtol=0, atol=0, msg=key)
    # ZeRO-3 x tp2: a weight loaded as slices in configure_model() and written after the load is refused
    for run in both:
        refused = run["tp2_after_load"]
        assert refused is not None and "model.layers.0.self_attn.q_proj.weight" in refused, refused
        assert "make the write before the load" in refused, refused
