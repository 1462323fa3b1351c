"""How the pipeline cut's cost model changes step time, on Hugging Face's GPT-2 with its real vocabulary.

Run (from the repository root)::

    python -m benchmarks.bench_pp_partition            # default: GPT-2 shape, vocab 50257, p=2, ~3 min
    python -m benchmarks.bench_pp_partition --quick    # tiny smoke configuration, ~20 s
    python -m benchmarks.bench_pp_partition --help     # every field of PartitionConfig is a flag

What is measured
----------------
``p`` Gloo ranks (one torch thread each) train the same seeded ``GPT2LMHeadModel`` (token table tied to
the LM head, as GPT-2 ships; ``benchmarks/hf_gpt2.py``) under our 1F1B pipeline, once per cut, on the
same data with AdamW, in rotating order in the same processes (``A B C C B A ...``; the first
``--warmup`` steps of each not summarised). Cuts (``--methods``): ``partition_method`` ``"parameters"``
(the previous default), ``"uniform"``, ``"compute"`` (the default: matrix-product weights counted at
every use, lookups free), and ``"flops"``: the layer counts that minimise the largest stage's floating-point
operations as counted by ``torch.utils.flop_counter.FlopCounterMode`` on one micro-batch's forward +
backward (attention's sequence term included), handed to the pipeline as explicit layer counts. It is
the best cut a FLOP count can give, so the reference for the others.

* **Stage load**: each stage's share of the counted FLOPs; ``max_over_ideal`` = the largest stage's
  FLOPs over ``total / p`` (1.0 is a perfect balance; the pipeline's steady state runs at the largest
  stage's pace).
* **Step time**: ``zero_grad``, ``PipelineRuntime.train_step``, the tied-gradient all-reduce,
  ``optimizer.step()``; barrier before (untimed); median over steps of the slowest rank; ratios against
  ``"parameters"`` and against ``"flops"`` (paired per round and of medians).
* **Correctness**: every cut trains the same model on the same data, so the loss trajectories agree
  (relative ``LOSS_RTOL``; the tied table's gradient is summed in another order on another cut); the
  run raises after writing the JSON if not.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import common
from benchmarks.bench_dp import BenchConfig, make_batches
from benchmarks.bench_zero import rotation
from benchmarks.hf_gpt2 import HFGPT2
from lightning_par.mesh import ParallelMesh
from lightning_par.pipeline import PipelineRuntime, partition
from lightning_par.pipeline.apply import TiedGradients, apply_pipeline

LOSS_RTOL = 1e-4
ALL_METHODS = ("parameters", "uniform", "compute", "flops")


@dataclass(frozen=True)
class PartitionConfig(BenchConfig):
    n_layer: int = 12
    n_head: int = 6
    n_embd: int = 384
    seq: int = 64
    micro_batch: int = 2  # rows per pipeline micro-batch
    vocab: int = 50257  # GPT-2's: the head's product is as large as five of these blocks
    microbatches: int = 8
    schedule: str = "1f1b"
    methods: str = ",".join(ALL_METHODS)
    steps: int = 8
    warmup: int = 1
    world_size: int = 2
    lr: float = 3e-4

    def model(self) -> HFGPT2:
        return HFGPT2(
            vocab=self.vocab, seq=self.seq, n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd
        )


QUICK = PartitionConfig(n_layer=4, n_head=2, n_embd=64, seq=16, vocab=4096, microbatches=4, steps=3)


def layer_flops(cfg: PartitionConfig) -> list[float]:
    """Counted FLOPs of one micro-batch's forward + backward through each pipeline layer (meta tensors)."""
    with torch.device("meta"):
        layers = cfg.model().layers()
    x: Any = torch.zeros(cfg.micro_batch, cfg.seq, dtype=torch.int64, device="meta")
    flops = []
    for layer in layers:
        with FlopCounterMode(display=False) as counter:
            y = layer(x)
            if y.requires_grad:
                y.float().sum().backward()
        flops.append(float(counter.get_total_flops()))
        x = y.detach().requires_grad_(True)
    return flops


def cut_of(method: str, flops: list[float], cfg: PartitionConfig) -> Any:
    """What ``apply_pipeline`` gets for ``method``: the method's name, or the FLOP-optimal layer counts."""
    if method != "flops":
        return method
    return tuple(end - start for start, end in partition(flops, cfg.world_size))


class Runner:
    def __init__(self, method: Any, cfg: PartitionConfig, mesh: ParallelMesh) -> None:
        torch.manual_seed(cfg.seed)
        self.model = cfg.model()
        split = apply_pipeline(
            self.model.layers(),
            pp_rank=mesh.coords.pp,
            pp_size=cfg.world_size,
            method=method,
            groups=(mesh.pp_group,),
        )
        self.pieces = split.pieces
        self.runtime = PipelineRuntime(
            chunks=split.chunks, group=mesh.pp_group, schedule=cfg.schedule, num_microbatches=cfg.microbatches
        )
        self.tied = TiedGradients(
            self.model, local=split.local, pp_group=mesh.pp_group, pp_groups=mesh.layout.groups("pp")
        )
        params = [p for p in self.model.parameters() if id(p) in split.local]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
        self.timer = common.StepTimer(warmup=cfg.warmup)
        self.losses: list[float] = []
        self.first = mesh.coords.pp == 0

    def step(self, x: Tensor, y: Tensor, m: int) -> None:
        xs, ys = x.chunk(m), y.chunk(m)
        dist.barrier()
        with self.timer.step():
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.runtime.train_step(
                inputs=list(xs) if self.first else None,
                loss_fn=lambda out, i: F.cross_entropy(out.flatten(0, 1), ys[i].flatten()),
            )
            self.tied.exchange()
            self.optimizer.step()
        self.losses.append(float(loss))


def rank_main(rank: int, world: int, cfg: PartitionConfig, methods: tuple[str, ...]) -> dict[str, Any]:
    mesh = ParallelMesh(pipeline_parallel_size=world)
    flops = layer_flops(cfg)
    runners = {name: Runner(cut_of(name, flops, cfg), cfg, mesh) for name in methods}
    data = replace(BenchConfig(), vocab=cfg.vocab, seq=cfg.seq, world_size=1, seed=cfg.seed)
    data = replace(data, micro_batch=cfg.microbatches * cfg.micro_batch, steps=cfg.steps, warmup=cfg.warmup)
    batches = make_batches(data, 0)  # the same rows on every stage: the first reads inputs, the last targets
    for name, k in rotation(methods, cfg.warmup + cfg.steps, 1):
        x, y = batches[k]
        runners[name].step(x, y, cfg.microbatches)
    return {
        "flops": flops,
        "pieces": {n: r.pieces for n, r in runners.items()},
        "losses": {n: r.losses for n, r in runners.items()},
        "times": {n: r.timer.times for n, r in runners.items()},
        "cpu_times": {n: r.timer.cpu_times for n, r in runners.items()},
        "phases": {n: {} for n in runners},
    }


def stage_load(flops: list[float], pieces: list[tuple[int, int]]) -> dict[str, Any]:
    loads = [sum(flops[a:b]) for a, b in pieces]
    ideal = sum(flops) / len(pieces)
    return {"stage_flops_share": [x / sum(flops) for x in loads], "max_over_ideal": max(loads) / ideal}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = common.config_parser(PartitionConfig, name="pp_partition")
    ns = parser.parse_args(argv)
    cfg = common.config_from_args(ns, QUICK if ns.quick else PartitionConfig())
    methods = tuple(cfg.methods.split(","))
    unknown = set(methods) - set(ALL_METHODS)
    if unknown:
        raise SystemExit(f"--methods: unknown {sorted(unknown)}; choose from {ALL_METHODS}")
    start = time.perf_counter()
    per_rank = common.launch(rank_main, cfg.world_size, cfg, methods, threads_per_rank=cfg.threads_per_rank)
    flops, pieces = per_rank[0]["flops"], per_rank[0]["pieces"]
    timings = {n: common.timing(common.per_impl(per_rank, n), cfg.warmup) for n in methods}
    losses = per_rank[-1]["losses"]  # the last stage computes them; every rank returns the same
    reference = methods[0]
    results: dict[str, Any] = {}
    for n in methods:
        results[n] = {
            "pieces": pieces[n],
            **stage_load(flops, pieces[n]),
            "step_time_median_s": timings[n]["summary"]["median"],
            "step_time_iqr_s": timings[n]["summary"]["iqr"],
            "losses": losses[n],
            **common.loss_agreement(losses[n], losses[reference], rtol=LOSS_RTOL),
        }
        for other in ("parameters", "flops"):
            if other in methods and other != n:
                results[n][f"time_over_{other}"] = common.time_ratios(timings[n], timings[other], cfg.warmup)
    payload = {
        "benchmark": "pp_partition",
        "description": __doc__.split("\n")[0] if __doc__ else "",
        "environment": common.environment(threads_per_rank=cfg.threads_per_rank, world_size=cfg.world_size),
        "config": asdict(cfg),
        "layer_flops": flops,
        "methods": results,
        "timings": timings,
        "correct": all(r["losses_agree"] for r in results.values()),
        "wall_time_s": time.perf_counter() - start,
    }
    path = common.write_result("pp_partition" + ("_quick" if ns.quick else ""), payload, ns.out)
    print(table(payload))
    print(f"wrote {path}")
    if not payload["correct"]:
        raise SystemExit("the cuts' loss trajectories differ: see the JSON")
    return payload


def table(payload: dict[str, Any]) -> str:
    rows = [
        "| cut | layers per stage | largest stage / ideal (FLOPs) | step s | ÷ parameters | ÷ flops |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in payload["methods"].items():
        counts = "/".join(str(b - a) for a, b in r["pieces"])
        ratio = {k: r.get(f"time_over_{k}", {}).get("median_paired_ratio") for k in ("parameters", "flops")}
        rows.append(
            f"| {name} | {counts} | {r['max_over_ideal']:.3f} | {r['step_time_median_s']:.3f}"
            f" | {common.fmt(ratio['parameters'])} | {common.fmt(ratio['flops'])} |"
        )
    rows.append(
        f"\nloss trajectories agree (rtol {LOSS_RTOL}): {payload['correct']}; median of losses:"
        f" {statistics.median(next(iter(payload['methods'].values()))['losses']):.4f}"
    )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
