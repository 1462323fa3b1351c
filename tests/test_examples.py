"""Every script in examples/ runs at smoke size (sweep.sh is run by tests/test_sweep.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=EXAMPLES.parent,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_plain_trainer_example() -> None:
    out = _run("train_gpt_plain.py", "--steps", "4", "--stage", "2")
    assert "final val_loss=" in out


def test_lightning_demo_under_zero3() -> None:
    out = _run("zero3_lightning_demo.py", "--steps", "3")
    assert "trained 3 steps" in out
