"""The memory planner: layouts, their model-state prediction (the estimate that memory_report matches
in test_zero_trainer / test_zero3_trainer), the PNG, and the console script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_par.memory import estimate_memory
from lightning_par.planner import ModelShape, draw, plan

SHAPE = ModelShape(n_layer=4, n_embd=64, n_head=4, vocab_size=256, seq_len=128)


def test_plan_enumerates_valid_layouts_and_predicts_model_states() -> None:
    layouts = plan(SHAPE, world=8, memory_gib=0.05, micro_batches=(1, 4))
    assert {(x.tp, x.pp, x.dp) for x in layouts} >= {(1, 1, 8), (2, 2, 2), (4, 2, 1), (1, 4, 2)}
    assert all(x.tp * x.pp * x.dp == 8 and SHAPE.n_head % x.tp == 0 for x in layouts)
    # ZeRO-3 under a pipeline keeps the stage's units gathered for the step (fp32: 4 bytes per parameter
    # live) besides its shards of parameters, gradients and AdamW state (4 + 4 + 8 bytes over dp), and the
    # step's unsharded gradient sums wait for their one reduce-scatter (4 bytes, communication buffers)
    z3pp = next(
        x
        for x in layouts
        if x.zero_stage == 3 and (x.tp, x.pp, x.dp) == (2, 2, 2) and x.precision == "32-true"
    )
    psi = SHAPE.params / 4
    assert z3pp.model_states_gib * 2**30 == pytest.approx(4 * psi + (4 + 4 + 8) * psi / 2, rel=1e-6)
    assert z3pp.buffers_gib * 2**30 == pytest.approx(4 * psi, rel=1e-6)
    for x in layouts:
        est = estimate_memory(
            SHAPE.params, zero_stage=x.zero_stage, dp=x.dp, tp=x.tp, pp=x.pp, precision=x.precision
        )
        states = est["parameters"] + est["gradients"] + est["optimizer_state"] + est["live_units"]
        assert x.model_states_gib == pytest.approx(states / 2**30)
    fits = [x.fits for x in layouts]
    assert fits == sorted(fits, reverse=True), "layouts within the budget come first"
    # ZeRO-3 over 8 ranks holds 1/8 of the fp32 AdamW model states
    z3 = next(x for x in layouts if x.zero_stage == 3 and x.dp == 8 and x.precision == "32-true")
    assert z3.model_states_gib * 2**30 == pytest.approx(16 * SHAPE.params / 8, rel=0.01)


def test_plan_png_and_console_script(tmp_path: Path) -> None:
    png = draw(plan(SHAPE, world=4, memory_gib=0.05), tmp_path / "plan.png", memory_gib=0.05)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # what pip's generated `lightning-par-plan` script does: sys.exit(<entry point>()), so the entry point
    # must return None for a zero exit status
    console_script = "import sys; from lightning_par.planner import cli; sys.exit(cli())"
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            console_script,
            "--n-layer",
            "4",
            "--n-embd",
            "64",
            "--n-head",
            "4",
            "--world",
            "4",
            "--memory-gib",
            "1",
            "--png",
            str(tmp_path / "cli.png"),
            "--json",
            str(tmp_path / "p.json"),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "parameters, world 4" in out.stdout and (tmp_path / "cli.png").stat().st_size > 1000
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_par.planner",
            "--n-layer",
            "4",
            "--n-embd",
            "64",
            "--n-head",
            "4",
            "--world",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--world and --micro-batches must be >= 1" in bad.stderr
