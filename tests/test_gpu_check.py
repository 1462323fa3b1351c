"""The GPU check's CPU path: the whole script (every part, the same code the GPU run uses) on tiny
models with Gloo, in a subprocess that cannot import hydra or omegaconf (the GPU machine has neither);
the assertions read the JSON it writes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_HYDRA = "import sys\nsys.modules['hydra'] = None\nsys.modules['omegaconf'] = None\n"


def _run_cpu_path(module: str, out: Path, tmp_path: Path) -> None:
    """``python -m <module> --device cpu --quick --out-dir <out>`` in processes that cannot import hydra
    or omegaconf (the GPU machine has neither), one thread each."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(NO_HYDRA)  # imported first by every process the check starts
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "OUT")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"  # tiny models: one thread per process is as fast, and never oversubscribes
    done = subprocess.run(
        [sys.executable, "-m", module, "--device", "cpu", "--quick", "--out-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]


def test_gpu_check_cpu_path(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _run_cpu_path("benchmarks.gpu_check", out, tmp_path)
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["ok"] and summary["failures"] == []
    assert summary["env"]["hydra_loaded"] is False
    assert set(summary["parts"]) == {
        "matrix",
        "meta_init",
        "flash",
        "health",
        "throughput",
        "compression",
        "models",
    }

    # 1. the matrix: 4 stages x 3 precisions x token off/on and Lightning's own reference (not fp16), all
    # with SGD; AdamW at 32-true on the 4 stages
    rows = summary["parts"]["matrix"]["combinations"]
    assert len(rows) == 4 * 3 * 2 + 2 * 2 + 4
    for stage in (1, 2, 3):  # the same bits on the CPU
        assert rows[f"zero{stage}-32-true-adamw"]["max_dw_vs_stage0"] <= 1e-6
        assert rows[f"zero{stage}-32-true-adamw"]["optimizer"].startswith("AdamW")
    for name, row in rows.items():
        assert all(math.isfinite(x) for x in row["losses"]), name
        assert row["max_dw_vs_stage0"] <= row["tol_vs_stage0"], name
        if not name.startswith("lightning"):
            assert row["plugin"] == "ParallelPrecision", name
    for suffix in ("32-true", "32-true-token"):  # fp32: every stage and Lightning agree to 1e-6
        for who in ("zero1", "zero2", "zero3", "lightning"):
            assert rows[f"{who}-{suffix}"]["max_dw_vs_stage0"] <= 1e-6
            assert abs(rows[f"{who}-{suffix}"]["losses"][0] - rows[f"zero0-{suffix}"]["losses"][0]) <= 1e-6
    for suffix in ("bf16-mixed", "bf16-mixed-token", "16-mixed", "16-mixed-token"):
        base = rows[f"zero0-{suffix}"]
        for stage in (1, 2, 3):
            row = rows[f"zero{stage}-{suffix}"]
            assert 0 < row["tol_vs_stage0"] < 1e-2 and row["skipped"] == base["skipped"]
            if stage > 1:  # stages 1-3 compute alike (16-bit weights, fp32 masters)
                assert row["max_dw_vs_stage1"] <= row["tol_vs_stage1"]
    # token-exact normalisation changed the weights, and matched Lightning with the known token counts
    assert summary["parts"]["matrix"]["token_effect_32_true"] > 1e-4

    # 2. meta init at ZeRO-3
    meta = summary["parts"]["meta_init"]
    assert all(meta["checks"].values()), meta["checks"]
    assert meta["built_on_meta"] and meta["shard_devices_after_setup"] == ["cpu"]
    assert meta["initial_vs_twin_max_diff"] == 0.0 and meta["final_vs_eager_run_max_diff"] <= 1e-6
    assert meta["engine"] == "Stage3Engine"

    # 3. FlashCheckpoint: SIGKILLed after step 5, resumed from step 4, bitwise equal to a run never killed
    flash = summary["parts"]["flash"]
    assert flash["child_returncode"] == -9 and flash["killed_after_step"] == 5
    assert flash["resumed"]["step"] == 4 and flash["resumed_final_step"] == 8
    assert flash["final_bitwise_equal"] and flash["final_max_abs_diff_vs_uninterrupted"] == 0.0
    assert [s["step"] for s in flash["snapshots_before_kill"]] == [2, 4]
    assert [s["step"] for s in flash["snapshots_after_resume"]] == [6, 8]
    for snap in flash["snapshots_before_kill"] + flash["snapshots_after_resume"]:
        assert snap["bytes"] > 0 and snap["blocked_s"] >= 0 and snap["copy_s"] > 0

    # 4. NodeHealthCheck
    health = summary["parts"]["health"]
    assert health["verdict"] == "healthy" and health["results"][0]["matmul_gflops"] > 0

    # 5. throughput, each implementation in its own process
    ours = json.loads((out / "gpu_ours.json").read_text())
    ref = json.loads((out / "gpu_lightning.json").read_text())
    assert ours["precision"] == "ParallelPrecision" and ref["precision"] == "MixedPrecision"
    assert ours["steps"] == ref["steps"] == 3 and ours["params"] == ref["params"]
    assert math.isfinite(ours["final_loss"]) and math.isfinite(ref["final_loss"])
    compare = json.loads((out / "gpu_compare.json").read_text())
    assert compare["throughput_ratio"] == ours["tokens_per_s"] / ref["tokens_per_s"] > 0
    assert summary["parts"]["throughput"]["throughput_ratio"] == compare["throughput_ratio"]

    # 6. compression on the device path: every variant ran, PowerSGD changed the weights, the roundings
    # stayed small against the update
    comp = summary["parts"]["compression"]
    assert comp["update_size"] > 0
    assert comp["zero0-powersgd"]["max_dw_vs_uncompressed"] > 0
    for name in ("zero2-bf16", "zero3-bf16-int8"):
        assert comp[name]["max_dw_vs_uncompressed"] <= 0.05 * comp["update_size"] + 1e-6, name

    # 7. models we did not write, each against Lightning's own single-device run: 32-true equal, bf16
    # within its tolerance, frozen weights exactly as they started (fp32 under mixed precision too),
    # generate() at ZeRO-3 the same tokens, BatchNorm statistics equal; throughput ran last
    models = summary["parts"]["models"]
    assert set(models) == {
        *(f"lora-llama-zero{s}-32-true" for s in range(4)),
        "lora-llama-zero3-bf16-mixed",
        "resnet-zero2-32-true",
        "resnet-zero3-32-true",
        "fabric-lora-llama-zero3",
        "metrics-meta-init-zero3",
    }
    metrics = models.pop("metrics-meta-init-zero3")
    assert metrics["metric_device"] == "cpu" and abs(metrics["test_metric"] - metrics["test_loss"]) <= 1e-5
    for name, row in models.items():
        assert len(row["losses"]) == 4 and all(math.isfinite(x) for x in row["losses"]), name
        assert row["max_dloss"] <= row.get("tol", 1e-5), name
        if not name.startswith("fabric"):
            assert row["max_dw"] <= row["tol"] and row["dtest"] <= row["tol"], name
        if name.startswith("lora"):
            assert row["frozen_moved"] == 0.0, name
    assert models["lora-llama-zero3-bf16-mixed"]["max_dw"] > 0  # it did compute in bf16
    assert models["lora-llama-zero3-32-true"]["generated_equal"] is True
    assert models["resnet-zero3-32-true"]["max_d_running_stats"] <= 1e-5
    assert list(summary["seconds"])[:7][-1] == "throughput"


def test_gpu_profile_cpu_path(tmp_path: Path) -> None:
    """``benchmarks/gpu_profile.py``'s CPU path: both implementations profiled over the same steps; each
    file names its step time and its operator count per step, and lists the operators by time."""
    out = tmp_path / "out"
    _run_cpu_path("benchmarks.gpu_profile", out, tmp_path)
    counts = {}
    for impl in ("ours", "lightning"):
        head, *table = (out / f"profile_{impl}.txt").read_text().splitlines()
        assert head.startswith(f"{impl} on cpu: ") and "ms per step" in head, head
        counts[impl] = int(head.split(", ")[-1].split()[0])
        assert any("aten::mm" in line or "aten::addmm" in line for line in table), impl
    # the same model and steps: the engine adds work (bucket copies, hooks) but not a different model
    assert 0.5 < counts["ours"] / counts["lightning"] < 2.0, counts
