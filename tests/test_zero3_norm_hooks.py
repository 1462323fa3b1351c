"""Weight reparametrizations at ZeRO-3, on 2 Gloo ranks, against Lightning's ``"ddp"``.

``torch.nn.utils.weight_norm`` (the hook-based form that vocoders and audio codecs still use) computes
``weight = g * v / ||v||`` in a forward pre-hook of the module, from the parameters ``weight_g`` and
``weight_v``. ZeRO-3 gathers a unit's parameters in a forward pre-hook of its own; registered after the
model's, it ran second, so ``weight_norm`` read the NaN placeholders and training went NaN without an
error. The gathers now run before a module's own pre-hooks.

A model with weight-normed linear layers that are units themselves (children of an ``nn.ModuleList``) and
a weight-normed convolution held by the root unit and called outside the root's ``forward`` trains at
ZeRO-3 to the weights ``"ddp"`` reaches, and the convolution called in ``on_train_epoch_end``, outside any
step (the root's borrow hook gathers it), gives ``"ddp"``'s output; for the hook-based form and for the
parametrization forms (``parametrizations.weight_norm`` and ``spectral_norm``, which read their
parameters inside the module's forward and worked before).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state

WORLD, MICRO, N = 2, 4, 32
KINDS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "weight_norm": torch.nn.utils.weight_norm,
    "parametrizations.weight_norm": torch.nn.utils.parametrizations.weight_norm,
    "parametrizations.spectral_norm": torch.nn.utils.parametrizations.spectral_norm,
}


class Normed(pl.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        norm = KINDS[kind]
        self.layers = nn.ModuleList([norm(nn.Linear(8, 8)) for _ in range(2)])  # ZeRO-3 units
        self.conv = norm(nn.Conv1d(1, 2, 3, padding=1))  # in the root unit
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        for layer in self.layers:
            x = torch.tanh(layer(x))
        x = self.conv(x.unsqueeze(1)).flatten(1)
        return F.mse_loss(self.head(x).squeeze(-1), y)

    def on_train_epoch_end(self) -> None:
        # a call outside any step (as generate() in a hook): the root unit is borrowed for it
        with torch.no_grad():
            self.probe = self.conv(torch.linspace(-1, 1, 8).view(1, 1, 8)).clone()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _fit(kind: str, strategy: Any) -> dict[str, Tensor]:
    module = Normed(kind)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(N, 8, generator=g), torch.randn(N, generator=g))
    trainer = cpu_trainer(strategy, max_epochs=1)
    trainer.fit(module, DataLoader(data, batch_size=MICRO))
    return {**final_state(module, strategy), "probe": module.probe}


def _runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {
        kind: {"ddp": _fit(kind, "ddp"), "zero3": _fit(kind, HybridParallelStrategy(zero_stage=3))}
        for kind in KINDS
    }


def test_weight_norm_hooks_see_gathered_parameters_at_zero3() -> None:
    out = run_distributed(_runs, WORLD, init_group=False, timeout=300)[0]
    for kind, runs in out.items():
        reference, zero3 = runs["ddp"], runs["zero3"]
        assert zero3.keys() == reference.keys(), kind
        initial = Normed(kind).state_dict()
        for key, value in reference.items():
            assert torch.isfinite(zero3[key]).all(), f"{kind} {key}"
            torch.testing.assert_close(zero3[key], value, msg=lambda m, k=key, n=kind: f"{n} {k}: {m}")
        moved = max(float((reference[k] - initial[k]).abs().max()) for k in reference if k in initial)
        assert moved > 1e-3, kind  # training changed the weights
