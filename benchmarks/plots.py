"""PNG plots of the benchmark JSON files (used by ``python -m benchmarks.report``).

Each function takes the parsed JSON of one benchmark (or several) and writes one PNG; each returns the
path, or ``None`` when the input holds nothing to draw. matplotlib is imported lazily (the ``plot``
extra), with the non-interactive Agg backend, so the benchmarks themselves never need it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# Comparisons drawn in the step-time plot: (benchmark, key in its comparisons, label)
_ZERO_BARS: Sequence[tuple[str, str]] = (
    ("ours_s1/ddp", "ZeRO-1 ÷ DDP"),
    ("ours_s2/ddp", "ZeRO-2 ÷ DDP"),
    ("zero_opt/ddp", "torch ZeroRedundancyOpt ÷ DDP"),
    ("ours_s3/fsdp2", "ZeRO-3 ÷ FSDP2"),
    ("fsdp2/ddp", "torch FSDP2 ÷ DDP"),
)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def step_time_ratios(results: Mapping[str, Mapping[str, Any]], path: Path) -> Path | None:
    """Bars of step-time ratios (ours ÷ reference; wall-clock median and CPU time) from ``dp``, ``zero``
    and ``tp`` results, with the 1.0 line; below 1 means ours is faster."""
    bars: list[tuple[str, float, float | None]] = []
    dp = results.get("dp")
    if dp and "comparison" in dp:
        c = dp["comparison"]
        bars.append(("DP (stage 0) ÷ DDP", c["ratio_of_medians"], c.get("cpu_ratio_of_medians")))
    zero = results.get("zero")
    if zero:
        for key, label in _ZERO_BARS:
            c = zero.get("comparisons", {}).get(key)
            if c is not None:
                bars.append((label, c["ratio_of_medians"], c.get("cpu_ratio_of_medians")))
        for stage, st in sorted((zero.get("deepspeed") or {}).get("stages", {}).items()):
            via = st.get("ds_over_ours_via_ddp")
            if via is not None:
                bars.append((f"DeepSpeed {stage} ÷ ours (via DDP)", via, st.get("ds_over_ours_via_ddp_cpu")))
    for name, label in (("tp", "TP"),):
        data = results.get(name)
        for key, c in (data or {}).get("comparisons", {}).items():
            if "ratio_of_medians" in c:
                bars.append((f"{label} {key}", c["ratio_of_medians"], c.get("cpu_ratio_of_medians")))
    if not bars:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(bars) + 1.5))
    ys = range(len(bars))
    ax.barh([y + 0.2 for y in ys], [b[1] for b in bars], height=0.4, label="wall time (median)")
    ax.barh([y - 0.2 for y in ys], [b[2] or 0.0 for b in bars], height=0.4, label="CPU time (median)")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(list(ys), [b[0] for b in bars])
    ax.invert_yaxis()
    ax.set_xlabel("step-time ratio (lower is faster for the first named)")
    ax.legend(loc="best", framealpha=0.9)
    ax.set_title("Step time relative to the reference (2 CPU ranks, Gloo)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def memory_per_rank(zero: Mapping[str, Any] | None, path: Path) -> Path | None:
    """Per implementation of ``bench_zero``: peak RSS per rank (run alone) and, where measured, the model
    state bytes (parameters + gradients + optimizer state) of rank 0."""
    if not zero or not zero.get("memory_alone"):
        return None
    names = [n for n in zero["implementations"] if n in zero["memory_alone"]]
    rss = [max(zero["memory_alone"][n]["peak_rss_mib_per_rank"]) for n in names]
    states: list[float] = []
    for n in names:
        measured = (zero["implementations"][n].get("model_state_bytes_rank0") or {}).get("measured")
        states.append(sum(measured.values()) / 2**20 if isinstance(measured, dict) else 0.0)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], rss, width=0.4, label="peak RSS (max over ranks)")
    ax.bar([x + 0.2 for x in xs], states, width=0.4, label="model states, rank 0 (0 = not measured)")
    ax.set_xticks(list(xs), names, rotation=20)
    ax.set_ylabel("MiB per rank")
    ax.set_title(f"Memory per rank, GPT {zero['model']['num_parameters'] / 1e6:.1f}M, AdamW fp32")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bubble_vs_microbatches(pp: Mapping[str, Any] | None, path: Path) -> Path | None:
    """Measured pipeline bubble (1 - busy / total, mean over ranks) against the number of micro-batches
    m, per schedule, with the analytic value of each schedule as dashed lines."""
    if not pp or not pp.get("implementations"):
        return None
    series: dict[str, list[tuple[int, float, float]]] = {}
    for d in pp["implementations"].values():
        if d.get("bubble_measured") is None:
            continue  # the unpipelined reference
        series.setdefault(d["schedule"], []).append(
            (int(d["microbatches"]), float(d["bubble_measured"]), float(d["bubble_analytic"]))
        )
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for schedule, points in sorted(series.items()):
        points.sort()
        ms = [p[0] for p in points]
        (line,) = ax.plot(ms, [p[1] for p in points], marker="o", label=f"{schedule} measured")
        ax.plot(
            ms, [p[2] for p in points], linestyle="--", color=line.get_color(), label=f"{schedule} analytic"
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches per step (m)")
    ax.set_ylabel("bubble fraction")
    p = pp.get("environment", {}).get("world_size", 2)
    ax.set_title(f"Pipeline bubble, {p} stages")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def checkpoint_blocking(ckpt: Mapping[str, Any] | None, path: Path) -> Path | None:
    """Seconds the training thread is blocked per checkpoint (log scale): FlashCheckpoint (first save and
    the later ones), ``torch.save`` (page cache and with fsync) and Lightning's ``ModelCheckpoint``."""
    if not ckpt or "blocking_and_throughput" not in ckpt:
        return None
    s = ckpt["blocking_and_throughput"]["summary"]
    bars = [
        ("FlashCheckpoint, first", s["flash_first_blocking_s"]),
        ("FlashCheckpoint, later", s["flash_blocking_after_first_s"]),
        ("torch.save", s["torch_save_s"]),
        ("torch.save + fsync", s["torch_save_fsync_s"]),
        ("ModelCheckpoint", s["model_checkpoint_s"]),
    ]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ys = range(len(bars))
    ax.barh(list(ys), [b[1] for b in bars], color=["C0", "C0", "C1", "C1", "C2"])
    for y, (_, value) in zip(ys, bars, strict=True):
        ax.text(value, y, f" {value:.3g} s", va="center", fontsize=8)
    ax.set_yticks(list(ys), [b[0] for b in bars])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(plt.NullFormatter())  # labelled minor ticks overlap on a log axis
    ax.set_xlabel("training-thread blocking time per checkpoint (s, log scale)")
    ax.set_title(f"Checkpoint blocking time, {ckpt['state_bytes'] / 1e9:.2f} GB state (CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def compression_loss(compress: Mapping[str, Any] | None, path: Path) -> Path | None:
    """Training loss against the step for every gradient-compression hook (mean over the ranks), ours
    solid and torch DDP's hook dashed, one panel per model, from ``bench_compress``'s ``loss_curves``."""
    curves = (compress or {}).get("loss_curves")
    if not curves:
        return None
    kinds = sorted({key.split("/")[0] for key in curves})
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds, strict=True):
        colors: dict[str, Any] = {}
        for key, losses in sorted(curves.items()):
            model, hook, impl = key.split("/")
            if model != kind or impl == "ours_torch_hook":
                continue
            window = max(1, len(losses) // 30)  # a running mean: single batches are noisy
            spans = [losses[max(0, i - window + 1) : i + 1] for i in range(len(losses))]
            smooth = [sum(span) / len(span) for span in spans]
            style = "-" if impl == "ours" else "--"
            (line,) = ax.plot(smooth, style, color=colors.get(hook), label=f"{hook} ({impl})", linewidth=1.2)
            colors.setdefault(hook, line.get_color())
        ax.set_xlabel("step")
        ax.set_ylabel(f"training loss (running mean of {window})")
        ax.set_yscale("log")
        ax.set_title(f"{kind.upper()}: gradient compression, 2 ranks")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
