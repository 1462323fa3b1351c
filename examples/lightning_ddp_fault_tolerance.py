"""Fault tolerance with Lightning's own ``"ddp"`` strategy: our callbacks drop into any Trainer.

    python examples/lightning_ddp_fault_tolerance.py --dirpath /tmp/ft --crash-at-step 13   # fails
    python examples/lightning_ddp_fault_tolerance.py --dirpath /tmp/ft                      # resumes
    torchrun --nproc-per-node=2 --max-restarts=3 examples/lightning_ddp_fault_tolerance.py --dirpath /tmp/ft

The first command trains on 2 CPU processes with a node health check before training, a memory snapshot
every 4 steps (persisted to ``--dirpath`` every 8 in the background), a hang watchdog and a loss guard,
and raises a simulated failure on every rank after step ``--crash-at-step``. The second command, the
same without the crash, finds the newest snapshot complete on both ranks (in ``/dev/shm``, or on disk
after a reboot) and continues from it: the remaining batches come in the same order, so its final
weights equal those of a run that never failed (``--save-final`` writes them, to check).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_par.callbacks import FlashCheckpoint, HangWatchdog, LossGuard, NodeHealthCheck
from lightning_par.models import GPTModule, StdlibCorpusDataModule


class SimulatedFailure(pl.Callback):
    """Raise on every rank once ``global_step`` reaches ``step`` (a crash the restart must survive)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"simulated failure after step {self.step}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dirpath", required=True, help="where snapshots are persisted (resume key)")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--crash-at-step", type=int, default=None)
    parser.add_argument("--save-final", default=None, help="write rank 0's final weights here")
    args = parser.parse_args()

    pl.seed_everything(1234)
    flash = FlashCheckpoint(args.dirpath, every_n_steps=4, persist_every_n_steps=8, keep_last=2)
    callbacks: list[pl.Callback] = [
        NodeHealthCheck(matmul_size=256, bandwidth_mb=4.0, action="warn"),
        flash,
        HangWatchdog(timeout_s=300.0),
        LossGuard(action="skip"),
    ]
    if args.crash_at_step is not None:
        callbacks.append(SimulatedFailure(args.crash_at_step))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp",
        max_steps=args.steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=callbacks,
    )
    model = GPTModule(n_layer=1, n_embd=32, n_head=2, block_size=32, dropout=0.1, max_steps=args.steps)
    data = StdlibCorpusDataModule(block_size=32, batch_size=4, max_bytes=60_000)
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        resumed = flash.resumed["step"] if flash.resumed else None
        print(f"finished step {trainer.global_step}; resumed from step {resumed}")
        if args.save_final:
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            torch.save(state, Path(args.save_final))


if __name__ == "__main__":
    main()
