"""Tensor-parallel replicas and per-rank gradient clipping, on 2 Gloo ranks (tp 2, ZeRO-0), with a Hugging
Face Llama under the ``llama`` plan.

``torch.nn.utils.clip_grad_norm_(self.parameters(), ...)`` in ``on_before_optimizer_step`` (Trainer) or in a
Fabric loop measures this rank's slices only, so the ranks of a tensor-parallel group clip by different
factors and the weights they both hold whole (the RMSNorm weights) drift apart: 0.0017 apart after 3
AdamW steps, measured, with nothing reported. Now the first optimizer step compares those gradients
over the group and raises, naming the parameter and the fix (the Trainer after its first step, Fabric
before it, so the loop's weights are untouched). The fix itself, Lightning's clipping
(``gradient_clip_val``, ``fabric.clip_gradients``), measures the whole model: it equals one process
clipping the whole model with torch's ``clip_grad_norm_``.
"""

from __future__ import annotations

import random
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.fabric import HybridParallelStrategy as FabricStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state, rank_state
from tests.third_party import LLAMA, LoraLlama, Tokens, hf_model, llama, replay_order

CLIP, STEPS = 0.05, 3


class TorchClipped(LoraLlama):
    """Clips as a DDP user does: torch's clip over ``self.parameters()``, in the hook before the step."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        torch.nn.utils.clip_grad_norm_(self.parameters(), CLIP)


class SlightlyRescaled(LoraLlama):
    """Rescales each rank's gradients by a factor 0.1% apart: a clip by two halves' norms that nearly
    agree (before, under the check's 1% tolerance: it trained on, the replicas drifting apart)."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(1 + 1e-3 * self.global_rank)


def _loader() -> DataLoader[Any]:
    return DataLoader(Tokens(2 * STEPS), batch_size=2)


def _fabric_loop(strategy: Any, *, devices: int, torch_clip: bool) -> tuple[dict[str, Tensor], str]:
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(llama())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    refused = ""
    try:
        for x, y in _loader():
            loss = F.cross_entropy(model(input_ids=x, use_cache=False).logits.flatten(0, 1), y.flatten())
            fabric.backward(loss)
            if torch_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            else:
                fabric.clip_gradients(model, optimizer, max_norm=CLIP)
            optimizer.step()
            optimizer.zero_grad()
    except RuntimeError as error:
        refused = str(error)
        for name, value in model.named_parameters():  # refused before the step changed anything
            torch.testing.assert_close(value.detach(), before[name], msg=name)
    state = rank_state(model.module)  # the module inside Fabric's wrapper
    if isinstance(strategy, FabricStrategy):
        full = strategy.consolidated_state_dict() if not refused else {}
        state = {k: v.clone() for k, v in full.items()}
        strategy.destroy_process_groups()
    return state, refused


def _runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}

    def tp2() -> HybridParallelStrategy:
        return HybridParallelStrategy(tensor_parallel_size=2, tp_plan="llama")

    for key, kind in (("trainer_refused", TorchClipped), ("slightly_refused", SlightlyRescaled)):
        strategy = tp2()
        try:
            cpu_trainer(strategy, max_steps=STEPS).fit(kind(lora=False), _loader())
            out[key] = ""
        except RuntimeError as error:
            out[key] = str(error)
        strategy.destroy_process_groups()
    strategy = tp2()
    module = LoraLlama(lora=False)
    cpu_trainer(strategy, max_steps=STEPS, gradient_clip_val=CLIP).fit(module, _loader())
    out["trainer"] = final_state(module, strategy)
    out["fabric_refused"] = _fabric_loop(
        FabricStrategy(tensor_parallel_size=2, tp_plan="llama"), devices=2, torch_clip=True
    )[1]
    out["fabric"] = _fabric_loop(
        FabricStrategy(tensor_parallel_size=2, tp_plan="llama"), devices=2, torch_clip=False
    )[0]
    return out


def test_per_rank_clipping_under_tensor_parallelism_is_refused() -> None:
    ranks = run_distributed(_runs, 2, init_group=False, timeout=300)
    # one process clipping the whole model with torch's own function: what the fix must equal
    reference = cpu_trainer("auto", devices=1, max_steps=STEPS, gradient_clip_val=CLIP)
    module = LoraLlama(lora=False)
    # the batches in the order Lightning's DistributedSampler (seed 0) gave the tp group's one dp rank
    order = replay_order(2 * STEPS, dp=1, micro=2, epochs=1, seed=0)
    reference.fit(module, DataLoader(Tokens(2 * STEPS), batch_sampler=order))
    expected = final_state(module, "auto")
    fabric_expected, _ = _fabric_loop("auto", devices=1, torch_clip=True)
    for r, out in enumerate(ranks):
        for door, fix in (("trainer", "gradient_clip_val"), ("fabric", "fabric.clip_gradients")):
            message = out[f"{door}_refused"]
            assert "input_layernorm.weight" in message and "drift apart" in message, (r, door, message)
            assert fix in message and "clip_grad_norm_" in message, (r, door, message)
        assert "drift apart" in out["slightly_refused"], (r, out["slightly_refused"])
    for door, want in (("trainer", expected), ("fabric", fabric_expected)):
        got = ranks[0][door]
        assert got.keys() == want.keys(), door
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, msg=f"{door}: {name}")


# ------------------------------------------------------------------------------------ random state
DROPOUT = {"pad_token_id": 0, "resid_pdrop": 0.2, "embd_pdrop": 0.2, "attention_dropout": 0.2}


class DropoutPhi3(LoraLlama):
    """Phi-3 with dropout on the residual stream (replicated under tp) and in the attention."""

    def configure_model(self) -> None:
        if self.model is None:
            self.model = hf_model("Phi3ForCausalLM", "Phi3Config", **(LLAMA | DROPOUT))


def _norms(module: torch.nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters() if "norm" in n}


class HostDraws(pl.Callback):
    """What NumPy's and Python's global generators give at the start of training."""

    def __init__(self) -> None:
        self.drawn: tuple[float, float] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.drawn = (float(np.random.random()), random.random())


def _seeded_per_rank(rank: int, world: int) -> dict[str, Any]:
    """Each rank seeded apart (nanoGPT's ``manual_seed(1337 + rank)``), then a tp2 run with dropout: the
    Trainer (ZeRO-0) and a Fabric loop (ZeRO-1)."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    module = DropoutPhi3()
    module.configure_model()  # (hf_model seeds the init: the per-rank seeds come after it)
    torch.manual_seed(100 + rank)
    np.random.seed(100 + rank)  # NumPy's and Python's generators too (SpecAugment draws with NumPy)
    random.seed(100 + rank)
    strategy = HybridParallelStrategy(tensor_parallel_size=2, tp_plan="llama")
    draws = HostDraws()
    trainer = cpu_trainer(strategy, max_steps=STEPS, use_distributed_sampler=False, callbacks=[draws])
    trainer.fit(module, _loader())
    out["trainer"] = _norms(module)
    out["host_draws"] = draws.drawn
    strategy.destroy_process_groups()
    fabric_strategy = FabricStrategy(zero_stage=1, tensor_parallel_size=2, tp_plan="llama")
    fabric = Fabric(accelerator="cpu", devices=world, strategy=fabric_strategy)
    fabric.launch()
    model = hf_model("Phi3ForCausalLM", "Phi3Config", **(LLAMA | DROPOUT))
    torch.manual_seed(200 + rank)
    np.random.seed(200 + rank)
    random.seed(200 + rank)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    out["fabric_host_draws"] = (float(np.random.random()), random.random())
    batches = torch.randint(0, 64, (STEPS, 4, 13), generator=torch.Generator().manual_seed(5))
    for ids in batches:
        loss = F.cross_entropy(model(input_ids=ids[:, :-1]).logits.flatten(0, 1), ids[:, 1:].flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    out["fabric"] = _norms(model.module)
    fabric_strategy.destroy_process_groups()
    return out


def test_tp_ranks_seeded_apart_still_drop_alike() -> None:
    """The ranks of a tp group start the run with one random state (tp rank 0's), so dropout on the
    replicated residual stream masks alike and the weights both ranks hold whole stay one (before, with
    per-rank seeds: the norm weights 1.5e-3 apart in the Trainer and 2.9e-3 in Fabric after 3 steps); NumPy's
    and Python's global generators too (before, apart: Wav2Vec2's SpecAugment masked apart at tp2)."""
    ranks = run_distributed(_seeded_per_rank, 2, init_group=False)
    for key in ("host_draws", "fabric_host_draws"):  # tp rank 0's NumPy and Python states on both
        assert ranks[0][key] == ranks[1][key], (key, ranks[0][key], ranks[1][key])
    for front in ("trainer", "fabric"):
        first, second = ranks[0][front], ranks[1][front]
        assert first.keys() == second.keys() and first, front
        for name, value in first.items():
            torch.testing.assert_close(second[name], value, rtol=0, atol=0, msg=f"{front}: {name}")
        start = _norms(hf_model("Phi3ForCausalLM", "Phi3Config", **(LLAMA | DROPOUT)))
        prefix = "model." if front == "trainer" else ""  # the LightningModule holds the model as .model
        moved = max(float((v - start[k[len(prefix) :]]).abs().max()) for k, v in first.items())
        assert moved > 1e-4, (front, moved)  # they trained
