"""``fabric.init_module(empty_init=True)`` where ZeRO-3 meta init does not apply (ZeRO 0-2, or
``meta_init=False``): the constructors' own initialisation is skipped, as under Fabric's ``"ddp"``, so a
model initialised afterwards under a seed (litgpt's pretrain: ``reset_parameters`` after the block) gets
``"ddp"``'s weights. Before, the constructors drew from the seeded generator first: 0.67 apart in a
probe of litgpt's pretrain initialisation. At ZeRO-3 with meta init, litgpt's route for FSDP (an
initialiser set as each layer's ``reset_parameters``, not called) gives the shards ``"ddp"``'s weights."""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning as L
import torch
from lightning.fabric import Fabric
from torch import Tensor, nn

from lightning_par.fabric import HybridParallelStrategy
from tests.distributed import run_distributed


def _initialise(layer: nn.Linear, *, value: float) -> None:
    nn.init.constant_(layer.weight, value)
    nn.init.zeros_(layer.bias)


def _initialised(strategy: Any, *, assign: bool = False) -> dict[str, Tensor]:
    """``assign``: litgpt's route under FSDP, an initialiser set as each layer's ``reset_parameters``; it is
    called here unless the strategy is ZeRO-3 with meta init, whose shards are initialised through it."""
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    L.seed_everything(42)
    with fabric.init_module(empty_init=True):
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    meta = isinstance(strategy, HybridParallelStrategy) and strategy.zero_stage == 3 and strategy.meta_init
    for i, layer in enumerate(model):  # the initialisation after the block, from the seeded generator
        if isinstance(layer, nn.Linear):
            if assign:
                layer.reset_parameters = partial(_initialise, layer, value=0.5 + i)  # type: ignore[method-assign]
            if not (assign and meta):
                layer.reset_parameters()
    model = fabric.setup_module(model)
    if not isinstance(strategy, HybridParallelStrategy):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    state: dict[str, Tensor] = strategy.consolidated_state_dict()  # rank 0's
    strategy.destroy_process_groups()
    return state


def _job(rank: int, world: int) -> dict[str, dict[str, Tensor]]:
    torch.set_num_threads(1)
    runs = {"ddp": _initialised("ddp")}
    runs["zero1"] = _initialised(HybridParallelStrategy(zero_stage=1))
    runs["zero3-real"] = _initialised(HybridParallelStrategy(zero_stage=3, meta_init=False))
    runs["ddp-assigned"] = _initialised("ddp", assign=True)
    runs["zero3-assigned"] = _initialised(HybridParallelStrategy(zero_stage=3), assign=True)
    return runs


def test_empty_init_skips_the_constructors_initialisation_as_under_ddp() -> None:
    runs = run_distributed(_job, 2, init_group=False)[0]
    ddp = runs["ddp"]
    for name in ("zero1", "zero3-real"):
        assert set(runs[name]) == set(ddp), name
        for key, value in ddp.items():
            torch.testing.assert_close(runs[name][key], value, rtol=0, atol=0, msg=f"{name} {key}")
    # litgpt's FSDP route at ZeRO-3 with meta init: the shards take the assigned initialisers (the refusal
    # of writes after the block names this route)
    assert set(runs["zero3-assigned"]) == set(runs["ddp-assigned"])
    for key, value in runs["ddp-assigned"].items():
        torch.testing.assert_close(runs["zero3-assigned"][key], value, rtol=0, atol=0, msg=key)
