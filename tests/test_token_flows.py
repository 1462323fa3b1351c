"""``token_normalized`` in two users' flows, 2 Gloo ranks at ZeRO-2 against Lightning's ``"ddp"``.

Every target of the data is valid here, so the token-exact loss (sum of token losses over the window's
tokens) equals the mean loss ``"ddp"`` trains on, and any difference is a wrong rescale:

* a module that stops calling ``token_normalized`` after its first epoch (a curriculum, a switch of
  objective) and returns the mean loss: the later windows are left alone. Before, they were rescaled as
  windows of one token, their gradients ``dp x accumulation`` = 4 times too large (7.6e-2 off after the
  second epoch, silently).
* manual optimization accumulating 2 micro-batches: with the first backward inside
  ``block_backward_sync()`` it equals ``"ddp"``; without, the second synchronisation before the step is
  refused naming that fix. Before, each backward's synchronisation rescaled the whole buffer again, the
  first micro-batch twice (8.4e-2 off, silently).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.loss import token_loss_sum
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state
from tests.third_party import LoraLlama, Tokens

ACCUM = 2


class Switching(LoraLlama):
    """Token-exact in epoch 0 (under our strategy), the mean loss from epoch 1 on."""

    def __init__(self) -> None:
        super().__init__(lora=False, lr=0.3)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        strategy = self.trainer.strategy
        if self.current_epoch == 0 and isinstance(strategy, HybridParallelStrategy):
            loss_sum, tokens = token_loss_sum(self(x), y)
            return strategy.token_normalized(loss_sum, tokens)
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"])


class ManualAccumulation(LoraLlama):
    """The user's own accumulation of ``ACCUM`` micro-batches in manual optimization."""

    def __init__(self, *, block: bool) -> None:
        super().__init__(lora=False, lr=0.3)
        self.automatic_optimization = False
        self.block = block

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        opt = self.optimizers()
        strategy = self.trainer.strategy
        last = (batch_idx + 1) % ACCUM == 0
        blocked = self.block and not last
        with strategy.block_backward_sync() if blocked else nullcontext():  # type: ignore[attr-defined]
            if isinstance(strategy, HybridParallelStrategy):
                loss_sum, tokens = token_loss_sum(self(x), y)
                self.manual_backward(strategy.token_normalized(loss_sum, tokens))
            else:  # "ddp": the mean over the window's micro-batches (every target is valid)
                self.manual_backward(F.cross_entropy(self(x).flatten(0, 1), y.flatten()) / ACCUM)
        if last:
            opt.step()  # type: ignore[union-attr]
            opt.zero_grad()  # type: ignore[union-attr]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"])


def _fit(strategy: Any, module: pl.LightningModule, **options: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    trainer = cpu_trainer(strategy, **options)
    try:
        trainer.fit(module, DataLoader(Tokens(16), batch_size=2))
    except RuntimeError as error:
        if isinstance(strategy, HybridParallelStrategy):
            strategy.destroy_process_groups()
        return {"error": str(error), "step": trainer.global_step}
    return {"state": final_state(module, strategy)}


def _runs(rank: int, world: int) -> dict[str, Any]:
    zero2 = HybridParallelStrategy
    return {
        "switch_ddp": _fit("ddp", Switching(), max_epochs=2, accumulate_grad_batches=ACCUM),
        "switch": _fit(zero2(zero_stage=2), Switching(), max_epochs=2, accumulate_grad_batches=ACCUM),
        "manual_ddp": _fit("ddp", ManualAccumulation(block=True), max_epochs=1),
        "manual": _fit(zero2(zero_stage=2), ManualAccumulation(block=True), max_epochs=1),
        "manual_unblocked": _fit(zero2(zero_stage=2), ManualAccumulation(block=False), max_epochs=1),
    }


def test_token_normalized_in_switching_and_manual_windows() -> None:
    for rank, r in enumerate(run_distributed(_runs, 2, init_group=False, timeout=400)):
        assert "error" not in r["switch"] and "error" not in r["manual"], r
        if rank == 0:  # consolidated_state_dict(): the whole state on rank 0
            for ours, ref in (("switch", "switch_ddp"), ("manual", "manual_ddp")):
                for name, value in r[ref]["state"].items():
                    torch.testing.assert_close(r[ours]["state"][name], value, msg=f"{ours} {name}")
        refused = r["manual_unblocked"]
        assert "a second gradient synchronisation before the optimizer step" in refused["error"], refused
        assert "block_backward_sync" in refused["error"] and refused["step"] == 0
