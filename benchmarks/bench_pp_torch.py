"""Our pipeline schedules against ``torch.distributed.pipelining`` on the same GPT: bubble and step time.

Run (from the repository root)::

    python -m benchmarks.bench_pp_torch                  # default: p=2, m = 4, 8, 16, 4 pairs + zb, ~5 min
    python -m benchmarks.bench_pp_torch --quick          # tiny smoke configuration, ~15 s
    python -m benchmarks.bench_pp_torch --schedules 1f1b,zb --microbatches 8 --out /tmp/ppt.json
    python -m benchmarks.bench_pp_torch --slack 1       # ours' 1f1b and zb with pipeline_slack=1
    python -m benchmarks.bench_pp_torch --help           # every field of PPTorchConfig is a flag

What is measured
----------------
``p`` Gloo ranks (one torch thread each) form one pipeline group. For every pair of schedules and every
number of micro-batches ``m`` both sides train the same seeded GPT (ours, or with ``--model hf_gpt2``
Hugging Face's ``GPT2LMHeadModel`` of the same sizes, whose ``Conv1D`` layers the zero-bubble split
defers too: ``benchmarks/hf_gpt2.py``) on the same data (``m`` micro-batches
of ``--micro-batch`` rows) with AdamW, on the pieces ``apply_pipeline`` cuts (virtual stage ``c*p + s``
on rank ``s``, torch's mapping too), the tied embedding / LM-head gradient summed by ``TiedGradients``
after the pipeline step. Pairs: ours ``gpipe`` / ``1f1b`` vs ``ScheduleGPipe`` / ``Schedule1F1B``; ours
``interleaved_1f1b`` / ``interleaved_zb`` vs ``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble``,
both sides with ``v = --virtual-stages`` chunks per rank. Ours ``zb`` (ZB-H1, ``v = 1``) runs alone:
torch has no single-stage zero-bubble schedule (its zero-bubble schedules need several stages per rank);
it is compared with our ``1f1b``. torch's
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
  W``; bench_pp), ``(p-1)/(3 v m+p-1)`` interleaved zero bubble (both sides); ``bubble_unit_schedule``: the
  order each side runs, simulated with unit costs (``F = 1``, full ``B = 2``, ``I`` and ``W`` 1 each).
* **Jitter model** (explains, no target): ``bubble_jitter_model``, that order with each action's unit
  cost times an independent lognormal factor of mean 1 and the rank's coefficient of variation ``cv``
  (``sigma^2 = ln(1 + cv^2)``), mean over 400 draws of ``1 - busy / makespan`` (``pp_sim.jitter_bubble``);
  ``cv = pstdev / mean`` of the rank's probe times after warmup (``action_cv_per_rank``; a whole F + B
  taken as one action's cv, see ``action_cv``). In a static order one rank's slow action is the other's
  idle time, so fluctuating costs alone lift the bubble above the analytic value, the more the tighter
  the ranks are coupled; ``within_jitter_model``: ``bubble_mean <= bubble_jitter_model + 0.03``.
* **Targets** (booleans, JSON and table): ours <= torch (bubble, step time) at every point; 1F1B <= GPipe
  (bubble, each side); zero bubble <= its 1F1B (bubble: ours ``zb`` vs ``1f1b``, each side's interleaved
  zero bubble vs its interleaved 1F1B); measured bubble <= 1.2 x analytic + 0.03.
* **Correctness**: every step's loss of ours, torch's and the unpipelined model (whole GPT, gradient
  accumulation over the same micro-batches), and the final weights, agree (bench_pp's tolerances); the
  run raises after writing the JSON if not.
"""

from __future__ import annotations

import argparse
import os
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
from benchmarks.bench_pp import (
    ALL_SCHEDULES,
    LOSS_TOL,
    WEIGHT_ATOL_IN_LR,
    WEIGHT_RTOL,
    PPModelConfig,
    agreement,
)
from benchmarks.bench_zero import git_state, rotation
from benchmarks.hf_gpt2 import HFGPT2
from benchmarks.pp_sim import Order, ours_orders, torch_orders, unit_bubble
from benchmarks.pp_torch_report import aggregate, print_table
from lightning_par.mesh import ParallelMesh
from lightning_par.models.gpt import GPT
from lightning_par.pipeline import PipelineRuntime
from lightning_par.pipeline.apply import PipelineSplit, TiedGradients, apply_pipeline
from lightning_par.pipeline.schedule import INTERLEAVED

DEVICE = torch.device("cpu")
TORCH_SCHEDULES: dict[str, Any] = {
    "gpipe": pipelining.ScheduleGPipe,
    "1f1b": pipelining.Schedule1F1B,
    "interleaved_1f1b": pipelining.ScheduleInterleaved1F1B,
    "interleaved_zb": pipelining.ScheduleInterleavedZeroBubble,
}  # ours' zb (one stage per rank) has no torch counterpart


@dataclass(frozen=True)
class PPTorchConfig(PPModelConfig):
    """Everything one run depends on (saved in the JSON): bench_pp's model, data and lists, and these."""

    steps: int = 6
    slack: int = 0  # ours' pipeline_slack for 1f1b and zb (torch's schedules have none)
    probe_reps: int = 1
    model: str = "gpt"  # "gpt" (ours) or "hf_gpt2" (Hugging Face's GPT2LMHeadModel, same sizes)

    def build(self) -> GPT | HFGPT2:
        """The seeded model: ``layers()`` for the pipeline, ``forward(ids) -> logits``."""
        torch.manual_seed(self.seed)
        if self.model == "hf_gpt2":
            sizes = dict(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd)
            return HFGPT2(vocab=self.vocab, seq=self.seq, **sizes)
        return GPT(self.gpt_config())

    def chunks(self, schedule: str) -> int:
        """Chunks per rank: the interleaved schedules (both sides) use ``virtual_stages``."""
        return self.virtual_stages if schedule in INTERLEAVED else 1

    def impls(self) -> list[tuple[str, str, str, int]]:
        """``(name, "unpipelined" | "ours" | "torch", schedule, m)`` of every implementation."""
        out = []
        for m in self.microbatch_list():
            out.append((f"unpipelined_m{m}", "unpipelined", "-", m))
            for s in self.schedule_list():
                sides = ("ours", "torch") if s in TORCH_SCHEDULES else ("ours",)
                out.extend((f"{impl}_{s}_m{m}", impl, s, m) for impl in sides)
        return out


QUICK = PPTorchConfig(
    n_layer=2, n_head=2, n_embd=64, seq=32, micro_batch=2, vocab=64, microbatches="4,8", steps=2, warmup=1,
    lr=3e-3,
)  # fmt: skip
"""Tiny smoke configuration: every pair at m = 4 and 8 (latency-bound: its bubbles mean little)."""


def lm_loss(out: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def split_model(
    model: GPT | HFGPT2, cfg: PPTorchConfig, group: Any, v: int
) -> tuple[PipelineSplit, list[int]]:
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
        self.model = cfg.build()
        p, self.v = dist.get_world_size(self.group), cfg.chunks(schedule)
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
        split, self.ids = split_model(cfg.build(), cfg, mesh.pp_group, v)
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
    if other is not None:  # the same pieces on both sides
        out["losses_vs_torch"] = agreement(r.losses, other.losses, LOSS_TOL)
        out["weights_vs_torch"] = agreement(mine, other.final_params(), tol)
    return out


def rank_main(rank: int, world: int, cfg: PPTorchConfig, names: tuple[str, ...]) -> dict[str, Any]:
    """Build the implementations ``names`` on this rank and train them in rotating order; raw data."""
    mesh = ParallelMesh(pipeline_parallel_size=world)
    spec = {name: (impl, s, m) for name, impl, s, m in cfg.impls()}
    runners = {name: Runner(*spec[name], cfg, mesh) for name in names}
    batches = {m: make_batches(cfg.data_config(m), 0) for m in {r.m for r in runners.values()}}
    first = batches[min(batches)][0]
    probes = {
        v: Probe(cfg, mesh, v, *first)
        for v in sorted({r.v for r in runners.values() if r.impl != "unpipelined"})
    }
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
    if cfg.model not in ("gpt", "hf_gpt2"):
        parser.error(f"--model must be gpt or hf_gpt2, got {cfg.model!r}")
    unknown = {s.strip() for s in cfg.schedules.split(",") if s.strip()} - set(ALL_SCHEDULES)
    if unknown or not cfg.schedule_list():
        parser.error(f"--schedules must be a comma-separated subset of {','.join(ALL_SCHEDULES)}")
    try:
        ms = cfg.microbatch_list()
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
        nparams = cfg.build().num_parameters()
    name = {"gpt": "GPT", "hf_gpt2": "Hugging Face GPT2LMHeadModel"}[cfg.model]
    model = {"name": name, "num_parameters": nparams, **asdict(cfg.gpt_config())}
    result = {"config": asdict(cfg), "model": model, **aggregate(cfg, per_rank)}
    payload: dict[str, Any] = {
        "benchmark": "pp_torch",
        "description": "lightning_par pipeline schedules vs torch.distributed.pipelining (ScheduleGPipe, "
        "Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble) on the same model's pieces: "
        "bubble 1 - m c / T, step time, equality of losses and weights",
        "environment": {**env, "loadavg_at_end": list(os.getloadavg()), "code": code},
        "reference": "unpipelined_m<m>: the whole model on every rank, gradient accumulation over the same m "
        "micro-batches (for correctness)",
        **result,
        "wall_time_s": time.perf_counter() - wall,
    }
    stem = "pp_torch" if cfg.model == "gpt" else f"pp_torch_{cfg.model}"
    path = common.write_result(f"{stem}_quick" if ns.quick else stem, payload, ns.out)
    print_table(cfg, result)
    print(f"wall time {payload['wall_time_s']:.1f} s; wrote {path}")
    if not payload["correct"]:
        bad = {n: c for n, c in payload["correctness"].items() if not all(x["agree"] for x in c.values())}
        raise RuntimeError(f"ours, torch's and the unpipelined model disagree: {bad}")
    return payload


if __name__ == "__main__":
    main()
