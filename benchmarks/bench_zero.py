"""ZeRO stages 1, 2 and 3 of ``lightning_par`` against torch DDP, DDP + ZeroRedundancyOptimizer and FSDP2.

Run (from the repository root)::

    python -m benchmarks.bench_zero                         # GPT 19.2M params, all stages, 6.5-11 min
    python -m benchmarks.bench_zero --stages 1,2            # only the stage 1/2 comparison (+ DDP, ZeRO-opt)
    python -m benchmarks.bench_zero --quick                 # tiny smoke configuration, ~10-20 s
    python -m benchmarks.bench_zero --deepspeed-json benchmarks/results/deepspeed.json   # + DeepSpeed
    python -m benchmarks.bench_zero --help                  # every field of ZeroConfig is a flag

What is measured
----------------
Two Gloo ranks (one torch thread each) train the same GPT from the same seed on the same data, with
AdamW (same hyper-parameters everywhere, no gradient clipping), in up to seven implementations that live
side by side in the same two processes, each with its own model copy and optimizer:

* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (always run: the common baseline);
* ``zero_opt``: DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer`` (torch's ZeRO-1);
* ``ours_s1`` / ``ours_s2``: ``apply_zero(stage=1|2)`` + ``engine.shard_optimizers`` + ``after_step()``,
  with ``reduce_op`` (default ``"auto"``: all-reduce on Gloo) and the same bucket size as DDP;
* ``fsdp2``: torch ``fully_shard`` on every transformer block and on the root (torch's ZeRO-3);
* ``ours_s3``: ``Stage3Engine`` with ``reduce_op="all_reduce"`` (what the strategy's ``"auto"`` picks on
  Gloo), ``ours_s3_rs`` the same with ``reduce_op="reduce_scatter"`` (the engine's own default).

A step is ``zero_grad(set_to_none=True)``, forward + cross-entropy, backward (including the wait for the
gradient collectives), ``optimizer.step()`` and, for ours, ``engine.after_step()`` (the parameter
all-gather of stages 1/2): everything up to the point where the next forward can start. A barrier before
each step (not timed) aligns the ranks; a step's time is the slowest rank's. Implementations run in
rotating order (``A B C ... C B A A B C ...``, ``--block K`` steps each) so slow changes of the machine's
load hit all of them alike; each one's first ``--warmup`` steps are not summarised. Reported per
implementation: median and IQR of the step time, CPU time per step (all threads of the rank, averaged
over ranks), median forward/backward/optimizer split; per comparison: the ratio of medians, the median
of the per-round paired ratios and the CPU-time ratio (targets: ours stage 1/2 <= 1.10 x DDP, ours
stage 3 <= 1.0 x FSDP2); the global-batch loss trajectory of every implementation and its maximum
absolute and relative difference from DDP's (same math, so they must agree to ~1e-5), and the largest
difference of the final parameters.

With ``--memory-steps K > 0`` every implementation then runs K more steps *alone* in fresh processes to
measure its peak RSS per rank (a high-water mark, so it cannot be separated inside the shared run), along
with the RSS at fork time, the high-water mark after every step, and for ours the model-state bytes
measured by ``lightning_par.memory.measure_memory`` and predicted by ``estimate_memory``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks.bench_dp import BenchConfig, make_batches
from benchmarks.common import (
    StepTimer,
    config_from_args,
    config_parser,
    environment,
    fmt,
    launch,
    load_summary,
    loss_agreement,
    peak_rss_mib,
    per_impl,
    run_alone,
    time_ratios,
    timing,
    write_result,
)
from lightning_par.memory import estimate_memory, measure_memory
from lightning_par.models.gpt import GPT
from lightning_par.zero import apply_zero
from lightning_par.zero.stage3 import Stage3Engine

ALL_IMPLS = ("ddp", "zero_opt", "ours_s1", "ours_s2", "fsdp2", "ours_s3", "ours_s3_rs")
IMPLS_OF_STAGE: dict[int, tuple[str, ...]] = {
    1: ("zero_opt", "ours_s1"),
    2: ("zero_opt", "ours_s2"),
    3: ("fsdp2", "ours_s3", "ours_s3_rs"),
}
# (implementation, reference, target ratio of medians or None for an informative ratio)
COMPARISONS: tuple[tuple[str, str, float | None], ...] = (
    ("ours_s1", "ddp", 1.10),
    ("ours_s2", "ddp", 1.10),
    ("zero_opt", "ddp", None),
    ("ours_s1", "zero_opt", None),
    ("ours_s2", "zero_opt", None),
    ("ours_s3", "fsdp2", 1.0),
    ("ours_s3_rs", "fsdp2", 1.0),
    ("fsdp2", "ddp", None),
    ("ours_s3", "ddp", None),
    ("ours_s3_rs", "ddp", None),
)
LOSS_RTOL = 1e-5


@dataclass(frozen=True)
class ZeroConfig(BenchConfig):
    """Everything one run depends on (saved in the JSON); the model fields are ``bench_dp``'s.

    The micro-batch is 4 (``bench_dp``: 8) so that seven implementations fit in about ten minutes.
    """

    micro_batch: int = 4
    steps: int = 10
    stages: str = "1,2,3"
    reduce_op: str = "auto"  # stages 1/2 ("auto" = all_reduce on Gloo); stage 3 always runs both

    def num_parameters(self) -> int:
        """Parameters of the GPT (tied weights counted once), counted on the meta device (no memory)."""
        with torch.device("meta"):
            return sum(p.numel() for p in GPT(self.gpt_config()).parameters())

    def stage_list(self) -> list[int]:
        return sorted({int(s) for s in self.stages.split(",") if s.strip()})

    def impls(self) -> tuple[str, ...]:
        """The implementations to run, DDP first, in a fixed order."""
        wanted = {"ddp"} | {name for s in self.stage_list() for name in IMPLS_OF_STAGE[s]}
        return tuple(name for name in ALL_IMPLS if name in wanted)


QUICK = ZeroConfig(
    n_layer=2, n_head=2, n_embd=64, seq=32, micro_batch=2, vocab=64, steps=3, warmup=1, bucket_mb=0.05,
    lr=3e-3, memory_steps=1,
)  # fmt: skip
"""Tiny smoke configuration: several buckets per model (0.05 MiB), a loss that moves within 4 steps."""


# ---------------------------------------------------------------------------------------------- ranks
def current_rss_mib() -> float:
    """Resident set size of this process now (not the high-water mark), in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@dataclass
class Impl:
    """One implementation on one rank: what forward is called on and how it steps.

    By default a step is ``optimizer.zero_grad(set_to_none=True)``, ``loss.backward()``,
    ``optimizer.step()`` and ``after_step()``; engines with their own step (DeepSpeed) give
    ``backward_fn``/``step_fn`` instead.
    """

    name: str
    model: nn.Module  # what forward is called on (a wrapper for DDP)
    inner: nn.Module  # the GPT itself (parameter names without a wrapper prefix)
    optimizer: torch.optim.Optimizer | None
    after_step: Callable[[], None] | None
    full_params: Callable[[], dict[str, Tensor]]
    engine: Any = None
    backward_fn: Callable[[Tensor], None] | None = None
    step_fn: Callable[[], None] | None = None


def _plain_params(module: nn.Module) -> Callable[[], dict[str, Tensor]]:
    return lambda: {n: p.detach().clone() for n, p in module.named_parameters()}


def build_impl(name: str, cfg: ZeroConfig, group: dist.ProcessGroup) -> Impl:
    """Build implementation ``name`` around a freshly seeded GPT (the same on every rank, for every name)."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.gpt_config())

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)

    if name == "ddp":
        ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=cfg.bucket_mb)
        return Impl(name, ddp, model, adamw(ddp.parameters()), None, _plain_params(model))
    if name == "zero_opt":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=cfg.bucket_mb)
        opt = ZeroRedundancyOptimizer(
            ddp.parameters(),
            optimizer_class=torch.optim.AdamW,
            process_group=group,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
        )
        return Impl(name, ddp, model, opt, None, _plain_params(model))
    if name in ("ours_s1", "ours_s2"):
        engine = apply_zero(
            model,
            group=group,
            stage=int(name[-1]),
            bucket_size_mb=cfg.bucket_mb,
            reduce_op=cfg.reduce_op,  # type: ignore[arg-type]
        )
        opt = adamw(model.parameters())
        engine.shard_optimizers([opt])
        return Impl(name, model, model, opt, engine.after_step, _plain_params(model), engine)
    if name in ("ours_s3", "ours_s3_rs"):
        engine3 = Stage3Engine(
            model, group=group, reduce_op="reduce_scatter" if name == "ours_s3_rs" else "all_reduce"
        )
        opt = adamw(model.parameters())
        engine3.shard_optimizers([opt])

        def full3() -> dict[str, Tensor]:
            engine3.unshard_all()  # only at the end of the run: leaves every unit gathered
            return {n: p.detach().clone() for n, p in model.named_parameters()}

        return Impl(name, model, model, opt, engine3.after_step, full3, engine3)
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(group),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)

        def full_fsdp() -> dict[str, Tensor]:
            return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # type: ignore[operator]

        return Impl(name, model, model, adamw(model.parameters()), None, full_fsdp)
    raise ValueError(f"Unknown implementation {name!r}; expected one of {ALL_IMPLS}.")


class Runner:
    """Times and records the training steps of one implementation on one rank."""

    def __init__(self, impl: Impl, cfg: ZeroConfig) -> None:
        self.impl = impl
        self.timer = StepTimer(warmup=cfg.warmup)
        self.losses: list[float] = []
        self.peak_after_step: list[float] = []

    def step(self, x: Tensor, y: Tensor) -> None:
        """One timed training step (the barrier before it is not timed)."""
        dist.barrier()
        impl, timer = self.impl, self.timer
        with timer.step():
            with timer.phase("zero_grad"):
                if impl.step_fn is None and impl.optimizer is not None:
                    impl.optimizer.zero_grad(set_to_none=True)
            with timer.phase("forward"):
                logits = impl.model(x)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            with timer.phase("backward"):
                if impl.backward_fn is not None:
                    impl.backward_fn(loss)
                else:
                    loss.backward()
            with timer.phase("optimizer"):
                if impl.step_fn is not None:
                    impl.step_fn()
                elif impl.optimizer is not None:
                    impl.optimizer.step()
                if impl.after_step is not None:
                    impl.after_step()
        self.losses.append(loss.item())
        self.peak_after_step.append(peak_rss_mib())


def rotation(impls: tuple[str, ...], total: int, block: int) -> list[tuple[str, int]]:
    """Execution order ``(impl, step index)``: blocks of ``block`` steps, impl order reversed every round."""
    order: list[tuple[str, int]] = []
    for k, first in enumerate(range(0, total, block)):
        names = impls if k % 2 == 0 else tuple(reversed(impls))
        for name in names:
            order.extend((name, s) for s in range(first, min(first + block, total)))
    return order


def _memory_model(impl: Impl, cfg: ZeroConfig) -> dict[str, Any] | None:
    """Model-state bytes of ours, measured now and predicted by ``estimate_memory`` (None for torch's)."""
    if impl.engine is None:
        return None
    stage = 3 if isinstance(impl.engine, Stage3Engine) else impl.engine.stage
    measured = measure_memory(impl.inner, impl.engine, [impl.optimizer])
    # the placeholders of stage 3 keep the true shapes, so the module itself gives the unit sizes
    predicted = estimate_memory(impl.inner, zero_stage=stage, dp=cfg.world_size, bucket_size_mb=cfg.bucket_mb)
    return {"measured": dict(measured), "predicted": dict(predicted)}


def run_rotation(
    rank: int, cfg: ZeroConfig, built: dict[str, Impl], *, rss_at_start: float
) -> dict[str, Any]:
    """Train the implementations in ``built`` (in that order) in rotating order; return the raw data of
    this rank (what :func:`aggregate` and :func:`memory_runs` read)."""
    batches = make_batches(cfg, rank)
    impls = tuple(built)
    runners = {name: Runner(impl, cfg) for name, impl in built.items()}
    order = rotation(impls, cfg.warmup + cfg.steps, cfg.block)
    loadavg: list[float] = []
    for name, s in order:
        runners[name].step(*batches[s])
        loadavg.append(os.getloadavg()[0])

    out: dict[str, Any] = {
        "rank": rank,
        "num_parameters": cfg.num_parameters(),
        "order": [name for name, _ in order],
        "rss_at_start_mib": rss_at_start,
        "peak_rss_mib": peak_rss_mib(),
        "peak_rss_after_step_mib": {n: r.peak_after_step for n, r in runners.items()},
        "loadavg_1min_per_step": loadavg,
        "times": {n: r.timer.times for n, r in runners.items()},
        "cpu_times": {n: r.timer.cpu_times for n, r in runners.items()},
        "phases": {n: r.timer.phases for n, r in runners.items()},
        "losses": {n: r.losses for n, r in runners.items()},
        "model_state_bytes": {n: _memory_model(impl, cfg) for n, impl in built.items()},
    }
    if "ddp" in built and len(built) > 1:
        ref = built["ddp"].full_params()
        diffs = {}
        for name, impl in built.items():
            if name != "ddp":
                got = impl.full_params()
                diffs[name] = max((got[k] - v).abs().max().item() for k, v in ref.items())
        out["final_param_max_abs_diff_vs_ddp"] = diffs
    return out


def rank_main(rank: int, world: int, cfg: ZeroConfig, impls: tuple[str, ...]) -> dict[str, Any]:
    """Build ``impls`` on this (forked Gloo) rank and train them in rotating order; return the raw data."""
    rss_at_start = current_rss_mib()
    group = dist.group.WORLD
    assert group is not None  # launch() initialised the default group
    built = {name: build_impl(name, cfg, group) for name in impls}
    return run_rotation(rank, cfg, built, rss_at_start=rss_at_start)


# ---------------------------------------------------------------------------------------------- report
def compare(impls: dict[str, Any], a: str, b: str, w: int, target: float | None) -> dict[str, Any]:
    """Timing ratios and loss agreement of implementation ``a`` against reference ``b``."""
    ratios = time_ratios(impls[a], impls[b], w)  # the k-th steps of a and b ran in the same rotation round
    return {
        "impl": a,
        "reference": b,
        **ratios,
        "target_ratio": target,
        "meets_target": None if target is None else ratios["ratio_of_medians"] <= target,
        **loss_agreement(impls[a]["losses"], impls[b]["losses"], rtol=LOSS_RTOL),
    }


def aggregate(cfg: ZeroConfig, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-step slowest-rank times, summaries, ratios and loss agreement from all ranks' raw data."""
    w = cfg.warmup
    impls: dict[str, Any] = {}
    for name in per_rank[0]["times"]:
        impls[name] = {
            **timing(per_impl(per_rank, name), w),
            # every rank's loss is the mean over its equally sized micro-batch: their mean is the global loss
            "losses": [statistics.fmean(v) for v in zip(*(r["losses"][name] for r in per_rank), strict=True)],
            "model_state_bytes_rank0": per_rank[0]["model_state_bytes"][name],
        }
    comparisons = {
        f"{a}/{b}": compare(impls, a, b, w, target)
        for a, b, target in COMPARISONS
        if a in impls and b in impls
    }
    # every implementation against DDP, for the loss agreement (DDP is the reference of all)
    loss_vs_ddp = {
        name: compare(impls, name, "ddp", w, None) for name in impls if name != "ddp" and "ddp" in impls
    }
    param_diff: dict[str, float] = {}
    for r in per_rank:
        for name, d in r.get("final_param_max_abs_diff_vs_ddp", {}).items():
            param_diff[name] = max(d, param_diff.get(name, 0.0))
    load = per_rank[0]["loadavg_1min_per_step"]
    return {
        "implementations": impls,
        "comparisons": comparisons,
        "loss_agreement_vs_ddp": {
            name: {
                "loss_max_abs_diff": c["loss_max_abs_diff"],
                "loss_max_rel_diff": c["loss_max_rel_diff"],
                "losses_agree": c["losses_agree"],
                "final_param_max_abs_diff": param_diff.get(name),
            }
            for name, c in loss_vs_ddp.items()
        },
        "loss_rtol": LOSS_RTOL,
        "losses_agree": all(c["losses_agree"] for c in loss_vs_ddp.values()),
        "order_rank0": per_rank[0]["order"],
        "loadavg_1min_during_run": load_summary(load),
        "interleaved_peak_rss_mib_per_rank": [r["peak_rss_mib"] for r in per_rank],
    }


def memory_runs(cfg: ZeroConfig, impls: tuple[str, ...]) -> dict[str, Any]:
    """Peak RSS of each implementation alone, in fresh processes (``cfg.memory_steps`` steps each)."""
    out: dict[str, Any] = {"steps": cfg.memory_steps}
    for name in impls:
        per_rank, rss = run_alone(rank_main, cfg, name)
        out[name] = {
            **rss,
            "peak_rss_after_step_mib_per_rank": [r["peak_rss_after_step_mib"][name] for r in per_rank],
            "model_state_bytes_rank0": per_rank[0]["model_state_bytes"][name],
        }
    return out


def git_state() -> dict[str, Any]:
    """The checkout's commit and uncommitted changes under ``lightning_par/`` (call it when the run starts:
    the ranks use the code imported then, and the working tree may change while a long run goes on)."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--", "lightning_par") or ""
    diff = git("diff", "HEAD", "--", "lightning_par") or ""
    return {
        "commit": (git("rev-parse", "HEAD") or "").strip() or None,
        "lightning_par_uncommitted": status.splitlines(),
        "lightning_par_diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None,
    }


def print_table(cfg: ZeroConfig, nparams: int, agg: dict[str, Any], memory: dict[str, Any] | None) -> None:
    """Print the per-implementation table and the comparisons."""
    impls = agg["implementations"]
    print(
        f"\nGPT {nparams / 1e6:.2f}M params (n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, seq={cfg.seq}, "
        f"micro-batch={cfg.micro_batch}), world {cfg.world_size} x {cfg.threads_per_rank} thread, AdamW, "
        f"bucket {cfg.bucket_mb} MiB, {cfg.steps} measured + {cfg.warmup} warmup steps each"
    )
    cols = ["median s", "IQR s", "CPU s", "fwd s", "bwd s", "opt s", "RSS MiB", "loss |diff|"]
    widths = [max(9, len(c) + 2) for c in cols]
    print(f"{'impl':<11}" + "".join(f"{c:>{wd}}" for c, wd in zip(cols, widths, strict=True)))
    for name, d in impls.items():
        s, ph = d["summary"], d["phase_medians_s"]
        rss = max(memory[name]["peak_rss_mib_per_rank"]) if memory and name in memory else None
        diff = agg["loss_agreement_vs_ddp"].get(name, {}).get("loss_max_abs_diff")
        row = [
            fmt(s["median"]),
            fmt(s["iqr"]),
            fmt(d["cpu_summary"]["median"]),
            fmt(ph["forward"]),
            fmt(ph["backward"]),
            fmt(ph["optimizer"]),
            fmt(rss, ".0f"),
            "ref" if name == "ddp" else fmt(diff, ".1e"),
        ]
        print(f"{name:<11}" + "".join(f"{v:>{wd}}" for v, wd in zip(row, widths, strict=True)))
    print(f"{'ratio':<22}{'of medians':>12}{'paired':>9}{'CPU':>8}{'target':>9}")
    for key, c in agg["comparisons"].items():
        target = c["target_ratio"]
        verdict = "" if target is None else ("  OK" if c["meets_target"] else "  MISSED")
        print(
            f"{key:<22}{c['ratio_of_medians']:>12.3f}{c['median_paired_ratio']:>9.3f}"
            f"{c['cpu_ratio_of_medians']:>8.3f}{fmt(target, '<.2f') if target else '-':>9}{verdict}"
        )
    worst = max((v["loss_max_abs_diff"] for v in agg["loss_agreement_vs_ddp"].values()), default=0.0)
    verdict = "all agree" if agg["losses_agree"] else "DISAGREE"
    print(f"losses vs DDP: {verdict} at rtol {LOSS_RTOL:g} (max |diff| {worst:.1e})")
    load = agg["loadavg_1min_during_run"]
    print(
        f"1-min load average during the run: {load['min']:.2f}-{load['max']:.2f} "
        f"(median {load['median']:.2f})"
    )


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> tuple[ZeroConfig, argparse.Namespace]:
    """``(config, namespace)`` from the command line (``argv`` defaults to ``sys.argv[1:]``)."""
    p = config_parser(ZeroConfig, name="zero")
    p.add_argument(
        "--deepspeed-json",
        default=None,
        help="results of benchmarks.bench_deepspeed to put beside ours (through the shared DDP baseline)",
    )
    ns = p.parse_args(argv)
    base = QUICK if ns.quick else ZeroConfig()
    cfg = config_from_args(ns, base)
    if cfg.steps < 1 or cfg.warmup < 0 or cfg.block < 1 or cfg.world_size < 1:
        p.error("need --steps >= 1, --warmup >= 0, --block >= 1, --world-size >= 1")
    try:
        stages = cfg.stage_list()
    except ValueError:
        p.error(f"--stages must be a comma-separated list of 1, 2, 3; got {cfg.stages!r}")
    if not stages or any(s not in IMPLS_OF_STAGE for s in stages):
        p.error(f"--stages must be a comma-separated list of 1, 2, 3; got {cfg.stages!r}")
    if cfg.reduce_op not in ("auto", "all_reduce", "reduce_scatter"):
        p.error("--reduce-op must be auto, all_reduce or reduce_scatter")
    return cfg, ns


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table, write the JSON; return the JSON payload."""
    cfg, ns = parse_args(argv)
    env = environment(threads_per_rank=cfg.threads_per_rank, world_size=cfg.world_size)
    impls = cfg.impls()
    code = git_state()
    wall = time.perf_counter()
    per_rank = launch(rank_main, cfg.world_size, cfg, impls, threads_per_rank=cfg.threads_per_rank)
    agg = aggregate(cfg, per_rank)
    memory = memory_runs(cfg, impls) if cfg.memory_steps > 0 else None
    wall = time.perf_counter() - wall
    nparams = per_rank[0]["num_parameters"]
    payload: dict[str, Any] = {
        "benchmark": "zero",
        "description": "ZeRO stages 1-3: lightning_par vs torch DDP, DDP+ZeroRedundancyOptimizer and FSDP2",
        "environment": {
            **env,
            "loadavg_at_end": list(os.getloadavg()),
            "code": code,
            # glibc keeps freed memory resident unless told otherwise: RSS depends on these
            "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        },
        "config": asdict(cfg),
        "impls": list(impls),
        "model": {"name": "GPT", "num_parameters": nparams, **asdict(cfg.gpt_config())},
        **agg,
        "memory_alone": memory,
        "wall_time_s": wall,
    }
    if ns.deepspeed_json:
        from benchmarks.report import deepspeed_beside_ours, load_json

        payload["deepspeed"] = deepspeed_beside_ours(payload, load_json(ns.deepspeed_json))
    path = write_result("zero_quick" if ns.quick else "zero", payload, ns.out)
    print_table(cfg, nparams, agg, memory)
    if "deepspeed" in payload:
        from benchmarks.report import print_deepspeed

        print_deepspeed(payload["deepspeed"])
    print(f"wall time {wall:.1f} s; wrote {path}")
    return payload


if __name__ == "__main__":
    main()
