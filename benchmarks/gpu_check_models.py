"""GPU check, part 7: models this package did not write, on the device (world size 1, NCCL on CUDA).

The matrix (part 1) trains the package's own GPT; users bring Hugging Face models, PEFT adapters over
frozen weights and BatchNorm nets. Each run here goes through Lightning's ``Trainer`` (or ``Fabric``)
with :class:`~lightning_par.HybridParallelStrategy` and is compared with Lightning's own single-device
strategy doing the same thing on the same device:

- a Hugging Face Llama with a PEFT LoRA adapter (base frozen), SGD with momentum, ``fit`` then ``test``,
  at ZeRO 0-3 in ``32-true`` (deterministic kernels: the trainable weights and the test loss within 1e-5
  of Lightning's, the frozen weights unchanged) and at ZeRO-3 in ``bf16-mixed`` (within ``8 u U`` of
  Lightning's ``bf16-mixed``, ``U`` the largest update, as part 1's tolerance argues; the frozen weights
  exactly as they started: fp32 under mixed precision, as Lightning keeps them);
- greedy ``generate()`` of the trained model at ZeRO-3 inside ``strategy.gathered_params()`` (in
  ``on_train_end``): the same tokens as Lightning's trained model;
- a Hugging Face ResNet (BatchNorm: running statistics are buffers) at ZeRO-2 and ZeRO-3, ``fit`` then
  ``test``: weights and running statistics within 1e-5, the test loss within 1e-5;
- a Fabric loop with the LoRA Llama at ZeRO-3: losses within 1e-5 of plain Fabric's;
- a Llama built in ``configure_model`` (meta init at ZeRO-3) with torchmetrics ``MeanMetric`` objects
  logged in validation and test: each equals Lightning's mean of the same logged losses, the metrics
  on the device (before, at ZeRO-3 with meta init their states stayed on the CPU: "Encountered
  different devices in metric calculation", seen in the main job on the H200).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.gpu_check_correctness import SAME_NUMERICS, UNIT, Fail, deterministic
from benchmarks.gpu_check_correctness import trainer as make_trainer
from lightning_par import HybridParallelStrategy
from lightning_par.fabric import HybridParallelStrategy as FabricStrategy

LLAMA = {  # (full, quick)
    "full": dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4),
    "quick": dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2),
}
SEQ, BATCH, STEPS, TOL = 32, 4, 4, 1e-5
PROMPT = [[1, 5, 9, 2]]


def _llama(quick: bool, *, lora: bool = True) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    size = LLAMA["quick" if quick else "full"]
    config = LlamaConfig(
        **size,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )
    if not lora:
        return LlamaForCausalLM(config)
    adapters = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0
    )
    model = get_peft_model(LlamaForCausalLM(config), adapters)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # PEFT starts B at zero; non-zero B makes the adapters matter from step one
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _tokens(quick: bool, n: int) -> DataLoader[Any]:
    vocab = LLAMA["quick" if quick else "full"]["vocab_size"]
    data = torch.randint(0, vocab, (n, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=BATCH)


class FitTest(pl.LightningModule):
    """Keeps its training losses and logs ``test_loss``; subclasses define ``_loss``."""

    _loss: Callable[[Any], Tensor]  # each subclass's loss of a batch

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.losses.append(loss.detach())
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))


class LoraModule(FitTest):
    def __init__(self, quick: bool) -> None:
        super().__init__()
        self.model = _llama(quick)
        self.generated: Tensor | None = None

    def _loss(self, batch: Any) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.model(input_ids=x, use_cache=False).logits.flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5, momentum=0.9)


class MetricLlama(pl.LightningModule):
    """A Llama built in ``configure_model`` (on the meta device at ZeRO-3) with torchmetrics metrics."""

    def __init__(self, quick: bool) -> None:
        super().__init__()
        from torchmetrics import MeanMetric

        self.quick = quick
        self.model: torch.nn.Module | None = None
        self.val_mean, self.test_mean = MeanMetric(), MeanMetric()
        self.metric_device = torch.device("meta")

    def configure_model(self) -> None:
        if self.model is None:
            self.model = _llama(self.quick, lora=False)

    def _loss(self, batch: Any) -> Tensor:
        assert self.model is not None
        x, y = batch
        return F.cross_entropy(self.model(input_ids=x, use_cache=False).logits.flatten(0, 1), y.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss = self._loss(batch)
        self.val_mean.update(loss)
        self.log_dict({"val_loss": loss, "val_metric": self.val_mean})

    def test_step(self, batch: Any, batch_idx: int) -> None:
        loss = self._loss(batch)
        self.test_mean.update(loss)
        self.log_dict({"test_loss": loss, "test_metric": self.test_mean})
        # where the metric's state is during the step (Lightning moves the module to the CPU at teardown)
        self.metric_device = self.test_mean.mean_value.device

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _metrics_meta_init(quick: bool, device: str, root: str, fail: Fail) -> dict[str, Any]:
    module = MetricLlama(quick)
    strategy = HybridParallelStrategy(zero_stage=3)
    trainer = make_trainer(
        device,
        strategy,
        "32-true",
        STEPS,
        1,
        [],
        default_root_dir=root,
        val_check_interval=2,
        limit_val_batches=2,
    )
    loader = _tokens(quick, BATCH * STEPS)
    trainer.fit(module, loader, loader)
    val = {k: float(trainer.callback_metrics[k]) for k in ("val_loss", "val_metric")}
    test = trainer.test(module, loader, verbose=False)[0]
    row = {
        **val,
        "test_loss": float(test["test_loss"]),
        "test_metric": float(test["test_metric"]),
        "metric_device": str(module.metric_device),
    }
    for stage in ("val", "test"):
        if not abs(row[f"{stage}_metric"] - row[f"{stage}_loss"]) <= 1e-5:
            metric, loss = row[f"{stage}_metric"], row[f"{stage}_loss"]
            fail(f"models metrics-meta-init: {stage} MeanMetric {metric} vs the logged mean {loss}")
    if module.metric_device.type != device:
        fail(f"models metrics-meta-init: the metric's state was on {module.metric_device} in test_step")
    return row


class ResNetModule(FitTest):
    def __init__(self) -> None:
        super().__init__()
        from transformers import ResNetConfig, ResNetForImageClassification

        torch.manual_seed(0)
        config = ResNetConfig(
            embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=4
        )
        self.net = ResNetForImageClassification(config)

    def _loss(self, batch: Any) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.net(pixel_values=x).logits, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _images() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(4)
    x, y = (
        torch.randn(BATCH * STEPS, 3, 32, 32, generator=g),
        torch.randint(0, 4, (BATCH * STEPS,), generator=g),
    )
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


class Generate(pl.Callback):
    """Greedy tokens of the trained model, every unit gathered (at ZeRO-3) for the whole generation."""

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        gathered = getattr(trainer.strategy, "gathered_params", contextlib.nullcontext)
        with gathered(), torch.no_grad():
            prompt = torch.tensor(PROMPT, device=module.device)
            out = module.model.generate(input_ids=prompt, max_new_tokens=8, do_sample=False)  # type: ignore[operator]
            module.generated = out.cpu()  # type: ignore[assignment]


def _final(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Tensor]:
    if isinstance(trainer.strategy, HybridParallelStrategy):
        state = trainer.strategy.consolidated_state_dict()
    else:
        state = module.state_dict()
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def _fit_test(
    make: Any, loader: Any, device: str, stage: int | None, precision: str, root: str
) -> dict[str, Any]:
    module = make()
    strategy: Any = "auto" if stage is None else HybridParallelStrategy(zero_stage=stage, meta_init=False)
    callbacks = [Generate()] if isinstance(module, LoraModule) else []
    trainer = make_trainer(device, strategy, precision, STEPS, 1, callbacks, default_root_dir=root)
    start = time.perf_counter()
    with deterministic(device) if precision == "32-true" else contextlib.nullcontext():
        trainer.fit(module, loader())
        final = _final(trainer, module)
        test = trainer.test(module, loader(), verbose=False)[0]["test_loss"]
    return {
        "losses": [float(x) for x in torch.stack(module.losses).cpu()],
        "final": final,
        "test_loss": float(test),
        "generated": getattr(module, "generated", None),
        "seconds": time.perf_counter() - start,
    }


def _diff(a: dict[str, Tensor], b: dict[str, Tensor], keys: list[str]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in keys)


def _compare(name: str, run: dict[str, Any], ref: dict[str, Any], tol: float, fail: Fail) -> dict[str, Any]:
    if set(run["final"]) != set(ref["final"]):
        odd = sorted(set(run["final"]) ^ set(ref["final"]))[:4]
        fail(f"models {name}: state keys differ from Lightning's: {odd}")
        return {}
    floats = [k for k in ref["final"] if ref["final"][k].is_floating_point()]
    dw = _diff(run["final"], ref["final"], floats)
    dl = max(abs(a - b) for a, b in zip(run["losses"], ref["losses"], strict=True))
    dt = abs(run["test_loss"] - ref["test_loss"])
    row = {
        "losses": run["losses"],
        "max_dw": dw,
        "max_dloss": dl,
        "dtest": dt,
        "tol": tol,
        "seconds": run["seconds"],
    }
    if not all(math.isfinite(x) for x in run["losses"]):
        fail(f"models {name}: non-finite losses {run['losses']}")
    for what, value in (("weights", dw), ("losses", dl), ("test loss", dt)):
        if not value <= tol:
            fail(f"models {name}: {what} differ from Lightning's by {value:.3g} > {tol:.3g}")
    return row


def _fabric_losses(device: str, quick: bool, stage: int | None) -> list[float]:
    strategy: Any = "auto" if stage is None else FabricStrategy(zero_stage=stage, meta_init=False)
    fabric = Fabric(accelerator="cuda" if device == "cuda" else "cpu", devices=1, strategy=strategy)
    fabric.launch()
    model = _llama(quick)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    losses = []
    with deterministic(device):
        for x, y in fabric.setup_dataloaders(_tokens(quick, BATCH * STEPS), use_distributed_sampler=False):
            loss = F.cross_entropy(model(input_ids=x, use_cache=False).logits.flatten(0, 1), y.flatten())
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
    return [float(x) for x in torch.stack(losses).cpu()]


def part_models(quick: bool, device: str, root: str, fail: Fail) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def lora() -> LoraModule:
        return LoraModule(quick)

    def tokens() -> DataLoader[Any]:
        return _tokens(quick, BATCH * STEPS)

    start = {k: v.detach().clone() for k, v in lora().state_dict().items()}
    frozen = [k for k, v in lora().named_parameters() if not v.requires_grad]
    for precision, stages in (("32-true", (0, 1, 2, 3)), ("bf16-mixed", (3,))):
        ref = _fit_test(lora, tokens, device, None, precision, root)
        tol = TOL
        if precision != "32-true":
            trained = [k for k in start if k not in frozen and start[k].is_floating_point()]
            tol = SAME_NUMERICS * UNIT[precision] * _diff(ref["final"], start, trained) + TOL
        for stage in stages:
            name = f"lora-llama-zero{stage}-{precision}"
            run = _fit_test(lora, tokens, device, stage, precision, root)
            out[name] = _compare(name, run, ref, tol, fail)
            # frozen weights keep their fp32 values under mixed precision (ParallelPrecision's
            # frozen_dtype="auto", as Lightning keeps them): exactly as they started, never updated
            dtype = torch.float32
            kept = {k: start[k].to(dtype) for k in frozen}
            moved = _diff(run["final"], kept, [k for k in frozen if k in run["final"]])
            out[name]["frozen_moved"] = moved
            if moved != 0.0:
                fail(f"models {name}: frozen weights moved by {moved:.3g} from their start ({dtype})")
            if precision == "32-true" and stage == 3:
                same = run["generated"] is not None and torch.equal(run["generated"], ref["generated"])
                out[name]["generated_equal"] = same
                if not same:
                    fail(f"models {name}: generate() gave {run['generated']}, Lightning's {ref['generated']}")
    ref = _fit_test(ResNetModule, _images, device, None, "32-true", root)
    for stage in (2, 3):
        name = f"resnet-zero{stage}-32-true"
        run = _fit_test(ResNetModule, _images, device, stage, "32-true", root)
        out[name] = _compare(name, run, ref, TOL, fail)
        stats = [k for k in ref["final"] if "running_" in k]
        out[name]["max_d_running_stats"] = _diff(run["final"], ref["final"], stats) if stats else math.nan
        if not stats:
            fail(f"models {name}: no BatchNorm running statistics in the state dict")
    out["metrics-meta-init-zero3"] = _metrics_meta_init(quick, device, root, fail)
    plain, ours = _fabric_losses(device, quick, None), _fabric_losses(device, quick, 3)
    dl = max(abs(a - b) for a, b in zip(ours, plain, strict=True))
    out["fabric-lora-llama-zero3"] = {"losses": ours, "max_dloss": dl}
    if not dl <= TOL:
        fail(f"models fabric-lora-llama-zero3: losses differ from plain Fabric's by {dl:.3g}")
    return out
