"""Weights read from Lightning hooks between training steps at ZeRO-3, on 2 Gloo ranks, against ``"ddp"``.

Between steps a ZeRO-3 parameter is a NaN placeholder. Two common pieces of user code read weights there:

* an EMA of the weights kept in buffers and updated in ``on_train_batch_end`` (the latent-diffusion
  idiom; ``Shadow`` below is written for this test). Before, its buffers were NaN after the first update
  at ZeRO-3 while the model trained normally (measured: every EMA buffer NaN after one epoch, model
  weights equal to ``"ddp"``'s), and at ZeRO 1/2 in ``bf16-mixed`` it averaged the 16-bit compute copies
  (3.9e-4 from ``"ddp"``'s EMA);
* a weight norm logged in ``on_before_optimizer_step`` (logged NaN).

Now such a read is refused, naming the parameter, the function, the hook and the fix (the module's and
user callbacks' per-batch hooks run inside a guard at every batch; between the first two steps the
engine watches everything else too), and the guard leaves torch's function-mode stack as it found it.
The fix the message names,
``gathered_params(writeback=True)`` around the EMA update (the fp32 masters at ZeRO 1-3) and
``gathered_params()`` around the norm, equals ``"ddp"``: model weights and EMA buffers at ZeRO-3 in
``32-true`` and ``bf16-mixed`` and at ZeRO-2 in ``bf16-mixed``, with a ``ModelCheckpoint`` saving after
every step in the same fit (the strategy's own reads pass); the logged norm at ZeRO-3.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import final_state, fit_refused

WORLD = 2


class Shadow(nn.Module):
    """An exponential moving average of a model's trainable weights, held in buffers."""

    def __init__(self, model: nn.Module, *, decay: float = 0.9) -> None:
        super().__init__()
        self.decay = decay
        self.slots = {n: n.replace(".", "_") for n, p in model.named_parameters() if p.requires_grad}
        for name, slot in self.slots.items():
            self.register_buffer(slot, model.get_parameter(name).detach().clone())

    @torch.no_grad()
    def forward(self, model: nn.Module) -> None:
        buffers = dict(self.named_buffers())
        for name, p in model.named_parameters():
            if name in self.slots:
                shadow = buffers[self.slots[name]]
                shadow.sub_((1 - self.decay) * (shadow - p))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.relu(self.fc(x))


class WithEma(pl.LightningModule):
    def __init__(self, *, recipe: bool) -> None:
        super().__init__()
        self.recipe = recipe  # the fix the refusal names
        self.model = nn.Sequential(nn.Linear(8, 16), Block(), Block(), nn.Linear(16, 1))
        self.ema = Shadow(self.model)
        self.modes: list[int] = []  # torch function modes entered in steps after the first

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if batch_idx > 0:
            self.modes.append(torch._C._len_torch_function_stack())
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def on_train_batch_end(self, *args: Any) -> None:
        strategy = self.trainer.strategy
        if self.recipe and isinstance(strategy, HybridParallelStrategy):
            with strategy.gathered_params(writeback=True):
                self.ema(self.model)
        else:
            self.ema(self.model)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


class LogsNorm(WithEma):
    def on_train_batch_end(self, *args: Any) -> None:
        """No EMA update here: this module reads the weights in ``on_before_optimizer_step`` instead."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        strategy = self.trainer.strategy
        with strategy.gathered_params() if self.recipe else torch.no_grad():  # type: ignore[attr-defined]
            self.log("w_norm", self.model[0].weight.norm())


class ThroughData(WithEma):
    """The same EMA written through ``p.data`` (the classic form), or a dead-unit restart writing rows of
    a weight through ``p.data[rows] = v``: before, NaN (the EMA, then the model) or a lost write."""

    def __init__(self, *, write: bool) -> None:
        super().__init__(recipe=False)
        self.write = write

    @torch.no_grad()
    def on_train_batch_end(self, *args: Any) -> None:
        weight = self.model[0].weight
        if self.write:
            weight.data[[0, 3]] = 0.5
        else:
            self.ema.get_buffer("0_weight").mul_(0.9).add_(weight.data, alpha=0.1)


def _fit(
    make: Callable[[], pl.LightningModule], strategy: Any, precision: str, ckpt_dir: Path | None = None
) -> Any:
    torch.manual_seed(0)
    module = make()
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1)] if ckpt_dir else []
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        precision=precision,  # type: ignore[arg-type]
        max_epochs=1,
        logger=False,
        enable_checkpointing=ckpt_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    refused = fit_refused(trainer, module, strategy)
    if refused is not None:
        return {"error": refused, "modes": torch._C._len_torch_function_stack()}
    return {
        "state": final_state(module, strategy),
        "norm": trainer.callback_metrics.get("w_norm"),
        "modes": [*module.modes, torch._C._len_torch_function_stack()],  # type: ignore[operator]
    }


def _runs(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    zero3: dict[str, Any] = {"zero_stage": 3, "zero3_units": [Block]}
    ema, fixed_ema = partial(WithEma, recipe=False), partial(WithEma, recipe=True)
    norm, fixed_norm = partial(LogsNorm, recipe=False), partial(LogsNorm, recipe=True)
    out: dict[str, Any] = {
        "refused_ema": _fit(ema, HybridParallelStrategy(**zero3), "32-true"),
        "refused_norm": _fit(norm, HybridParallelStrategy(**zero3), "32-true"),
        "refused_data_ema": _fit(
            partial(ThroughData, write=False), HybridParallelStrategy(**zero3), "32-true"
        ),
        "refused_data_write": _fit(
            partial(ThroughData, write=True), HybridParallelStrategy(**zero3), "32-true"
        ),
        "norm/ddp": _fit(norm, DDPStrategy(), "32-true"),
        "norm/zero3": _fit(fixed_norm, HybridParallelStrategy(**zero3), "32-true"),
    }
    for precision in ("32-true", "bf16-mixed"):
        out[f"ema/ddp/{precision}"] = _fit(fixed_ema, DDPStrategy(), precision)
        ckpt = tmp / f"ckpt-{precision}"
        out[f"ema/zero3/{precision}"] = _fit(fixed_ema, HybridParallelStrategy(**zero3), precision, ckpt)
    out["ema/zero2/bf16-mixed"] = _fit(fixed_ema, HybridParallelStrategy(zero_stage=2), "bf16-mixed")
    return out


def test_reads_between_steps_are_refused_and_the_recipe_equals_ddp(tmp_path: Path) -> None:
    ranks = run_distributed(_runs, WORLD, tmp_path, init_group=False, timeout=300)
    for r, out in enumerate(ranks):
        for key, read in (
            ("refused_ema", "read by 'sub' in on_train_batch_end"),
            ("refused_norm", "read by 'norm' in on_before_optimizer_step"),
            ("refused_data_ema", "read by 'add_' in on_train_batch_end"),
            ("refused_data_write", "written by '__setitem__' in on_train_batch_end"),
        ):
            message = out[key].get("error", "")
            assert "parameter 'model.0.weight' of unit '<root>'" in message, (r, key, out[key])
            assert f"was {read}," in message, (r, key, message)
            assert "gathered_params(writeback=True)" in message, (r, key, message)
            assert out[key]["modes"] == 0, (r, key, out[key])  # the guard's mode left with the failed fit
        for key, result in out.items():
            if "/" in key:  # no mode in the later steps (the guard ended) nor after the fit
                assert "error" not in result, (r, key, result)
                assert len(result["modes"]) == 8 and set(result["modes"]) == {0}, (r, key, result["modes"])
    out = ranks[0]  # consolidated states land on rank 0
    for key in ("ema/zero3/32-true", "ema/zero3/bf16-mixed", "ema/zero2/bf16-mixed"):
        reference = out[f"ema/ddp/{key.rsplit('/', 1)[1]}"]["state"]
        state = out[key]["state"]
        assert state.keys() == reference.keys(), key
        for name, value in reference.items():
            torch.testing.assert_close(state[name], value, msg=f"{key}: {name}")
        torch.manual_seed(0)
        initial = WithEma(recipe=True).ema.get_buffer("0_weight")  # the EMA moved: it follows the weights
        assert not torch.allclose(state["ema.0_weight"], initial), key
    checkpoints = sorted(p.name for p in (tmp_path / "ckpt-32-true").iterdir())
    assert len(checkpoints) == 8, checkpoints  # one per step, the first inside the guarded window
    torch.testing.assert_close(out["norm/zero3"]["norm"], out["norm/ddp"]["norm"])
