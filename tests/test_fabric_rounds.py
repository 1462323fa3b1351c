"""One module set up by one Fabric after another in one process (a notebook's cells, a sweep), on 2 Gloo
ranks: after ``fabric.strategy.teardown()`` the next Fabric sets the same module up again, and each
round's weights equal Fabric's ``"ddp"`` doing the same rounds (before, the second setup was refused:
"already set up", a mark the first strategy left on the module for good). A module split over pipeline
stages is refused instead, naming the fix: this rank keeps its own stage's layers only; so is a module a
ZeRO-3 loop left sharded without a teardown, naming its placeholders and the fix."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric import Fabric
from torch import Tensor, nn

from lightning_par.fabric import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import fabric_setup_refused

WORLD, ROUNDS, STEPS = 2, 3, 2


def _rounds(rank: int, strategy: Any) -> list[dict[str, Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    g = torch.Generator().manual_seed(10 + rank)
    states = []
    for _ in range(ROUNDS):
        fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy())
        fabric.launch()
        m, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        for _ in range(STEPS):
            fabric.backward(m(torch.randn(4, 8, generator=g)).square().mean())
            opt.step()
            opt.zero_grad()
        if isinstance(fabric.strategy, HybridParallelStrategy):
            fabric.strategy.teardown()
            fabric.strategy.destroy_process_groups()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states


def _piped_twice(rank: int) -> str:
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def strategy() -> HybridParallelStrategy:
        return HybridParallelStrategy(
            pipeline_parallel_size=2, num_microbatches=2, pipeline_layers=lambda m: list(m)
        )

    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy())
    fabric.launch()
    fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.strategy.teardown()
    fabric.strategy.destroy_process_groups()  # type: ignore[attr-defined]
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy())
    fabric.launch()
    return fabric_setup_refused(fabric, model, torch.optim.SGD(model.parameters(), lr=0.1)) or "not refused"


def _left_sharded(rank: int) -> str:
    """A ZeRO-3 loop stopped without a teardown (an exception in a notebook cell): the module keeps the
    placeholders, and the next Fabric's setup of it says so with the fix."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=HybridParallelStrategy(zero_stage=3))
    fabric.launch()
    m, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.backward(m(torch.randn(4, 8)).square().mean())
    opt.step()
    fabric.strategy.destroy_process_groups()  # type: ignore[attr-defined]
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=HybridParallelStrategy(zero_stage=3))
    fabric.launch()
    return fabric_setup_refused(fabric, model, torch.optim.SGD(model.parameters(), lr=0.1)) or "not refused"


def _runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {
        "ddp": _rounds(rank, lambda: "ddp"),
        "zero1": _rounds(rank, lambda: HybridParallelStrategy(zero_stage=1)),
        "zero3": _rounds(rank, lambda: HybridParallelStrategy(zero_stage=3)),
        "piped": _piped_twice(rank),
        "left_sharded": _left_sharded(rank),
    }


def test_a_module_set_up_again_after_teardown_equals_ddp_round_by_round() -> None:
    for out in run_distributed(_runs, WORLD, init_group=False, timeout=300):
        for key in ("zero1", "zero3"):
            for k, (ours, ddp) in enumerate(zip(out[key], out["ddp"], strict=True)):
                for name, value in ddp.items():
                    torch.testing.assert_close(ours[name], value, msg=f"{key} round {k}: {name}")
        assert not torch.equal(out["ddp"][0]["0.weight"], out["ddp"][-1]["0.weight"])
        assert "split over pipeline stages" in out["piped"] and "build a fresh model" in out["piped"], out
        left = out["left_sharded"]
        assert "already set up" in left and "ZeRO-3's placeholders in 4 parameters" in left, left
        assert "fabric.load the last checkpoint" in left, left
