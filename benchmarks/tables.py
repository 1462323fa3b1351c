"""Markdown sections of the benchmark report for ``bench_dp``, ``bench_tp``, ``bench_pp``,
``bench_checkpoint`` and ``bench_lora`` results (``report.py`` holds the ZeRO/DeepSpeed table and
assembles the report).

Each function takes one parsed JSON result and returns markdown lines; every figure is read from the
JSON, nothing is typed in by hand, so the README table can always be regenerated from
``benchmarks/results/``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchmarks.common import fmt

LORA_CATEGORIES = ("parameters", "gradients", "optimizer_state")


def mib(n: float) -> str:
    """Bytes as MiB with one decimal."""
    return f"{n / 2**20:.1f}"


def _load(payload: Mapping[str, Any]) -> str:
    load = payload.get("loadavg_1min_during_run") or {}
    if not load:
        return ""
    return f"; 1-min load {load['min']:.1f}-{load['max']:.1f} during the run (its own ranks count ~2)"


def dp_section(dp: Mapping[str, Any]) -> list[str]:
    """One line: ZeRO stage 0 (``apply_data_parallel``) against torch DDP."""
    c = dp["comparison"]
    return [
        f"Data parallel (stage 0) ÷ torch DDP: {c['ratio_of_medians']:.3f} (ratio of medians; paired "
        f"{fmt(c.get('median_paired_ratio'))}, CPU time {fmt(c.get('cpu_ratio_of_medians'))}), "
        f"GPT {dp['model']['num_parameters'] / 1e6:.1f}M, 2 ranks x 1 thread.",
    ]


def tp_section(tp: Mapping[str, Any]) -> list[str]:
    """Tensor parallel (tp=2, with and without sequence parallel) against the unsharded model."""
    model, cfg = tp["model"], tp["config"]
    lines = [
        f"GPT {model['num_parameters'] / 1e6:.1f}M (n_layer={model['n_layer']}, n_embd={model['n_embd']}, "
        f"seq={cfg['seq']}), 2 ranks x 1 thread, Gloo, AdamW fp32, {cfg['steps']} measured steps"
        f"{_load(tp)}.",
        "",
        "| implementation | median s/step (IQR) | ÷ tp=1 (paired, CPU) | TP comm s/step | "
        "parameter bytes/rank (÷ full; = plan's prediction) | peak saved activations MiB/rank | "
        "peak RSS MiB/rank (alone) | agrees with tp=1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    alone = tp.get("memory_alone") or {}
    for name, d in tp["implementations"].items():
        s = d["summary"]
        c = tp["comparisons"].get(f"{name}/tp1")
        pm = tp["param_memory"][name]
        corr = tp["correctness"].get(name)
        rss = (alone.get(name) or {}).get("peak_rss_mib_per_rank")
        saved = d.get("peak_saved_activation_mib_per_rank")
        lines.append(
            "| "
            + " | ".join(
                [
                    name,
                    f"{s['median']:.3f} ({s['iqr']:.3f})",
                    "1"
                    if c is None
                    else f"{c['ratio_of_medians']:.3f} ({fmt(c.get('median_paired_ratio'))}, "
                    f"{fmt(c.get('cpu_ratio_of_medians'))})",
                    fmt(d.get("comm_median_s")),
                    f"{max(pm['measured_bytes_per_rank']) / 2**20:.1f} MiB ({pm['fraction_of_full']:.3f}; "
                    f"{'✓' if pm['matches_prediction'] else '✗'})",
                    "-" if not saved else " / ".join(f"{v:.1f}" for v in saved),
                    "-" if not rss else " / ".join(f"{v:.0f}" for v in rss),
                    "ref."
                    if corr is None
                    else ("✓" if corr["losses_agree"] and corr["weights_agree"] else "✗"),
                ]
            )
            + " |"
        )
    return lines


def pp_section(pp: Mapping[str, Any]) -> list[str]:
    """Pipeline schedules: measured and analytic bubble, in-flight micro-batches, saved activations."""
    model, cfg = pp["model"], pp["config"]
    p = pp["environment"].get("world_size", 2)
    lines = [
        f"GPT {model['num_parameters'] / 1e6:.1f}M (n_layer={model['n_layer']}, n_embd={model['n_embd']}), "
        f"{p} stages x 1 thread, Gloo, {cfg['steps']} measured steps; bubble = 1 - busy/total per rank "
        f"(mean), analytic (p-1)/(v·m+p-1){_load(pp)}.",
        "",
        "| schedule | m | median s/step | ÷ unpipelined | bubble measured | bubble analytic | "
        "forwards in flight per rank | peak saved activations MiB/rank | agrees with unpipelined |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    correctness = pp.get("correctness", {})
    for name, d in pp["implementations"].items():
        if d["schedule"] == "unpipelined":
            continue
        m = d["microbatches"]
        ref = pp["implementations"].get(f"unpipelined_m{m}")
        ratio = None if ref is None else d["summary"]["median"] / ref["summary"]["median"]
        corr = correctness.get(name) or {}
        ok = all(v for k, v in corr.items() if k.endswith("agree")) if corr else None
        saved = d.get("peak_saved_mib_per_rank")
        lines.append(
            "| "
            + " | ".join(
                [
                    d["schedule"],
                    str(m),
                    f"{d['summary']['median']:.3f}",
                    fmt(ratio),
                    fmt(d.get("bubble_measured")),
                    fmt(d.get("bubble_analytic")),
                    str(d.get("peak_forwards_in_flight_per_rank", "-")),
                    "-" if not saved else " / ".join(f"{v:.1f}" for v in saved),
                    "-" if ok is None else ("✓" if ok else "✗"),
                ]
            )
            + " |"
        )
    overheads = [
        d["bubble_measured"] - 1.2 * d["bubble_analytic"]
        for d in pp["implementations"].values()
        if d.get("bubble_measured") is not None
    ]
    if overheads:
        lines += [
            "",
            f"Measured bubble ≤ 1.2 x analytic + {max(overheads):.3f} in every row (the fixed overhead: "
            "transfers and the final loss broadcast count as idle; the analytic value assumes free ones).",
        ]
    alone = pp.get("memory_alone") or {}
    rss = [
        f"{name}: {' / '.join(f'{v:.0f}' for v in e['peak_rss_mib_per_rank'])}"
        for name, e in alone.items()
        if isinstance(e, Mapping) and "peak_rss_mib_per_rank" in e
    ]
    if rss:
        lines += ["", "Peak RSS MiB/rank, each schedule alone: " + "; ".join(rss) + "."]
    return lines


def checkpoint_section(ckpt: Mapping[str, Any]) -> list[str]:
    """FlashCheckpoint vs ``torch.save`` vs ``ModelCheckpoint``: blocking time, throughput, restart."""
    s = ckpt["blocking_and_throughput"]["summary"]
    cfg = ckpt["config"]
    tput = s["throughput_vs_none"]
    steady = s.get("throughput_vs_none_after_first_save") or {}
    lines = [
        f"State {ckpt['state_bytes'] / 1e9:.2f} GB (weights + AdamW moments), one CPU process, a checkpoint "
        f"every {cfg['every']} steps (FlashCheckpoint persists every {cfg['persist']} in the background).",
        "",
        "| checkpointing | blocking s per checkpoint | ÷ torch.save | throughput ÷ no checkpointing "
        "(after the first save) |",
        "|---|---|---|---|",
        f"| FlashCheckpoint (first save: {s['flash_first_blocking_s']:.3f} s) | "
        f"{s['flash_blocking_after_first_s']:.4f} | {s['flash_over_torch_save']:.4f} "
        f"(target ≤ {s['target_flash_over_torch_save']}) | {tput['flash']:.3f} "
        f"({fmt(steady.get('flash'))}; target ≥ {s['target_flash_throughput']}) |",
        f"| torch.save (page cache; with fsync {s['torch_save_fsync_s']:.3f} s) | "
        f"{s['torch_save_s']:.3f} | 1 | {tput['torch_save']:.3f} ({fmt(steady.get('torch_save'))}) |",
        f"| Lightning ModelCheckpoint | {s['model_checkpoint_s']:.3f} | "
        f"{s['model_checkpoint_s'] / s['torch_save_s']:.3f} | {tput['model_checkpoint']:.3f} "
        f"({fmt(steady.get('model_checkpoint'))}) |",
    ]
    none_runs = ckpt["blocking_and_throughput"]["step_times_s"].get("none", [])
    if len(none_runs) > 1:
        w = cfg["warmup"]
        means = [sum(t[w:]) / len(t[w:]) for t in none_runs]
        lines += [
            "",
            "No-checkpoint runs (first and last): "
            + " and ".join(f"{m:.3f}" for m in means)
            + " s/step; their spread is this machine's run-to-run noise.",
        ]
    restart = ckpt.get("restart")
    if restart:
        parts = [
            f"from {where.removeprefix('from_')} (step {r['resumed_step']}): process start "
            f"{r['kill_to_process_start_s']:.1f} s, resumed {r['kill_to_resume_done_s']:.1f} s, first step "
            f"{r['kill_to_first_step_s']:.1f} s"
            for where, r in restart.items()
        ]
        lines += ["", "SIGKILL → restart under `torchrun --max-restarts`: " + "; ".join(parts) + "."]
    return lines


def lora_section(payload: Mapping[str, Any]) -> list[str]:
    """LoRA and full fine-tuning at ZeRO-3, ours against FSDP2: bytes per rank measured against the
    analytic expectation, step time, peak RSS, time ratios and the correctness check (also printed by
    ``bench_lora`` itself)."""
    cfg, counts = payload["config"], payload["model"]
    lines = [
        f"Llama {counts['total_parameters'] / 1e6:.1f}M (hidden {cfg['hidden']}, {cfg['layers']} layers, "
        f"vocab {cfg['vocab']}, tied embeddings {cfg['tie_embeddings']}) + LoRA r={cfg['lora_r']} on "
        f"q/k/v/o ({counts['lora_parameters'] / 1e6:.2f}M trainable), fp32, AdamW over all parameters, "
        f"{cfg['world_size']} ranks x {cfg['threads_per_rank']} thread, batch {cfg['micro_batch']} x "
        f"{cfg['seq']} per rank{_load(payload)}. Bytes per rank after one step; expected = (4 B per "
        "parameter, 4 B grads and 8 B AdamW per trainable parameter) / ranks.",
        "",
        "| config | parameters MiB (expected) | gradients MiB (expected) | AdamW state MiB (expected) | "
        "frozen share MiB | comm buffers held MiB | median s/step | peak RSS MiB/rank |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, res in payload["results"].items():
        exp = res["expected_bytes_per_rank"]
        cells = [name]
        for cat in LORA_CATEGORIES:
            got = max(r["bytes"][cat] for r in res["per_rank"])
            cells.append(f"{mib(got)} ({mib(exp[cat])})")
        cells.append(mib(max(r["bytes"]["frozen"] for r in res["per_rank"])))
        comm = [r["detail"].get("measure_memory", {}).get("comm_buffers") for r in res["per_rank"]]
        cells.append("-" if None in comm else mib(max(comm)))  # type: ignore[type-var]
        cells.append(fmt(res["timing"]["summary"]["median"]))
        cells.append(f"{max(r['peak_rss_mib'] for r in res['per_rank']):.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    for name, err in payload["refused"].items():
        lines.append(f"| {name} | refused: `{err}` | | | | | | |")
    lines.append("")
    for key, r in payload["time_ratios"].items():
        lines.append(
            f"- step time {key}: {r['ratio_of_medians']:.3f} (CPU time {r['cpu_ratio_of_medians']:.3f})"
        )
    c = payload["correctness"]
    if "losses_agree" in c:
        lines.append(
            f"- ours_lora vs {c['reference']}: losses max rel diff {c['loss_max_rel_diff']:.1e} "
            f"(rtol {c['loss_rtol']:g}), final adapters max |diff| "
            f"{fmt(c.get('adapter_max_abs_diff'), '.1e')}; "
            "frozen base unchanged: "
            + ", ".join(f"{n} {'yes' if f['unchanged'] else 'NO'}" for n, f in c["frozen_base"].items())
            + f" — {'PASSED' if c['passed'] else 'FAILED'}"
        )
    return lines


def compress_section(payload: Mapping[str, Any]) -> list[str]:
    """Gradient compression (``bench_compress``): payload bytes per step, step time and held-out loss per
    model and hook, ours beside torch DDP with torch's hook of the same kind (and torch's hook run on our
    engine)."""
    cfg = payload["config"]
    lines = [
        f"Link: {payload.get('link', 'loopback')}. 2 ranks x 1 thread, AdamW, ZeRO-0; MLP {cfg['mlp_layers']}"
        f" x {cfg['mlp_hidden']}^2 ({cfg['mlp_steps']} steps, batch {cfg['mlp_batch']}), GPT"
        f" {cfg['gpt_layers']} layers x {cfg['gpt_embd']} on {cfg['gpt_data']} bytes ({cfg['gpt_steps']}"
        f" steps, batch {cfg['gpt_batch']} x {cfg['gpt_seq']}); PowerSGD from step {cfg['start_powersgd']}."
        " Loss: held out, after the last step. Speed-up: uncompressed step ÷ this step (each"
        " implementation against its own uncompressed run).",
        "",
        "| model / hook | all-reduce payload per step (cut) | ours s/step (speed-up) | DDP + torch hook"
        " s/step (speed-up) | ours ÷ DDP | torch hook on ours s/step | loss ours (÷ uncompressed) |"
        " loss DDP |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, r in payload["results"].items():
        cells = [
            key,
            f"{r['bytes_per_step'] / 1e6:.3f} MB ({r['bytes_cut_vs_uncompressed']:.1f}x)",
            f"{fmt(r['ours_step_s'], '.4f')} ({r['speedup_vs_uncompressed']:.2f}x)",
            "refused by DDP on Gloo"
            if r["ddp_step_s"] is None
            else f"{fmt(r['ddp_step_s'], '.4f')} ({fmt(r['ddp_speedup_vs_uncompressed'], '.2f')}x)",
            fmt(r["ours_vs_ddp"]),
            fmt(r.get("ours_torch_hook_step_s"), ".4f"),
            f"{r['final_loss']:.4f} ({r['final_loss_vs_uncompressed']:.3f})",
            fmt(r["ddp_final_loss"], ".4f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    zero3 = payload.get("zero3") or {}
    if zero3:
        lines += [
            "",
            "GPT at ZeRO-3 (ours; gradient all-reduces and parameter all-gathers counted, a gather by its"
            " gathered size):",
            "",
            "| variant | bytes per step (cut) | s/step (speed-up) | held-out loss (÷ none) |",
            "|---|---|---|---|",
        ]
        for name, r in zero3.items():
            lines.append(
                f"| {name} | {r['bytes_per_step'] / 1e6:.3f} MB ({r['bytes_cut_vs_uncompressed']:.2f}x) |"
                f" {r['step_s']:.4f} ({r['speedup_vs_uncompressed']:.2f}x) |"
                f" {r['final_loss']:.4f} ({r['final_loss_vs_uncompressed']:.4f}) |"
            )
    return lines
