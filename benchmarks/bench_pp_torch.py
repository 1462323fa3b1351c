"""Our pipeline schedules against ``torch.distributed.pipelining`` on the same GPT: bubble and step time.

Run (from the repository root)::

    python -m benchmarks.bench_pp_torch                  # default: p=2, m = 4, 8, 16, 4 pairs, ~4 min
    python -m benchmarks.bench_pp_torch --quick          # tiny smoke configuration, ~15 s
    python -m benchmarks.bench_pp_torch --schedules 1f1b,zb --microbatches 8 --out /tmp/ppt.json
    python -m benchmarks.bench_pp_torch --slack 1       # ours' 1f1b and zb with pipeline_slack=1
    python -m benchmarks.bench_pp_torch --help           # every field of PPTorchConfig is a flag

What is measured
----------------
``p`` Gloo ranks (one torch thread each) form one pipeline group. For every pair of schedules and every
number of micro-batches ``m`` both sides train the same seeded GPT on the same data (``m`` micro-batches
of ``--micro-batch`` rows) with AdamW, on the pieces ``apply_pipeline`` cuts (virtual stage ``c*p + s``
on rank ``s``, torch's mapping too), the tied embedding / LM-head gradient summed by ``TiedGradients``
after the pipeline step. Pairs: ours ``gpipe`` / ``1f1b`` vs ``ScheduleGPipe`` / ``Schedule1F1B``; ours
``interleaved_1f1b`` vs ``ScheduleInterleaved1F1B``, both with ``v = --virtual-stages`` chunks per rank;
ours ``zb`` (ZB-H1, ``v = 1``) vs ``ScheduleInterleavedZeroBubble``, which needs several stages per rank
and so runs on the ``v``-chunk pieces: the two sides of that pair cut the model differently. torch's
stages get ``input_args`` / ``output_args`` (static mode: no shape inference), ``loss_fn(output,
target)`` with ``scale_grads=True``; its last stage's ``losses=`` are broadcast after the step (untimed).
All implementations, the unpipelined reference included, run in the same processes in rotating order
(``A B C ... C B A``), the first ``--warmup`` steps of each not summarised.

* **Step time**: ``zero_grad``, the pipeline step (``PipelineRuntime.train_step`` / ``schedule.step``),
  the tied-gradient all-reduce, ``optimizer.step()``; barrier before (untimed); median over steps of the
  slowest rank; ratio ours/torch.
* **Bubble**, one definition for both: ``bubble = 1 - m * c / T`` per rank. ``T``: the pipeline part of
  the step (all forwards, backwards and transfers of the ``m`` micro-batches) from the common start after
  the barrier until the last rank is done (per step the slowest rank's; median over steps). ``c``: the
  rank's compute for one micro-batch's forward + backward (loss included on the last stage) through the
  same pieces without communication, on a copy of the pieces right after every timed step (both ranks at
  once, as in the pipeline; median after warmup). Not each rank's own pipeline time: where a rank idles
  at the end is bookkeeping (ours ends ``train_step`` with a loss broadcast that holds the last stage
  until the first is done; torch's last stage returns early and waits in the tied all-reduce instead);
  that variant is in the JSON as ``bubble_per_rank_own_T``. Reported per rank, mean (targets) and max
  over ranks, for ours also ``StepStats.bubble``; analytic (equal stages, free transfers):
  ``(p-1)/(m+p-1)`` GPipe / 1F1B, ``(p-1)/(v m+p-1)`` interleaved, ``(p-1)/(3m+p-1)`` ZB-H1 (``F = B =
  W``; bench_pp), ``(p-1)/(3 v m+p-1)`` torch's interleaved zero bubble; ``bubble_unit_schedule``: the
  order each side runs, simulated with unit costs (``F = 1``, full ``B = 2``, ``I`` and ``W`` 1 each).
* **Jitter model** (explains, no target): ``bubble_jitter_model``, that order with each action's unit
  cost times an independent lognormal factor of mean 1 and the rank's coefficient of variation ``cv``
  (``sigma^2 = ln(1 + cv^2)``), mean over 400 draws of ``1 - busy / makespan`` (``pp_sim.jitter_bubble``);
  ``cv = pstdev / mean`` of the rank's probe times after warmup (``action_cv_per_rank``; a whole F + B
  taken as one action's cv, see ``action_cv``). In a static order one rank's slow action is the other's
  idle time, so fluctuating costs alone lift the bubble above the analytic value, the more the tighter
  the ranks are coupled; ``within_jitter_model``: ``bubble_mean <= bubble_jitter_model + 0.03``.
* **Targets** (booleans, JSON and table): ours <= torch (bubble, step time) at every point; 1F1B <= GPipe
  (bubble, each side); measured bubble <= 1.2 x analytic + 0.03.
* **Correctness**: every step's loss of ours, torch's and the unpipelined model (whole GPT, gradient
  accumulation over the same micro-batches), and the final weights, agree (bench_pp's tolerances); the
  run raises after writing the JSON if not.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import pipelining

from benchmarks import common
from benchmarks.bench_dp import make_batches
from benchmarks.bench_pp import ALL_SCHEDULES, LOSS_TOL, WEIGHT_ATOL_IN_LR, WEIGHT_RTOL, PPConfig, agreement
from benchmarks.bench_pp import analytic_bubble as ours_analytic
from benchmarks.bench_zero import git_state, rotation
from benchmarks.pp_sim import Order, jitter_bubble, ours_orders, torch_orders, unit_bubble
from lightning_par.mesh import ParallelMesh
from lightning_par.models.gpt import GPT
from lightning_par.pipeline import PipelineRuntime
from lightning_par.pipeline.apply import PipelineSplit, TiedGradients, apply_pipeline

DEVICE = torch.device("cpu")
TORCH_SCHEDULES: dict[str, Any] = {
    "gpipe": pipelining.ScheduleGPipe,
    "1f1b": pipelining.Schedule1F1B,
    "interleaved_1f1b": pipelining.ScheduleInterleaved1F1B,
    "zb": pipelining.ScheduleInterleavedZeroBubble,
}


@dataclass(frozen=True)
class PPTorchConfig:
    """Everything one run depends on (saved in the JSON); ``world_size`` is the pipeline size ``p``."""

    n_layer: int = 4
    n_head: int = 6
    n_embd: int = 384
    seq: int = 128
    micro_batch: int = 2
    vocab: int = 256
    schedules: str = "gpipe,1f1b,interleaved_1f1b,zb"
    microbatches: str = "4,8,16"
    virtual_stages: int = 2
    slack: int = 0  # ours' pipeline_slack for 1f1b and zb (torch's schedules have none)
    partition: str = "parameters"
    steps: int = 6
    warmup: int = 1
    block: int = 1
    probe_reps: int = 1
    lr: float = 3e-4
    weight_decay: float = 0.1
    seed: int = 0
    world_size: int = 2
    threads_per_rank: int = 1

    def base(self) -> PPConfig:
        """bench_pp's config with the shared fields (model, data, schedule and micro-batch lists)."""
        shared = {f.name for f in dataclasses.fields(PPConfig)} & set(asdict(self))
        return PPConfig(**{k: getattr(self, k) for k in shared})

    def chunks(self, impl: str, schedule: str) -> int:
        """Chunks per rank: ours interleaved and torch's two multi-stage schedules use ``virtual_stages``."""
        multi = schedule == "interleaved_1f1b" or (impl == "torch" and schedule == "zb")
        return self.virtual_stages if multi else 1

    def impls(self) -> list[tuple[str, str, str, int]]:
        """``(name, "unpipelined" | "ours" | "torch", schedule, m)`` of every implementation."""
        out = []
        for m in self.base().microbatch_list():
            out.append((f"unpipelined_m{m}", "unpipelined", "-", m))
            for s in self.base().schedule_list():
                out.extend((f"{impl}_{s}_m{m}", impl, s, m) for impl in ("ours", "torch"))
        return out


QUICK = PPTorchConfig(
    n_layer=2, n_head=2, n_embd=64, seq=32, micro_batch=2, vocab=64, microbatches="4,8", steps=2, warmup=1,
    lr=3e-3,
)  # fmt: skip
"""Tiny smoke configuration: every pair at m = 4 and 8 (latency-bound: its bubbles mean little)."""


def analytic(impl: str, schedule: str, *, p: int, m: int, v: int) -> float:
    """Bubble with equal stages and free transfers (module docstring)."""
    if impl == "torch" and schedule == "zb":
        return (p - 1) / (3 * v * m + p - 1)
    return ours_analytic(schedule, p=p, m=m, v=v)


def lm_loss(out: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def split_model(model: GPT, cfg: PPTorchConfig, group: Any, v: int) -> tuple[PipelineSplit, list[int]]:
    """``apply_pipeline``'s pieces for ``v`` chunks per rank and their virtual stages ``c*p + s``."""
    p, s = dist.get_world_size(group), dist.get_rank(group)
    method: Any = cfg.partition
    split = apply_pipeline(model.layers(), pp_rank=s, pp_size=p, virtual_stages=v, method=method)
    return split, [c * p + s for c in range(v)]


def torch_stage(chunk: nn.Module, g: int, n: int, cfg: PPTorchConfig, group: Any) -> pipelining.PipelineStage:
    """A ``PipelineStage`` with example input / output shapes (static mode: no shape inference)."""
    mb, seq, width = cfg.micro_batch, cfg.seq, cfg.n_embd
    tokens = torch.empty(mb, seq, dtype=torch.int64, device="meta")
    x = tokens if g == 0 else torch.empty(mb, seq, width, device="meta", requires_grad=True)
    out = torch.empty(mb, seq, cfg.vocab if g == n - 1 else width, device="meta", requires_grad=True)
    return pipelining.PipelineStage(chunk, g, n, DEVICE, input_args=x, output_args=out, group=group)


# ---------------------------------------------------------------------------------------------- ranks
class Runner:
    """One implementation on one rank: model (pieces or whole), pipeline, AdamW, timer, losses."""

    def __init__(self, impl: str, schedule: str, m: int, cfg: PPTorchConfig, mesh: ParallelMesh) -> None:
        self.impl, self.m, self.group = impl, m, mesh.pp_group
        torch.manual_seed(cfg.seed)
        self.model = GPT(cfg.base().gpt_config())
        p, self.v = dist.get_world_size(self.group), cfg.chunks(impl, schedule)
        self.last, self.ids = p * self.v - 1, list(range(p * self.v))
        self.runtime: PipelineRuntime | None = None
        self.torch_schedule: Any = None
        self.tied: TiedGradients | None = None
        self.unit_bubble: float | None = None
        self.orders: Order | None = None  # the compute order run, for the jitter model in the parent
        local = {id(q) for q in self.model.parameters()}
        if impl != "unpipelined":
            split, self.ids = split_model(self.model, cfg, self.group, self.v)
            local = split.local
            if impl == "ours":
                slack = cfg.slack if schedule in ("1f1b", "zb") else 0
                self.runtime = PipelineRuntime(
                    chunks=split.chunks, group=self.group, schedule=schedule, num_microbatches=m, slack=slack
                )
                orders = ours_orders(schedule, p=p, m=m, v=self.v, slack=slack)
            else:
                pieces = zip(split.chunks, self.ids, strict=True)
                stages = [torch_stage(c, g, p * self.v, cfg, self.group) for c, g in pieces]
                cls, arg = TORCH_SCHEDULES[schedule], stages[0] if self.v == 1 else stages
                self.torch_schedule = cls(arg, n_microbatches=m, loss_fn=lm_loss)
                # a single-stage schedule's pipeline_order is for display only; it runs our schedule's order
                multi = self.v > 1
                orders = torch_orders(self.torch_schedule) if multi else ours_orders(schedule, p=p, m=m, v=1)
            self.orders, self.unit_bubble = orders, unit_bubble(orders, last=self.last)
            groups = mesh.layout.groups("pp")
            self.tied = TiedGradients(self.model, local=local, pp_group=self.group, pp_groups=groups)
        self.params = {n: q for n, q in self.model.named_parameters() if id(q) in local}
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.timer = common.StepTimer(warmup=cfg.warmup)
        self.losses: list[float] = []
        self.internal_bubble: list[float] = []

    def step(self, x: Tensor, y: Tensor) -> None:
        """One timed training step on ``m`` micro-batches of ``x``/``y`` (the barrier is not timed)."""
        xs, ys = x.chunk(self.m), y.chunk(self.m)
        mb_losses: list[Tensor] = []
        loss = torch.zeros((), device=DEVICE)
        dist.barrier()
        timer = self.timer
        with timer.step():
            with timer.phase("zero_grad"):
                self.optimizer.zero_grad(set_to_none=True)
            with timer.phase("pipeline"):
                if self.runtime is not None:
                    loss = self.runtime.train_step(inputs=xs, loss_fn=lambda out, i: lm_loss(out, ys[i]))
                elif self.torch_schedule is not None:
                    args, target = (x,) if 0 in self.ids else (), y if self.last in self.ids else None
                    self.torch_schedule.step(*args, target=target, losses=mb_losses, return_outputs=False)
                else:
                    for mx, my in zip(xs, ys, strict=True):
                        part = lm_loss(self.model(mx), my) / self.m
                        part.backward()
                        loss += part.detach()
            with timer.phase("tied"):
                if self.tied is not None:
                    self.tied.exchange()
            with timer.phase("optimizer"):
                self.optimizer.step()
        if self.runtime is not None:
            self.internal_bubble.append(self.runtime.last_stats.bubble)
        if self.torch_schedule is not None:  # the last stage's mean loss, to every rank (untimed)
            loss = torch.tensor([sum(float(t.detach()) for t in mb_losses) / self.m], device=DEVICE)
            src = dist.get_global_rank(self.group, self.last % dist.get_world_size(self.group))
            dist.broadcast(loss, src=src, group=self.group)
        self.losses.append(float(loss.reshape(-1)[0]))

    def final_params(self) -> dict[str, Tensor]:
        return {n: q.detach().clone() for n, q in self.params.items()}


class Probe:
    """``c``: one micro-batch's forward + backward (with the loss on the last stage) through this rank's
    pieces of the ``v``-chunk split, without communication, on its own copy of the model; a later stage's
    input and an earlier stage's output gradient are fixed random tensors of the right shape."""

    def __init__(self, cfg: PPTorchConfig, mesh: ParallelMesh, v: int, x: Tensor, y: Tensor) -> None:
        torch.manual_seed(cfg.seed)
        split, self.ids = split_model(GPT(cfg.base().gpt_config()), cfg, mesh.pp_group, v)
        self.chunks, self.last = split.chunks, dist.get_world_size(mesh.pp_group) * v - 1
        self.x, self.y = x[: cfg.micro_batch], y[: cfg.micro_batch]
        gen = torch.Generator(device=DEVICE).manual_seed(cfg.seed + 1)
        shape = (cfg.micro_batch, cfg.seq, cfg.n_embd)
        self.act = torch.randn(shape, generator=gen, device=DEVICE)
        self.grad = torch.randn(shape, generator=gen, device=DEVICE) * 1e-3
        self.samples: list[tuple[int, float]] = []  # (step index, seconds)

    def run(self, step: int, reps: int) -> None:
        dist.barrier()  # both ranks compute at once, as inside the pipeline
        for _ in range(reps):
            start = time.perf_counter()
            for chunk, g in zip(self.chunks, self.ids, strict=True):
                out = chunk(self.x if g == 0 else self.act.detach().requires_grad_(True))
                if g == self.last:
                    lm_loss(out, self.y).backward()
                else:
                    out.backward(self.grad)
            self.samples.append((step, time.perf_counter() - start))


def check(r: Runner, ref: Runner, other: Runner | None, tol: dict[str, float]) -> dict[str, Any]:
    """Losses and final weights of ``r`` against the unpipelined ``ref`` and (ours) torch's ``other``."""
    mine = r.final_params()
    out = {"losses": agreement(r.losses, ref.losses, LOSS_TOL)}
    out["weights"] = agreement(mine, ref.final_params(), tol)
    if other is not None:  # torch's zb holds other pieces: compare the parameters both hold
        theirs = other.final_params()
        out["losses_vs_torch"] = agreement(r.losses, other.losses, LOSS_TOL)
        out["weights_vs_torch"] = agreement({k: t for k, t in mine.items() if k in theirs}, theirs, tol)
    return out


def rank_main(rank: int, world: int, cfg: PPTorchConfig, names: tuple[str, ...]) -> dict[str, Any]:
    """Build the implementations ``names`` on this rank and train them in rotating order; raw data."""
    mesh = ParallelMesh(pipeline_parallel_size=world)
    spec = {name: (impl, s, m) for name, impl, s, m in cfg.impls()}
    runners = {name: Runner(*spec[name], cfg, mesh) for name in names}
    batches = {m: make_batches(cfg.base().data_config(m), 0) for m in {r.m for r in runners.values()}}
    first = batches[min(batches)][0]
    probes = {v: Probe(cfg, mesh, v, *first) for v in sorted({r.v for r in runners.values()})}
    order = rotation(names, cfg.warmup + cfg.steps, cfg.block)
    loadavg = []
    for name, s in order:
        r = runners[name]
        r.step(*batches[r.m][s])
        if r.impl != "unpipelined":
            probes[r.v].run(s, cfg.probe_reps)
        loadavg.append(os.getloadavg()[0])
    tol = {"rtol": WEIGHT_RTOL, "atol": WEIGHT_ATOL_IN_LR * cfg.lr}
    correctness = {}
    for n, r in runners.items():
        if r.impl != "unpipelined" and (ref := runners.get(f"unpipelined_m{r.m}")) is not None:
            other = runners.get(n.replace("ours_", "torch_")) if r.impl == "ours" else None
            correctness[n] = check(r, ref, other, tol)
    keep = ("losses", "internal_bubble", "v", "ids", "unit_bubble", "orders")
    records = {n: {k: getattr(r, k) for k in keep} | vars(r.timer) for n, r in runners.items()}
    samples = {v: pr.samples for v, pr in probes.items()}
    out = {"rank": rank, "order": [n for n, _ in order], "loadavg": loadavg, "runners": records}
    return out | {"probe_samples": samples, "correctness": correctness}


# ---------------------------------------------------------------------------------------------- report
def action_cv(samples: list[tuple[int, float]], *, warmup: int) -> float:
    """One rank's coefficient of variation of an action's compute time for the jitter model: ``pstdev /
    mean`` of its probe times (``Probe``: ``(step, seconds)``) from step ``warmup`` on.

    An approximation: the probe times a micro-batch's whole forward + backward through the rank's ``v``
    pieces, ``2v`` actions, and across steps. Independent per-action noise averages down in that sum (by
    up to ``sqrt(2v)``), while slow drift over the run (load, clock) adds to it. It is the one chosen as
    the only fluctuation measured on each rank, under the pipeline's conditions (both ranks busy), that
    needs no timer inside the timed schedules."""
    times = [t for s, t in samples if s >= warmup]
    return statistics.pstdev(times) / statistics.fmean(times)


def summarise(
    cfg: PPTorchConfig, impl: str, schedule: str, m: int, rs: list[Any], c: Any, *, cv: dict[int, list[float]]
) -> dict[str, Any]:
    """One implementation: timing (``common.timing``) and, if pipelined, its bubbles (``T``: the median
    over steps of the slowest rank's pipeline part; ``own_T``: each rank's own median), analytic value and
    jitter model (its order with per-action cv ``cv[v]`` per rank)."""
    w, p = cfg.warmup, cfg.world_size
    d: dict[str, Any] = {"impl": impl, "schedule": schedule, "microbatches": m, **common.timing(rs, w)}
    d["losses"] = rs[-1]["losses"]
    if impl == "unpipelined":
        return d
    v = rs[0]["v"]
    span = statistics.median(common.slowest(rs, "phases", "pipeline")[w:])
    own = [statistics.median(r["phases"]["pipeline"][w:]) for r in rs]
    bubble = [1 - m * cr / span for cr in c[v]]
    a = analytic(impl, schedule, p=p, m=m, v=v)
    d.update(virtual_stages=v, stages_per_rank=[r["ids"] for r in rs], compute_per_microbatch_s_per_rank=c[v])
    d.update(pipeline_s=span, pipeline_s_per_rank=own, bubble_per_rank=bubble, bubble_max=max(bubble))
    d.update(
        bubble_mean=statistics.fmean(bubble), bubble_analytic=a, bubble_unit_schedule=rs[0]["unit_bubble"]
    )
    d["bubble_per_rank_own_T"] = [1 - m * cr / t for cr, t in zip(c[v], own, strict=True)]
    d["within_analytic"] = d["bubble_mean"] <= 1.2 * a + 0.03
    jitter = jitter_bubble(rs[0]["orders"], last=p * v - 1, cv=cv[v], seed=cfg.seed)
    d.update(action_cv_per_rank=cv[v], bubble_jitter_model=jitter)
    d["within_jitter_model"] = d["bubble_mean"] <= jitter + 0.03
    if impl == "ours":
        internal = [statistics.median(r["internal_bubble"][w:]) for r in rs]
        d.update(internal_bubble_per_rank=internal, internal_bubble_mean=statistics.fmean(internal))
    return d


def aggregate(cfg: PPTorchConfig, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-implementation timing and bubbles, per-pair comparisons and targets, correctness."""
    w, ms, schedules = cfg.warmup, cfg.base().microbatch_list(), cfg.base().schedule_list()
    c = {
        v: [statistics.median(t for s, t in r["probe_samples"][v] if s >= w) for r in per_rank]
        for v in per_rank[0]["probe_samples"]
    }
    cv = {v: [action_cv(r["probe_samples"][v], warmup=w) for r in per_rank] for v in c}
    impls = {
        n: summarise(cfg, impl, s, m, [r["runners"][n] for r in per_rank], c, cv=cv)
        for n, impl, s, m in cfg.impls()
    }
    pairs: dict[str, Any] = {}
    for o, t in ((impls[f"ours_{s}_m{m}"], impls[f"torch_{s}_m{m}"]) for m in ms for s in schedules):
        pairs[f"{o['schedule']}_m{o['microbatches']}"] = {
            "time_ours_over_torch": common.time_ratios(o, t, w),
            "ours_le_torch_bubble": o["bubble_mean"] <= t["bubble_mean"],
            "ours_le_torch_time": o["summary"]["median"] <= t["summary"]["median"],
        }
    one_f_one_b: dict[str, bool] = {}
    if {"gpipe", "1f1b"} <= set(schedules):
        for i, m in ((i, m) for i in ("ours", "torch") for m in ms):
            ofo, gp = impls[f"{i}_1f1b_m{m}"]["bubble_mean"], impls[f"{i}_gpipe_m{m}"]["bubble_mean"]
            one_f_one_b[f"{i}_m{m}"] = ofo <= gp
    correctness: dict[str, Any] = {}
    for name in (n for n in impls if n in per_rank[0]["correctness"]):
        per = [r["correctness"][name] for r in per_rank]
        correctness[name] = {
            k: {
                "agree": all(x[k]["agree"] for x in per),
                "max_abs_diff": max(x[k]["max_abs_diff"] for x in per),
                "failures": [x[k]["first_failure"] for x in per if x[k]["first_failure"]],
            }
            for k in per[0]
        }
    within = {
        i: all(d["within_analytic"] for d in impls.values() if d["impl"] == i) for i in ("ours", "torch")
    }
    return {
        "implementations": impls,
        "pairs": pairs,
        "compute_per_microbatch_s": {f"v{v}": x for v, x in c.items()},
        "compute_samples_s": {f"v{v}": [r["probe_samples"][v] for r in per_rank] for v in c},
        "action_cv_per_rank": {f"v{v}": x for v, x in cv.items()},
        "targets": {
            "ours_le_torch_bubble": all(q["ours_le_torch_bubble"] for q in pairs.values()),
            "ours_le_torch_time": all(q["ours_le_torch_time"] for q in pairs.values()),
            "1f1b_le_gpipe": one_f_one_b,
            "ours_within_analytic": within["ours"],
            "torch_within_analytic": within["torch"],
        },
        "correctness": correctness,
        "correct": bool(correctness) and all(x["agree"] for cs in correctness.values() for x in cs.values()),
        "loss_tol": LOSS_TOL,
        "weight_tol": {"rtol": WEIGHT_RTOL, "atol": WEIGHT_ATOL_IN_LR * cfg.lr},
        "order_rank0": per_rank[0]["order"],
        "loadavg_1min_during_run": common.load_summary(per_rank[0]["loadavg"]),
    }


def pair_row(q: dict[str, Any], o: dict[str, Any], t: dict[str, Any], corr: dict[str, Any]) -> list[str]:
    """One table row: ours ``o`` vs torch's ``t`` (``q`` their comparison, ``corr`` ours' correctness)."""
    yn = {True: "y", False: "N"}

    def pair(f: Any) -> str:
        return f"{f(o)}/{f(t)}"

    vs = "" if o["virtual_stages"] == t["virtual_stages"] else " v" + pair(lambda d: d["virtual_stages"])
    cells = [
        pair(lambda d: f"{d['summary']['median']:.3f}"),
        f"{q['time_ours_over_torch']['ratio_of_medians']:.2f}",
        pair(lambda d: f"{d['bubble_mean']:.3f}"),
        "|".join("/".join(f"{b:.2f}" for b in d["bubble_per_rank"]) for d in (o, t)),
        f"{o['internal_bubble_mean']:.3f}",
        pair(lambda d: f"{d['bubble_analytic']:.3f}"),
        pair(lambda d: f"{d['bubble_unit_schedule']:.3f}"),
        pair(lambda d: f"{d['bubble_jitter_model']:.3f}"),
        yn[q["ours_le_torch_bubble"]] + "/" + yn[q["ours_le_torch_time"]],
        pair(lambda d: yn[d["within_analytic"]]),
        f"{corr['losses']['max_abs_diff']:.0e}/{corr['losses_vs_torch']['max_abs_diff']:.0e}",
    ]
    return [o["schedule"] + vs, str(o["microbatches"]), *cells]


def print_table(cfg: PPTorchConfig, result: dict[str, Any]) -> None:
    impls, c, cv = result["implementations"], result["compute_per_microbatch_s"], result["action_cv_per_rank"]
    print(
        f"\np={cfg.world_size}: GPT {result['model']['num_parameters'] / 1e6:.2f}M params (n_layer="
        f"{cfg.n_layer}, n_embd={cfg.n_embd}, seq={cfg.seq}), micro-batch {cfg.micro_batch} rows, "
        f"{cfg.steps} measured + {cfg.warmup} warmup steps; c per micro-batch per rank (ms): "
        + "; ".join(f"{k} " + "/".join(f"{x * 1e3:.1f}" for x in per) for k, per in c.items())
        + "; its cv: "
        + "; ".join(f"{k} " + "/".join(f"{x:.2f}" for x in per) for k, per in cv.items())
        + "\nbubble = 1 - m c / T (mean over ranks), o/t: ours/torch; internal: ours' StepStats; unit: "
        "the order run at unit costs; jitter: at unit costs x lognormal(mean 1, that cv); y/N: targets"
    )
    head = "pair m step_s_o/t o/t bubble_o/t per_rank_o|t internal analytic_o/t unit_o/t jitter_o/t"
    rows = [head.split() + ["o<=t_bub/time", "<=1.2a+.03_o/t", "loss|d|_ref/t"]]
    for name, q in result["pairs"].items():
        o, t, corr = impls[f"ours_{name}"], impls[f"torch_{name}"], result["correctness"][f"ours_{name}"]
        rows.append(pair_row(q, o, t, corr))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print(
            " ".join(
                x.rjust(wd) if i else x.ljust(wd) for i, (x, wd) in enumerate(zip(r, widths, strict=True))
            )
        )
    tg, load = result["targets"], result["loadavg_1min_during_run"]
    print(
        f"targets: ours <= torch: bubble {tg['ours_le_torch_bubble']}, step time {tg['ours_le_torch_time']}; "
        "1F1B <= GPipe: "
        + (", ".join(f"{k} {v}" for k, v in tg["1f1b_le_gpipe"].items()) or "-")
        + f"; <= 1.2 analytic + 0.03: ours {tg['ours_within_analytic']}, torch {tg['torch_within_analytic']}"
    )
    verdict = "agree" if result["correct"] else "DISAGREE"
    print(
        f"correctness (losses vs unpipelined and ours vs torch, final weights): {verdict}; "
        f"1-min load {load['min']:.2f}-{load['max']:.2f}"
    )


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> tuple[PPTorchConfig, argparse.Namespace]:
    """``(config, namespace)`` from the command line (``argv`` defaults to ``sys.argv[1:]``)."""
    parser = common.config_parser(PPTorchConfig, name="pp_torch")
    ns = parser.parse_args(argv)
    cfg = common.config_from_args(ns, QUICK if ns.quick else PPTorchConfig())
    if cfg.steps < 1 or cfg.warmup < 0 or cfg.block < 1 or cfg.world_size < 2 or cfg.probe_reps < 1:
        parser.error("need --steps >= 1, --warmup >= 0, --block >= 1, --world-size >= 2, --probe-reps >= 1")
    if cfg.slack < 0:
        parser.error("need --slack >= 0 (ours' pipeline_slack for 1f1b and zb)")
    unknown = {s.strip() for s in cfg.schedules.split(",") if s.strip()} - set(ALL_SCHEDULES)
    if unknown or not cfg.base().schedule_list():
        parser.error(f"--schedules must be a comma-separated subset of {','.join(ALL_SCHEDULES)}")
    try:
        ms = cfg.base().microbatch_list()
    except ValueError:
        ms = ()
    if not ms or any(m % cfg.world_size for m in ms) or cfg.virtual_stages < 2:
        parser.error(f"need --microbatches multiples of p={cfg.world_size} and --virtual-stages >= 2")
    return cfg, ns


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table, write the JSON (then raise if ours, torch's and the unpipelined
    model disagree); return the JSON payload."""
    cfg, ns = parse_args(argv)
    env = common.environment(threads_per_rank=cfg.threads_per_rank, world_size=cfg.world_size)
    code = git_state()
    wall = time.perf_counter()
    names = tuple(name for name, *_ in cfg.impls())
    per_rank = common.launch(rank_main, cfg.world_size, cfg, names, threads_per_rank=cfg.threads_per_rank)
    with torch.device("meta"):
        nparams = GPT(cfg.base().gpt_config()).num_parameters()
    model = {"name": "GPT", "num_parameters": nparams, **asdict(cfg.base().gpt_config())}
    result = {"config": asdict(cfg), "model": model, **aggregate(cfg, per_rank)}
    payload: dict[str, Any] = {
        "benchmark": "pp_torch",
        "description": "lightning_par pipeline schedules vs torch.distributed.pipelining (ScheduleGPipe, "
        "Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble) on the same GPT pieces: "
        "bubble 1 - m c / T, step time, equality of losses and weights",
        "environment": {**env, "loadavg_at_end": list(os.getloadavg()), "code": code},
        "reference": "unpipelined_m<m>: the whole GPT on every rank, gradient accumulation over the same m "
        "micro-batches (for correctness)",
        **result,
        "wall_time_s": time.perf_counter() - wall,
    }
    path = common.write_result("pp_torch_quick" if ns.quick else "pp_torch", payload, ns.out)
    print_table(cfg, result)
    print(f"wall time {payload['wall_time_s']:.1f} s; wrote {path}")
    if not payload["correct"]:
        bad = {n: c for n, c in payload["correctness"].items() if not all(x["agree"] for x in c.values())}
        raise RuntimeError(f"ours, torch's and the unpipelined model disagree: {bad}")
    return payload


if __name__ == "__main__":
    main()
