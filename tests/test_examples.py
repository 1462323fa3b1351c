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


def test_fault_tolerance_example_resumes_to_the_uninterrupted_weights(tmp_path: Path) -> None:
    """Lightning's "ddp" + our callbacks: crash after step 13, run the same command again, and the final
    weights equal those of a run that never crashed (snapshot of step 12 in shared memory, mid-epoch)."""
    import os

    import torch

    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same kernels in every run, for bitwise equality

    def run(*args: str, ok: bool = True) -> str:
        done = subprocess.run(
            [sys.executable, str(EXAMPLES / "lightning_ddp_fault_tolerance.py"), *args],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=EXAMPLES.parent,
            env=env,
        )
        assert (done.returncode == 0) == ok, done.stderr[-3000:]
        return done.stdout + done.stderr

    crashed = run("--dirpath", str(tmp_path / "ft"), "--crash-at-step", "13", ok=False)
    assert "simulated failure after step 13" in crashed
    resumed = run("--dirpath", str(tmp_path / "ft"), "--save-final", str(tmp_path / "resumed.pt"))
    assert "finished step 24; resumed from step 12" in resumed
    plain = run("--dirpath", str(tmp_path / "plain"), "--save-final", str(tmp_path / "plain.pt"))
    assert "resumed from step None" in plain
    got = torch.load(tmp_path / "resumed.pt", weights_only=True)
    want = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def test_hf_pipeline_example_equals_one_process() -> None:
    """Lightning launches the ranks itself (its subprocess launcher), pp2 with zb on a Hugging Face Llama
    behind hf_pipeline_layers / hf_causal_lm_loss; rank 0 replays the batches in one process on the
    model's own loss and reports the largest weight difference."""
    import re

    out = _run("pp_hf_finetune.py", "--steps", "4", "--schedule", "zb", "--padding", "left", "--check")
    assert "trained 4 steps" in out, out
    found = re.search(r"max \|W_pp - W_one_process\| = (\S+)", out)
    assert found is not None, out
    assert float(found.group(1)) < 1e-5, out


def test_hf_pipeline_fabric_example_equals_one_process() -> None:
    """Fabric launches the ranks itself; pp2 with 1F1B on a Hugging Face Llama (``pipeline_layers=
    hf_pipeline_layers``), packed rows, accumulation 2 and clipping in the loop; rank 0 replays the batches
    in one process on the model's own loss and reports the largest weight difference."""
    import re

    out = _run("pp_hf_fabric.py", "--steps", "3", "--schedule", "1f1b", "--padding", "packed", "--check")
    assert "trained 3 steps" in out, out
    found = re.search(r"max \|W_pp - W_one_process\| = (\S+)", out)
    assert found is not None, out
    assert float(found.group(1)) < 1e-5, out
