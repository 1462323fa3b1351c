"""``HybridParallelStrategy(pretrained=...)``: a Hugging Face Llama saved with ``save_pretrained`` (one
safetensors file, a sharded index, a ``torch.save`` state dict; and as Lightning's ``ModelParallelStrategy``
saves it, a ``torch.distributed.checkpoint`` directory) loaded into a LightningModule that builds
``LlamaForCausalLM(config)`` in ``configure_model()`` (so under meta init), at ZeRO-3 and at tensor
parallel size 2, against ``LlamaForCausalLM.from_pretrained`` in one process: parameters on the meta device
while the model was built, no rank holding the whole model, the first step's loss and gradients those of
the unsharded model, a PEFT LoRA model whose base comes from the file and whose adapters are initialised
(and named in a warning; at ZeRO-3 and at TP=2 with ranks in different random states), and bad inputs
refused with a clear message before training, files untouched.

TP=2 is checked both into a model built on the meta device (the default) and with ``meta_init=False``;
``trainer.validate`` after ``trainer.fit`` evaluates the trained weights, not the file's again.

Gradients at ZeRO-3 live in the engine's shards, so each run takes one plain SGD step (no momentum, no
weight decay): ``w1 = w0 - lr * g`` exactly, and ``(w0 - w1) / lr`` read from the consolidated state dict
is compared with the reference gradient.
"""

from __future__ import annotations

import hashlib
import traceback
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import peft
import pytest
import safetensors.torch as safetensors_torch
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import transformers
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import rank_state
from tests.third_party import LLAMA, LORA_TARGETS, LossRecorder, Tokens, llama

WORLD = 2
N = 4  # samples: one step of 2 per rank at dp=2, or all 4 at tp=2 (dp=1)
LR = 1.0  # large enough that (w0 - w1) / lr recovers the gradient to ~1e-7
WIDE = 64  # a wrong size for model.layers.0.mlp.up_proj.weight (64, 32)
RENAMED = ("model.norm.weight", "model.final_norm.weight")
CHANGED = "model.layers.0.mlp.up_proj.weight"
PEFT_PREFIX = "model.base_model.model."  # LightningModule.model -> PeftModel -> LoraModel -> Llama


# ---------------------------------------------------------------------------------------------- modules
class PretrainedLlama(pl.LightningModule):
    """A user's module: ``configure_model()`` builds ``LlamaForCausalLM(config)`` (optionally under PEFT
    LoRA) and records whether its parameters were on the meta device; one SGD step."""

    def __init__(self, lora: bool = False, rank_seeded: bool = False) -> None:
        super().__init__()
        self.lora = lora
        self.rank_seeded = rank_seeded  # build in a random state that differs across ranks
        self.model: nn.Module | None = None
        self.built_on_meta: bool | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self.rank_seeded:
            torch.manual_seed(self.global_rank)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
        if self.lora:
            config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, lora_dropout=0.0)
            model = peft.get_peft_model(model, config)
        self.built_on_meta = all(p.is_meta for p in model.parameters())
        self.model = model

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        assert self.model is not None
        x, y = batch
        logits = self.model(input_ids=x, use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.training_step(batch, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class Gain(nn.Module):
    """A parameter held directly, and no ``reset_parameters()``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(n))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gain


def gain_net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), Gain(16), nn.Linear(16, 4))


class GainModule(pl.LightningModule):
    """``self.net = gain_net()`` built in ``configure_model()``; mean squared error, one SGD step. With
    ``valueless``, the gain is created on the meta device by the user's code: no values to replay (a
    gain created with values is kept as built), so only pretrained weights can fill it."""

    def __init__(self, valueless: bool = False) -> None:
        super().__init__()
        self.net: nn.Module | None = None
        self.built_on_meta: bool | None = None
        self.valueless = valueless

    def configure_model(self) -> None:
        if self.net is None:
            self.net = gain_net()
            if self.valueless:
                self.net[1].gain = nn.Parameter(torch.empty(16, device="meta"))
            self.built_on_meta = all(p.is_meta for p in self.net.parameters())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        assert self.net is not None
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def gain_data() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(N, 8, generator=g), torch.randn(N, 4, generator=g))


# ---------------------------------------------------------------------------------------------- files
def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): _sha(p) for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The pretrained Llama in every format, the bad copies, and the Gain net's files."""
    root = tmp_path_factory.mktemp("pretrained_load")
    model = llama(seed=0)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.save_pretrained(root / "hf")
    model.save_pretrained(root / "hf_sharded", max_shard_size="20KB")
    torch.save(sd, root / "sd.pt")
    # as Lightning's ModelParallelStrategy (FSDP2) saves this module: a torch.distributed.checkpoint
    # directory, the LightningModule's names under "state_dict"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(
            {"state_dict": {"model." + k: v for k, v in sd.items()}}, checkpoint_id=root / "dcp", no_dist=True
        )
    renamed = {RENAMED[1] if k == RENAMED[0] else k: v for k, v in sd.items()}
    safetensors_torch.save_file(renamed, str(root / "renamed.safetensors"))
    reshaped = dict(sd)
    reshaped[CHANGED] = torch.zeros(WIDE + 16, sd[CHANGED].shape[1])
    safetensors_torch.save_file(reshaped, str(root / "reshaped.safetensors"))
    (root / "truncated").mkdir()
    whole = (root / "hf" / "model.safetensors").read_bytes()
    (root / "truncated" / "model.safetensors").write_bytes(whole[: len(whole) - 1000])
    torch.manual_seed(7)
    net = gain_net()
    with torch.no_grad():
        net[1].gain.uniform_(0.5, 1.5)
    torch.save(dict(net.state_dict()), root / "gain.pt")
    torch.save(
        {k: v for k, v in net.state_dict().items() if not k.startswith("1.")}, root / "gain_missing.pt"
    )
    return {
        "root": root,
        "hf": root / "hf",
        "sharded": root / "hf_sharded",
        "torch": root / "sd.pt",
        "dcp": root / "dcp",
        "renamed": root / "renamed.safetensors",
        "reshaped": root / "reshaped.safetensors",
        "truncated": root / "truncated",
        "gain": root / "gain.pt",
        "gain_missing": root / "gain_missing.pt",
    }


# ---------------------------------------------------------------------------------------------- ranks
class Probe(pl.Callback):
    """This rank's parameter bytes during training, and the consolidated state dict at its end."""

    def __init__(self) -> None:
        self.parameters = -1
        self.export: dict[str, Tensor] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.parameters = int(trainer.strategy.memory_report()["parameters"])  # type: ignore[attr-defined]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.export = trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]


def _trainer(strategy: HybridParallelStrategy, tmp: str, callbacks: list[pl.Callback]) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp,
        callbacks=callbacks,
    )


def _fit(
    strategy: HybridParallelStrategy,
    module: Any,
    data: Dataset[Any],
    batch: int,
    tmp: str,
    *,
    then_validate: bool = False,
) -> dict:
    """One SGD step; what the parent compares: losses, parameter bytes, export, meta flag, warnings.
    ``then_validate``: also the module's state dict after the fit (the whole model is back on every rank)
    and after a following ``trainer.validate`` of the same module (its setup runs again)."""
    rec, probe = LossRecorder(), Probe()
    trainer = _trainer(strategy, tmp, [rec, probe])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(data, batch_size=batch))
    assert trainer.global_step == 1
    out = {
        "losses": rec.losses,
        "parameters": probe.parameters,
        "export": probe.export,
        "meta": module.built_on_meta,
        "warnings": [str(w.message) for w in caught if "pretrained weights" in str(w.message)],
    }
    if then_validate:
        out["after_fit"] = rank_state(module)
        trainer.validate(module, DataLoader(data, batch_size=batch), verbose=False)
        out["after_validate"] = rank_state(module)
    return out


def _refused(strategy: HybridParallelStrategy, module: Any, data: Dataset[Any], batch: int, tmp: str) -> str:
    """The fit fails with a ValueError before any step; returns its message."""
    trainer = _trainer(strategy, tmp, [])
    with pytest.raises(ValueError) as info:
        trainer.fit(module, DataLoader(data, batch_size=batch))
    assert trainer.global_step == 0
    return str(info.value)


def _attempt(
    strategy: HybridParallelStrategy, module: Any, data: Dataset[Any], batch: int, tmp: str, **kw: Any
) -> dict:
    """:func:`_fit`, or ``{"error": traceback}`` when the fit raises (the same way on every rank), so that
    one failing layout does not hide the others' results."""
    try:
        return _fit(strategy, module, data, batch, tmp, **kw)
    except Exception:
        return {"error": traceback.format_exc()}


def _good_runs(rank: int, world: int, paths: dict[str, Path], tmp: str) -> dict[str, dict]:
    def s3(path: Path) -> HybridParallelStrategy:
        return HybridParallelStrategy(zero_stage=3, pretrained=path)

    def tp2(path: Path, meta_init: bool) -> HybridParallelStrategy:
        return HybridParallelStrategy(
            tensor_parallel_size=2, tp_plan="llama", pretrained=path, meta_init=meta_init
        )

    tokens, dp_batch = Tokens(N), N // world
    return {
        "zero3_hf": _attempt(s3(paths["hf"]), PretrainedLlama(), tokens, dp_batch, tmp, then_validate=True),
        "zero3_sharded": _attempt(s3(paths["sharded"]), PretrainedLlama(), tokens, dp_batch, tmp),
        "zero3_torch": _attempt(s3(paths["torch"]), PretrainedLlama(), tokens, dp_batch, tmp),
        "zero3_dcp": _attempt(s3(paths["dcp"]), PretrainedLlama(), tokens, dp_batch, tmp),
        "tp2_meta_dcp": _attempt(tp2(paths["dcp"], True), PretrainedLlama(), tokens, N, tmp),
        "tp2_meta_hf": _attempt(tp2(paths["hf"], True), PretrainedLlama(), tokens, N, tmp),
        "tp2_meta_sharded": _attempt(tp2(paths["sharded"], True), PretrainedLlama(), tokens, N, tmp),
        "tp2_real_hf": _attempt(
            tp2(paths["hf"], False), PretrainedLlama(), tokens, N, tmp, then_validate=True
        ),
        "tp2_real_sharded": _attempt(tp2(paths["sharded"], False), PretrainedLlama(), tokens, N, tmp),
        "zero3_lora": _attempt(s3(paths["hf"]), PretrainedLlama(lora=True), tokens, dp_batch, tmp),
        "tp2_lora": _attempt(
            tp2(paths["hf"], True), PretrainedLlama(lora=True, rank_seeded=True), tokens, N, tmp
        ),
        "zero3_gain": _attempt(s3(paths["gain"]), GainModule(), gain_data(), dp_batch, tmp),
    }


def _bad_runs(rank: int, world: int, paths: dict[str, Path], tmp: str) -> dict[str, str]:
    def s3(path: Path) -> HybridParallelStrategy:
        return HybridParallelStrategy(zero_stage=3, pretrained=path)

    tokens, dp_batch = Tokens(N), N // world
    # meta_init=False: a tensor-parallel model built on the meta device cannot be sliced yet (see
    # test_tp2_pretrained_into_a_meta_built_model); the shape check runs on the full shapes either way
    tp2 = HybridParallelStrategy(
        tensor_parallel_size=2, tp_plan="llama", pretrained=paths["reshaped"], meta_init=False
    )
    return {
        "renamed": _refused(s3(paths["renamed"]), PretrainedLlama(), tokens, dp_batch, tmp),
        "renamed_lora": _refused(s3(paths["renamed"]), PretrainedLlama(lora=True), tokens, dp_batch, tmp),
        "reshaped": _refused(s3(paths["reshaped"]), PretrainedLlama(), tokens, dp_batch, tmp),
        "reshaped_tp2": _refused(tp2, PretrainedLlama(), tokens, N, tmp),
        "truncated": _refused(s3(paths["truncated"]), PretrainedLlama(), tokens, dp_batch, tmp),
        "gain_missing": _refused(s3(paths["gain_missing"]), GainModule(True), gain_data(), dp_batch, tmp),
        "gain_missing_zero0": _refused(
            HybridParallelStrategy(zero_stage=0, pretrained=paths["gain_missing"]),
            GainModule(True),
            gain_data(),
            dp_batch,
            tmp,
        ),
    }


@pytest.fixture(scope="module")
def good(files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict]]:
    """Every successful layout, in one launch of two ranks; the files on disk must not change."""
    digests = _digests(files["root"])
    results = run_distributed(
        _good_runs, WORLD, files, str(tmp_path_factory.mktemp("good")), init_group=False
    )
    assert _digests(files["root"]) == digests, "a pretrained file changed on disk"
    return results


@pytest.fixture(scope="module")
def bad(files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The error messages of every refused input, in one launch of two ranks (identical on both); the
    files on disk must not change."""
    digests = _digests(files["root"])
    results = run_distributed(_bad_runs, WORLD, files, str(tmp_path_factory.mktemp("bad")), init_group=False)
    assert _digests(files["root"]) == digests, "a pretrained file changed on disk"
    assert results[0] == results[1]
    return results[0]


# ---------------------------------------------------------------------------------------------- reference
class Reference:
    """``LlamaForCausalLM.from_pretrained`` in one process: its weights, and the loss and gradients of
    one forward and backward on the whole batch."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        model = transformers.LlamaForCausalLM.from_pretrained(directory, attn_implementation="eager")
        self.initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        assert all(v.dtype == torch.float32 for v in self.initial.values())
        data = Tokens(N)
        self.x, self.y = data.data[:, :-1], data.data[:, 1:]
        self.loss, self.grads = self.backward(model)
        assert set(self.grads) == set(self.initial)
        self.bytes = sum(v.numel() * v.element_size() for v in self.initial.values())
        self.norm_bytes = sum(
            v.numel() * v.element_size() for k, v in self.initial.items() if k.endswith("norm.weight")
        )

    def backward(self, model: nn.Module) -> tuple[Tensor, dict[str, Tensor]]:
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=self.x, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), self.y.flatten())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def reference(files: dict[str, Path]) -> Reference:
    return Reference(files["hf"])


def _stepped_grads(export: dict[str, Tensor], before: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The gradient of the one SGD step, ``(w0 - w1) / lr``, under the names of ``before``."""
    return {k: (w0 - export[prefix + k]) / LR for k, w0 in before.items()}


def _assert_grad(actual: Tensor, expected: Tensor, msg: str) -> None:
    """Equal within fp32 tolerance, and within 0.1% of the gradient's own scale (some are ~1e-4, below
    the default absolute tolerance; recovering g from a weight near 1.0 costs ~1e-7 absolute)."""
    torch.testing.assert_close(actual, expected, msg=msg)
    error, scale = (actual - expected).abs().max().item(), expected.abs().max().item()
    assert scale > 0 and error <= 1e-3 * scale + 1e-8, f"{msg}: error {error:.2e} at scale {scale:.2e}"


def _loss_of(ranks: list[dict], dp: int) -> Tensor:
    losses = torch.tensor([r["losses"] for r in ranks])
    assert losses.shape == (WORLD, 1)
    if dp == 1:  # tensor-parallel ranks compute the same loss
        torch.testing.assert_close(losses[0], losses[1])
        return losses[0, 0]
    return losses.mean()  # each dp rank's loss is the mean over its half of the batch


def _ranks(good: list[dict[str, dict]], name: str) -> list[dict]:
    ranks = [r[name] for r in good]
    for rank, r in enumerate(ranks):
        assert "error" not in r, f"{name} failed on rank {rank}:\n{r['error']}"
    return ranks


def _check_llama(name: str, ranks: list[dict], ref: Reference, *, meta: bool) -> None:
    """Built on meta (or not), no warning, the reference's first loss and gradients, and the parameter
    bytes of this layout's share."""
    dp = 1 if name.startswith("tp2") else WORLD
    assert [r["meta"] for r in ranks] == [meta] * WORLD, f"{name}: parameters on meta in configure_model()"
    assert all(r["warnings"] == [] for r in ranks), (name, ranks[0]["warnings"])
    torch.testing.assert_close(_loss_of(ranks, dp), ref.loss, msg=name)
    export = ranks[0]["export"]
    assert ranks[1]["export"] == {}
    assert set(export) == {"model." + k for k in ref.initial}, name
    for key, grad in _stepped_grads(export, ref.initial, "model.").items():
        _assert_grad(grad, ref.grads[key], f"{name}: gradient of {key}")
    for r in ranks:
        if dp == WORLD:  # ZeRO-3: half of every unit (plus padding), never the whole model
            assert r["parameters"] == pytest.approx(ref.bytes / WORLD, rel=0.01), (name, r["parameters"])
        else:  # TP=2: every matrix halved, the norms replicated
            assert r["parameters"] == (ref.bytes - ref.norm_bytes) // 2 + ref.norm_bytes, (name, r)


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", ["zero3_hf", "zero3_sharded", "zero3_torch", "zero3_dcp"])
def test_zero3_pretrained_matches_from_pretrained(name: str, good: list[dict], reference: Reference) -> None:
    """ZeRO-3 from a save_pretrained directory (one safetensors file / a sharded index) or a torch.save
    state dict, names differing by the ``model.`` prefix: built on meta, each rank holding half the model,
    first loss and gradients those of from_pretrained."""
    _check_llama(name, _ranks(good, name), reference, meta=True)


@pytest.mark.parametrize("name", ["tp2_real_hf", "tp2_real_sharded"])
def test_tp2_pretrained_into_a_real_model(name: str, good: list[dict], reference: Reference) -> None:
    """TP=2 (stage 0) with ``meta_init=False``: the model is built on the CPU, sliced, and every slice is
    overwritten from the file; the reference's loss and gradients, half of every matrix per rank."""
    _check_llama(name, _ranks(good, name), reference, meta=False)


@pytest.mark.parametrize("name", ["tp2_meta_hf", "tp2_meta_sharded", "tp2_meta_dcp"])
def test_tp2_pretrained_into_a_meta_built_model(name: str, good: list[dict], reference: Reference) -> None:
    """TP=2 (stage 0) with the default ``meta_init``: ``configure_model()`` builds on meta, the slices are
    materialised straight from the file; the reference's loss and gradients."""
    _check_llama(name, _ranks(good, name), reference, meta=True)


@pytest.mark.parametrize("name", ["zero3_hf", "tp2_real_hf"])
def test_validate_after_fit_keeps_the_trained_weights(
    name: str, good: list[dict], reference: Reference
) -> None:
    """``trainer.validate(model)`` after ``trainer.fit(model)`` (same trainer and strategy) evaluates the
    trained model: the pretrained weights were the starting point of the fit, not of every later stage."""
    for rank, r in enumerate(_ranks(good, name)):
        trained, validated = r["after_fit"], r["after_validate"]
        assert set(trained) == {"model." + k for k in reference.initial}
        # the fit did train: its step moved the (replicated, full-size) final norm away from the file's
        assert not torch.equal(trained["model.model.norm.weight"], reference.initial["model.norm.weight"])
        if rank == 0 and name.startswith("zero3"):  # the whole model, gathered back at the end of the fit
            for key, value in trained.items():
                torch.testing.assert_close(value, r["export"][key], msg=f"{name}: {key} after fit")
        changed = sorted(k for k in trained if not torch.equal(trained[k], validated[k]))
        assert changed == [], f"{name} rank {rank}: validate() changed {len(changed)} tensors: {changed[:4]}"


@pytest.mark.parametrize("name", ["zero3_lora", "tp2_lora"])
def test_lora_on_pretrained_base(name: str, good: list[dict], reference: Reference) -> None:
    """PEFT LoRA under meta init, at ZeRO-3 and at TP=2 (stage 0): the frozen base is the file's, untouched;
    the adapters are initialised as PEFT does (B = 0) and named in a warning, so the first loss is the base
    model's; after the step A is unchanged (zero gradient) and B moved by the reference LoRA model's
    gradient (same A). At TP=2 the ranks build in different random states: the seed the adapters are
    drawn from is rank 0's on both (before, each rank's own), so the replicated A of a column-parallel
    layer is one and the row-parallel A's slices are parts of one matrix (before, refused)."""
    ranks = _ranks(good, name)
    assert [r["meta"] for r in ranks] == [True] * WORLD
    torch.testing.assert_close(_loss_of(ranks, 1 if name.startswith("tp2") else WORLD), reference.loss)
    export = ranks[0]["export"]
    base = {k: v for k, v in export.items() if "lora_" not in k}
    adapters = {k: v for k, v in export.items() if "lora_" in k}
    assert len(adapters) == 2 * len(LORA_TARGETS) * LLAMA["num_hidden_layers"]

    def file_name(key: str) -> str:
        assert key.startswith(PEFT_PREFIX), key
        return key[len(PEFT_PREFIX) :].replace(".base_layer.", ".")

    assert sorted(map(file_name, base)) == sorted(reference.initial)
    for key, value in base.items():
        assert torch.equal(value, reference.initial[file_name(key)]), f"base weight {key} is not the file's"
    for r in ranks:
        assert len(r["warnings"]) == 1, r["warnings"]
        message = r["warnings"][0]
        assert f"{len(adapters)} trainable parameters" in message and "initialised" in message, message
        listed = message.split("[", 1)[1].rstrip("]").split(", ")
        assert listed and all("lora_A" in n or "lora_B" in n for n in listed), message

    lora_ref = peft.get_peft_model(
        transformers.LlamaForCausalLM.from_pretrained(reference.directory, attn_implementation="eager"),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, lora_dropout=0.0),
    )
    with torch.no_grad():
        for n, p in lora_ref.named_parameters():
            if "lora_A" in n:
                assert export["model." + n].abs().sum() > 0, f"{n} was not initialised"
                p.copy_(export["model." + n])
            elif "lora_B" in n:
                p.zero_()
    loss, grads = reference.backward(lora_ref)
    torch.testing.assert_close(loss, reference.loss)
    assert {"model." + n for n in grads} == set(adapters)
    for n, grad in grads.items():
        if "lora_A" in n:  # the gradient of A is 0 while B = 0: A did not move
            assert torch.equal(grad, torch.zeros_like(grad)), n
            assert torch.equal(export["model." + n], lora_ref.get_parameter(n)), n
        else:  # B started at 0
            _assert_grad(-export["model." + n] / LR, grad, f"lora: gradient of {n}")


def test_zero3_module_without_reset_parameters_loads_from_file(
    good: list[dict], files: dict[str, Path]
) -> None:
    """A module holding an ``nn.Parameter`` directly, with no ``reset_parameters()``, built on meta at
    ZeRO-3: its weights come from the file, so it needs none; loss and gradients of the unsharded net."""
    ranks = _ranks(good, "zero3_gain")
    assert [r["meta"] for r in ranks] == [True] * WORLD
    before = torch.load(files["gain"], weights_only=True)
    net = gain_net()
    net.load_state_dict(before)
    x, y = gain_data().tensors
    loss = F.mse_loss(net(x), y)
    loss.backward()
    torch.testing.assert_close(_loss_of(ranks, WORLD), loss.detach())
    export = ranks[0]["export"]
    assert set(export) == {"net." + k for k in before}
    for key, grad in _stepped_grads(export, before, "net.").items():
        _assert_grad(grad, net.get_parameter(key).grad, f"gain net: gradient of {key}")


def test_bad_pretrained_inputs_fail_before_training(bad: dict[str, str], files: dict[str, Path]) -> None:
    """Each bad input is a ValueError during setup on every rank (no step taken, files untouched), whose
    message names what is wrong: the renamed key and the model parameter it leaves unset (frozen under
    LoRA), the key with both shapes (the model's full shape under TP), the truncated file, the module
    without reset_parameters() that the file does not fill."""
    renamed = bad["renamed"]
    assert str(files["renamed"]) in renamed and "match no model name" in renamed, renamed
    assert repr(RENAMED[1]) in renamed and repr("model." + RENAMED[0]) in renamed, renamed
    lora = bad["renamed_lora"]
    assert "match no model name" in lora and repr(RENAMED[1]) in lora, lora
    assert "frozen parameters are not in the file" in lora and repr(PEFT_PREFIX + RENAMED[0]) in lora, lora

    for name in ("reshaped", "reshaped_tp2"):
        expected = f"model.{CHANGED}: file ({WIDE + 16}, 32) vs model ({WIDE}, 32)"
        assert expected in bad[name], bad[name]

    truncated = bad["truncated"]
    assert str(files["truncated"] / "model.safetensors") in truncated and "truncated" in truncated, truncated

    for name in ("gain_missing", "gain_missing_zero0"):  # ZeRO-3's shards, or stage 0's whole model
        gain = bad[name]
        assert "'net.1' (Gain)" in gain and "['gain']" in gain and "reset_parameters()" in gain, gain


def test_a_tied_parameter_loads_from_either_of_its_names() -> None:
    """GPT-2's table is ``transformer.wte.weight`` and ``lm_head.weight``: a ``state_dict()`` holds both
    (no entry is unexpected), and a file holding only the head's name still fills the table."""
    from lightning_par.checkpoint.load_pretrained import plan_pretrained

    config = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    source = transformers.GPT2LMHeadModel(config)
    for drop in (None, "transformer.wte.weight"):
        weights = {k: v.clone() for k, v in source.state_dict().items() if k != drop}
        torch.manual_seed(1)
        target = transformers.GPT2LMHeadModel(config)
        plan = plan_pretrained(target, weights, strict=True)
        try:
            assert plan.load_local(target) > 0
        finally:
            plan.close()
        assert target.lm_head.weight is target.transformer.wte.weight
        torch.testing.assert_close(
            target.transformer.wte.weight, source.transformer.wte.weight, msg=str(drop)
        )


def test_a_checkpoint_transformers_converts_on_load_is_named(tmp_path: Path) -> None:
    """transformers 5 saves a Mixtral's fused experts one tensor per expert and fuses them again in
    ``from_pretrained``; ``pretrained=`` reads names as stored, so such a directory does not fit: the
    refusal says why and names ``from_pretrained(..., use_kernels=False)`` in ``configure_model()`` (before,
    it suggested the file was the wrong one). A mismatch of a model without such a conversion says
    nothing of it."""
    from lightning_par.checkpoint.load_pretrained import plan_pretrained

    config = transformers.MixtralConfig(**{**LLAMA, "num_local_experts": 4, "num_experts_per_tok": 2})
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path / "mixtral")
    with pytest.raises(
        ValueError, match=r"block_sparse_moe\.experts\.0.*transformers converts mixtral"
    ) as info:
        plan_pretrained(transformers.MixtralForCausalLM(config), str(tmp_path / "mixtral"))
    assert "from_pretrained(dir, use_kernels=False) inside configure_model()" in str(info.value)
    weights = {**llama().state_dict(), "model.bogus.weight": torch.zeros(2)}
    with pytest.raises(ValueError, match="do not fit the model") as info:
        plan_pretrained(llama(), weights)
    assert "transformers converts" not in str(info.value)
