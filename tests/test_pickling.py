"""The LightningModule pickled or deep-copied while a fit runs, on 2 Gloo ranks, against ``"ddp"``.

A callback that logs the whole model with ``torch.save(pl_module, f)`` in ``on_train_end`` (as model
registries' ``log_model`` helpers do) failed at every ZeRO stage with "Can't pickle local object
'for_owner.<locals>.run'": the engine's module hooks and the run's instance attributes (``zero_grad``,
``no_sync``, the guarded hooks) were local functions. Now the pickle equals ``"ddp"``'s in fp32: loaded
in one process, the module computes and holds ``"ddp"``'s weights, with no trace of the run (its hooks
inert, its ``zero_grad`` the class's, its ``no_sync`` a context doing nothing, as for one process). At
ZeRO-3 the pickle is refused outside ``gathered_params()`` (it would hold the NaN placeholders), naming
the fix, and taken inside it equals ``"ddp"``'s. A ``copy.deepcopy`` made during the run no longer keeps
the engine's hooks or the original's wrappers either (an EMA's ``zero_grad()`` zeroes the copy alone,
as under ``"ddp"``). In mixed precision at ZeRO 1-3 the pickle holds the 16-bit compute copies, as the
module does during the fit (README).
"""

from __future__ import annotations

import copy
import io
from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state

WORLD = 2


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(32, 4, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


class Pickles(pl.Callback):
    """In ``on_train_end``: the module pickled (inside ``gathered_params()`` at ZeRO-3, after trying
    outside), and a deep copy's ``zero_grad()`` and forward."""

    def __init__(self) -> None:
        self.out: dict[str, Any] = {}

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        ours = isinstance(strategy, HybridParallelStrategy)
        if ours and strategy.zero_stage == 3:
            try:
                torch.save(module, io.BytesIO())
                self.out["outside"] = "saved"
            except RuntimeError as error:
                self.out["outside"] = str(error)
        gathered = strategy.gathered_params if ours else nullcontext
        buffer = io.BytesIO()
        with gathered():
            torch.save(module, buffer)
            twin = copy.deepcopy(module)
        self.out["pickle"] = buffer.getvalue()
        for p in twin.parameters():
            p.grad = torch.ones_like(p)
        twin.zero_grad()  # the copy's own gradients only
        self.out["twin_grads"] = [p.grad for p in twin.parameters()]
        self.out["twin_forward"] = twin.net(torch.ones(2, 4)).detach()


def _load(data: bytes) -> dict[str, Any]:
    """The pickled module in this process: its weights, a forward, and what the run left on it."""
    loaded = torch.load(io.BytesIO(data), weights_only=False)
    try:
        with loaded.no_sync():
            no_sync = "a context doing nothing"
    except AttributeError as error:
        no_sync = str(error)
    return {
        "state": {k: v.clone() for k, v in loaded.state_dict().items()},
        "forward": loaded.net(torch.ones(2, 4)).detach(),
        "zero_grad_is_class": getattr(loaded.zero_grad, "__func__", None) is type(loaded).zero_grad,
        "no_sync": no_sync,
    }


def _runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name, strategy in (
        ("ddp", "ddp"),
        ("zero1", HybridParallelStrategy(zero_stage=1)),
        ("zero3", HybridParallelStrategy(zero_stage=3)),
    ):
        callback = Pickles()
        module = Net()
        cpu_trainer(strategy, devices=world, max_steps=4, callbacks=[callback]).fit(module)
        final = final_state(module, strategy)
        out[name] = {**callback.out, **_load(callback.out.pop("pickle")), "final": final}
    return out


def test_the_module_pickled_during_fit_equals_ddps_pickle() -> None:
    ranks = run_distributed(_runs, WORLD, init_group=False, timeout=240)
    for rank, out in enumerate(ranks):
        ddp = out["ddp"]
        assert ddp["zero_grad_is_class"] and "has no attribute 'no_sync'" in ddp["no_sync"]
        for name in ("zero1", "zero3"):
            got = out[name]
            torch.testing.assert_close(got["state"], ddp["state"])
            torch.testing.assert_close(got["forward"], ddp["forward"])
            torch.testing.assert_close(got["twin_forward"], ddp["twin_forward"])
            assert [g is None for g in got["twin_grads"]] == [g is None for g in ddp["twin_grads"]]
            assert got["zero_grad_is_class"], (rank, name)
            assert got["no_sync"] == "a context doing nothing", (rank, name)  # DDP's idiom, lent for the run
            if rank == 0:  # the final weights land on rank 0
                torch.testing.assert_close(got["final"], ddp["final"])
        outside = out["zero3"]["outside"]
        assert outside.startswith("The whole model (Net) was pickled"), (rank, outside)
        assert "gathered_params()" in outside and "consolidated_state_dict()" in outside, outside
