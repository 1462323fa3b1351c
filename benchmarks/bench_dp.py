"""Data parallel (ZeRO stage 0): ``lightning_par``'s ``apply_data_parallel`` against torch DDP.

Run (from the repository root)::

    python -m benchmarks.bench_dp                  # default GPT (19.2M params), ~3-4 min on 2 CPU cores
    python -m benchmarks.bench_dp --quick          # tiny smoke configuration, a few seconds
    python -m benchmarks.bench_dp --steps 30 --warmup 3 --n-layer 8 --out /tmp/dp.json

What is measured
----------------
Two Gloo ranks (one torch thread each) train the same GPT from the same seed on the same data, twice
side by side in the same processes: (a) ``apply_data_parallel`` (our bucketed, overlapped all-reduce)
and (b) ``torch.nn.parallel.DistributedDataParallel`` (the engine behind Lightning's ``"ddp"``), each
with its own model copy and AdamW. Both use the same bucket size (``bucket_cap_mb`` is passed
explicitly, so DDP's 1 MiB first bucket is not used) and ``zero_grad(set_to_none=True)`` as Lightning
does. A step is ``zero_grad, forward + cross-entropy, backward (including the wait for the gradient
all-reduces), optimizer.step``; a barrier before each step (not timed) aligns the ranks, and the step
time is the slowest rank's. Implementations alternate in ABBA blocks (ours, ddp, ddp, ours, ...) so
slow drifts of the machine hit both equally; each implementation's first ``--warmup`` steps are not
summarised. Reported: median and IQR step time per implementation, the ratio of medians ours/DDP
(target <= 1.05) and the median of per-pair ratios (adjacent steps), the global-batch loss trajectory of
each and their maximum absolute and relative difference (same math, so they must agree to ~1e-5).

With ``--memory-steps K > 0`` each implementation then runs K more steps alone in fresh processes to
report its peak RSS (a high-water mark, so it cannot be separated inside the interleaved run).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks.common import (
    StepTimer,
    config_from_args,
    config_parser,
    environment,
    launch,
    loss_agreement,
    peak_rss_mib,
    per_impl,
    time_ratios,
    timing,
    write_result,
)
from lightning_par.models.gpt import GPT, GPTConfig
from lightning_par.zero import apply_data_parallel

IMPLS = ("ours", "ddp")
LOSS_RTOL = 1e-5


@dataclass(frozen=True)
class BenchConfig:
    """Everything one run depends on (saved in the JSON)."""

    n_layer: int = 6
    n_head: int = 8
    n_embd: int = 512
    seq: int = 256
    micro_batch: int = 8
    vocab: int = 256
    steps: int = 15
    warmup: int = 2
    block: int = 1
    bucket_mb: float = 25.0
    lr: float = 3e-4
    weight_decay: float = 0.1
    seed: int = 0
    world_size: int = 2
    threads_per_rank: int = 1
    memory_steps: int = 2

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab,
            block_size=self.seq,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            dropout=0.0,
        )


QUICK = BenchConfig(
    n_layer=2, n_head=2, n_embd=64, seq=32, micro_batch=2, vocab=64, steps=4, warmup=1, bucket_mb=0.05,
    lr=3e-3, memory_steps=1,
)  # fmt: skip
"""Tiny smoke configuration: several buckets per model (0.05 MiB), a loss that moves within 5 steps."""


# ---------------------------------------------------------------------------------------------- data
def make_batches(cfg: BenchConfig, rank: int) -> list[tuple[Tensor, Tensor]]:
    """This rank's micro-batch for every step: rank ``r`` takes rows ``[r*B, (r+1)*B)`` of a global batch.

    Each sequence is an arithmetic progression modulo the vocabulary with a random start and one of a few
    strides, so the loss falls visibly within a few steps (a moving trajectory is a sharper equality
    check than the flat loss of uniform noise). The same steps get the same data in both implementations.
    """
    total = cfg.warmup + cfg.steps
    rows = cfg.world_size * cfg.micro_batch
    g = torch.Generator().manual_seed(cfg.seed)
    start = torch.randint(0, cfg.vocab, (total, rows, 1), generator=g)
    stride = torch.randint(1, 8, (total, rows, 1), generator=g)
    tokens = (start + stride * torch.arange(cfg.seq + 1)) % cfg.vocab
    mine = tokens[:, rank * cfg.micro_batch : (rank + 1) * cfg.micro_batch]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in mine]


# ---------------------------------------------------------------------------------------------- ranks
class Runner:
    """One implementation on one rank: its model (wrapped or hooked), optimizer, timer and losses."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], cfg: BenchConfig) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.timer = StepTimer(warmup=cfg.warmup)
        self.losses: list[float] = []

    def step(self, x: Tensor, y: Tensor) -> None:
        """One timed training step (the barrier before it is not timed)."""
        dist.barrier()
        timer = self.timer
        with timer.step():
            with timer.phase("zero_grad"):
                self.optimizer.zero_grad(set_to_none=True)
            with timer.phase("forward"):
                logits = self.model(x)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            with timer.phase("backward"):
                loss.backward()
            with timer.phase("optimizer"):
                self.optimizer.step()
        self.losses.append(loss.item())


def _ddp_bucket_sizes(ddp: DistributedDataParallel) -> list[int] | None:
    """DDP's bucket sizes in bytes after its first-iteration rebuild, if its logging data has them."""
    try:
        data = ddp._get_ddp_logging_data()
    except Exception:  # private API: absent or changed in some torch versions
        return None
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
    if isinstance(sizes, str):
        return [int(s) for s in sizes.split(",") if s.strip()]
    return None


def rank_main(rank: int, world: int, cfg: BenchConfig, impls: tuple[str, ...]) -> dict[str, Any]:
    """Train ``impls`` on this rank (interleaved in ABBA blocks when there are two); return raw data."""
    gpt_cfg = cfg.gpt_config()
    batches = make_batches(cfg, rank)
    group = dist.group.WORLD
    assert group is not None  # launch() initialised the default group
    runners: dict[str, Runner] = {}
    info: dict[str, Any] = {}
    for name in impls:
        torch.manual_seed(cfg.seed)
        model = GPT(gpt_cfg)
        info["num_parameters"] = model.num_parameters()
        if name == "ours":
            sync = apply_data_parallel(model, group=group, bucket_size_mb=cfg.bucket_mb)
            runners[name] = Runner(model, list(model.parameters()), cfg)
            info["ours_sync"] = sync
        elif name == "ddp":
            ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=cfg.bucket_mb)
            runners[name] = Runner(ddp, list(ddp.parameters()), cfg)
            info["ddp_module"] = ddp
        else:
            raise ValueError(f"Unknown implementation {name!r}; expected one of {IMPLS}.")

    total = cfg.warmup + cfg.steps
    order: list[str] = []  # execution order, e.g. ours ddp ddp ours ours ddp ...
    for k, first in enumerate(range(0, total, cfg.block)):
        names = impls if k % 2 == 0 else tuple(reversed(impls))
        for name in names:
            for s in range(first, min(first + cfg.block, total)):
                runners[name].step(*batches[s])
                order.append(name)

    out: dict[str, Any] = {
        "rank": rank,
        "num_parameters": info["num_parameters"],
        "order": order,
        "peak_rss_mib": peak_rss_mib(),
        "times": {n: r.timer.times for n, r in runners.items()},
        "cpu_times": {n: r.timer.cpu_times for n, r in runners.items()},
        "phases": {n: r.timer.phases for n, r in runners.items()},
        "losses": {n: r.losses for n, r in runners.items()},
    }
    if "ours_sync" in info:
        item = next(runners["ours"].model.parameters()).element_size()
        out["ours_bucket_bytes"] = [b.numel * item for b in info["ours_sync"].layout.buckets]
    if "ddp_module" in info:
        out["ddp_bucket_bytes"] = _ddp_bucket_sizes(info["ddp_module"])
    if len(runners) == 2:
        a, b = (list(runners[n].model.parameters()) for n in impls)
        out["final_param_max_abs_diff"] = max((p - q).abs().max().item() for p, q in zip(a, b, strict=True))
    return out


# ---------------------------------------------------------------------------------------------- report
def _aggregate(cfg: BenchConfig, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-step slowest-rank times, summaries, ratios and loss agreement from all ranks' raw data."""
    w = cfg.warmup
    impls: dict[str, Any] = {}
    for name in per_rank[0]["times"]:
        impls[name] = {
            **timing(per_impl(per_rank, name), w),
            # every rank's loss is the mean over its equally sized micro-batch: their mean is the global loss
            "losses": [statistics.fmean(v) for v in zip(*(r["losses"][name] for r in per_rank), strict=True)],
            "peak_rss_mib_per_rank": [r["peak_rss_mib"] for r in per_rank],
        }
    result: dict[str, Any] = {"implementations": impls}
    if set(impls) == set(IMPLS):
        ours, ddp = impls["ours"], impls["ddp"]
        agreement = loss_agreement(ours["losses"], ddp["losses"], rtol=LOSS_RTOL)
        result["comparison"] = {
            # the k-th measured steps of the two run next to each other in time (ABBA order)
            **time_ratios(ours, ddp, w),
            "target_ratio": 1.05,
            **agreement,
            "loss_rtol": LOSS_RTOL,
            "final_param_max_abs_diff": max(r["final_param_max_abs_diff"] for r in per_rank),
            "order_rank0": per_rank[0]["order"],
        }
    return result


def _memory_runs(cfg: BenchConfig) -> dict[str, Any]:
    """Peak RSS of each implementation alone, in fresh processes (``cfg.memory_steps`` steps each)."""
    alone = replace(cfg, steps=cfg.memory_steps, warmup=0)
    out: dict[str, Any] = {"steps": cfg.memory_steps}
    for name in IMPLS:
        per_rank = launch(rank_main, cfg.world_size, alone, (name,), threads_per_rank=cfg.threads_per_rank)
        out[name] = {"peak_rss_mib_per_rank": [r["peak_rss_mib"] for r in per_rank]}
    return out


def _print_table(cfg: BenchConfig, nparams: int, agg: dict[str, Any], memory: dict[str, Any] | None) -> None:
    impls = agg["implementations"]
    print(
        f"\nGPT {nparams / 1e6:.2f}M params (n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, seq={cfg.seq}, "
        f"micro-batch={cfg.micro_batch}), world {cfg.world_size} x {cfg.threads_per_rank} thread, "
        f"bucket {cfg.bucket_mb} MiB, {cfg.steps} measured + {cfg.warmup} warmup steps each"
    )
    cols = ["median s", "IQR s", "min s", "max s", "CPU s", "fwd s", "bwd s", "opt s"]
    if memory:
        cols.append("RSS MiB alone")
    print(f"{'impl':<6}" + "".join(f"{c:>{max(9, len(c) + 2)}}" for c in cols))
    for name, d in impls.items():
        s, ph = d["summary"], d["phase_medians_s"]
        values = [s["median"], s["iqr"], s["min"], s["max"], d["cpu_summary"]["median"]]
        values += [ph["forward"], ph["backward"], ph["optimizer"]]
        row = [f"{v:.3f}" for v in values]
        if memory:
            row.append(f"{max(memory[name]['peak_rss_mib_per_rank']):.0f}")
        print(f"{name:<6}" + "".join(f"{v:>{max(9, len(c) + 2)}}" for v, c in zip(row, cols, strict=True)))
    cmp = agg.get("comparison")
    if cmp:
        verdict = "OK" if cmp["ratio_of_medians"] <= cmp["target_ratio"] else "SLOWER than target"
        print(
            f"ours/DDP: ratio of medians {cmp['ratio_of_medians']:.3f}, median paired ratio "
            f"{cmp['median_paired_ratio']:.3f} (target <= {cmp['target_ratio']}: {verdict}); "
            f"CPU time per step {cmp['cpu_ratio_of_medians']:.3f}"
        )
        print(
            f"loss: max |diff| {cmp['loss_max_abs_diff']:.2e}, max rel {cmp['loss_max_rel_diff']:.2e} "
            f"({'agree' if cmp['losses_agree'] else 'DISAGREE'} at rtol {LOSS_RTOL:g}); "
            f"final params max |diff| {cmp['final_param_max_abs_diff']:.2e}"
        )
        first, last = impls["ours"]["losses"], impls["ddp"]["losses"]
        print(f"loss ours {first[0]:.4f} -> {first[-1]:.4f}, ddp {last[0]:.4f} -> {last[-1]:.4f}")


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, str | None, bool]:
    """``(config, --out, --quick)`` from the command line (``argv`` defaults to ``sys.argv[1:]``)."""
    p = config_parser(BenchConfig, name="dp")
    ns = p.parse_args(argv)
    base = QUICK if ns.quick else BenchConfig()
    cfg = config_from_args(ns, base)
    if cfg.steps < 1 or cfg.warmup < 0 or cfg.block < 1 or cfg.world_size < 1:
        p.error("need --steps >= 1, --warmup >= 0, --block >= 1, --world-size >= 1")
    return cfg, ns.out, ns.quick


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table, write the JSON; return the JSON payload."""
    cfg, out, quick = parse_args(argv)
    env = environment(threads_per_rank=cfg.threads_per_rank, world_size=cfg.world_size)
    wall = time.perf_counter()
    per_rank = launch(rank_main, cfg.world_size, cfg, IMPLS, threads_per_rank=cfg.threads_per_rank)
    agg = _aggregate(cfg, per_rank)
    memory = _memory_runs(cfg) if cfg.memory_steps > 0 else None
    wall = time.perf_counter() - wall
    nparams = per_rank[0]["num_parameters"]
    payload = {
        "benchmark": "dp",
        "description": "ZeRO stage 0: lightning_par apply_data_parallel vs torch DistributedDataParallel",
        "environment": {**env, "loadavg_at_end": list(os.getloadavg())},
        "config": asdict(cfg),
        "model": {"name": "GPT", "num_parameters": nparams, **asdict(cfg.gpt_config())},
        "buckets": {
            "ours_bytes": per_rank[0].get("ours_bucket_bytes"),
            "ddp_bytes": per_rank[0].get("ddp_bucket_bytes"),
        },
        **agg,
        "memory_alone": memory,
        "wall_time_s": wall,
    }
    path = write_result("dp_quick" if quick else "dp", payload, out)
    _print_table(cfg, nparams, agg, memory)
    print(f"wall time {wall:.1f} s; wrote {path}")
    return payload


if __name__ == "__main__":
    main()
