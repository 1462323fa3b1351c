"""Hydra sweeps of multi-process jobs: one summary of every job's outcome in the sweep directory.

``lightning-par-train -m strategy=zero1,zero2 precision=32-true,bf16-mixed`` runs the jobs one after the
other, each with its own ranks (CPU: Lightning starts the second process for the first job; that process
runs the same sweep in lockstep, see ``lightning_par/train.py``) and its own output folder
``<sweep dir>/<job number>``. :class:`SweepSummary` (a Hydra callback, configured in
``conf/hydra/default.yaml``) appends each finished or failed job to ``<sweep dir>/summary.json`` and
``summary.csv``: job number, overrides, status, the final metrics of its ``metrics.json``, and the error
of a failed job in one line. A job refused for its configuration does not stop the sweep (Hydra reports
it when the sweep ends); a job failing at run time in a sweep over several processes does (its ranks
cannot go on in step, see ``train._stop_sweep``), and its row is written before the processes end.

Only global rank 0 writes (ranks > 0 run the same sweep).
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0" and os.environ.get("LOCAL_RANK", "0") == "0"


def _sweep_dir(config: DictConfig, job_dir: Path) -> Path:
    """The sweep directory, resolved in the job's whole config: ``hydra.sweep.dir`` reads top-level keys
    (``${task_name}``), which the detached Hydra node of the job's return cannot resolve (before, the
    summary of a sweep with the default directory was never written: an interpolation error that Hydra
    reports as one warning). Falls back to the job directory's parent (the default ``subdir`` is the
    job number)."""
    try:
        resolved = OmegaConf.select(config, "hydra.sweep.dir", throw_on_missing=True)
    except Exception:  # an interpolation that still cannot be resolved
        resolved = None
    return Path(str(resolved)) if resolved is not None else job_dir.parent


class SweepSummary(Callback):
    """Appends one row per job to ``summary.json`` / ``summary.csv`` in the sweep directory."""

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        hydra_cfg = job_return.hydra_cfg.hydra if job_return.hydra_cfg is not None else None
        if hydra_cfg is None or hydra_cfg.mode != RunMode.MULTIRUN or not _is_rank_zero():
            return
        job_dir = Path(str(hydra_cfg.runtime.output_dir))
        sweep_dir = _sweep_dir(config, job_dir)
        row: dict[str, Any] = {
            "job": int(hydra_cfg.job.num),
            "overrides": " ".join(job_return.overrides or []),
            "status": "completed" if job_return.status == JobStatus.COMPLETED else "failed",
            "output_dir": str(job_dir),
        }
        metrics = job_dir / "metrics.json"
        if metrics.is_file():
            row.update(json.loads(metrics.read_text()))
        if job_return.status == JobStatus.FAILED:
            error = job_return._return_value
            row["error"] = " ".join(f"{type(error).__name__}: {error}".split())
        append_row(sweep_dir, row)


def append_row(sweep_dir: Path, row: dict[str, Any]) -> None:
    """Write ``row`` (keyed by its ``job``) into ``summary.json`` / ``summary.csv``, replacing an earlier
    row of the same job."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    summary = sweep_dir / "summary.json"
    rows = json.loads(summary.read_text()) if summary.is_file() else []
    rows = [r for r in rows if r.get("job") != row["job"]] + [row]
    rows.sort(key=lambda r: r["job"])
    summary.write_text(json.dumps(rows, indent=2) + "\n")
    columns = sorted({k for r in rows for k in r}, key=lambda k: (k not in row, k))
    with (sweep_dir / "summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def record_stopped_job(error: BaseException) -> None:
    """On global rank 0: the job that stopped a sweep over several processes (``train._stop_sweep``, which
    ends the process before Hydra's ``on_job_end``), as a failed row; the jobs after it have none."""
    from hydra.core.hydra_config import HydraConfig

    if not _is_rank_zero() or not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    job_dir = Path(str(hydra_cfg.runtime.output_dir))
    text = " ".join(f"{type(error).__name__}: {error}".split())
    try:
        sweep_dir = Path(str(hydra_cfg.sweep.dir))
    except Exception:  # an interpolation the detached node cannot resolve (see _sweep_dir)
        sweep_dir = job_dir.parent
    append_row(
        sweep_dir,
        {
            "job": int(hydra_cfg.job.num),
            "overrides": " ".join(hydra_cfg.overrides.task),
            "status": "failed",
            "output_dir": str(job_dir),
            "error": f"{text} (the sweep stopped at this job; every rank printed its own error)",
        },
    )
