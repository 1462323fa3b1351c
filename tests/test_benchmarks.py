"""Smoke test of the benchmarks: ``bench_dp --quick`` runs, writes its JSON, and both engines agree."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import bench_dp


def test_bench_dp_quick_writes_json_and_losses_agree(tmp_path: Path) -> None:
    out = tmp_path / "dp.json"
    # in-process main(): the ranks are forked from here, so no second interpreter start (~5-10 s) is paid
    payload = bench_dp.main(["--quick", "--steps", "3", "--out", str(out)])

    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(payload))
    for key in ("environment", "config", "model", "buckets", "implementations", "comparison", "memory_alone"):
        assert key in data, key
    env = data["environment"]
    for key in ("torch", "lightning", "cpu_count", "date", "command", "threads_per_rank", "world_size"):
        assert env[key] is not None, key
    assert data["model"]["num_parameters"] > 0
    cfg = data["config"]
    total_steps = cfg["warmup"] + cfg["steps"]
    assert total_steps == 4

    impls = data["implementations"]
    assert set(impls) == {"ours", "ddp"}
    for d in impls.values():
        assert len(d["step_times_s"]) == total_steps
        assert len(d["step_times_per_rank_s"]) == cfg["world_size"]
        assert d["summary"]["n"] == cfg["steps"]
        assert d["summary"]["median"] > 0
        assert len(d["losses"]) == total_steps
    assert len(data["buckets"]["ours_bytes"]) > 1  # the quick config exercises several buckets

    cmp = data["comparison"]
    assert cmp["losses_agree"]
    ours, ddp = impls["ours"]["losses"], impls["ddp"]["losses"]
    for a, b in zip(ours, ddp, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert cmp["final_param_max_abs_diff"] < 1e-5
    assert ours[-1] != ours[0]  # the trajectory moves, so agreement is not trivial
    assert cmp["ratio_of_medians"] > 0
    # ABBA interleaving: ours, ddp, ddp, ours
    assert cmp["order_rank0"] == ["ours", "ddp", "ddp", "ours", "ours", "ddp", "ddp", "ours"]
    for name in ("ours", "ddp"):
        assert data["memory_alone"][name]["peak_rss_mib_per_rank"][0] > 0
