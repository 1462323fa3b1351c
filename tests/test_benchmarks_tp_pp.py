"""Smoke tests of ``bench_tp --quick``, ``bench_pp --quick``, ``bench_hf_pieces --quick`` and
``bench_pp_partition --quick``: they run, write complete JSON, the sharded / pipelined runs agree with the
unsharded / unpipelined model (the Hugging Face pieces with the model's own forward; the cuts with each
other), and the pipeline's measured bubble and activation counts follow the schedules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_hf_pieces, bench_pp, bench_pp_partition, bench_tp
from lightning_par.pipeline import build_schedule, peak_in_flight


def test_bench_tp_quick_writes_json_and_tp_matches_unsharded(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    # in-process main(): the ranks are forked from here, so no second interpreter start is paid
    payload = bench_tp.main(["--quick", "--out", str(out)])

    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(payload))
    for key in (
        "environment", "config", "impls", "reference", "model", "implementations", "comparisons",
        "correctness", "correct", "param_memory", "param_memory_matches_prediction", "memory_alone",
        "loadavg_1min_during_run", "wall_time_s",
    ):  # fmt: skip
        assert key in data, key
    env = data["environment"]
    for key in ("torch", "lightning", "cpu_count", "date", "command", "threads_per_rank", "world_size"):
        assert env[key] is not None, key
    cfg = data["config"]
    total = cfg["warmup"] + cfg["steps"]
    impls = data["implementations"]
    assert list(impls) == list(bench_tp.ALL_IMPLS) == data["impls"]
    for d in impls.values():
        assert len(d["step_times_s"]) == total and len(d["losses"]) == total
        assert d["summary"]["n"] == cfg["steps"] and d["summary"]["median"] > 0
        assert set(d["phase_medians_s"]) == {"zero_grad", "forward", "backward", "optimizer"}
    # rotation: A B C C B A ...
    assert data["order_rank0"][:6] == ["tp1", "tp2", "tp2_sp", "tp2_sp", "tp2", "tp1"]
    for key in ("tp2/tp1", "tp2_sp/tp1", "tp2_sp/tp2"):
        assert data["comparisons"][key]["ratio_of_medians"] > 0

    # correctness: every step's loss, the first-step gradients and the final gathered weights
    assert data["correct"]
    ref = impls["tp1"]["losses"]
    assert ref[-1] != ref[0]  # the trajectory moves, so agreement is not trivial
    for name in ("tp2", "tp2_sp"):
        c = data["correctness"][name]
        assert c["losses_agree"] and c["first_step_grads_agree"] and c["weights_agree"], c["failures"]
        assert c["ranks_report_equal_losses"]
        assert c["loss_max_abs_diff"] < 1e-4 and c["first_step_grad_max_abs_diff"] < 1e-5
        assert c["final_weight_max_abs_diff_over_lr"] <= 1.0  # within one AdamW step (see bench_tp)

    # memory: parameter bytes measured = predicted from the plan; tp=2 holds about half
    assert data["param_memory_matches_prediction"]
    full = data["param_memory"]["tp1"]["full_bytes"]
    assert data["param_memory"]["tp1"]["measured_bytes_per_rank"] == [full] * cfg["world_size"]
    for name in ("tp2", "tp2_sp"):
        pm = data["param_memory"][name]
        assert 0.5 < pm["fraction_of_full"] < 0.6  # replicated norms, biases and position table on top
        state = impls[name]["model_state_bytes_per_rank"][0]
        assert state["optimizer"] == 2 * state["parameters"]  # AdamW's two moments, sharded alike
        # heads and MLP hidden units are split: fewer saved activations than the unsharded model
        act, ref_act = (impls[n]["peak_saved_activation_mib_per_rank"][0] for n in (name, "tp1"))
        assert 0 < act < ref_act
    # collectives: plain TP all-reduces (+1 all-gather of the logits); SP also gathers and scatters
    counts = impls["tp2"]["comm_counts_per_step"]
    assert counts["all_reduce"] == 4 * cfg["n_layer"] + 2 and counts["all_gather"] == 1
    assert impls["tp2_sp"]["comm_counts_per_step"]["reduce_scatter"] > 0
    assert impls["tp1"]["comm_counts_per_step"] == {}
    for name in bench_tp.ALL_IMPLS:
        assert min(data["memory_alone"][name]["peak_rss_mib_per_rank"]) > 0


def test_bench_pp_quick_bubbles_in_flight_and_equality(tmp_path: Path) -> None:
    out = tmp_path / "pp.json"
    payload = bench_pp.main(["--quick", "--out", str(out)])

    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(payload))
    for key in (
        "environment", "config", "reference", "model", "implementations", "activations_vs_gpipe",
        "correctness", "correct", "in_flight_matches_schedule", "loadavg_1min_during_run", "pp4",
        "wall_time_s",
    ):  # fmt: skip
        assert key in data, key
    assert data["environment"]["world_size"] == 2
    cfg = data["config"]
    total = cfg["warmup"] + cfg["steps"]
    ms = [int(m) for m in cfg["microbatches"].split(",")]
    assert 4 in ms and 16 in ms
    impls = data["implementations"]
    assert set(impls) == {
        f"{s}_m{m}"
        for m in ms
        for s in ("unpipelined", "gpipe", "1f1b", "interleaved_1f1b", "zb", "interleaved_zb")
    }
    for d in impls.values():
        assert len(d["step_times_s"]) == total and d["summary"]["median"] > 0

    # correctness against the unpipelined model: losses, first-step gradients, final weights
    assert data["correct"]
    for name, c in data["correctness"].items():
        assert c["losses_agree"] and c["first_step_grads_agree"] and c["weights_agree"], (name, c["failures"])
        assert c["parameters_compared"] > 0

    # bubble: measured from the runtime's StepStats, analytic from the schedule formula
    p = cfg["world_size"]
    for name, d in impls.items():
        if d["schedule"] == "unpipelined":
            continue
        assert 0.0 < d["bubble_measured"] < 1.0, name
        assert all(0.0 <= b < 1.0 for b in d["bubble_measured_per_rank"]), name
    gp4 = impls["gpipe_m4"]
    assert gp4["bubble_analytic"] == (p - 1) / (4 + p - 1)
    # a sane band: the measured bubble contains the structural one (transfers and overheads add to it)
    assert 0.5 * gp4["bubble_analytic"] < gp4["bubble_measured"] < 0.95
    assert gp4["bubble_analytic"] > impls["gpipe_m16"]["bubble_analytic"]
    assert impls["interleaved_1f1b_m4"]["bubble_analytic"] < gp4["bubble_analytic"]
    assert impls["zb_m4"]["bubble_analytic"] == (p - 1) / (3 * 4 + p - 1)
    assert impls["interleaved_zb_m4"]["bubble_analytic"] == (p - 1) / (3 * cfg["virtual_stages"] * 4 + p - 1)

    # activations in flight: counted from autograd's saved tensors, exactly the schedules' bound
    assert data["in_flight_matches_schedule"]
    for m in ms:
        assert impls[f"gpipe_m{m}"]["peak_forwards_in_flight_per_rank"] == [m] * p
        assert impls[f"1f1b_m{m}"]["peak_forwards_in_flight_per_rank"] == [p - s for s in range(p)]
        assert impls[f"zb_m{m}"]["peak_forwards_in_flight_per_rank"] == [p - s for s in range(p)]
        assert impls[f"unpipelined_m{m}"]["peak_forwards_in_flight_per_rank"] == [1] * p
        inter = build_schedule("interleaved_1f1b", p=p, m=m, v=cfg["virtual_stages"])
        for s in ("interleaved_1f1b", "interleaved_zb"):  # the split backward keeps interleaved 1F1B's bound
            assert impls[f"{s}_m{m}"]["peak_forwards_in_flight_per_rank"] == [
                peak_in_flight(a) for a in inter
            ]
    # and in bytes: the first stage of 1F1B holds far less than GPipe's m micro-batches at m=16
    gp, one = impls["gpipe_m16"]["peak_saved_mib_per_rank"], impls["1f1b_m16"]["peak_saved_mib_per_rank"]
    assert one[0] * 4 < gp[0]

    # the tiny p=4 run (4 processes): 1F1B keeps p - s micro-batches on rank s
    pp4 = data["pp4"]
    assert pp4["config"]["world_size"] == 4 and pp4["correct"] and pp4["in_flight_matches_schedule"]
    assert pp4["implementations"]["1f1b_m16"]["peak_forwards_in_flight_per_rank"] == [4, 3, 2, 1]
    assert pp4["implementations"]["gpipe_m16"]["peak_forwards_in_flight_per_rank"] == [16] * 4


def test_bench_hf_pieces_quick_writes_json_and_the_pieces_equal_the_model(tmp_path: Path) -> None:
    out = tmp_path / "hf_pieces.json"
    payload = bench_hf_pieces.main(["--quick", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(payload))
    assert {(r["family"], r["form"]) for r in data["rows"]} == {
        (f, form) for f in bench_hf_pieces.FAMILIES for form in bench_hf_pieces.FORMS
    }
    assert data["correct"] and all(r["logits_equal"] for r in data["rows"])
    for r in data["rows"]:
        assert len(r["step_times_s"]["model"]) == len(r["step_times_s"]["pieces"]) == data["config"]["rounds"]
        assert r["pieces_over_model"] == pytest.approx(r["pieces_ms"] / r["model_ms"])


def test_bench_pp_partition_quick_default_cut_is_the_flop_optimal_one(tmp_path: Path) -> None:
    out = tmp_path / "pp_partition.json"
    payload = bench_pp_partition.main(["--quick", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(payload))
    methods = data["methods"]
    assert set(methods) == set(bench_pp_partition.ALL_METHODS)
    assert data["correct"] and all(r["losses_agree"] for r in methods.values())
    assert methods["compute"]["pieces"] == methods["flops"]["pieces"]
    assert methods["parameters"]["max_over_ideal"] > 1.5 * methods["compute"]["max_over_ideal"]
    for r in methods.values():
        steps = data["config"]["warmup"] + data["config"]["steps"]
        assert len(r["losses"]) == steps and r["step_time_median_s"] > 0
        assert sum(r["stage_flops_share"]) == pytest.approx(1.0)
