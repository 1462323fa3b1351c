"""The cost of peer replicas: ``FlashCheckpoint(replicas=1)`` against snapshots without replicas and
against no checkpointing, on two simulated nodes.

Run (from the repository root)::

    python -m benchmarks.bench_replica            # MLP 4 x 1024^2 + AdamW (~50 MB per rank), ~3 min
    python -m benchmarks.bench_replica --quick    # tiny smoke configuration (used by no test)

Each mode is one ``torchrun`` job of two agents (one rank each, c10d rendezvous through the
``lightning_par`` backend, separate shared memory per "node"), our ZeRO-2 strategy, one torch thread per
rank, a snapshot every ``--every`` steps (not persisted within the run). Modes run none, flash,
flash_replicas, none; the baseline is the mean of both ``none`` runs. Reported per mode: the mean step
time after ``--warmup`` steps and its ratio to the baseline, and for replicas the bytes each rank sent
per snapshot and the seconds each exchange took (in the background, on a Gloo group of its own). On this
2-core machine the replica thread competes with training for the same cores; on real nodes it mostly
waits on the network.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.bench_checkpoint import StepClock, Wide
from benchmarks.common import free_port

REPO = Path(__file__).resolve().parent.parent
MODES = ("none", "flash", "flash_replicas", "none")


@dataclass
class Config:
    hidden: int = 1024
    layers: int = 4
    batch: int = 16
    steps: int = 60
    warmup: int = 10
    every: int = 5


def job(path: str) -> None:
    """One torchrun worker: train ``steps`` steps in the given mode, write the step times and stats."""
    spec = json.loads(Path(path).read_text())
    cfg, out, mode = Config(**spec["config"]), Path(spec["out"]), spec["mode"]
    torch.set_num_threads(1)
    callbacks: list[pl.Callback] = [clock := StepClock()]
    flash = None
    if mode != "none":
        from lightning_par.callbacks import FlashCheckpoint

        flash = FlashCheckpoint(
            out / "flash",
            every_n_steps=cfg.every,
            persist_every_n_steps=10 * cfg.steps,  # memory only: the replica is what is measured
            shm_dir=os.environ["BENCH_SHM_DIR"],
            replicas=1 if mode == "flash_replicas" else 0,
            flush_on_exit=False,
        )
        callbacks.append(flash)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(cfg.batch * 8, cfg.hidden), torch.randn(cfg.batch * 8, cfg.hidden))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=2,
        strategy="zero2",
        max_steps=cfg.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(Wide(cfg.hidden, cfg.layers), DataLoader(data, batch_size=cfg.batch))
    record = {
        "times": clock.times,
        "replica": flash.store.replica_stats if flash else [],
        "snapshots": len(flash.stats) if flash else 0,
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record, default=str))


def run_mode(cfg: Config, mode: str, root: Path) -> list[dict[str, Any]]:
    out = root / f"{mode}_{uuid.uuid4().hex[:6]}"
    out.mkdir(parents=True)
    spec = root / f"{out.name}.json"
    spec.write_text(json.dumps({"config": asdict(cfg), "out": str(out), "mode": mode}))
    shm = Path("/dev/shm") / f"bench_replica_{uuid.uuid4().hex[:8]}"
    port = free_port()
    procs = []
    try:
        for node, host in (("A", True), ("B", False)):
            env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
            env["BENCH_SHM_DIR"] = str(shm / node)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
            cmd += ["--rdzv-backend=lightning_par", f"--rdzv-endpoint=127.0.0.1:{port}"]
            cmd += [f"--rdzv-id=bench-{port}", f"--rdzv-conf=is_host={str(host).lower()}"]
            cmd += [__file__, "job", str(spec)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        logs = [p.communicate(timeout=900)[0].decode(errors="replace") for p in procs]
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    if any(p.returncode for p in procs):
        raise RuntimeError(f"the {mode} job failed:\n" + "\n".join(log[-3000:] for log in logs))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def summarize(cfg: Config, runs: list[tuple[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    def step_s(ranks: list[dict[str, Any]]) -> float:
        # the slower rank sets the pace of a synchronous job
        return max(statistics.mean(r["times"][cfg.warmup :]) for r in ranks)

    base = statistics.mean(step_s(r) for m, r in runs if m == "none")
    modes: dict[str, Any] = {}
    for mode, ranks in runs:
        if mode == "none":
            modes.setdefault("none", []).append(step_s(ranks))
            continue
        entry: dict[str, Any] = {"step_s": step_s(ranks), "throughput_vs_none": base / step_s(ranks)}
        stats = [s for r in ranks for s in r["replica"]]
        if stats:
            entry["replica_bytes_sent_per_snapshot"] = statistics.mean(s["bytes_sent"] for s in stats)
            entry["replica_exchange_s"] = statistics.mean(s["seconds"] for s in stats)
            entry["replica_errors"] = [s["error"] for s in stats if s["error"]]
            entry["snapshots_replicated"] = len(stats) // 2
        modes[mode] = entry
    return {"baseline_step_s": base, "modes": modes}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["job"]:
        job(argv[1])
        return {}
    from benchmarks.common import environment, write_result

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny smoke configuration")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/replica.json)")
    ns = parser.parse_args(argv)
    cfg = Config(hidden=128, layers=2, steps=20, warmup=4, every=5) if ns.quick else Config()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [(mode, run_mode(cfg, mode, Path(tmp))) for mode in MODES]
    state_mb = 3 * 4 * cfg.layers * (cfg.hidden * cfg.hidden + cfg.hidden) / 2**20
    payload = {
        "benchmark": "replica",
        "config": asdict(cfg),
        "state_mib_per_model": state_mb,
        **summarize(cfg, runs),
        "environment": environment(threads_per_rank=1, world_size=2),
    }
    path = write_result("replica" if not ns.quick else "replica_quick", payload, ns.out)
    print(json.dumps(payload["modes"], indent=1))
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
