"""Hydra multirun over multi-process jobs: a 2 x 2 sweep through the console script, each job with its
own 2 ranks and folder, the metrics of all four in the sweep summary; a job with an invalid value fails
with its message while the others finish."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path


def _command() -> list[str]:
    script = shutil.which("lightning-par-train")
    return [script] if script else [sys.executable, "-m", "lightning_par.train"]


def test_sweep_of_strategies_and_precisions(tmp_path: Path) -> None:
    """examples/sweep.sh: 2 strategies x 2 precisions through the console script."""
    sweep = tmp_path / "sweep"
    script = Path(__file__).resolve().parent.parent / "examples" / "sweep.sh"
    run = subprocess.run(
        ["bash", str(script), "logger=none", f"hydra.sweep.dir={sweep}"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((sweep / "summary.json").read_text())
    assert [r["job"] for r in rows] == [0, 1, 2, 3]
    combos = {
        (r["overrides"].split("strategy=")[1].split()[0], r["overrides"].split("precision=")[1].split()[0])
        for r in rows
    }
    assert combos == {(s, p) for s in ("zero1", "zero2") for p in ("32-true", "bf16-mixed")}
    for r in rows:
        assert r["status"] == "completed" and r["world_size"] == 2 and r["global_step"] == 4
        assert math.isfinite(r["val_loss"])
        assert Path(r["output_dir"]).parent == sweep
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1", "2", "3"]
    assert (sweep / "summary.csv").read_text().count("\n") == 5


def test_sweep_job_with_invalid_value_fails_alone(tmp_path: Path) -> None:
    """In the default sweep directory (``multirun/<task>/<time>``, whose path reads a top-level key of the
    config: before, the summary was never written there, only Hydra's one warning said why)."""
    run = subprocess.run(
        [
            *_command(),
            "-m",
            "experiment=smoke",
            "strategy=zero1",
            "strategy.bucket_size_mb=-1,25",
            "logger=none",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert run.returncode != 0  # Hydra reports the failed job when the sweep ends
    (sweep,) = (tmp_path / "multirun").glob("*/*")
    rows = json.loads((sweep / "summary.json").read_text())
    assert [r["status"] for r in rows] == ["failed", "completed"]
    assert "bucket_size_mb must be > 0" in rows[0]["error"] and "\n" not in rows[0]["error"]
    assert math.isfinite(rows[1]["val_loss"])


FAILING = '''
from lightning_par.models import GPTModule


class FailingGPT(GPTModule):
    """Raises in training_step at step 1 on rank 1 only (a bad sample in that rank's data)."""

    def training_step(self, batch, batch_idx):
        if self.global_step == 1 and self.global_rank == 1:
            raise RuntimeError("user failure on rank 1")
        return super().training_step(batch, batch_idx)
'''


def test_sweep_job_failing_on_one_rank_stops_the_sweep(tmp_path: Path) -> None:
    """A job of a 2-process sweep that raises on rank 1 only: before, rank 1 moved on to the next job while
    rank 0 waited in the failed job's collectives, forever and without a word (Ctrl-C did not end it).
    Now the sweep stops on every rank with the error printed, the next job not started."""
    (tmp_path / "failing_gpt.py").write_text(FAILING)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run(
        [
            *_command(),
            "-m",
            "experiment=smoke",
            "model._target_=failing_gpt.FailingGPT",
            "strategy=zero1",
            "strategy.bucket_size_mb=25,26",
            "logger=none",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert run.returncode != 0
    assert "rank 1: the job failed (RuntimeError: user failure on rank 1)" in run.stderr, run.stderr[-3000:]
    (sweep,) = (tmp_path / "multirun").glob("*/*")
    assert not (sweep / "1").exists()  # the next job never started
    # the failed job has its row (before, the process ended before Hydra's on_job_end wrote one)
    (row,) = json.loads((sweep / "summary.json").read_text())
    assert row["job"] == 0 and row["status"] == "failed", row
    assert (
        "strategy.bucket_size_mb=25" in row["overrides"] and "the sweep stopped at this job" in row["error"]
    )
    (csv_row,) = csv.DictReader((sweep / "summary.csv").open())
    assert csv_row["status"] == "failed" and csv_row["job"] == "0", csv_row
