"""Tensor parallelism: ``apply_tensor_parallel(plan="gpt")`` at tp=2 (with and without sequence
parallelism) against the same GPT unsharded (tp=1).

Run (from the repository root)::

    python -m benchmarks.bench_tp                  # default GPT (19.2M params), ~1.5-3 min on 2 CPU cores
    python -m benchmarks.bench_tp --quick          # tiny smoke configuration, a few seconds
    python -m benchmarks.bench_tp --impls tp1,tp2 --steps 12 --out /tmp/tp.json
    python -m benchmarks.bench_tp --help           # every field of TPConfig is a flag

What is measured
----------------
Two Gloo ranks (one torch thread each) form one tensor-parallel group (``ParallelMesh``). Every rank
sees the same global batch, as tensor parallelism requires. Implementations, each with its own model
copy (same seed) and AdamW, living side by side in the same two processes:

* ``tp1``: the unsharded GPT, run *redundantly* on both ranks (no communication at all). Each rank does
  exactly what one single-process tp=1 run would do, so its step time is the tp=1 step time, measured
  under the same load as the TP runs (both cores busy) and interleaved with them in the same processes;
  and its losses and final weights are the correctness reference on every rank.
* ``tp2``: ``apply_tensor_parallel(model, plan="gpt")``: q/k/v/fc_in column-parallel, out_proj/fc_out
  row-parallel, token embedding vocab-parallel (tied to the column-parallel LM head, whose output is
  all-gathered so the loss is the ordinary cross-entropy of full logits), LayerNorms and the position
  table replicated.
* ``tp2_sp``: the same with ``sequence_parallel=True`` (norms and residual stream split along the
  sequence; all-gather/reduce-scatter instead of all-reduce).

A step is ``zero_grad(set_to_none=True)``, forward + cross-entropy, backward, ``optimizer.step()``. A
barrier before each step (not timed) aligns the ranks; a step's time is the slowest rank's.
Implementations run in rotating order (``A B C C B A A B C ...``) and each one's first ``--warmup`` steps
are not summarised. Reported:

* **time**: median and IQR of the step time, CPU time, the forward/backward/optimizer split, the time
  inside the tensor-parallel collectives (counted by wrapping them, with their number and bytes per
  step), the ratio of medians against ``tp1``;
* **memory per rank**: parameter bytes measured and predicted from the plan (sharded: 1/t of the block
  weights and of the vocabulary table; replicated: norms, row-parallel biases, position table), the
  model-state bytes (parameters + gradients + AdamW state), the peak bytes of the activations autograd
  saves for backward (``bench_pp.ActivationTracker``: parameters excluded, each storage once), and with
  ``--memory-steps K > 0`` the peak RSS of every implementation run alone for K steps in fresh processes;
* **correctness** against ``tp1``: the loss of every step, the gradients after the first backward and
  the final weights, all-gathered (``torch.testing.assert_close`` with ``LOSS_TOL``, ``GRAD_TOL`` and
  ``WEIGHT_*``, plus the max abs difference; see the comment there for the weights' tolerance).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.bench_dp import BenchConfig, make_batches
from benchmarks.bench_pp import ActivationTracker, agreement
from benchmarks.bench_zero import current_rss_mib, git_state, rotation
from benchmarks.common import (
    StepTimer,
    config_from_args,
    config_parser,
    environment,
    fmt,
    launch,
    load_summary,
    peak_rss_mib,
    per_impl,
    run_alone,
    slowest,
    time_ratios,
    timing,
    write_result,
)
from lightning_par.mesh import ParallelMesh
from lightning_par.models.gpt import GPT, GPTConfig
from lightning_par.tensor_parallel import TP_DIM_ATTR, apply_tensor_parallel
from lightning_par.tensor_parallel import comm as tp_comm

ALL_IMPLS = ("tp1", "tp2", "tp2_sp")
# torch.testing.assert_close tolerances against tp1. The sharded matmuls sum in another order (partial
# sums + all-reduce), so nothing is bitwise equal: losses and first-step gradients differ by ~1e-7
# relative, and a sharding bug would show there at O(1). AdamW then divides each gradient by its own
# running RMS: an element whose gradient is at rounding level gets a rounding-decided update of up to
# ~lr (k_proj.bias has an exactly zero true gradient, since softmax ignores a per-row shift of the
# scores; a vocabulary row absent from the first batch can get |g| ~ 1e-9 < eps = 1e-8, and its first
# update, lr * g / (|g| + eps), then differs by ~0.15 lr on the default model). So the final weights are
# compared with an absolute tolerance of one AdamW step (``lr``); their max difference is reported in
# units of lr.
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-7}
WEIGHT_RTOL, WEIGHT_ATOL_IN_LR = 1e-4, 1.0


@dataclass(frozen=True)
class TPConfig:
    """Everything one run depends on (saved in the JSON). ``batch`` rows per step, the same on every
    rank (the tensor-parallel group shares its input); ``world_size`` is the tensor-parallel size."""

    n_layer: int = 6
    n_head: int = 8
    n_embd: int = 512
    seq: int = 256
    batch: int = 4
    vocab: int = 256
    steps: int = 8
    warmup: int = 2
    block: int = 1
    lr: float = 3e-4
    weight_decay: float = 0.1
    seed: int = 0
    world_size: int = 2
    threads_per_rank: int = 1
    memory_steps: int = 2
    impls: str = "tp1,tp2,tp2_sp"

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab,
            block_size=self.seq,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            dropout=0.0,
        )

    def impl_list(self) -> tuple[str, ...]:
        wanted = {s.strip() for s in self.impls.split(",") if s.strip()}
        return tuple(name for name in ALL_IMPLS if name in wanted)

    def data_config(self) -> BenchConfig:
        """``bench_dp``'s data with one rank of ``batch`` rows: every TP rank gets the same batch."""
        return BenchConfig(
            vocab=self.vocab,
            seq=self.seq,
            micro_batch=self.batch,
            world_size=1,
            steps=self.steps,
            warmup=self.warmup,
            seed=self.seed,
        )


QUICK = TPConfig(
    n_layer=2, n_head=4, n_embd=64, seq=32, batch=2, vocab=64, steps=3, warmup=1, lr=3e-3, memory_steps=1,
)  # fmt: skip
"""Tiny smoke configuration (0.1M params): a loss that moves within 4 steps."""


# ---------------------------------------------------------------------------------------------- model
def predicted_param_bytes(cfg: GPTConfig, t: int, *, itemsize: int = 4) -> dict[str, int]:
    """Per-rank parameter bytes of the GPT under the ``"gpt"`` plan at tensor-parallel size ``t``,
    from the shapes alone: ``sharded`` (q/k/v/fc_in weights and biases, out_proj/fc_out weights, the
    vocabulary table tied to the LM head), ``replicated`` (LayerNorms, out_proj/fc_out biases, position
    table, final norm) and the unsharded ``full`` size."""
    c, h, n = cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, cfg.n_layer
    b = 1 if cfg.bias else 0
    block_sharded = 4 * c * c + 2 * h * c + b * (3 * c + h)  # q,k,v,out weights; fc_in, fc_out; col biases
    block_replicated = b * 2 * c + 2 * (2 * c if cfg.bias else c)  # row biases; ln_1, ln_2
    vocab_table = cfg.vocab_size * c  # embed.tok, tied to head.lm_head (counted once)
    lm_head = 0 if cfg.tie_weights else cfg.vocab_size * c
    sharded = n * block_sharded + vocab_table + lm_head
    replicated = n * block_replicated + cfg.block_size * c + (2 * c if cfg.bias else c)
    return {
        "sharded": sharded // t * itemsize,
        "replicated": replicated * itemsize,
        "total": (sharded // t + replicated) * itemsize,
        "full": (sharded + replicated) * itemsize,
    }


def measured_param_bytes(model: nn.Module) -> dict[str, int]:
    """This rank's parameter bytes (tied parameters once), split by whether the plan sharded them."""
    sharded = replicated = 0
    for p in model.parameters():  # parameters() yields a tied parameter once
        nbytes = p.numel() * p.element_size()
        if getattr(p, TP_DIM_ATTR, None) is not None:
            sharded += nbytes
        else:
            replicated += nbytes
    return {"sharded": sharded, "replicated": replicated, "total": sharded + replicated}


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state held by this rank now."""
    params = list(model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    state = sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, Tensor) and v.dim() > 0
    )
    par = sum(p.numel() * p.element_size() for p in params)
    return {"parameters": par, "gradients": grads, "optimizer": state, "total": par + grads + state}


def gather_full(
    model: nn.Module, group: dist.ProcessGroup | None, *, grads: bool = False
) -> dict[str, Tensor]:
    """The unsharded parameters (or, with ``grads``, their gradients) of a tensor-parallel model: pieces
    concatenated along their tp dim (``group=None``: an unsharded model, copied as it is)."""
    world = 1 if group is None else dist.get_world_size(group)
    out = {}
    for name, p in model.named_parameters():
        value = p.grad if grads else p.detach()
        if value is None:
            value = torch.zeros_like(p)
        dim = getattr(p, TP_DIM_ATTR, None)
        if dim is not None and world > 1:
            parts = [torch.empty_like(value) for _ in range(world)]
            dist.all_gather(parts, value.contiguous(), group=group)
            value = torch.cat(parts, dim=dim)
        out[name] = value.detach().clone()
    return out


# ---------------------------------------------------------------------------------------------- comm
@dataclass
class CommCounter:
    """Number, bytes and wall time of the tensor-parallel collectives, per step (see :func:`counting`)."""

    active: bool = False
    counts: dict[str, int] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def reset(self) -> None:
        self.counts, self.nbytes, self.seconds = {}, {}, 0.0

    def wrap(self, kind: str, fn: Callable[..., Any], tensor_arg: int) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(*args, **kwargs)
            t = args[tensor_arg]
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.counts[kind] = self.counts.get(kind, 0) + 1
                self.nbytes[kind] = self.nbytes.get(kind, 0) + t.numel() * t.element_size()

        return wrapped


@contextmanager
def counting(counter: CommCounter) -> Iterator[None]:
    """Route the collectives of ``lightning_par.tensor_parallel`` through ``counter``: ``dist.all_reduce``
    (looked up at call time by ``comm.py`` and ``layers.py``) and the flat all-gather / reduce-scatter
    that ``comm.py`` imported. Bytes are those of the input of each call (for the all-gather: one rank's
    piece). Only counted while ``counter.active``; the barrier between steps is not a Python call."""
    with (
        mock.patch.object(dist, "all_reduce", counter.wrap("all_reduce", dist.all_reduce, 0)),
        mock.patch.object(tp_comm, "all_gather_flat", counter.wrap("all_gather", tp_comm.all_gather_flat, 1)),
        mock.patch.object(
            tp_comm, "reduce_scatter_flat", counter.wrap("reduce_scatter", tp_comm.reduce_scatter_flat, 1)
        ),
    ):
        yield


# ---------------------------------------------------------------------------------------------- ranks
class Runner:
    """One implementation on one rank: model, AdamW, timer, losses and collective statistics."""

    def __init__(self, name: str, cfg: TPConfig, group: dist.ProcessGroup, counter: CommCounter) -> None:
        self.name = name
        self.group = group
        self.counter = counter
        torch.manual_seed(cfg.seed)
        self.model = GPT(cfg.gpt_config())
        self.applied: dict[str, str] | None = None
        if name != "tp1":
            self.applied = apply_tensor_parallel(
                self.model, group=group, plan="gpt", sequence_parallel=name.endswith("_sp")
            )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.tracker = ActivationTracker(list(self.model.parameters()))
        self.peak_saved_bytes: list[int] = []
        self.timer = StepTimer(warmup=cfg.warmup)
        self.losses: list[float] = []
        self.comm_s: list[float] = []
        self.comm_counts: dict[str, int] = {}
        self.comm_bytes: dict[str, int] = {}
        self.peak_after_step: list[float] = []
        self.first_grads: dict[str, Tensor] | None = None  # after the first backward, all-gathered

    def step(self, x: Tensor, y: Tensor) -> None:
        """One timed training step (the barrier before it is not timed)."""
        dist.barrier()
        timer, counter = self.timer, self.counter
        counter.reset()
        counter.active = True
        self.tracker.reset_peaks()
        try:
            with timer.step():
                with timer.phase("zero_grad"):
                    self.optimizer.zero_grad(set_to_none=True)
                with timer.phase("forward"), self.tracker.forward():
                    logits = self.model(x)
                    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                with timer.phase("backward"):
                    loss.backward()
                with timer.phase("optimizer"):
                    self.optimizer.step()
        finally:
            counter.active = False
        self.losses.append(loss.item())
        self.comm_s.append(counter.seconds)
        self.peak_saved_bytes.append(self.tracker.peak_bytes)
        self.comm_counts, self.comm_bytes = dict(counter.counts), dict(counter.nbytes)
        self.peak_after_step.append(peak_rss_mib())
        if self.first_grads is None:  # untimed; every rank reaches it at the same point of the rotation
            self.first_grads = gather_full(self.model, self._tp_group(), grads=True)

    def _tp_group(self) -> dist.ProcessGroup | None:
        return None if self.applied is None else self.group

    def full_params(self) -> dict[str, Tensor]:
        return gather_full(self.model, self._tp_group())


def rank_main(rank: int, world: int, cfg: TPConfig, impls: tuple[str, ...]) -> dict[str, Any]:
    """Build ``impls`` on this rank and train them in rotating order; return this rank's raw data."""
    rss_at_start = current_rss_mib()
    mesh = ParallelMesh(tensor_parallel_size=world)
    group = mesh.tp_group
    batches = make_batches(cfg.data_config(), 0)  # the same rows on every rank
    counter = CommCounter()
    with counting(counter):
        runners = {name: Runner(name, cfg, group, counter) for name in impls}
        order = rotation(impls, cfg.warmup + cfg.steps, cfg.block)
        loadavg = []
        for name, s in order:
            runners[name].step(*batches[s])
            loadavg.append(os.getloadavg()[0])
        finals = {name: r.full_params() for name, r in runners.items()}
    out: dict[str, Any] = {
        "rank": rank,
        "order": [name for name, _ in order],
        "rss_at_start_mib": rss_at_start,
        "peak_rss_mib": peak_rss_mib(),
        "peak_rss_after_step_mib": {n: r.peak_after_step for n, r in runners.items()},
        "loadavg_1min_per_step": loadavg,
        "times": {n: r.timer.times for n, r in runners.items()},
        "cpu_times": {n: r.timer.cpu_times for n, r in runners.items()},
        "phases": {n: r.timer.phases for n, r in runners.items()},
        "comm_s": {n: r.comm_s for n, r in runners.items()},
        "comm_counts_per_step": {n: r.comm_counts for n, r in runners.items()},
        "comm_bytes_per_step": {n: r.comm_bytes for n, r in runners.items()},
        "losses": {n: r.losses for n, r in runners.items()},
        "param_bytes": {n: measured_param_bytes(r.model) for n, r in runners.items()},
        "peak_saved_bytes": {n: r.peak_saved_bytes for n, r in runners.items()},
        "model_state_bytes": {n: model_state_bytes(r.model, r.optimizer) for n, r in runners.items()},
        "applied_plan": {n: r.applied for n, r in runners.items() if r.applied is not None},
    }
    if "tp1" in runners:
        ref = finals["tp1"]
        out["losses_vs_tp1"] = {
            n: agreement(r.losses, runners["tp1"].losses, LOSS_TOL) for n, r in runners.items() if n != "tp1"
        }
        weight_tol = {"rtol": WEIGHT_RTOL, "atol": WEIGHT_ATOL_IN_LR * cfg.lr}
        out["weights_vs_tp1"] = {n: agreement(finals[n], ref, weight_tol) for n in runners if n != "tp1"}
        ref_grads = runners["tp1"].first_grads
        out["first_grads_vs_tp1"] = {
            n: agreement(r.first_grads or {}, ref_grads, GRAD_TOL) for n, r in runners.items() if n != "tp1"
        }
    return out


# ---------------------------------------------------------------------------------------------- report
def aggregate(cfg: TPConfig, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-step slowest-rank times, summaries, ratios, memory and correctness from all ranks' raw data."""
    w = cfg.warmup
    predicted = predicted_param_bytes(cfg.gpt_config(), cfg.world_size)
    impls: dict[str, Any] = {}
    for name in per_rank[0]["times"]:
        comm = slowest(per_rank, "comm_s", name)
        tp = 1 if name == "tp1" else cfg.world_size
        impls[name] = {
            "tensor_parallel_size": tp,
            "sequence_parallel": name.endswith("_sp"),
            **timing(per_impl(per_rank, name), w),
            "comm_median_s": statistics.median(comm[w:]),
            "comm_counts_per_step": per_rank[0]["comm_counts_per_step"][name],
            "comm_bytes_per_step": per_rank[0]["comm_bytes_per_step"][name],
            "comm_s_per_rank": [r["comm_s"][name] for r in per_rank],
            "losses": per_rank[0]["losses"][name],
            "losses_per_rank": [r["losses"][name] for r in per_rank],
            "param_bytes_per_rank": [r["param_bytes"][name] for r in per_rank],
            "param_bytes_predicted": predicted_param_bytes(cfg.gpt_config(), tp),
            "model_state_bytes_per_rank": [r["model_state_bytes"][name] for r in per_rank],
            "peak_saved_activation_mib_per_rank": [
                max(r["peak_saved_bytes"][name]) / 2**20 for r in per_rank
            ],
        }
    comparisons: dict[str, Any] = {}
    for a, b in (("tp2", "tp1"), ("tp2_sp", "tp1"), ("tp2_sp", "tp2")):
        if a in impls and b in impls:
            da, db = impls[a], impls[b]
            comparisons[f"{a}/{b}"] = {
                **time_ratios(da, db, w),
                "param_bytes_ratio": da["param_bytes_per_rank"][0]["total"]
                / db["param_bytes_per_rank"][0]["total"],
            }
    correctness: dict[str, Any] = {}
    if "tp1" in impls:
        for name in impls:
            if name == "tp1":
                continue
            losses = [r["losses_vs_tp1"][name] for r in per_rank]
            weights = [r["weights_vs_tp1"][name] for r in per_rank]
            grads = [r["first_grads_vs_tp1"][name] for r in per_rank]
            ranks_equal = all(r["losses"][name] == per_rank[0]["losses"][name] for r in per_rank)
            correctness[name] = {
                "loss_max_abs_diff": max(x["max_abs_diff"] for x in losses),
                "losses_agree": all(x["agree"] for x in losses),
                "loss_tol": LOSS_TOL,
                "first_step_grad_max_abs_diff": max(x["max_abs_diff"] for x in grads),
                "first_step_grads_agree": all(x["agree"] for x in grads),
                "grad_tol": GRAD_TOL,
                "final_weight_max_abs_diff": max(x["max_abs_diff"] for x in weights),
                "final_weight_max_abs_diff_over_lr": max(x["max_abs_diff"] for x in weights) / cfg.lr,
                "weights_agree": all(x["agree"] for x in weights),
                "weight_tol": {"rtol": WEIGHT_RTOL, "atol": WEIGHT_ATOL_IN_LR * cfg.lr},
                "ranks_report_equal_losses": ranks_equal,
                "failures": [x["first_failure"] for x in losses + grads + weights if x["first_failure"]],
            }
    param_memory: dict[str, Any] = {}
    for name, d in impls.items():
        measured = d["param_bytes_per_rank"]
        pred = d["param_bytes_predicted"]
        param_memory[name] = {
            "measured_bytes_per_rank": [m["total"] for m in measured],
            "predicted_bytes": pred["total"],
            "full_bytes": pred["full"],
            "fraction_of_full": measured[0]["total"] / pred["full"],
            # tp1 has no sharded parameters: only its total is compared
            "matches_prediction": all(m["total"] == pred["total"] for m in measured)
            and (d["tensor_parallel_size"] == 1 or all(m["sharded"] == pred["sharded"] for m in measured)),
        }
    load = per_rank[0]["loadavg_1min_per_step"]
    return {
        "implementations": impls,
        "comparisons": comparisons,
        "correctness": correctness,
        "correct": bool(correctness)
        and all(
            c["losses_agree"]
            and c["first_step_grads_agree"]
            and c["weights_agree"]
            and c["ranks_report_equal_losses"]
            for c in correctness.values()
        ),
        "param_memory": param_memory,
        "param_memory_matches_prediction": all(p["matches_prediction"] for p in param_memory.values()),
        "predicted_param_bytes_tp": predicted,
        "order_rank0": per_rank[0]["order"],
        "applied_plan": per_rank[0]["applied_plan"],
        "loadavg_1min_during_run": load_summary(load),
        "interleaved_peak_rss_mib_per_rank": [r["peak_rss_mib"] for r in per_rank],
    }


def memory_runs(cfg: TPConfig, impls: tuple[str, ...]) -> dict[str, Any]:
    """Peak RSS of each implementation alone, in fresh processes (``cfg.memory_steps`` steps each)."""
    out: dict[str, Any] = {"steps": cfg.memory_steps}
    for name in impls:
        per_rank, rss = run_alone(rank_main, cfg, name)
        out[name] = {
            **rss,
            "peak_rss_after_step_mib_per_rank": [r["peak_rss_after_step_mib"][name] for r in per_rank],
        }
    return out


def print_table(cfg: TPConfig, nparams: int, agg: dict[str, Any], memory: dict[str, Any] | None) -> None:
    impls = agg["implementations"]
    print(
        f"\nGPT {nparams / 1e6:.2f}M params (n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, seq={cfg.seq}, "
        f"batch={cfg.batch} on every rank), {cfg.world_size} ranks x {cfg.threads_per_rank} thread, AdamW, "
        f"{cfg.steps} measured + {cfg.warmup} warmup steps each"
    )
    cols = ["median s", "IQR s", "CPU s", "fwd s", "bwd s", "opt s", "comm s", "params MiB", "state MiB"]
    cols += ["act MiB", "RSS MiB", "loss |d|", "grad |d|", "weight |d|"]
    widths = [max(9, len(c) + 2) for c in cols]
    print(f"{'impl':<8}" + "".join(f"{c:>{wd}}" for c, wd in zip(cols, widths, strict=True)))
    for name, d in impls.items():
        s, ph = d["summary"], d["phase_medians_s"]
        rss = max(memory[name]["peak_rss_mib_per_rank"]) if memory and name in memory else None
        corr = agg["correctness"].get(name)
        row = [
            fmt(s["median"]),
            fmt(s["iqr"]),
            fmt(d["cpu_summary"]["median"]),
            fmt(ph["forward"]),
            fmt(ph["backward"]),
            fmt(ph["optimizer"]),
            fmt(d["comm_median_s"]),
            fmt(max(m["total"] for m in d["param_bytes_per_rank"]) / 2**20, ".2f"),
            fmt(max(m["total"] for m in d["model_state_bytes_per_rank"]) / 2**20, ".2f"),
            fmt(max(d["peak_saved_activation_mib_per_rank"]), ".1f"),
            fmt(rss, ".0f"),
            "ref" if corr is None else fmt(corr["loss_max_abs_diff"], ".1e"),
            "ref" if corr is None else fmt(corr["first_step_grad_max_abs_diff"], ".1e"),
            "ref" if corr is None else fmt(corr["final_weight_max_abs_diff"], ".1e"),
        ]
        print(f"{name:<8}" + "".join(f"{v:>{wd}}" for v, wd in zip(row, widths, strict=True)))
    for key, c in agg["comparisons"].items():
        print(
            f"{key:<12} step time: ratio of medians {c['ratio_of_medians']:.3f}, median paired "
            f"{c['median_paired_ratio']:.3f}, CPU {c['cpu_ratio_of_medians']:.3f}; parameter bytes per rank "
            f"{c['param_bytes_ratio']:.3f}"
        )
    for name, p in agg["param_memory"].items():
        print(
            f"{name:<8} parameter bytes per rank: measured {p['measured_bytes_per_rank'][0]:,}, predicted "
            f"{p['predicted_bytes']:,} ({'match' if p['matches_prediction'] else 'MISMATCH'}), "
            f"{p['fraction_of_full']:.3f} of the full {p['full_bytes']:,}"
        )
    for name, d in impls.items():
        if d["comm_counts_per_step"]:
            parts = ", ".join(
                f"{k} x{n} ({d['comm_bytes_per_step'][k] / 2**20:.1f} MiB)"
                for k, n in sorted(d["comm_counts_per_step"].items())
            )
            print(f"{name:<8} collectives per step: {parts}")
    for name, c in agg["correctness"].items():
        ok = c["losses_agree"] and c["first_step_grads_agree"] and c["weights_agree"]
        print(
            f"{name:<8} vs tp1: {'agree' if ok else 'DISAGREE'} (assert_close; losses max |diff| "
            f"{c['loss_max_abs_diff']:.1e}, first-step gradients {c['first_step_grad_max_abs_diff']:.1e}, "
            f"final weights {c['final_weight_max_abs_diff']:.1e} = "
            f"{c['final_weight_max_abs_diff_over_lr']:.3f} lr)"
        )
    load = agg["loadavg_1min_during_run"]
    print(
        f"1-min load average during the run: {load['min']:.2f}-{load['max']:.2f} "
        f"(median {load['median']:.2f})"
    )


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> tuple[TPConfig, argparse.Namespace]:
    """``(config, namespace)`` from the command line (``argv`` defaults to ``sys.argv[1:]``)."""
    p = config_parser(TPConfig, name="tp")
    ns = p.parse_args(argv)
    base = QUICK if ns.quick else TPConfig()
    cfg = config_from_args(ns, base)
    if cfg.steps < 1 or cfg.warmup < 0 or cfg.block < 1 or cfg.world_size < 2:
        p.error("need --steps >= 1, --warmup >= 0, --block >= 1, --world-size >= 2")
    unknown = {s.strip() for s in cfg.impls.split(",") if s.strip()} - set(ALL_IMPLS)
    if unknown or not cfg.impl_list():
        p.error(f"--impls must be a comma-separated subset of {','.join(ALL_IMPLS)}; got {cfg.impls!r}")
    return cfg, ns


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table, write the JSON; return the JSON payload."""
    cfg, ns = parse_args(argv)
    env = environment(threads_per_rank=cfg.threads_per_rank, world_size=cfg.world_size)
    impls = cfg.impl_list()
    code = git_state()
    wall = time.perf_counter()
    per_rank = launch(rank_main, cfg.world_size, cfg, impls, threads_per_rank=cfg.threads_per_rank)
    agg = aggregate(cfg, per_rank)
    memory = memory_runs(cfg, impls) if cfg.memory_steps > 0 else None
    wall = time.perf_counter() - wall
    with torch.device("meta"):
        nparams = GPT(cfg.gpt_config()).num_parameters()
    payload: dict[str, Any] = {
        "benchmark": "tp",
        "description": "Tensor parallel tp=2 (plan 'gpt', with and without sequence parallelism) vs the "
        "unsharded GPT (tp1, run redundantly on both ranks)",
        "environment": {**env, "loadavg_at_end": list(os.getloadavg()), "code": code},
        "config": asdict(cfg),
        "impls": list(impls),
        "reference": "tp1: the unsharded GPT on every rank, same batch, no communication; its step time is "
        "a single-process tp=1 step under the same machine load, and its losses/weights are the reference",
        "model": {"name": "GPT", "num_parameters": nparams, **asdict(cfg.gpt_config())},
        **agg,
        "memory_alone": memory,
        "wall_time_s": wall,
    }
    path = write_result("tp_quick" if ns.quick else "tp", payload, ns.out)
    print_table(cfg, nparams, agg, memory)
    print(f"wall time {wall:.1f} s; wrote {path}")
    return payload


if __name__ == "__main__":
    main()
