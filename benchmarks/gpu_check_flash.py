"""GPU check, part 3: a FlashCheckpoint run SIGKILLed mid-epoch, resumed, and compared.

1. A child process (``python -m benchmarks.gpu_check_flash CFG.json``) trains ``STEPS`` optimizer steps
   of the package's GPT (AdamW, warmup-cosine schedule) at ZeRO-3 in ``bf16-mixed`` with
   ``FlashCheckpoint(every_n_steps=2, persist_every_n_steps=4)``, writes its snapshot timings and then
   SIGKILLs itself after step ``KILL_AFTER`` (5). The newest complete snapshot is then step 4: the fence
   before step 5's optimizer step waited for its copy. An epoch is 6 steps, so the resume lands
   mid-epoch and crosses an epoch boundary.
2. The same run again with ``auto_resume``: it must resume step 4 (from shared memory) and finish.
3. The same run without FlashCheckpoint, never interrupted: the resumed run's final weights (fp32
   masters, consolidated) must equal it. On CUDA all three runs use deterministic kernels (the math SDPA
   backend, ``torch.use_deterministic_algorithms``), so the equality is bitwise in practice; it is
   asserted to 1e-6 and reported exactly.

Timing per snapshot (``FlashCheckpoint.stats``): ``blocked_s`` is what the training thread waited
(``capture_s``: the state's layout and the small copies; ``fence_wait_s``: the wait before the next
optimizer step for the device-to-host copy still running), ``copy_s`` the device-to-host copy itself
(the copy thread: pinned buffers, a side stream), overlapped with the next step's forward and backward.
The first snapshot of a process also allocates its shared-memory slot.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from benchmarks.gpu_check_correctness import (
    FULL,
    QUICK,
    SEED,
    Sizes,
    Tokens,
    child_env,
    deterministic,
    max_diff,
    trainer,
)
from lightning_par import HybridParallelStrategy
from lightning_par.callbacks import FlashCheckpoint
from lightning_par.models import GPTModule

STEPS, EVERY, PERSIST, KILL_AFTER, EPOCH = 8, 2, 4, 5, 6
STAGE, PRECISION = 3, "bf16-mixed"
CHILD_TIMEOUT_S = 150.0  # the killed run takes ~20 s on one H200; a hang must not eat the budget


class Final(pl.Callback):
    def __init__(self) -> None:
        self.state: dict[str, Tensor] = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.state = trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]


class KillAfter(pl.Callback):
    """Writes the snapshot timings so far, then SIGKILLs this process after optimizer step ``step``."""

    def __init__(self, step: int, flash: FlashCheckpoint, marker: Path) -> None:
        self.step, self.flash, self.marker = step, flash, marker

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            record = {"step": trainer.global_step, "pid": os.getpid(), "stats": self.flash.stats}
            self.marker.write_text(json.dumps(record, default=str))
            os.kill(os.getpid(), signal.SIGKILL)


def _flash(cfg: dict[str, Any]) -> FlashCheckpoint:
    return FlashCheckpoint(
        cfg["dir"],
        every_n_steps=EVERY,
        persist_every_n_steps=PERSIST,
        shm_dir=cfg["shm"],
        flush_timeout_s=30.0,
    )


def train(cfg: dict[str, Any], callbacks: list[pl.Callback]) -> dict[str, Any]:
    """One run of the flash job (the same in the child, the resumed run and the reference)."""
    sizes: Sizes = QUICK if cfg["quick"] else FULL
    model = sizes.flash_model
    pl.seed_everything(SEED, verbose=False)
    module = GPTModule(**model.kwargs(), learning_rate=1e-3, warmup_steps=2, max_steps=STEPS)
    module.configure_model()
    final = Final()
    t = trainer(
        cfg["device"],
        HybridParallelStrategy(zero_stage=STAGE),
        PRECISION,
        STEPS,
        1,
        [*callbacks, final],
        default_root_dir=cfg["dir"],
    )
    data = DataLoader(Tokens(sizes.flash_micro * EPOCH, model), batch_size=sizes.flash_micro, shuffle=False)
    start = time.perf_counter()
    with deterministic(cfg["device"]):
        t.fit(module, data)
    return {"state": final.state, "seconds": time.perf_counter() - start, "global_step": t.global_step}


def timings(stats: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in stats:
        blocked = float(r.get("capture_s", 0.0)) + float(r.get("fence_wait_s", 0.0))
        copy = r.get("copy_s")
        out.append(
            {
                **{k: r[k] for k in ("step", "bytes", "persist") if k in r},
                "blocked_s": blocked,
                "capture_s": r.get("capture_s"),
                "fence_wait_s": r.get("fence_wait_s"),
                "copy_s": copy,
                "copy_gb_per_s": r["bytes"] / copy / 1e9 if copy else None,
            }
        )
    return out


def shm_root(work: Path) -> Path:
    base = Path("/dev/shm")
    return base / f"gpu_check_{os.getpid()}" if base.is_dir() else work / "shm"


def part_flash(quick: bool, device: str, work: Path, fail: Callable[[str], None]) -> dict[str, Any]:
    shm = shm_root(work)
    cfg = {"quick": quick, "device": device, "dir": str(work / "flash"), "shm": str(shm)}
    cfg_path, marker = work / "flash_cfg.json", work / "flash_killed.json"
    cfg_path.write_text(json.dumps({**cfg, "marker": str(marker)}))
    try:
        start = time.perf_counter()
        child = subprocess.run(
            [sys.executable, "-m", "benchmarks.gpu_check_flash", str(cfg_path)],
            env=child_env(deterministic=True),
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
        )
        child_s = time.perf_counter() - start
        if child.returncode != -signal.SIGKILL or not marker.exists():
            fail(f"flash: the child exited with {child.returncode}, not SIGKILL: {child.stderr[-3000:]}")
            return {"child_returncode": child.returncode}
        killed = json.loads(marker.read_text())
        flash = _flash(cfg)
        resumed = train(cfg, [flash])
        reference = train(cfg, [])
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    diff = max_diff(resumed["state"], reference["state"])
    bitwise = all(torch.equal(resumed["state"][k], reference["state"][k]) for k in reference["state"])
    expected = KILL_AFTER - KILL_AFTER % EVERY
    out = {
        "stage": STAGE,
        "precision": PRECISION,
        "steps": STEPS,
        "killed_after_step": killed["step"],
        "child_returncode": child.returncode,
        "child_seconds": child_s,
        "resumed": flash.resumed,
        "resumed_final_step": resumed["global_step"],
        "final_max_abs_diff_vs_uninterrupted": diff,
        "final_bitwise_equal": bitwise,
        "persist_errors": flash.errors,
        "snapshots_before_kill": timings(killed["stats"]),
        "snapshots_after_resume": timings(flash.stats),
        "shm_free_gib": shutil.disk_usage(shm.parent).free / 2**30 if shm.parent.is_dir() else None,
        "resumed_seconds": resumed["seconds"],
        "reference_seconds": reference["seconds"],
    }
    later = [r["blocked_s"] for r in out["snapshots_before_kill"][1:] + out["snapshots_after_resume"][1:]]
    out["median_blocked_s_after_first"] = sorted(later)[len(later) // 2] if later else None
    checks = {
        f"resumed step {expected}": bool(flash.resumed) and flash.resumed.get("step") == expected,
        f"finished at step {STEPS}": resumed["global_step"] == STEPS,
        "final weights == uninterrupted run (1e-6)": diff <= 1e-6,
        "no persist errors": not flash.errors,
        "snapshots were timed": len(killed["stats"]) == KILL_AFTER // EVERY and len(flash.stats) > 0,
    }
    for what, ok in checks.items():
        if not ok:
            fail(f"flash: {what} failed (resumed {flash.resumed}, max|dW| {diff:.3g})")
    out["checks"] = checks
    return out


def child(cfg_path: str) -> None:
    """The run that is killed: FlashCheckpoint, then SIGKILL after step ``KILL_AFTER``."""
    cfg = json.loads(Path(cfg_path).read_text())
    flash = _flash(cfg)
    train(cfg, [flash, KillAfter(KILL_AFTER, flash, Path(cfg["marker"]))])
    raise SystemExit(f"the run was not killed after step {KILL_AFTER}")


if __name__ == "__main__":
    child(sys.argv[1])
