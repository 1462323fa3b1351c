"""Smoke tests of the benchmarks: ``bench_dp --quick`` and ``bench_zero --quick`` run, write their JSON,
and every engine agrees with its torch reference. DeepSpeed (``bench_deepspeed``) is optional and not
tested here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_dp, bench_zero, report


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


def test_bench_zero_quick_all_stages_agree_with_torch(tmp_path: Path) -> None:
    """``bench_zero --quick``: every implementation runs, the JSON is complete, and ours (stages 1-3)
    follow the same loss trajectory as torch DDP, DDP + ZeroRedundancyOptimizer and FSDP2."""
    out = tmp_path / "zero.json"
    payload = bench_zero.main(["--quick", "--out", str(out)])

    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(payload))
    for key in (
        "environment", "config", "impls", "model", "implementations", "comparisons",
        "loss_agreement_vs_ddp", "losses_agree", "loadavg_1min_during_run", "memory_alone", "wall_time_s",
    ):  # fmt: skip
        assert key in data, key
    assert data["environment"]["code"]["commit"]  # which lightning_par was measured
    cfg = data["config"]
    total_steps = cfg["warmup"] + cfg["steps"]
    impls = data["implementations"]
    assert list(impls) == list(bench_zero.ALL_IMPLS) == data["impls"]
    for d in impls.values():
        assert len(d["step_times_s"]) == total_steps
        assert d["summary"]["n"] == cfg["steps"] and d["summary"]["median"] > 0
        assert set(d["phase_medians_s"]) == {"zero_grad", "forward", "backward", "optimizer"}
    # rotation: every implementation once per round, the order reversed every other round
    order = data["order_rank0"]
    n = len(impls)
    assert len(order) == n * total_steps
    assert order[:n] == list(impls) and order[n : 2 * n] == list(reversed(impls))

    for key in ("ours_s1/ddp", "ours_s2/ddp", "zero_opt/ddp", "ours_s3/fsdp2", "ours_s3_rs/fsdp2"):
        c = data["comparisons"][key]
        assert c["ratio_of_medians"] > 0 and c["median_paired_ratio"] > 0
        has_target = key.startswith("ours")  # the targets are ours'; torch's own ratios are informative
        assert (c["target_ratio"] is not None) == has_target
        assert isinstance(c["meets_target"], bool) == has_target

    ddp = impls["ddp"]["losses"]
    assert ddp[-1] != ddp[0]  # the trajectory moves, so agreement is not trivial
    assert data["losses_agree"]
    for name in bench_zero.ALL_IMPLS[1:]:
        for a, b in zip(impls[name]["losses"], ddp, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), name
        agreement = data["loss_agreement_vs_ddp"][name]
        assert agreement["losses_agree"], name
        assert agreement["final_param_max_abs_diff"] < 1e-5, name

    for name in bench_zero.ALL_IMPLS:
        mem = data["memory_alone"][name]
        assert len(mem["peak_rss_mib_per_rank"]) == cfg["world_size"]
        assert min(mem["peak_rss_mib_per_rank"]) >= max(mem["rss_at_start_mib_per_rank"]) * 0.5 > 0
    assert data["memory_alone"]["ours_s3"]["model_state_bytes_rank0"]["measured"]["total"] > 0
    assert data["memory_alone"]["ddp"]["model_state_bytes_rank0"] is None

    # the report (markdown, DeepSpeed beside ours) works on it without DeepSpeed: fake a DeepSpeed run
    # whose "ds_z<k>" are copies of ours, so every ratio through the DDP baseline is exactly 1
    fake = json.loads(json.dumps(data))
    fake["environment"]["deepspeed"] = "fake"
    fake["implementations"] = {
        "ddp": impls["ddp"], "ds_z1": impls["ours_s1"], "ds_z2": impls["ours_s2"], "ds_z3": impls["ours_s3"],
    }  # fmt: skip
    fake["comparisons"] = {}
    fake["loss_agreement_vs_ddp"] = {k: data["loss_agreement_vs_ddp"][v] for k, v in (
        ("ds_z1", "ours_s1"), ("ds_z2", "ours_s2"), ("ds_z3", "ours_s3"))}  # fmt: skip
    fake["memory_alone"] = None
    beside = report.deepspeed_beside_ours(data, fake)
    assert beside["same_model_and_data"]
    for stage in ("ds_z1", "ds_z2", "ds_z3"):
        assert abs(beside["stages"][stage]["ds_over_ours_via_ddp"] - 1.0) < 1e-12
    table = report.markdown(data, fake)
    assert table.count("\n| ") == 1 + len(impls) + 1 + 3  # header, ours and torch's; header, DeepSpeed


def test_bench_zero_rejects_bad_stages() -> None:
    with pytest.raises(SystemExit):
        bench_zero.parse_args(["--stages", "4"])
    cfg, _ = bench_zero.parse_args(["--quick", "--stages", "3"])
    assert cfg.impls() == ("ddp", "fsdp2", "ours_s3", "ours_s3_rs")


def test_report_writes_markdown_and_every_plot_from_the_committed_results(tmp_path: Path) -> None:
    """``python -m benchmarks.report`` on the committed JSON files: one section per result file, every
    figure read from them (spot-checked against the JSON), and the five PNGs it links."""
    results = report.RESULTS_DIR
    present = [n for n in report.RESULT_NAMES if (results / f"{n}.json").exists()]
    assert {"dp", "zero", "tp", "pp", "checkpoint"} <= set(present)
    text = report.main(["--out-dir", str(tmp_path)])
    assert (tmp_path / "REPORT.md").read_text() == text
    for name in present:
        assert f"(`{name}.json`)" in text or name == "deepspeed", name
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    plots = (
        "step_time_ratios",
        "memory_per_rank",
        "bubble_vs_microbatches",
        "checkpoint_blocking",
        "compression_loss",
    )
    assert pngs == sorted(f"{name}.png" for name in plots)
    for png in pngs:
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png})" in text
    tp = json.loads((results / "tp.json").read_text())
    assert f"{tp['comparisons']['tp2/tp1']['ratio_of_medians']:.3f}" in text
    compress = json.loads((results / "compress.json").read_text())
    assert f"{compress['results']['mlp/powersgd_r4']['bytes_cut_vs_uncompressed']:.1f}x" in text
    ckpt = json.loads((results / "checkpoint.json").read_text())
    assert f"{ckpt['blocking_and_throughput']['summary']['flash_over_torch_save']:.4f}" in text


def test_bench_ema_quick_sharded_average_is_half_and_equal(tmp_path: Path) -> None:
    """``bench_ema --quick``: every configuration runs and the JSON is complete; the sharded average holds
    the model's fp32 values once over the two ranks (the DDP copy and the gathered recipe whole on each),
    and its averaged weights equal Lightning's way (``AveragedModel`` under DDP)."""
    from benchmarks import bench_ema

    out = tmp_path / "ema.json"
    payload = bench_ema.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text())["ratios"] == payload["ratios"]
    rows, fp32 = payload["rows"], 4 * payload["parameters"]
    assert rows["ddp_ema"]["state_bytes_per_rank"][0] >= fp32  # the whole model (and its buffers)
    assert rows["zero3_gathered_ema"]["state_bytes_per_rank"] == [fp32, fp32]
    sharded = rows["zero3_sharded_ema"]["state_bytes_per_rank"]
    assert sum(sharded) == fp32 and max(sharded) < fp32
    assert payload["max_abs_diff_vs_ddp_ema"]["zero3_sharded_ema"] <= 1e-6
    assert payload["max_abs_diff_vs_ddp_ema"]["zero3_gathered_ema"] <= 1e-5
