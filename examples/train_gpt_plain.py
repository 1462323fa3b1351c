"""Plain Python, no Hydra: our strategy in an ordinary Lightning script.

    python examples/train_gpt_plain.py                       # 2 CPU processes, ZeRO-2
    python examples/train_gpt_plain.py --stage 3 --steps 50  # ZeRO-3
    torchrun --nproc-per-node=2 examples/train_gpt_plain.py  # processes started by torchrun

Everything is standard Lightning; only the strategy changes (``strategy="zero2"`` works too, after
``import lightning_par``).
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl

from lightning_par import HybridParallelStrategy
from lightning_par.models import GPTModule, StdlibCorpusDataModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=64)
    args = parser.parse_args()

    pl.seed_everything(1234)
    model = GPTModule(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4, block_size=64)
    data = StdlibCorpusDataModule(block_size=64, batch_size=8, max_bytes=200_000)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=HybridParallelStrategy(zero_stage=args.stage),
        max_steps=args.steps,
        val_check_interval=max(1, args.steps // 2),
        limit_val_batches=4,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        print(f"final val_loss={float(trainer.callback_metrics['val_loss']):.4f}")


if __name__ == "__main__":
    main()
