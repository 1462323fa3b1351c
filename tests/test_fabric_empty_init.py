"""``fabric.init_module(empty_init=True)`` where ZeRO-3 meta init does not apply (ZeRO 0-2, or
``meta_init=False``): the constructors' own initialisation is skipped, as under Fabric's ``"ddp"``, so a
model initialised afterwards under a seed (litgpt's pretrain: ``reset_parameters`` after the block) gets
``"ddp"``'s weights. Before, the constructors drew from the seeded generator first: 0.67 apart in a
probe of litgpt's pretrain initialisation."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.fabric import Fabric
from torch import Tensor, nn

from lightning_par.fabric import HybridParallelStrategy
from tests.distributed import run_distributed


def _initialised(strategy: Any) -> dict[str, Tensor]:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    L.seed_everything(42)
    with fabric.init_module(empty_init=True):
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    for layer in model:  # the initialisation after the block, from the seeded generator
        if isinstance(layer, nn.Linear):
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
    return runs


def test_empty_init_skips_the_constructors_initialisation_as_under_ddp() -> None:
    runs = run_distributed(_job, 2, init_group=False)[0]
    ddp = runs["ddp"]
    for name in ("zero1", "zero3-real"):
        assert set(runs[name]) == set(ddp), name
        for key, value in ddp.items():
            torch.testing.assert_close(runs[name][key], value, rtol=0, atol=0, msg=f"{name} {key}")
