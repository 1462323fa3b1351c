"""The benchmark report: ``REPORT.md`` plus PNG plots from every result JSON present (``dp``, ``zero``,
``deepspeed``, ``tp``, ``pp``, ``checkpoint``, ``lora``), written next to them in ``benchmarks/results/``.

Run (from the repository root)::

    python -m benchmarks.report                                  # reads and writes benchmarks/results/
    python -m benchmarks.report --zero-json A.json --out-dir /tmp/report

The plots are step-time ratios against each reference, memory per rank per ZeRO implementation, pipeline
bubble against micro-batches, and checkpoint blocking time (``plots.py``); the tables of TP, PP, DP,
checkpoints and LoRA are in ``tables.py``; the ZeRO/DeepSpeed table is here.

DeepSpeed runs in another process run (other minutes, other machine load) than ``bench_zero``, so its
step times are set beside ours in two ways: raw seconds (comparable only if both runs saw the same load)
and through the DDP baseline that each benchmark timed in its own processes:
``ds_over_ours_via_ddp = (DeepSpeed / DDP in bench_deepspeed) / (ours / DDP in bench_zero)``.
The same goes for peak RSS: both benchmarks measure DDP alone too, so ``rss_minus_ddp`` compares what
each implementation holds beyond plain DDP in the same harness.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, fmt

# DeepSpeed ZeRO stage -> (ours at that stage, torch's implementation of it)
OURS_OF_DS_STAGE = {1: ("ours_s1", "zero_opt"), 2: ("ours_s2", "zero_opt"), 3: ("ours_s3", "fsdp2")}
DESCRIPTIONS = {
    "ddp": "torch DDP",
    "zero_opt": "DDP + ZeroRedundancyOptimizer",
    "ours_s1": "ours, stage 1",
    "ours_s2": "ours, stage 2",
    "fsdp2": "torch FSDP2 (fully_shard)",
    "ours_s3": "ours, stage 3 (all_reduce)",
    "ours_s3_rs": "ours, stage 3 (reduce_scatter)",
    "ds_z1": "DeepSpeed ZeRO-1",
    "ds_z2": "DeepSpeed ZeRO-2",
    "ds_z3": "DeepSpeed ZeRO-3",
}
REFERENCE_OF = {
    "ours_s1": "ddp",
    "ours_s2": "ddp",
    "zero_opt": "ddp",
    "ours_s3": "fsdp2",
    "ours_s3_rs": "fsdp2",
}


def load_json(path: str | Path) -> dict[str, Any]:
    """The parsed JSON file at ``path``."""
    return dict(json.loads(Path(path).read_text()))


def _median(payload: dict[str, Any], name: str) -> float | None:
    d = payload["implementations"].get(name)
    return None if d is None else float(d["summary"]["median"])


def _ratio(payload: dict[str, Any], a: str, b: str) -> float | None:
    """Ratio of medians a/b inside one run (None if either is missing)."""
    x, y = _median(payload, a), _median(payload, b)
    return None if x is None or y is None else x / y


def _div(a: float | None, b: float | None) -> float | None:
    """a / b, or None if either is missing (or b is zero)."""
    return None if a is None or not b else a / b


def _peak_rss(payload: dict[str, Any], name: str) -> list[float] | None:
    memory = payload.get("memory_alone") or {}
    entry = memory.get(name)
    return None if entry is None else list(entry["peak_rss_mib_per_rank"])


def deepspeed_beside_ours(zero: dict[str, Any], ds: dict[str, Any]) -> dict[str, Any]:
    """Per DeepSpeed stage: its time and RSS raw and relative to its own DDP, and against ours and torch's
    implementation of that stage through the shared DDP baseline."""
    same_model = zero["model"] == ds["model"] and all(
        zero["config"][k] == ds["config"][k] for k in ("seq", "micro_batch", "seed", "bucket_mb", "lr")
    )
    out: dict[str, Any] = {
        "same_model_and_data": same_model,
        "deepspeed_version": ds["environment"].get("deepspeed"),
        "ddp_median_s": {"bench_zero": _median(zero, "ddp"), "bench_deepspeed": _median(ds, "ddp")},
        "loadavg_1min_during_run": {
            "bench_zero": zero.get("loadavg_1min_during_run"),
            "bench_deepspeed": ds.get("loadavg_1min_during_run"),
        },
        "stages": {},
    }
    ddp_rss_zero, ddp_rss_ds = _peak_rss(zero, "ddp"), _peak_rss(ds, "ddp")
    for stage, (ours, torch_ref) in OURS_OF_DS_STAGE.items():
        name = f"ds_z{stage}"
        if name not in ds["implementations"]:
            continue
        ds_vs_ddp = _ratio(ds, name, "ddp")
        ours_vs_ddp = _ratio(zero, ours, "ddp")
        ref_vs_ddp = _ratio(zero, torch_ref, "ddp")
        cmp = ds.get("comparisons", {}).get(f"{name}/ddp", {})
        ours_cmp = zero.get("comparisons", {}).get(f"{ours}/ddp", {})
        ds_paired, ours_paired = cmp.get("median_paired_ratio"), ours_cmp.get("median_paired_ratio")
        ds_cpu, ours_cpu = cmp.get("cpu_ratio_of_medians"), ours_cmp.get("cpu_ratio_of_medians")
        rss_ds, rss_ours = _peak_rss(ds, name), _peak_rss(zero, ours)
        out["stages"][name] = {
            "ours": ours,
            "torch_reference": torch_ref,
            "median_s_raw": _median(ds, name),
            "ours_median_s_raw": _median(zero, ours),
            "ds_over_ddp": ds_vs_ddp,
            "ds_over_ddp_paired": ds_paired,
            "ds_over_ddp_cpu": ds_cpu,
            "ours_over_ddp": ours_vs_ddp,
            "torch_reference_over_ddp": ref_vs_ddp,
            "ds_over_ours_via_ddp": _div(ds_vs_ddp, ours_vs_ddp),
            "ds_over_ours_via_ddp_paired": _div(ds_paired, ours_paired),
            "ds_over_ours_via_ddp_cpu": _div(ds_cpu, ours_cpu),
            "ds_over_torch_reference_via_ddp": _div(ds_vs_ddp, ref_vs_ddp),
            "loss_max_abs_diff_vs_ddp": ds["loss_agreement_vs_ddp"][name]["loss_max_abs_diff"],
            "peak_rss_mib_per_rank": rss_ds,
            "rss_minus_ddp_mib": (
                None if rss_ds is None or ddp_rss_ds is None else max(rss_ds) - max(ddp_rss_ds)
            ),
            "ours_rss_minus_ddp_mib": (
                None if rss_ours is None or ddp_rss_zero is None else max(rss_ours) - max(ddp_rss_zero)
            ),
        }
    return out


def print_deepspeed(d: dict[str, Any]) -> None:
    """Plain-text summary of :func:`deepspeed_beside_ours`."""
    ddp = d["ddp_median_s"]
    print(
        f"\nDeepSpeed {d['deepspeed_version']} (separate run; DDP median there "
        f"{fmt(ddp['bench_deepspeed'])} s, here {fmt(ddp['bench_zero'])} s; "
        f"same model and data: {d['same_model_and_data']})"
    )
    if not d["same_model_and_data"]:
        print("WARNING: the two runs used different models or data; these ratios mean nothing.")
    header = ("median s", 10), ("/DDP", 8), ("ours/DDP", 10), ("DS/ours", 9), ("DS/torch", 10), ("RSS-DDP", 9)
    print(f"{'impl':<7}" + "".join(f"{h:>{w}}" for h, w in header))
    for name, s in d["stages"].items():
        print(
            f"{name:<7}{fmt(s['median_s_raw']):>10}{fmt(s['ds_over_ddp']):>8}{fmt(s['ours_over_ddp']):>10}"
            f"{fmt(s['ds_over_ours_via_ddp']):>9}{fmt(s['ds_over_torch_reference_via_ddp']):>10}"
            f"{fmt(s['rss_minus_ddp_mib'], '.0f'):>9}"
        )


def markdown(zero: dict[str, Any], ds: dict[str, Any] | None = None) -> str:
    """One markdown table: every implementation of ``zero`` (and DeepSpeed's, if given)."""
    model = zero["model"]
    cfg = zero["config"]
    lines = [
        f"GPT {model['num_parameters'] / 1e6:.1f}M params (n_layer={cfg['n_layer']}, n_embd={cfg['n_embd']}, "
        f"seq={cfg['seq']}, micro-batch={cfg['micro_batch']}/rank), 2 ranks x 1 thread, Gloo, AdamW fp32, "
        f"bucket {cfg['bucket_mb']} MiB, {cfg['steps']} measured steps each (median; ratios are ratios of "
        "medians, the paired median in brackets).",
        "",
        "| implementation | median s/step (IQR) | CPU s/step | ÷ DDP | ÷ torch ref. | target | "
        "peak RSS MiB/rank (alone) | loss max abs diff vs DDP |",
        "|---|---|---|---|---|---|---|---|",
    ]
    comparisons = zero.get("comparisons", {})
    agreement = zero.get("loss_agreement_vs_ddp", {})
    for name, d in zero["implementations"].items():
        s = d["summary"]
        vs_ddp = comparisons.get(f"{name}/ddp")
        ref = REFERENCE_OF.get(name)
        vs_ref = comparisons.get(f"{name}/{ref}") if ref and ref != "ddp" else None
        rss = _peak_rss(zero, name)
        loss = agreement.get(name, {}).get("loss_max_abs_diff")
        target = (vs_ref or vs_ddp or {}).get("target_ratio")
        met = (vs_ref or vs_ddp or {}).get("meets_target")
        lines.append(
            "| "
            + " | ".join(
                [
                    DESCRIPTIONS.get(name, name),
                    f"{s['median']:.2f} ({s['iqr']:.2f})",
                    f"{d['cpu_summary']['median']:.2f}",
                    "1" if name == "ddp" else _pair(vs_ddp),
                    (f"{_pair(vs_ref)} vs FSDP2" if vs_ref else "-"),
                    "-" if target is None else f"≤ {target:.2f} {'✓' if met else '✗'}",
                    "-" if rss is None else " / ".join(f"{v:.0f}" for v in rss),
                    "ref." if name == "ddp" else fmt(loss, ".1e"),
                ]
            )
            + " |"
        )
    if ds is not None:
        beside = deepspeed_beside_ours(zero, ds)
        ddp_there = beside["ddp_median_s"]["bench_deepspeed"]
        ddp_rss = _peak_rss(ds, "ddp")
        if not beside["same_model_and_data"]:
            lines += ["", "**The DeepSpeed run used another model or other data: its ratios mean nothing.**"]
        lines += [
            "",
            f"DeepSpeed {beside['deepspeed_version']}, separate run (`bench_deepspeed`, torchrun ranks) with "
            f"torch DDP timed in the same processes (DDP median there {ddp_there:.2f} s/step, peak RSS "
            f"{'-' if ddp_rss is None else ' / '.join(f'{v:.0f}' for v in ddp_rss)} MiB/rank); "
            "DeepSpeed is compared with ours and torch's only through each run's DDP.",
            "",
            "| DeepSpeed | median s/step (IQR) | CPU s/step | ÷ DDP (same run) | ours ÷ DDP | "
            "DeepSpeed ÷ ours, via DDP | DeepSpeed ÷ torch's, via DDP | "
            "peak RSS MiB/rank (vs DDP's; ours vs DDP's) | loss max abs diff vs DDP |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, st in beside["stages"].items():
            d = ds["implementations"][name]
            rss = st["peak_rss_mib_per_rank"]
            ref = DESCRIPTIONS[st["torch_reference"]].split(" (")[0]
            lines.append(
                "| "
                + " | ".join(
                    [
                        DESCRIPTIONS[name],
                        f"{d['summary']['median']:.2f} ({d['summary']['iqr']:.2f})",
                        f"{d['cpu_summary']['median']:.2f}",
                        f"{fmt(st['ds_over_ddp'])} (paired {fmt(st['ds_over_ddp_paired'])},"
                        f" CPU {fmt(st['ds_over_ddp_cpu'])})",
                        f"{fmt(st['ours_over_ddp'])} ({DESCRIPTIONS[st['ours']]})",
                        f"{fmt(st['ds_over_ours_via_ddp'])} (paired {fmt(st['ds_over_ours_via_ddp_paired'])},"
                        f" CPU {fmt(st['ds_over_ours_via_ddp_cpu'])})",
                        f"{fmt(st['ds_over_torch_reference_via_ddp'])} (vs {ref})",
                        ("-" if rss is None else " / ".join(f"{v:.0f}" for v in rss))
                        + f" ({fmt(st['rss_minus_ddp_mib'], '+.0f')};"
                        + f" {fmt(st['ours_rss_minus_ddp_mib'], '+.0f')})",
                        fmt(st["loss_max_abs_diff_vs_ddp"], ".1e"),
                    ]
                )
                + " |"
            )
    load = zero.get("loadavg_1min_during_run", {})
    if load:
        lines += [
            "",
            f"bench_zero wall time {zero['wall_time_s'] / 60:.1f} min; 1-min load average during the run "
            f"{load['min']:.1f}-{load['max']:.1f} (median {load['median']:.1f}; the benchmark's own 2 ranks "
            "count ~2).",
        ]
    return "\n".join(lines)


def _pair(c: dict[str, Any] | None) -> str:
    if c is None:
        return "-"
    return f"{c['ratio_of_medians']:.3f} ({c['median_paired_ratio']:.3f})"


def full_report(results: dict[str, dict[str, Any]], out_dir: Path) -> str:
    """``REPORT.md`` and the PNG plots in ``out_dir`` from whichever results are present; returns the
    markdown. Plots are skipped with a note when matplotlib (the ``plot`` extra) is missing."""
    from benchmarks import plots, tables

    out_dir.mkdir(parents=True, exist_ok=True)
    if results.get("zero") is not None and results.get("deepspeed") is not None:
        results["zero"]["deepspeed"] = deepspeed_beside_ours(results["zero"], results["deepspeed"])
    drawn: list[tuple[str, Path]] = []
    try:
        for title, fn, arg in (
            ("Step time ÷ reference", plots.step_time_ratios, results),
            ("Memory per rank (ZeRO)", plots.memory_per_rank, results.get("zero")),
            ("Pipeline bubble vs micro-batches", plots.bubble_vs_microbatches, results.get("pp")),
            ("Checkpoint blocking time", plots.checkpoint_blocking, results.get("checkpoint")),
            ("Training loss per compression hook", plots.compression_loss, results.get("compress")),
        ):
            name = fn.__name__ + ".png"
            path = fn(arg, out_dir / name)  # type: ignore[operator]
            if path is not None:
                drawn.append((title, Path(name)))
        plot_note = ""
    except ImportError as exc:
        plot_note = f"(no plots: {exc}; install the `plot` extra)"
    lines = [
        "# Benchmark report",
        "",
        "Generated by `python -m benchmarks.report` from the JSON files in"
        " this directory; every figure is read from them.",
        "",
    ]
    if plot_note:
        lines += [plot_note, ""]
    for title, name in drawn:
        lines += [f"![{title}]({name.as_posix()})", ""]
    sections = (
        ("Data parallel", "dp", tables.dp_section),
        ("ZeRO 1/2/3 (and DeepSpeed)", "zero", lambda z: markdown(z, results.get("deepspeed")).split("\n")),
        ("Tensor parallel", "tp", tables.tp_section),
        ("Pipeline parallel", "pp", tables.pp_section),
        ("Checkpoints", "checkpoint", tables.checkpoint_section),
        ("LoRA at ZeRO-3", "lora", tables.lora_section),
        ("Gradient compression", "compress", tables.compress_section),
        ("Gradient compression over a 1 Gbit/s link", "compress_1gbit", tables.compress_section),
    )
    for title, key, section in sections:
        if results.get(key) is not None:
            lines += [f"## {title} (`{key}.json`)", "", *section(results[key]), ""]
    text = "\n".join(lines)
    (out_dir / "REPORT.md").write_text(text)
    return text


RESULT_NAMES = ("dp", "zero", "deepspeed", "tp", "pp", "checkpoint", "lora", "compress", "compress_1gbit")


def main(argv: list[str] | None = None) -> str:
    """Write ``REPORT.md`` and the plots from the result files (default ``benchmarks/results/``); print
    the markdown."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results-dir", default=str(RESULTS_DIR), help="where the <name>.json files are")
    p.add_argument("--out-dir", default=None, help="where REPORT.md and the PNGs go (default: --results-dir)")
    for name in RESULT_NAMES:
        p.add_argument(f"--{name}-json", default=None, help=f"{name}.json elsewhere than --results-dir")
    ns = p.parse_args(argv)
    results: dict[str, dict[str, Any]] = {}
    for name in RESULT_NAMES:
        path = Path(getattr(ns, f"{name}_json") or Path(ns.results_dir) / f"{name}.json")
        if path.exists():
            results[name] = load_json(path)
    if not results:
        raise SystemExit(f"no benchmark results in {ns.results_dir}: run a benchmark first (see its README)")
    text = full_report(results, Path(ns.out_dir or ns.results_dir))
    print(text)
    return text


if __name__ == "__main__":
    main()
