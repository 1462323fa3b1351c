"""GPU check: one CUDA device, world size 1 (NCCL); ``--device cpu`` runs every part on Gloo.

``python -m benchmarks.gpu_check --out-dir DIR`` (what ``benchmarks/gpu_check.sh`` runs) does, in order:

1. the correctness matrix: ZeRO 0-3 x 32-true / bf16-mixed / 16-mixed x token-exact loss off/on, with
   Lightning's own single-device Trainer as a reference (``benchmarks/gpu_check_correctness.py``);
2. meta init at ZeRO-3 on the device (``benchmarks/gpu_check_meta.py``);
3. FlashCheckpoint: a run SIGKILLed after step 5, resumed, equal to an uninterrupted one; snapshot
   timings (``benchmarks/gpu_check_flash.py``);
4. NodeHealthCheck once (``benchmarks/gpu_check_meta.py``);
5. throughput: our strategy (ZeRO-2, bf16-mixed, fused AdamW) against Lightning's own single-device
   bf16-mixed on a GPT of ~300M parameters, each in its own process so peak memory is per
   implementation: tokens/s over the steps after ``--warmup`` (batch * seq * steps / seconds), MFU =
   6 N tokens/s / ``--peak-tflops`` (H200 dense bf16: 989), peak CUDA memory
   (``torch.cuda.max_memory_allocated``; on CPU peak RSS and no MFU);
6. gradient compression on the device: PowerSGD at ZeRO 0/1, the bf16 reduce-scatter at ZeRO-2, ZeRO-3
   with the bf16 reduction and int8 parameter gathers, against the uncompressed run
   (``benchmarks/gpu_check_compress.py``; counted in the budget of parts 1-4);
7. models this package did not write: a Hugging Face Llama with a PEFT LoRA adapter at ZeRO 0-3 (fit,
   test, ``generate()`` inside ``gathered_params``), a Hugging Face ResNet (BatchNorm) at ZeRO-2/3, a
   Fabric loop at ZeRO-3, each against Lightning's own single-device run (``benchmarks/gpu_check_models.py``;
   counted in the budget of parts 1-4).

Part 5 runs last, so that a run cut short by its time limit has every correctness result.

Results: ``DIR/gpu_check.json`` (every part, the failures, the timings; rewritten after each part),
``DIR/gpu_ours.json``, ``DIR/gpu_lightning.json``, ``DIR/gpu_compare.json``. The exit status is 1 if any
check failed. ``--quick`` shrinks every model (the CPU test); ``--parts 1,5`` runs some parts only.
The single throughput runs stay available: ``--impl ours|lightning --out FILE``, ``--compare A B``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from benchmarks.gpu_check_correctness import child_env
from lightning_par import HybridParallelStrategy
from lightning_par.models import GPTModule

BUDGET_S = {"parts_1_4": 180.0, "part_5": 240.0}  # on one H200
THROUGHPUT = {  # full size (GPT ~355M at vocab 50k; ~300M here with vocab 256), and --quick
    "full": dict(n_layer=24, n_head=16, n_embd=1024, seq=1024, batch=16, vocab=256, steps=30, warmup=5),
    "quick": dict(n_layer=1, n_head=2, n_embd=32, seq=16, batch=4, vocab=64, steps=5, warmup=2),
}
PARTS = {1: "matrix", 2: "meta_init", 3: "flash", 4: "health", 5: "throughput", 6: "compression", 7: "models"}


def quiet() -> None:
    """Lightning's per-fit banners and data-loader hints would bury the progress lines."""
    import logging

    for name in ("lightning.pytorch", "lightning.fabric", "lightning_par"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers|LeafSpec).*")
    warnings.filterwarnings("ignore", category=UserWarning, module="lightning")


# ---------------------------------------------------------------------------------------------- part 5
class Synthetic(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (n, seq + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


class FusedGPT(GPTModule):
    """GPTModule's AdamW groups and schedule, with ``fused=True`` on CUDA (both implementations)."""

    def configure_optimizers(self) -> Any:
        config = super().configure_optimizers()
        if self.trainer.strategy.root_device.type != "cuda":
            return config
        old, schedule = config["optimizer"], config["lr_scheduler"]["scheduler"]
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in old.param_groups]
        fused = torch.optim.AdamW(groups, lr=self.learning_rate, betas=self.betas, fused=True)
        config["optimizer"] = fused
        config["lr_scheduler"]["scheduler"] = torch.optim.lr_scheduler.LambdaLR(fused, schedule.lr_lambdas[0])
        return config


class Timer(pl.Callback):
    def __init__(self, warmup: int, device: str) -> None:
        self.warmup, self.device = warmup, device
        self.start = 0.0
        self.end = 0.0
        self.loss: torch.Tensor | None = None

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            self._sync()
            self.start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *a: Any
    ) -> None:
        self.loss = outputs["loss"].detach() if isinstance(outputs, dict) else None

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._sync()
        self.end = time.perf_counter()


def run(args: argparse.Namespace) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = FusedGPT(
        vocab_size=args.vocab,
        block_size=args.seq,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        max_steps=args.steps,
    )
    model.configure_model()
    n_params = model.gpt.num_parameters()
    strategy: Any = HybridParallelStrategy(zero_stage=args.zero_stage) if args.impl == "ours" else "auto"
    timer = Timer(args.warmup, args.device)
    trainer = pl.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu",
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
    group = trainer.optimizers[0].param_groups[0]
    result: dict[str, Any] = {
        "impl": args.impl,
        "device": args.device,
        "params": n_params,
        "tokens_per_s": tps,
        "seconds": seconds,
        "steps": args.steps - args.warmup,
        "precision": str(trainer.precision_plugin.__class__.__name__),
        "optimizer": type(trainer.optimizers[0]).__name__,
        "fused": bool(group.get("fused")),
        "final_loss": float(timer.loss) if timer.loss is not None else math.nan,
        "config": {k: getattr(args, k) for k in THROUGHPUT["full"]},
    }
    if args.impl == "ours":
        result["zero_stage"] = args.zero_stage
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["mfu"] = 6 * n_params * tps / (args.peak_tflops * 1e12)
    else:
        result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    # This process exits next: with Gloo groups alive, a group's worker thread can race the interpreter's
    # shutdown and abort it ("terminate called without an active exception", as tests/restart_job.py
    # records; it failed this run once in CI). Destroying the groups joins their threads first.
    if isinstance(strategy, HybridParallelStrategy):
        strategy.destroy_process_groups()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return result


def compare(paths: list[str]) -> dict[str, Any]:
    ours, ref = (json.loads(Path(p).read_text()) for p in paths)
    out = {"ours": ours, "lightning": ref, "throughput_ratio": ours["tokens_per_s"] / ref["tokens_per_s"]}
    if "peak_memory_gib" in ours:
        out["memory_ratio"] = ours["peak_memory_gib"] / ref["peak_memory_gib"]
    if "mfu" in ours:
        out["mfu"] = {"ours": ours["mfu"], "lightning": ref["mfu"]}
    return out


def part_throughput(args: argparse.Namespace, out_dir: Path, fail: Any, log: Any) -> dict[str, Any]:
    sizes = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in THROUGHPUT["full"]]
    common = [*sizes, f"--device={args.device}", f"--peak-tflops={args.peak_tflops}"]
    common.append(f"--zero-stage={args.zero_stage}")
    paths = {}
    for impl in ("lightning", "ours"):
        paths[impl] = out_dir / f"gpu_{impl}.json"
        start = time.perf_counter()
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.gpu_check",
                "--impl",
                impl,
                "--out",
                str(paths[impl]),
                *common,
            ],
            env=child_env(deterministic=False),
            capture_output=True,
            text=True,
            timeout=args.throughput_timeout,
        )
        if done.returncode != 0 or not paths[impl].exists():
            fail(f"throughput {impl}: exit {done.returncode}: {done.stderr[-3000:]}")
            return {}
        r = json.loads(paths[impl].read_text())
        peak = r.get("peak_memory_gib", r.get("peak_rss_gib"))
        log(
            f"  {impl}: {r['tokens_per_s']:.0f} tokens/s, loss {r['final_loss']:.3f}, mfu {r.get('mfu')},"
            f" peak {peak:.2f} GiB ({time.perf_counter() - start:.0f} s)"
        )
        if not (r["tokens_per_s"] > 0 and math.isfinite(r["final_loss"])):
            fail(f"throughput {impl}: tokens/s {r['tokens_per_s']}, final loss {r['final_loss']}")
        if args.device == "cuda" and not (r["fused"] and r["optimizer"] == "AdamW"):
            fail(f"throughput {impl}: optimizer {r['optimizer']} fused={r['fused']}, expected fused AdamW")
    result = compare([str(paths["ours"]), str(paths["lightning"])])
    (out_dir / "gpu_compare.json").write_text(json.dumps(result, indent=2))
    if (
        result["ours"]["precision"] != "ParallelPrecision"
        or result["lightning"]["precision"] != "MixedPrecision"
    ):
        fail(
            f"throughput: precision plugins {result['ours']['precision']}, {result['lightning']['precision']}"
        )
    return result


# ---------------------------------------------------------------------------------------------- driver
def environment(device: str) -> dict[str, Any]:
    import lightning

    env: dict[str, Any] = {
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "python": platform.python_version(),
        "device": device,
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "hydra_loaded": "hydra" in sys.modules and sys.modules["hydra"] is not None,
    }
    if device == "cuda":
        env.update(
            gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda, nccl=str(torch.cuda.nccl.version())
        )
    return env


def check_all(args: argparse.Namespace) -> int:
    from benchmarks import gpu_check_correctness as corr
    from benchmarks.gpu_check_compress import part_compress
    from benchmarks.gpu_check_flash import part_flash
    from benchmarks.gpu_check_meta import part_health, part_meta
    from benchmarks.gpu_check_models import part_models

    if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:  # before cuBLAS starts: deterministic cuBLAS
        os.environ.update(CUBLAS_WORKSPACE_CONFIG=":4096:8", GPU_CHECK_SET_CUBLAS="1")
    quiet()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = corr.QUICK if args.quick else corr.FULL
    parts = sorted({int(p) for p in args.parts.split(",")}, key=lambda n: (n == 5, n))  # throughput last
    failures: list[str] = []
    summary: dict[str, Any] = {
        "env": environment(args.device),
        "quick": args.quick,
        "parts": {},
        "failures": failures,
        "seconds": {},
    }
    begin = time.perf_counter()

    def log(line: str) -> None:
        print(f"[{time.perf_counter() - begin:6.1f} s] {line}", flush=True)

    def fail(message: str) -> None:
        failures.append(message)
        log(f"  FAIL {message}")

    def save() -> None:
        (out_dir / "gpu_check.json").write_text(json.dumps(summary, indent=1, default=str))

    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    root = str(work)
    jobs = {
        1: lambda: corr.part_matrix(sizes, args.device, root, fail, log),
        2: lambda: part_meta(sizes, args.device, root, fail),
        3: lambda: part_flash(args.quick, args.device, work, fail),
        4: lambda: part_health(sizes, args.device, root, fail),
        5: lambda: part_throughput(args, out_dir, fail, log),
        6: lambda: part_compress(sizes, args.device, root, fail),
        7: lambda: part_models(args.quick, args.device, root, fail),
    }
    log(f"GPU check on {args.device} ({'quick' if args.quick else 'full'} sizes), parts {parts} -> {out_dir}")
    try:
        for n in parts:
            log(f"part {n}: {PARTS[n]}")
            start = time.perf_counter()
            try:
                summary["parts"][PARTS[n]] = jobs[n]()
            except Exception as exc:  # the other parts still run; the failure is reported
                fail(f"part {n} ({PARTS[n]}) raised {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            summary["seconds"][PARTS[n]] = time.perf_counter() - start
            log(f"part {n}: {PARTS[n]} done in {summary['seconds'][PARTS[n]]:.1f} s")
            save()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    first = sum(v for k, v in summary["seconds"].items() if k != "throughput")
    summary["seconds"].update(parts_1_4=first, total=time.perf_counter() - begin)
    summary["budget_s"] = BUDGET_S
    if args.device == "cuda":
        for key, seconds in (("parts_1_4", first), ("part_5", summary["seconds"].get("throughput", 0.0))):
            if seconds > BUDGET_S[key]:
                log(f"WARNING: {key} took {seconds:.0f} s, over its budget of {BUDGET_S[key]:.0f} s")
    summary["ok"] = not failures
    save()
    log(f"{'OK' if not failures else f'{len(failures)} FAILURE(S)'}; results in {out_dir / 'gpu_check.json'}")
    return 0 if not failures else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", choices=("ours", "lightning"), default=None, help="one throughput run only")
    p.add_argument("--compare", nargs=2, default=None, help="compare two throughput JSON files")
    p.add_argument("--out", default=None, help="the JSON file of a single throughput run")
    p.add_argument("--out-dir", default=os.environ.get("OUT", "/tmp/gpu_check"))
    p.add_argument("--parts", default="1,2,3,4,5,6,7")
    p.add_argument("--quick", action="store_true", help="tiny models everywhere (the CPU test)")
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--zero-stage", type=int, default=2)
    for key in THROUGHPUT["full"]:
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--throughput-timeout", type=float, default=200.0, help="seconds per throughput run")
    args = p.parse_args(argv)
    for key, value in THROUGHPUT["quick" if args.quick else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not set(args.parts.split(",")) <= {str(n) for n in PARTS}:
        p.error(f"--parts takes a comma-separated subset of {sorted(PARTS)}, got {args.parts!r}")
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}): only later steps are timed")
    if args.compare:
        print(json.dumps(compare(args.compare), indent=2))
        return 0
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if args.impl is None:
        return check_all(args)
    quiet()
    result = run(args)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
