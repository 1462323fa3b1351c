"""Where a training step's time goes: the GPU check's throughput run (part 5: GPT ~300M, bf16-mixed, fused
AdamW, one device) under ``torch.profiler`` for a few steps, ours (ZeRO-2) and Lightning's own
single-device strategy, each in its own process.

``python -m benchmarks.gpu_profile --out-dir DIR`` writes ``DIR/profile_{impl}.txt``: the step time, the
number of kernels (CUDA) or aten operators (CPU) per step, the runtime calls per step that make the host
wait for the device (synchronisations, blocking copies, ``.item()``), the operators that take the most
device time, and those that take the most host time. ``--quick`` shrinks the model (the CPU path).
``--proxy`` keeps the full model's 24 layers at tiny widths: on a CPU the step is then mostly per-operator
host work, so the aten operators per step stand in for the kernel launches a GPU waits for (run it with
``OMP_NUM_THREADS=1``: Lightning's launcher gives our processes cores / processes threads where
``"auto"`` keeps one, which on tiny matrices costs more than the work).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader

from benchmarks.gpu_check import THROUGHPUT, FusedGPT, Synthetic, quiet
from benchmarks.gpu_check_correctness import child_env
from benchmarks.gpu_check_correctness import trainer as make_trainer
from lightning_par import HybridParallelStrategy

WARMUP, PROFILED = 5, 3
PROXY = dict(n_layer=24, n_head=4, n_embd=64, seq=16, batch=2, vocab=256)  # the full depth, tiny widths


class Profiled(pl.Callback):
    """Profiles the optimizer steps ``WARMUP`` .. ``WARMUP + PROFILED - 1``."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.prof: Any = None
        self.start = 0.0
        self.seconds = 0.0

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == WARMUP:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
            self._sync()
            self.prof = profile(activities=activities)
            self.prof.__enter__()
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == WARMUP + PROFILED and self.prof is not None:
            self._sync()
            self.seconds = time.perf_counter() - self.start
            self.prof.__exit__(None, None, None)


def one(impl: str, device: str, quick: bool, out: Path, proxy: bool = False) -> None:
    quiet()
    size = PROXY if proxy else THROUGHPUT["quick" if quick else "full"]
    pl.seed_everything(0, verbose=False)
    model = FusedGPT(
        vocab_size=size["vocab"],
        block_size=size["seq"],
        n_layer=size["n_layer"],
        n_head=size["n_head"],
        n_embd=size["n_embd"],
        max_steps=WARMUP + PROFILED + 1,
    )
    model.configure_model()
    prof = Profiled(device)
    strategy = HybridParallelStrategy(zero_stage=2) if impl == "ours" else "auto"
    trainer = make_trainer(device, strategy, "bf16-mixed", WARMUP + PROFILED + 1, 1, [prof])
    data = Synthetic(size["batch"] * (WARMUP + PROFILED + 1), size["seq"], size["vocab"])
    trainer.fit(model, DataLoader(data, batch_size=size["batch"]))
    events = prof.prof.key_averages()
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    if device == "cuda":
        kernels = sum(
            e.count for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
        )
    else:
        kernels = sum(e.count for e in events if e.key.startswith("aten::"))
    # host waits: runtime calls that block the host until the device catches up (a step without them
    # keeps the GPU fed; with them the queue drains and the next kernels wait for Python)
    waits = {
        e.key: e.count // PROFILED
        for e in events
        if any(w in e.key for w in ("Synchronize", "cudaMemcpy", "_local_scalar_dense", "aten::item"))
    }
    head = (
        f"{impl} on {device}: {prof.seconds / PROFILED * 1e3:.1f} ms per step (profiled),"
        f" {kernels / PROFILED:.0f} {'kernels' if device == 'cuda' else 'aten ops'} per step\n"
        f"host waits per step: {waits or 'none'}\n"
    )
    by_host = events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
    (out / f"profile_{impl}.txt").write_text(
        head
        + events.table(sort_by=sort, row_limit=40, max_name_column_width=60)
        + "\nby host time:\n"
        + by_host
    )
    print(head, end="")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default="/tmp/gpu_profile")
    p.add_argument("--impl", choices=("ours", "lightning"), default=None, help="one run in this process")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--proxy", action="store_true", help="24 layers at tiny widths (host work per operator)")
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    args = p.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.impl:
        one(args.impl, args.device, args.quick, out, args.proxy)
        return 0
    status = 0
    for impl in ("lightning", "ours"):
        cmd = [sys.executable, "-m", "benchmarks.gpu_profile", "--impl", impl, "--out-dir", str(out)]
        cmd += (
            ["--device", args.device]
            + (["--quick"] if args.quick else [])
            + (["--proxy"] if args.proxy else [])
        )
        status |= subprocess.run(cmd, env=child_env(deterministic=False), timeout=240).returncode
    return status


if __name__ == "__main__":
    sys.exit(main())
