"""The GPU check script's CPU path (the same code the GPU run uses), in subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TINY = [
    "--device",
    "cpu",
    "--n-layer",
    "1",
    "--n-embd",
    "32",
    "--n-head",
    "2",
    "--seq",
    "16",
    "--batch",
    "4",
    "--steps",
    "5",
    "--warmup",
    "2",
]


def test_gpu_check_cpu_path(tmp_path: Path) -> None:
    outs = {}
    for impl in ("ours", "lightning"):
        out = tmp_path / f"{impl}.json"
        subprocess.run(
            [sys.executable, "-m", "benchmarks.gpu_check", "--impl", impl, "--out", str(out), *TINY],
            check=True,
            capture_output=True,
            timeout=180,
        )
        outs[impl] = json.loads(out.read_text())
        assert outs[impl]["tokens_per_s"] > 0 and outs[impl]["steps"] == 3
    assert outs["ours"]["precision"] == "ParallelPrecision"
    assert outs["lightning"]["precision"] == "MixedPrecision"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu_check",
            "--compare",
            str(tmp_path / "ours.json"),
            str(tmp_path / "lightning.json"),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(done.stdout)["throughput_ratio"] > 0
