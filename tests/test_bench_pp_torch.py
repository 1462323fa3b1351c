"""Smoke test of ``bench_pp_torch --quick``: ours and torch.distributed.pipelining run the same GPT pieces,
agree with each other and the unpipelined model, and the JSON holds every field of the comparison."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_pp_torch


def test_bench_pp_torch_quick_agrees_with_torch_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "pp_torch.json"
    # in-process main(): the ranks are forked from here, so no second interpreter start is paid
    payload = bench_pp_torch.main(["--quick", "--out", str(out)])

    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(payload))
    for key in (
        "benchmark", "environment", "config", "model", "reference", "implementations", "pairs",
        "compute_per_microbatch_s", "compute_samples_s", "targets", "correctness", "correct", "loss_tol",
        "weight_tol", "order_rank0", "loadavg_1min_during_run", "wall_time_s",
    ):  # fmt: skip
        assert key in data, key
    assert data["environment"]["world_size"] == 2 and data["environment"]["torch"]
    cfg = data["config"]
    p, v, total = cfg["world_size"], cfg["virtual_stages"], cfg["warmup"] + cfg["steps"]
    ms = [int(m) for m in cfg["microbatches"].split(",")]
    schedules = ("gpipe", "1f1b", "interleaved_1f1b", "zb")
    impls = data["implementations"]
    expected = {f"{i}_{s}_m{m}" for i in ("ours", "torch") for s in schedules for m in ms}
    assert set(impls) == expected | {f"unpipelined_m{m}" for m in ms}
    assert data["order_rank0"][: len(impls)] == [name for name, *_ in bench_pp_torch.QUICK.impls()]
    for d in impls.values():
        assert len(d["step_times_s"]) == total and len(d["losses"]) == total
        assert d["summary"]["n"] == cfg["steps"] and d["summary"]["median"] > 0
        assert set(d["phase_medians_s"]) == {"zero_grad", "pipeline", "tied", "optimizer"}

    # correctness: every step's loss and the final weights, ours vs torch vs the unpipelined model
    assert data["correct"]
    ref = impls[f"unpipelined_m{ms[0]}"]["losses"]
    assert ref[-1] != ref[0]  # the trajectory moves, so agreement is not trivial
    for name in expected:
        c = data["correctness"][name]
        checks = ("losses", "weights") + (
            ("losses_vs_torch", "weights_vs_torch") if name[:4] == "ours" else ()
        )
        assert set(c) == set(checks), name
        for k in checks:
            assert c[k]["agree"], (name, k, c[k]["failures"])
        assert c["losses"]["max_abs_diff"] < 1e-5
        assert c["weights"]["max_abs_diff"] <= cfg["lr"]  # within one AdamW step (bench_pp's tolerance)

    # bubble: 1 - m c / T per rank against the analytic value and the simulated unit-cost order
    for c in data["compute_per_microbatch_s"].values():
        assert len(c) == p and min(c) > 0
    for name in expected:
        d, m = impls[name], impls[name]["microbatches"]
        assert d["virtual_stages"] == (
            v if d["schedule"] == "interleaved_1f1b" or name == f"torch_zb_m{m}" else 1
        )
        assert len(d["bubble_per_rank"]) == p and all(b < 1.0 for b in d["bubble_per_rank"])
        assert d["bubble_mean"] == pytest.approx(sum(d["bubble_per_rank"]) / p)
        assert d["bubble_max"] == max(d["bubble_per_rank"]) and d["pipeline_s"] > 0
        assert isinstance(d["within_analytic"], bool)
        assert d["bubble_unit_schedule"] >= d["bubble_analytic"] - 1e-9  # the formula is the ideal
        if name.startswith("ours"):
            assert all(0.0 <= b < 1.0 for b in d["internal_bubble_per_rank"])
    m = ms[0]
    assert impls[f"ours_gpipe_m{m}"]["bubble_analytic"] == (p - 1) / (m + p - 1)
    assert impls[f"ours_interleaved_1f1b_m{m}"]["bubble_analytic"] == (p - 1) / (v * m + p - 1)
    assert impls[f"ours_zb_m{m}"]["bubble_analytic"] == (p - 1) / (3 * m + p - 1)
    assert impls[f"torch_zb_m{m}"]["bubble_analytic"] == (p - 1) / (3 * v * m + p - 1)
    for s in ("gpipe", "1f1b", "interleaved_1f1b"):  # these orders reach the formula at unit costs
        for impl in ("ours", "torch"):
            d = impls[f"{impl}_{s}_m{m}"]
            assert d["bubble_unit_schedule"] == pytest.approx(d["bubble_analytic"]), (impl, s)

    # the pairs and the targets (booleans; on the tiny model they need not hold)
    assert set(data["pairs"]) == {f"{s}_m{m}" for s in schedules for m in ms}
    for q in data["pairs"].values():
        assert q["time_ours_over_torch"]["ratio_of_medians"] > 0
        assert isinstance(q["ours_le_torch_bubble"], bool) and isinstance(q["ours_le_torch_time"], bool)
    targets = data["targets"]
    assert set(targets["1f1b_le_gpipe"]) == {f"{i}_m{m}" for i in ("ours", "torch") for m in ms}
    for key in (
        "ours_le_torch_bubble",
        "ours_le_torch_time",
        "ours_within_analytic",
        "torch_within_analytic",
    ):
        assert isinstance(targets[key], bool), key
