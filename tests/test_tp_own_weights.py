"""Layers whose weight torch computes from other tensors (pruning, weight norm, parametrizations) under
tensor parallelism, on 2 Gloo ranks: refused with the fix, the user's model left as it was.

Before, at tp2: a Llama whose ``q_proj`` was pruned or weight-normed (hook form) before the fit failed in
the first forward ("'ColumnParallelLinear' object has no attribute 'weight_mask'"); one reparametrised by
``parametrizations.weight_norm`` trained a plain weight instead, silently (2.9e-4 from one process after 8
SGD steps, the export's names changed); pruning the head during the fit ranked each rank's slice on its
own (one process pruned 12% / 88% of the two halves of a head whose first half was scaled x10, tp2 50% of
each) and exported rank 0's slice of the mask beside the whole weight. ``"ddp"`` and ZeRO train all three.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn.utils import parametrizations, prune
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer
from tests.third_party import LoraLlama, Tokens

TP = 2


def _prune(layer: nn.Module) -> None:
    prune.l1_unstructured(layer, "weight", amount=0.3)


def _weight_norm(layer: nn.Module) -> None:
    torch.nn.utils.weight_norm(layer)


def _parametrized(layer: nn.Module) -> None:
    parametrizations.weight_norm(layer)


REPARAMETRISE: dict[str, Callable[[nn.Module], None]] = {
    "prune": _prune,
    "weight_norm": _weight_norm,
    "parametrize": _parametrized,
}


class Reparametrised(LoraLlama):
    def __init__(self, how: str) -> None:
        super().__init__(lora=False)
        self.how = how

    def configure_model(self) -> None:
        if self.model is None:
            super().configure_model()
            assert self.model is not None
            REPARAMETRISE[self.how](self.model.get_submodule("model.layers.0.self_attn.q_proj"))


class PruneHead(pl.Callback):
    """Prunes the (tensor-parallel) LM head when training starts."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        prune.l1_unstructured(pl_module.model.lm_head, "weight", amount=0.5)


def _fit(module: pl.LightningModule, **options: Any) -> tuple[str, int]:
    strategy = HybridParallelStrategy(tensor_parallel_size=TP, tp_plan="llama", meta_init=False)
    trainer = cpu_trainer(strategy, devices=TP, max_steps=2, **options)
    try:
        trainer.fit(module, DataLoader(Tokens(8), batch_size=2))
        message = "not refused"
    except (ValueError, RuntimeError) as error:
        message = f"{type(error).__name__}: {error}"
    strategy.destroy_process_groups()
    return message, trainer.global_step


def _runs(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for how in REPARAMETRISE:
        module = Reparametrised(how)
        out[how] = _fit(module)
        q_proj = module.model.get_submodule("model.layers.0.self_attn.q_proj")  # type: ignore[union-attr]
        out[f"{how}_kept"] = (type(q_proj).__name__, sorted(n for n, _ in q_proj.named_parameters()))
    out["mid_fit"] = _fit(LoraLlama(lora=False), callbacks=[PruneHead()])
    return out


def test_reparametrised_weights_are_refused_under_tensor_parallelism() -> None:
    for r in run_distributed(_runs, TP, init_group=False, timeout=300):
        fixes = {
            "prune": "torch.nn.utils.prune.remove(module, 'weight')",
            "weight_norm": "torch.nn.utils.remove_weight_norm(module)",
            "parametrize": "torch.nn.utils.parametrize.remove_parametrizations(module, 'weight')",
        }
        for how, fix in fixes.items():
            message, steps = r[how]
            converts = "ValueError: tp_plan converts 'model.model.layers.0.self_attn.q_proj'"
            assert message.startswith(converts), (how, message)
            assert fix in message and steps == 0, (how, message)
        # the user's layer is untouched: still reparametrised, not converted
        assert r["prune_kept"] == ("Linear", ["weight_orig"])
        assert r["weight_norm_kept"] == ("Linear", ["weight_g", "weight_v"])
        assert r["parametrize_kept"][0] == "ParametrizedLinear"
        message, steps = r["mid_fit"]
        reparametrised = "RuntimeError: A tensor-parallel ColumnParallelLinear had its weight"
        assert message.startswith(reparametrised), message
        assert "torch.nn.utils.prune.remove(module, 'weight')" in message and steps == 0
