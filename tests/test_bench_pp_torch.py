"""Smoke test of ``bench_pp_torch --quick``: ours and torch.distributed.pipelining run the same pieces of
our GPT (and of Hugging Face's GPT-2 with ``--model hf_gpt2``), agree with each other and the unpipelined
model, and the JSON holds every field of the comparison; and unit tests (no processes) of the schedule
simulator ``benchmarks.pp_sim`` behind its bubble models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_pp_torch
from benchmarks.pp_sim import Order, jitter_bubble, ours_orders, simulate, unit_bubble


@pytest.mark.parametrize(("model", "slack"), [("gpt", 0), ("gpt", 1), ("hf_gpt2", 0)])
def test_bench_pp_torch_quick_agrees_with_torch_and_writes_json(
    tmp_path: Path, model: str, slack: int
) -> None:
    out = tmp_path / "pp_torch.json"
    # in-process main(): the ranks are forked from here, so no second interpreter start is paid
    payload = bench_pp_torch.main(["--quick", "--out", str(out), "--slack", str(slack), "--model", model])

    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(payload))
    for key in (
        "benchmark", "environment", "config", "model", "reference", "implementations", "pairs",
        "compute_per_microbatch_s", "compute_samples_s", "action_cv_per_rank", "targets", "correctness",
        "correct", "loss_tol", "weight_tol", "order_rank0", "loadavg_1min_during_run", "wall_time_s",
    ):  # fmt: skip
        assert key in data, key
    assert data["environment"]["world_size"] == 2 and data["environment"]["torch"]
    assert data["model"]["name"] == {"gpt": "GPT", "hf_gpt2": "Hugging Face GPT2LMHeadModel"}[model]
    cfg = data["config"]
    assert cfg["slack"] == slack  # ours' 1f1b and zb ran with it (their losses still equal torch's, below)
    p, v, total = cfg["world_size"], cfg["virtual_stages"], cfg["warmup"] + cfg["steps"]
    ms = [int(m) for m in cfg["microbatches"].split(",")]
    paired = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb")  # torch has the same schedule
    impls = data["implementations"]
    expected = {f"{i}_{s}_m{m}" for i in ("ours", "torch") for s in paired for m in ms}
    expected |= {f"ours_zb_m{m}" for m in ms}  # torch has no single-stage zero bubble
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
            ("losses_vs_torch", "weights_vs_torch")
            if name.startswith("ours") and not name.startswith("ours_zb_")
            else ()
        )
        assert set(c) == set(checks), name
        for k in checks:
            assert c[k]["agree"], (name, k, c[k]["failures"])
        assert c["losses"]["max_abs_diff"] < 1e-5
        assert c["weights"]["max_abs_diff"] <= cfg["lr"]  # within one AdamW step (bench_pp's tolerance)

    # bubble: 1 - m c / T per rank against the analytic value and the simulated unit-cost order
    for c in data["compute_per_microbatch_s"].values():
        assert len(c) == p and min(c) > 0
    assert set(data["action_cv_per_rank"]) == set(data["compute_per_microbatch_s"])
    for cv in data["action_cv_per_rank"].values():
        assert len(cv) == p and all(0.0 <= x < 1.0 for x in cv)
    for name in expected:
        d, m = impls[name], impls[name]["microbatches"]
        assert d["virtual_stages"] == (v if d["schedule"].startswith("interleaved") else 1)
        assert len(d["bubble_per_rank"]) == p and all(b < 1.0 for b in d["bubble_per_rank"])
        assert d["bubble_mean"] == pytest.approx(sum(d["bubble_per_rank"]) / p)
        assert d["bubble_max"] == max(d["bubble_per_rank"]) and d["pipeline_s"] > 0
        assert isinstance(d["within_analytic"], bool)
        assert d["bubble_unit_schedule"] >= d["bubble_analytic"] - 1e-9  # the formula is the ideal
        assert d["action_cv_per_rank"] == data["action_cv_per_rank"][f"v{d['virtual_stages']}"]
        assert 0.0 <= d["bubble_jitter_model"] < 1.0 and isinstance(d["within_jitter_model"], bool)
        assert d["within_jitter_model"] == (d["bubble_mean"] <= d["bubble_jitter_model"] + 0.03)
        if name.startswith("ours"):
            assert all(0.0 <= b < 1.0 for b in d["internal_bubble_per_rank"])
    m = ms[0]
    assert impls[f"ours_gpipe_m{m}"]["bubble_analytic"] == (p - 1) / (m + p - 1)
    assert impls[f"ours_interleaved_1f1b_m{m}"]["bubble_analytic"] == (p - 1) / (v * m + p - 1)
    assert impls[f"ours_zb_m{m}"]["bubble_analytic"] == (p - 1) / (3 * m + p - 1)
    for impl in ("ours", "torch"):
        assert impls[f"{impl}_interleaved_zb_m{m}"]["bubble_analytic"] == (p - 1) / (3 * v * m + p - 1)
    for s in paired:  # these orders reach the formula at unit costs (ours and torch's)
        for impl in ("ours", "torch"):
            d = impls[f"{impl}_{s}_m{m}"]
            assert d["bubble_unit_schedule"] == pytest.approx(d["bubble_analytic"]), (impl, s)

    # the pairs and the targets (booleans; on the tiny model they need not hold)
    assert set(data["pairs"]) == {f"{s}_m{m}" for s in paired for m in ms}
    for q in data["pairs"].values():
        assert q["time_ours_over_torch"]["ratio_of_medians"] > 0
        assert isinstance(q["ours_le_torch_bubble"], bool) and isinstance(q["ours_le_torch_time"], bool)
    targets = data["targets"]
    assert set(targets["1f1b_le_gpipe"]) == {f"{i}_m{m}" for i in ("ours", "torch") for m in ms}
    zb_keys = {f"ours_zb_m{m}" for m in ms} | {
        f"{i}_interleaved_zb_m{m}" for i in ("ours", "torch") for m in ms
    }
    assert set(targets["zb_le_1f1b"]) == zb_keys and all(
        isinstance(x, bool) for x in targets["zb_le_1f1b"].values()
    )
    for key in (
        "ours_le_torch_bubble",
        "ours_le_torch_time",
        "ours_within_analytic",
        "torch_within_analytic",
    ):
        assert isinstance(targets[key], bool), key


# ---------------------------------------------------------------------------------------------- pp_sim
def test_simulate_hand_computed_p2_m1() -> None:
    # p=2, m=1, F=1, B=2, free transfers. Rank 0: F 0-1; rank 1: F 1-2 (waits for rank 0's F), B 2-4;
    # rank 0: B 4-6 (waits for rank 1's input gradient). T = 6, each rank busy 3: bubble 1 - 3/6 = 0.5.
    orders: Order = [[("F", 0, 0), ("B", 0, 0)], [("F", 1, 0), ("B", 1, 0)]]
    unit = {"F": 1.0, "B": 2.0}
    assert simulate(orders, last=1, cost=lambda kind, _: unit[kind]) == [0.5, 0.5]
    # rank 1 twice as slow: rank 0 F 0-1; rank 1 F 1-3, B 3-7; rank 0 B 7-9. T = 9, busy 3 and 6:
    # bubbles 1 - 3/9 = 2/3 and 1 - 6/9 = 1/3
    slow = simulate(orders, last=1, cost=lambda kind, r: unit[kind] * (1 + r))
    assert slow == pytest.approx([2 / 3, 1 / 3])
    # split backward, all costs 1: rank 0 F 0-1; rank 1 F 1-2, I 2-3, W 3-4; rank 0 I 3-4 (its input
    # gradient is rank 1's I), W 4-5. T = 5, busy 3 each: 1 - 3/5 = 0.4
    split: Order = [[("F", 0, 0), ("I", 0, 0), ("W", 0, 0)], [("F", 1, 0), ("I", 1, 0), ("W", 1, 0)]]
    assert simulate(split, last=1, cost=lambda *_: 1.0) == pytest.approx([0.4, 0.4])
    # rank 0's backward first: it waits for rank 1's, which waits for rank 0's forward, queued behind it
    with pytest.raises(ValueError, match="deadlock"):
        simulate([[("B", 0, 0), ("F", 0, 0)], [("F", 1, 0), ("B", 1, 0)]], last=1, cost=lambda *_: 1.0)


@pytest.mark.parametrize("m", [4, 8])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_jitter_bubble_without_jitter_is_the_unit_bubble(schedule: str, m: int) -> None:
    orders = ours_orders(schedule, p=2, m=m, v=1)
    assert jitter_bubble(orders, last=1, cv=[0.0, 0.0]) == unit_bubble(orders, last=1)


def test_jitter_bubble_is_deterministic_and_at_least_the_unit_bubble() -> None:
    orders = ours_orders("1f1b", p=2, m=16, v=1)
    jitter = jitter_bubble(orders, last=1, cv=[0.15, 0.15], seed=3)
    assert jitter == jitter_bubble(orders, last=1, cv=[0.15, 0.15], seed=3)
    assert jitter != jitter_bubble(orders, last=1, cv=[0.15, 0.15], seed=4)
    assert jitter > unit_bubble(orders, last=1) + 0.02  # 0.104 vs 1/17 = 0.059
    # one rank never waits: whatever its costs, busy time is the makespan (the drawn costs are counted)
    assert jitter_bubble([[("F", 0, 0), ("B", 0, 0)]], last=0, cv=[0.5]) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="one cv"):
        jitter_bubble(orders, last=1, cv=[0.15])


def test_jitter_hurts_1f1b_more_than_gpipe_at_m16() -> None:
    # same unit bubble 1/17; 1F1B's steady state waits on the other rank every micro-batch, GPipe's
    # queued forwards absorb lateness: about 0.104 vs 0.087 (seed spread ~0.001). Not so at m = 4
    # (0.218 vs 0.229): there the warmup / drain dominate, and GPipe's are longer.
    gpipe, ofob = (ours_orders(s, p=2, m=16, v=1) for s in ("gpipe", "1f1b"))
    assert unit_bubble(gpipe, last=1) == pytest.approx(unit_bubble(ofob, last=1))
    assert jitter_bubble(ofob, last=1, cv=[0.15, 0.15]) > jitter_bubble(gpipe, last=1, cv=[0.15, 0.15]) + 0.01


def test_slack_takes_most_of_the_jitter_out_of_1f1b_and_zb() -> None:
    # the figures in lightning_par.pipeline.schedule's docstring: p = 2, m = 16, cv = 0.15
    cv = [0.15, 0.15]
    gpipe = jitter_bubble(ours_orders("gpipe", p=2, m=16, v=1), last=1, cv=cv)
    for schedule, before, after in (("1f1b", 0.104, 0.063), ("zb", 0.042, 0.029)):
        tight, slack = (
            jitter_bubble(ours_orders(schedule, p=2, m=16, v=1, slack=k), last=1, cv=cv) for k in (0, 1)
        )
        assert (tight, slack) == pytest.approx((before, after), abs=0.002), schedule
        assert slack < gpipe  # one micro-batch of slack absorbs more than GPipe's queue of all of them
