"""Checkpoint cost: ``FlashCheckpoint`` vs ``torch.save`` vs Lightning's ``ModelCheckpoint``, same state.

Run (from the repository root)::

    python -m benchmarks.bench_checkpoint             # ~1.2 GB state (MLP 6 x 4096^2 + AdamW), ~5-8 min
    python -m benchmarks.bench_checkpoint --quick     # tiny smoke configuration (used by no test)

What is measured (one process, one torch thread for training, CPU; the training state is the model's
weights plus AdamW's two moments, ``state_bytes`` in the JSON):

* **Blocking time per checkpoint**: the time the training thread spends checkpointing. FlashCheckpoint:
  its call at the step end (capture, small copies, hand-over) plus any wait at the next optimizer step for
  the background copy (the *fence*). ``torch.save``: of Lightning's full checkpoint dict of the same state
  to the same file system (page cache, as ``ModelCheckpoint`` writes it; with ``fsync`` too).
  ``ModelCheckpoint``: its ``_save_checkpoint`` (every ``--every`` steps). The first save of each is
  reported apart (FlashCheckpoint allocates its shared memory then). Target: FlashCheckpoint after the
  first save <= 1/10 of ``torch.save``.
* **Throughput**: mean step time over the measured steps (the saving steps included) with no checkpoint,
  with FlashCheckpoint every ``--every`` steps (persisted to disk every ``--persist`` steps in the
  background), with ``torch.save`` and with ``ModelCheckpoint`` at the same interval. Runs go
  none, flash, torch_save, model_checkpoint, none; the baseline is the mean of both ``none`` runs.
  Target: FlashCheckpoint >= 95% of no checkpointing. Also reported over the steps after the first save
  (``throughput_vs_none_after_first_save``): the steady state, without the one-time allocation of the
  shared-memory buffers that the first snapshot pays.
* **Restart**: a ``torchrun --max-restarts=1`` job with the same model SIGKILLs itself two steps after a
  snapshot; reported are the seconds from the SIGKILL to the new process' start, to the end of the resume
  (``on_train_start``) and to its first completed step, and where it resumed from (memory). The same is
  measured with the shared memory wiped (a replaced node: resume from disk).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PROCESS_START = time.time()

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_par.callbacks import FlashCheckpoint  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Config:
    hidden: int = 4096
    layers: int = 6
    batch: int = 32
    steps: int = 31
    warmup: int = 2
    every: int = 10
    persist: int = 10
    restart: bool = True


class Wide(pl.LightningModule):
    """An MLP of ``layers`` square layers: ~4 x hidden^2 x layers bytes of weights, 3x that with AdamW."""

    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            *(nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(layers))
        )

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-5)


class StepClock(pl.Callback):
    """Wall time between consecutive step ends: everything a step costs, checkpointing included."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last: float | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        now = time.perf_counter()
        assert self._last is not None
        self.times.append(now - self._last)
        self._last = now


class TorchSave(pl.Callback):
    """``torch.save`` of Lightning's checkpoint dict every ``every`` steps (page cache, then with fsync)."""

    def __init__(self, path: Path, every: int) -> None:
        self.path, self.every = path, every
        self.seconds: list[float] = []
        self.seconds_fsync: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step % self.every:
            return
        start = time.perf_counter()
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        torch.save(checkpoint, self.path)
        self.seconds.append(time.perf_counter() - start)
        start = time.perf_counter()
        with open(self.path, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        self.seconds_fsync.append(time.perf_counter() - start)


class TimedModelCheckpoint(ModelCheckpoint):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seconds: list[float] = []

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        start = time.perf_counter()
        super()._save_checkpoint(trainer, filepath)
        self.seconds.append(time.perf_counter() - start)


def _fit(cfg: Config, callbacks: list[pl.Callback], steps: int | None = None) -> pl.Trainer:
    torch.manual_seed(0)
    steps = steps or cfg.steps
    x = torch.randn(cfg.batch * steps, cfg.hidden)
    data = DataLoader(TensorDataset(x, x.roll(1, dims=1)), batch_size=cfg.batch)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    trainer.fit(Wide(cfg.hidden, cfg.layers), data)
    return trainer


def _state_bytes(cfg: Config) -> int:
    params = cfg.layers * (cfg.hidden * cfg.hidden + cfg.hidden)
    return params * 4 * 3  # weights + AdamW exp_avg + exp_avg_sq (fp32)


def _mean(values: list[float], cfg: Config) -> float:
    return statistics.fmean(values[cfg.warmup :])


def throughput_after_first_save(clocks: dict[str, list[list[float]]], every: int) -> dict[str, float]:
    """Throughput relative to no checkpointing over the steps after the first save and the step after it
    (step index ``every + 1`` on): the steady state, without the one-time allocation of the first save."""
    lo = every + 1

    def mean(times: list[list[float]]) -> float:
        return statistics.fmean(statistics.fmean(t[lo:]) for t in times)

    baseline = mean(clocks["none"])
    return {name: baseline / mean(ts) for name, ts in clocks.items() if name != "none"}


def run_blocking(cfg: Config, root: Path) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    clocks: dict[str, list[list[float]]] = {}

    def timed(name: str, extra: list[pl.Callback]) -> list[pl.Callback]:
        clock = StepClock()
        clocks.setdefault(name, []).append(clock.times)
        return [*extra, clock]  # the clock last: it sees the time spent in the checkpoint callbacks

    _fit(cfg, timed("none", []))
    print(f"none: {_mean(clocks['none'][0], cfg):.3f} s/step", flush=True)
    shm = Path("/dev/shm") / f"bench_checkpoint_{uuid.uuid4().hex[:8]}"
    flash = FlashCheckpoint(
        root / "flash", every_n_steps=cfg.every, persist_every_n_steps=cfg.persist, shm_dir=shm
    )
    _fit(cfg, timed("flash", [flash]))
    blocking = [s["capture_s"] + s["fence_wait_s"] for s in flash.stats]
    runs["flash"] = {
        "blocking_s": blocking,
        "capture_s": [s["capture_s"] for s in flash.stats],
        "fence_wait_s": [s["fence_wait_s"] for s in flash.stats],
        "background_copy_s": [s.get("copy_s") for s in flash.stats],
        "snapshot_bytes": [s["bytes"] for s in flash.stats],
        "persist_errors": flash.errors,
    }
    print(f"flash: blocking {blocking}", flush=True)
    saver = TorchSave(root / "torch_save.ckpt", cfg.every)
    _fit(cfg, timed("torch_save", [saver]))
    runs["torch_save"] = {"blocking_s": saver.seconds, "blocking_fsync_s": saver.seconds_fsync}
    print(f"torch.save: {saver.seconds} (fsync {saver.seconds_fsync})", flush=True)
    ckpt = TimedModelCheckpoint(dirpath=root / "lightning", every_n_train_steps=cfg.every, save_top_k=-1)
    _fit(cfg, timed("model_checkpoint", [ckpt]))
    runs["model_checkpoint"] = {"blocking_s": ckpt.seconds}
    print(f"ModelCheckpoint: {ckpt.seconds}", flush=True)
    _fit(cfg, timed("none", []))
    shutil.rmtree(shm, ignore_errors=True)

    baseline = statistics.fmean(_mean(t, cfg) for t in clocks["none"])
    step_time = {name: statistics.fmean(_mean(t, cfg) for t in ts) for name, ts in clocks.items()}
    later = statistics.fmean(blocking[1:]) if len(blocking) > 1 else float("nan")
    torch_save = statistics.fmean(saver.seconds[1:] or saver.seconds)
    return {
        "runs": runs,
        "step_times_s": clocks,
        "mean_step_s": step_time,
        "summary": {
            "flash_first_blocking_s": blocking[0],
            "flash_blocking_after_first_s": later,
            "torch_save_s": torch_save,
            "torch_save_fsync_s": statistics.fmean(saver.seconds_fsync[1:] or saver.seconds_fsync),
            "model_checkpoint_s": statistics.fmean(ckpt.seconds[1:] or ckpt.seconds),
            "flash_over_torch_save": later / torch_save,
            "target_flash_over_torch_save": 0.1,
            "throughput_vs_none": {name: baseline / t for name, t in step_time.items() if name != "none"},
            "throughput_vs_none_after_first_save": throughput_after_first_save(clocks, cfg.every),
            "target_flash_throughput": 0.95,
        },
    }


# ------------------------------------------------------------------------------------------ restart
def job(path: str) -> None:
    """One torchrun worker of the restart measurement (see the module docstring)."""
    spec = json.loads(Path(path).read_text())
    cfg, out = Config(**spec["config"]), Path(spec["out"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    if attempt in spec["wipe_shm_attempts"]:
        shutil.rmtree(spec["shm_dir"], ignore_errors=True)
    flash = FlashCheckpoint(
        out / "flash", every_n_steps=cfg.every, persist_every_n_steps=cfg.persist, shm_dir=spec["shm_dir"]
    )

    class Probe(pl.Callback):
        first: float | None = None
        resumed_at: float | None = None

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.resumed_at = time.time()

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if self.first is None:
                self.first = time.time()
                record = {
                    "process_start": PROCESS_START,
                    "resume_done": self.resumed_at,
                    "first_step": self.first,
                }
                record["resumed"] = flash.resumed
                (out / f"attempt{attempt}.json").write_text(json.dumps(record))
            if attempt < len(spec["kill_steps"]) and trainer.global_step == spec["kill_steps"][attempt]:
                # the disk copy of the newest snapshot must exist for the wiped-memory attempt to find it
                flash.flush()
                (out / f"kill{attempt}.json").write_text(json.dumps({"time": time.time()}))
                os.kill(os.getpid(), signal.SIGKILL)

    _fit(cfg, [flash, Probe()], steps=spec["steps"])


def run_restart(cfg: Config, root: Path) -> dict[str, Any]:
    out = root / "restart"
    out.mkdir(parents=True)
    shm = Path("/dev/shm") / f"bench_restart_{uuid.uuid4().hex[:8]}"
    spec = {
        "config": asdict(cfg),
        "out": str(out),
        "shm_dir": str(shm),
        "steps": 2 * cfg.every + 6,
        "kill_steps": [cfg.every + 2, 2 * cfg.every + 2],  # attempt 0 and 1 (the latter with shm wiped)
        "wipe_shm_attempts": [2],
    }
    (root / "restart.json").write_text(json.dumps(spec))
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    cmd += ["--max-restarts=2", "--monitor-interval=0.1", __file__, "job", str(root / "restart.json")]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    if done.returncode != 0:
        raise RuntimeError(f"the restart job failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = {}
    for attempt, source in ((1, "memory"), (2, "disk")):
        kill = json.loads((out / f"kill{attempt - 1}.json").read_text())["time"]
        rec = json.loads((out / f"attempt{attempt}.json").read_text())
        result[f"from_{source}"] = {
            "resumed_step": rec["resumed"]["step"],
            "sources": rec["resumed"]["sources"],
            "kill_to_process_start_s": rec["process_start"] - kill,
            "kill_to_resume_done_s": rec["resume_done"] - kill,
            "kill_to_first_step_s": rec["first_step"] - kill,
        }
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["job"]:
        job(argv[1])
        return {}
    from benchmarks.common import environment, write_result

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny configuration (seconds)")
    parser.add_argument("--no-restart", action="store_true", help="skip the torchrun restart measurement")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/checkpoint.json)")
    for name, value in asdict(Config()).items():
        if isinstance(value, int) and not isinstance(value, bool):
            parser.add_argument(f"--{name}", type=int, default=None)
    args = parser.parse_args(argv)
    cfg = Config(hidden=256, layers=2, batch=8, steps=13, every=4, persist=4) if args.quick else Config()
    for name in asdict(cfg):
        if getattr(args, name, None) is not None:
            setattr(cfg, name, getattr(args, name))
    cfg.restart = not args.no_restart
    torch.set_num_threads(1)
    print(f"state: {_state_bytes(cfg) / 1e9:.2f} GB; config {asdict(cfg)}", flush=True)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        payload = {
            "environment": environment(threads_per_rank=1, world_size=1),
            "config": asdict(cfg),
            "state_bytes": _state_bytes(cfg),
            "blocking_and_throughput": run_blocking(cfg, Path(tmp)),
        }
        if cfg.restart:
            payload["restart"] = run_restart(cfg, Path(tmp))
    path = write_result("checkpoint", payload, args.out)
    print(json.dumps(payload["blocking_and_throughput"]["summary"], indent=2))
    if "restart" in payload:
        print(json.dumps(payload["restart"], indent=2))
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
