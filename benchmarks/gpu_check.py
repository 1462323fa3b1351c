"""GPU check: our strategy in bf16-mixed against Lightning's own single-device bf16-mixed.

One CUDA device, world size 1 (NCCL). Each implementation runs in its own process (peak memory is a
high-water mark), trains the same GPT on the same synthetic batches for ``--steps`` optimizer steps
and reports, over the steps after ``--warmup``:

* tokens/s = batch * seq * steps / seconds,
* MFU = 6 * N * tokens/s / peak FLOP/s (N = parameters; ``--peak-tflops``, H200 dense bf16: 989),
* peak CUDA memory (``torch.cuda.max_memory_allocated``).

``--device cpu`` runs the same code path on the CPU (Gloo; no MFU, memory from RSS) so the script is
tested without a GPU. Usage (what ``benchmarks/gpu_check.sh`` runs)::

    python -m benchmarks.gpu_check --impl ours --out /tmp/ours.json
    python -m benchmarks.gpu_check --impl lightning --out /tmp/lightning.json
    python -m benchmarks.gpu_check --compare /tmp/ours.json /tmp/lightning.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_par import HybridParallelStrategy
from lightning_par.models import GPTModule


class Synthetic(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (n, seq + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


class Timer(pl.Callback):
    def __init__(self, warmup: int, device: str) -> None:
        self.warmup, self.device = warmup, device
        self.start = 0.0
        self.end = 0.0

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            self._sync()
            self.start = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._sync()
        self.end = time.perf_counter()


def run(args: argparse.Namespace) -> dict[str, Any]:
    pl.seed_everything(0)
    model = GPTModule(
        vocab_size=args.vocab,
        block_size=args.seq,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        max_steps=args.steps,
    )
    model.configure_model()
    n_params = model.gpt.num_parameters()
    accelerator = "gpu" if args.device == "cuda" else "cpu"
    if args.impl == "ours":
        strategy: Any = HybridParallelStrategy(zero_stage=args.zero_stage)
    else:
        strategy = "auto"
    timer = Timer(args.warmup, args.device)
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[timer],
    )
    data = Synthetic(args.batch * args.steps, args.seq, args.vocab)
    trainer.fit(model, DataLoader(data, batch_size=args.batch))
    seconds = timer.end - timer.start
    tokens = args.batch * args.seq * (args.steps - args.warmup)
    tps = tokens / seconds
    result: dict[str, Any] = {
        "impl": args.impl,
        "device": args.device,
        "params": n_params,
        "tokens_per_s": tps,
        "seconds": seconds,
        "steps": args.steps - args.warmup,
        "precision": str(trainer.precision_plugin.__class__.__name__),
    }
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["mfu"] = 6 * n_params * tps / (args.peak_tflops * 1e12)
    else:
        result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return result


def compare(paths: list[str]) -> dict[str, Any]:
    ours, ref = (json.loads(Path(p).read_text()) for p in paths)
    out = {"ours": ours, "lightning": ref, "throughput_ratio": ours["tokens_per_s"] / ref["tokens_per_s"]}
    if "peak_memory_gib" in ours:
        out["memory_ratio"] = ours["peak_memory_gib"] / ref["peak_memory_gib"]
    print(json.dumps(out, indent=2))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", choices=("ours", "lightning"), default="ours")
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--zero-stage", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=24)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--n-embd", type=int, default=1024)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--out", default=None)
    p.add_argument("--compare", nargs=2, default=None)
    args = p.parse_args(argv)
    if args.compare:
        return compare(args.compare)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    result = run(args)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
