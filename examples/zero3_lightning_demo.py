"""A LightningModule not written for lightning_par (``lightning.pytorch.demos.LightningTransformer``, an
``nn.Transformer`` encoder-decoder) trained under ZeRO-3 with no change to its code.

    python examples/zero3_lightning_demo.py --steps 20

The demo's own ``prepare_data`` downloads WikiText-2; nothing may be downloaded here, so a subclass
replaces only that hook and the data (random token pairs). ZeRO-3's default units are the children of
``nn.ModuleList``s: the encoder and decoder layers.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos.transformer import LightningTransformer
from torch.utils.data import DataLoader, TensorDataset

import lightning_par  # noqa: F401  registers "zero3"

VOCAB = 128


class OfflineTransformer(LightningTransformer):
    def prepare_data(self) -> None:
        """The demo downloads WikiText-2 here; this example brings its own data."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()

    pl.seed_everything(7)
    g = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, VOCAB, (64, 16), generator=g)
    data = DataLoader(TensorDataset(inputs, inputs.roll(-1, dims=1)), batch_size=8, shuffle=True)
    model = OfflineTransformer(vocab_size=VOCAB)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="zero3",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, data)
    if trainer.is_global_zero:
        report = trainer.strategy.memory_report()  # type: ignore[attr-defined]
        print(f"trained {trainer.global_step} steps; parameter bytes on this rank: {report['parameters']}")


if __name__ == "__main__":
    main()
