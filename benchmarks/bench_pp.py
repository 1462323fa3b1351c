"""Pipeline parallelism: ``lightning_par.pipeline`` (GPipe, 1F1B, interleaved 1F1B, zero bubble) against the
unpipelined GPT: bubble fraction, step time, activations in flight, and equality of losses and gradients.

Run (from the repository root)::

    python -m benchmarks.bench_pp                  # default: p=2, m = 4, 8, 16, + a tiny p=4 run, ~2-3 min
    python -m benchmarks.bench_pp --quick          # tiny smoke configuration, a few seconds
    python -m benchmarks.bench_pp --schedules 1f1b --microbatches 8,32 --pp4 false --out /tmp/pp.json
    python -m benchmarks.bench_pp --help           # every field of PPConfig is a flag

What is measured
----------------
``p`` Gloo ranks (one torch thread each) form one pipeline group (``ParallelMesh``). For every schedule
(``gpipe``, ``1f1b``, ``zb``, and ``interleaved_1f1b`` / ``interleaved_zb`` with ``--virtual-stages``
chunks per rank) and every number of micro-batches ``m``, each rank builds the same seeded GPT, keeps its
pieces with ``apply_pipeline`` (``--partition``, default ``"parameters"``), sums the tied embedding /
LM-head gradient with ``TiedGradients`` and runs ``PipelineRuntime.train_step`` on ``m`` micro-batches
of ``--micro-batch`` rows (the global batch is ``m * micro_batch`` rows, so every micro-batch costs the
same and the bubble is measured on equal work). The reference ``unpipelined_m<m>`` is the whole GPT on
every rank (redundantly, no communication: what one process would do) with gradient accumulation over the
same ``m`` micro-batches. Every implementation has its own model and AdamW and they all run in the same
processes in rotating order (``A B C ... C B A A B ...``), each one's first ``--warmup`` steps not
summarised.

* **Step time**: ``zero_grad``, ``train_step`` (all forwards and backwards and their transfers), the tied
  gradient all-reduce, ``optimizer.step()``; barrier before (not timed); slowest rank. The speed-up over
  the unpipelined model with the same ``m`` is ``t_unpipelined / t_pipeline`` (ideal: ``p * (1-bubble)``).
* **Bubble**: the runtime's ``StepStats`` of each rank: ``1 - busy_s / total_s`` where ``busy_s`` is the
  time inside chunk forwards (with the loss) and backwards and ``total_s`` the whole ``train_step``
  (transfers and the final loss broadcast count as idle). Reported per rank and as the mean over ranks
  (median over steps), against the schedule's analytic bubble ``(p-1)/(m+p-1)`` (GPipe, 1F1B) and
  ``(p-1)/(v*m+p-1)`` (interleaved), ``(p-1)/(3m+p-1)`` (zb) and ``(p-1)/(3vm+p-1)`` (interleaved_zb;
  see ``lightning_par/pipeline/schedule.py``), which assume equal stages (``F = B = W`` where the
  backward is split) and free transfers.
* **Activations in flight**: every chunk forward (and the loss on the last stage) runs under
  ``torch.autograd.graph.saved_tensors_hooks`` that register each tensor autograd saves for backward
  (parameters excluded, each storage counted once) until autograd frees it. Per rank and step: the
  largest number of chunk forwards whose saved tensors are still alive (the runtime's in-flight
  (chunk, micro-batch) count, deterministic: compared exactly with ``peak_in_flight(until="B")`` of the
  schedule) and the peak bytes of those saved tensors. 1F1B and zb keep at most ``p - s`` micro-batches
  on rank ``s``, GPipe all ``m``, interleaved_zb interleaved 1F1B's counts; the split schedules' ``W``
  inputs (the linear layers' inputs and output gradients, for up to rank 0's in-flight count of
  micro-batches) are held by the runtime, not by autograd, and not counted here.
* **Correctness**: the loss of every step equals the unpipelined loss; the gradients after the first
  step (tied gradient exchanged) equal the unpipelined gradients of the same parameters; the final
  weights agree (``torch.testing.assert_close``, tolerances ``LOSS_TOL``, ``GRAD_TOL``, ``WEIGHT_*``).
* **Peak RSS** (``--memory-steps K > 0``): GPipe and 1F1B at the largest ``m`` then run K steps alone in
  fresh processes each, for the process' high-water mark per rank.
* **p=4** (``--pp4 true``): the same over 4 ranks with a tiny GPT (4 processes on 2 cores: the step times
  and bubbles are those of an oversubscribed machine; the in-flight counts and correctness hold).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.bench_dp import BenchConfig, make_batches
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
    run_alone,
    time_ratios,
    timing,
    write_result,
)
from lightning_par.mesh import ParallelMesh
from lightning_par.models.gpt import GPT, GPTConfig
from lightning_par.pipeline import SCHEDULES, PipelineRuntime, build_schedule, peak_in_flight
from lightning_par.pipeline.apply import TiedGradients, apply_pipeline
from lightning_par.pipeline.schedule import INTERLEAVED, SPLIT_BACKWARD

ALL_SCHEDULES = SCHEDULES  # gpipe, 1f1b, interleaved_1f1b, zb, interleaved_zb
# torch.testing.assert_close tolerances against the unpipelined model. The pipeline runs the same ops on
# the same shapes, so losses and most gradients are bitwise equal; the tied embedding / LM-head
# gradient is summed in another order (per stage, then all-reduced). AdamW turns rounding-level
# gradients (k_proj.bias: exactly zero in exact arithmetic; see bench_tp) into rounding-decided updates
# of up to ~lr, so final weights are compared with an absolute tolerance of one AdamW step (``lr``).
LOSS_TOL = {"rtol": 1e-6, "atol": 1e-6}
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-8}
WEIGHT_RTOL, WEIGHT_ATOL_IN_LR = 1e-4, 1.0


@dataclass(frozen=True)
class PPModelConfig:
    """What both pipeline benchmarks (this one and ``bench_pp_torch``) share: model, data, schedule and
    micro-batch lists, steps and ranks; ``world_size`` is the pipeline size ``p``."""

    n_layer: int = 4
    n_head: int = 6
    n_embd: int = 384
    seq: int = 128
    micro_batch: int = 2
    vocab: int = 256
    schedules: str = ",".join(SCHEDULES)
    microbatches: str = "4,8,16"
    virtual_stages: int = 2
    partition: str = "parameters"
    steps: int = 4
    warmup: int = 1
    block: int = 1
    lr: float = 3e-4
    weight_decay: float = 0.1
    seed: int = 0
    world_size: int = 2
    threads_per_rank: int = 1

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab,
            block_size=self.seq,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            dropout=0.0,
        )

    def schedule_list(self) -> tuple[str, ...]:
        wanted = {s.strip() for s in self.schedules.split(",") if s.strip()}
        return tuple(s for s in ALL_SCHEDULES if s in wanted)

    def microbatch_list(self) -> tuple[int, ...]:
        return tuple(sorted({int(s) for s in self.microbatches.split(",") if s.strip()}))

    def data_config(self, m: int) -> BenchConfig:
        """``bench_dp``'s data, ``m * micro_batch`` rows per step, the same on every rank."""
        return BenchConfig(
            vocab=self.vocab,
            seq=self.seq,
            micro_batch=m * self.micro_batch,
            world_size=1,
            steps=self.steps,
            warmup=self.warmup,
            seed=self.seed,
        )


@dataclass(frozen=True)
class PPConfig(PPModelConfig):
    """Everything one run depends on (saved in the JSON)."""

    memory_steps: int = 2
    pp4: bool = True

    def chunks_of(self, schedule: str) -> int:
        return self.virtual_stages if schedule in INTERLEAVED else 1

    def impls(self) -> tuple[tuple[str, str, int], ...]:
        """``(name, schedule or "unpipelined", m)`` of every implementation, in a fixed order."""
        out = []
        for m in self.microbatch_list():
            out.append((f"unpipelined_m{m}", "unpipelined", m))
            out.extend((f"{s}_m{m}", s, m) for s in self.schedule_list())
        return tuple(out)


QUICK = PPConfig(
    n_layer=2, n_head=2, n_embd=64, seq=32, micro_batch=2, vocab=64, microbatches="4,16", steps=2, warmup=1,
    lr=3e-3, memory_steps=0,
)  # fmt: skip
"""Tiny smoke configuration: every schedule at m = 4 and 16, plus the tiny p=4 run."""

PP4 = dict(n_layer=6, n_head=2, n_embd=64, seq=32, micro_batch=2, vocab=64, steps=2, warmup=1, lr=3e-3)
"""Model and steps of the p=4 run (4 processes on 2 cores: tiny, for counts and correctness)."""


def analytic_bubble(schedule: str, *, p: int, m: int, v: int) -> float:
    """The schedule's bubble fraction with equal stages and free transfers (schedule module docstring)."""
    chunks = v if schedule in INTERLEAVED else 1
    if schedule in SPLIT_BACKWARD:  # F = B = W: W fills all but (p-1) of 1F1B's 3(p-1) idle units
        return (p - 1) / (3 * chunks * m + p - 1)
    return (p - 1) / (chunks * m + p - 1)


# ---------------------------------------------------------------------------------------------- tracking
class _Saved:
    """One tensor saved for backward, registered with its tracker until autograd drops it."""

    __slots__ = ("key", "ptr", "tensor", "tracker")

    def __init__(self, tracker: ActivationTracker, key: int, tensor: Tensor, ptr: int) -> None:
        self.tracker, self.key, self.tensor, self.ptr = tracker, key, tensor, ptr
        tracker._add(self)

    def __del__(self) -> None:
        self.tracker._remove(self)


class ActivationTracker:
    """Live saved-for-backward tensors per forward call (a "key": one chunk on one micro-batch).

    ``forward()`` wraps a forward in ``saved_tensors_hooks``: each saved tensor that is not a parameter
    (nor a view of one) is held in a :class:`_Saved` until autograd releases it after its backward.
    ``peak_forwards`` is the most keys with a live saved tensor at once, ``peak_bytes`` the most bytes of
    distinct storages saved (since the last :meth:`reset_peaks`).
    """

    def __init__(self, params: Sequence[Tensor]) -> None:
        self.param_storages = {p.untyped_storage().data_ptr() for p in params if p.device.type != "meta"}
        self.next_key = 0
        self.last_key = 0
        self.live: dict[int, int] = {}  # key -> live saved tensors
        self.storages: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_forwards = 0

    def reset_peaks(self) -> None:
        self.peak_bytes, self.peak_forwards = self.live_bytes, len(self.live)

    def _add(self, s: _Saved) -> None:
        self.live[s.key] = self.live.get(s.key, 0) + 1
        entry = self.storages.get(s.ptr)
        if entry is None:
            nbytes = s.tensor.untyped_storage().nbytes()
            self.storages[s.ptr] = [1, nbytes]
            self.live_bytes += nbytes
        else:
            entry[0] += 1
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.peak_forwards = max(self.peak_forwards, len(self.live))

    def _remove(self, s: _Saved) -> None:
        self.live[s.key] -= 1
        if self.live[s.key] == 0:
            del self.live[s.key]
        entry = self.storages[s.ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes -= entry[1]
            del self.storages[s.ptr]

    @contextmanager
    def forward(self, key: int | None = None) -> Iterator[None]:
        """Track what autograd saves inside the block under ``key`` (default: a new key)."""
        if key is None:
            self.next_key += 1
            key = self.next_key
        self.last_key = key

        def pack(t: Tensor) -> Any:
            ptr = t.untyped_storage().data_ptr()
            return t if ptr in self.param_storages else _Saved(self, key, t, ptr)

        def unpack(obj: Any) -> Tensor:
            return obj.tensor if isinstance(obj, _Saved) else obj

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield


class Tracked(nn.Module):
    """A pipeline chunk whose forwards are tracked (each call is a new key)."""

    def __init__(self, chunk: nn.Module, tracker: ActivationTracker) -> None:
        super().__init__()
        self.chunk = chunk
        self.tracker = tracker

    def forward(self, x: Any) -> Any:
        with self.tracker.forward():
            return self.chunk(x)


# ---------------------------------------------------------------------------------------------- p2p
@dataclass
class P2PCounter:
    """Per step: wall time waiting for the runtime's p2p batches (``work.wait()`` after
    ``batch_isend_irecv``: transfer + waiting for the peer, most of the idle time; ``recv_s``), time
    posting them (``send_s``), and the received messages and bytes."""

    recv_s: float = 0.0
    send_s: float = 0.0
    recv_messages: int = 0
    recv_bytes: int = 0

    def reset(self) -> None:
        self.recv_s = self.send_s = 0.0
        self.recv_messages = self.recv_bytes = 0

    @contextmanager
    def patched(self) -> Iterator[None]:
        post = dist.batch_isend_irecv
        counter = self

        class TimedWork:
            def __init__(self, work: Any) -> None:
                self.work = work

            def wait(self) -> Any:
                start = time.perf_counter()
                try:
                    return self.work.wait()
                finally:
                    counter.recv_s += time.perf_counter() - start

        def timed_post(ops: list[Any]) -> list[Any]:
            start = time.perf_counter()
            try:
                works = post(ops)
            finally:
                self.send_s += time.perf_counter() - start
            for op in ops:
                if op.op is dist.irecv:
                    self.recv_messages += 1
                    self.recv_bytes += op.tensor.numel() * op.tensor.element_size()
            return [TimedWork(w) for w in works]

        with mock.patch.object(dist, "batch_isend_irecv", timed_post):
            yield


def modelled_bubble(busy_s: Sequence[float], m: int) -> float:
    """Mean bubble over ranks of a GPipe/1F1B pipeline whose stage ``s`` computes ``busy_s[s] / m`` per
    micro-batch (forward + backward) and whose transfers are free: the step lasts
    ``sum_s t_s + (m - 1) max_s t_s`` (fill and drain through every stage, the slowest stage in between),
    so rank ``s`` idles ``1 - m t_s / step``. Equal stages give ``(p-1)/(m+p-1)``; the difference from
    the analytic value is the stage imbalance, the difference to the measured bubble is the transfers and
    the per-micro-batch overheads."""
    t = [b / m for b in busy_s]
    step = sum(t) + (m - 1) * max(t)
    return statistics.fmean(1 - m * ts / step for ts in t)


# ---------------------------------------------------------------------------------------------- ranks
class Runner:
    """One implementation on one rank: model (pipelined or whole), AdamW, timer and measurements."""

    def __init__(
        self, name: str, schedule: str, m: int, cfg: PPConfig, mesh: ParallelMesh, p2p: P2PCounter
    ) -> None:
        self.name, self.schedule, self.m, self.p2p = name, schedule, m, p2p
        torch.manual_seed(cfg.seed)
        self.model = GPT(cfg.gpt_config())
        self.runtime: PipelineRuntime | None = None
        self.tied: TiedGradients | None = None
        self.pieces: list[tuple[int, int]] | None = None
        if schedule == "unpipelined":
            local = {id(p) for p in self.model.parameters()}
        else:
            v = cfg.chunks_of(schedule)
            split = apply_pipeline(
                self.model.layers(),
                pp_rank=mesh.coords.pp,
                pp_size=mesh.layout.pipeline_parallel_size,
                virtual_stages=v,
                method=cfg.partition,  # type: ignore[arg-type]
            )
            local = split.local
            self.pieces = split.pieces
        self.params = {n: p for n, p in self.model.named_parameters() if id(p) in local}
        self.tracker = ActivationTracker(list(self.params.values()))
        if schedule != "unpipelined":
            self.runtime = PipelineRuntime(
                chunks=[Tracked(c, self.tracker) for c in split.chunks],
                group=mesh.pp_group,
                schedule=schedule,
                num_microbatches=m,
            )
            self.tied = TiedGradients(
                self.model, local=local, pp_group=mesh.pp_group, pp_groups=mesh.layout.groups("pp")
            )
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.timer = StepTimer(warmup=cfg.warmup)
        self.losses: list[float] = []
        self.busy_s: list[float] = []
        self.total_s: list[float] = []
        self.bubble: list[float] = []
        self.peak_forwards: list[int] = []
        self.peak_saved_bytes: list[int] = []
        self.peak_after_step: list[float] = []
        self.recv_s: list[float] = []
        self.send_s: list[float] = []
        self.recv_messages = self.recv_bytes = 0
        self.first_grads: dict[str, Tensor] | None = None

    def _loss_fn(self, ys: Sequence[Tensor]) -> Callable[[Tensor, int], Tensor]:
        def loss_fn(out: Tensor, i: int) -> Tensor:
            with self.tracker.forward(self.tracker.last_key):  # part of the last chunk's forward
                return F.cross_entropy(out.flatten(0, 1), ys[i].flatten())

        return loss_fn

    def step(self, x: Tensor, y: Tensor) -> None:
        """One timed training step on ``m`` micro-batches of ``x``/``y`` (the barrier is not timed)."""
        xs, ys = x.chunk(self.m), y.chunk(self.m)
        dist.barrier()
        timer = self.timer
        self.tracker.reset_peaks()
        self.p2p.reset()
        with timer.step():
            with timer.phase("zero_grad"):
                self.optimizer.zero_grad(set_to_none=True)
            if self.runtime is None:
                with timer.phase("pipeline"):
                    start = time.perf_counter()
                    total = torch.zeros(())
                    for mx, my in zip(xs, ys, strict=True):
                        with self.tracker.forward():
                            loss = F.cross_entropy(self.model(mx).flatten(0, 1), my.flatten()) / self.m
                        loss.backward()
                        total += loss.detach()
                    busy = time.perf_counter() - start
                    self.busy_s.append(busy)
                    self.total_s.append(busy)
                    self.bubble.append(0.0)
                with timer.phase("tied"):
                    pass  # nothing to exchange unpipelined; timed empty so every runner has the same phases
            else:
                with timer.phase("pipeline"):
                    total = self.runtime.train_step(inputs=xs, loss_fn=self._loss_fn(ys))
                stats = self.runtime.last_stats
                self.busy_s.append(stats.busy_s)
                self.total_s.append(stats.total_s)
                self.bubble.append(stats.bubble)
                with timer.phase("tied"):
                    assert self.tied is not None
                    self.tied.exchange()
            with timer.phase("optimizer"):
                self.optimizer.step()
        self.losses.append(float(total))
        self.recv_s.append(self.p2p.recv_s)
        self.send_s.append(self.p2p.send_s)
        self.recv_messages, self.recv_bytes = self.p2p.recv_messages, self.p2p.recv_bytes
        self.peak_forwards.append(self.tracker.peak_forwards)
        self.peak_saved_bytes.append(self.tracker.peak_bytes)
        self.peak_after_step.append(peak_rss_mib())
        if self.first_grads is None:
            self.first_grads = {
                n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                for n, p in self.params.items()
            }

    def final_params(self) -> dict[str, Tensor]:
        return {n: p.detach().clone() for n, p in self.params.items()}


def agreement(got: Sequence[float] | dict[str, Tensor], ref: Any, tol: dict[str, Any]) -> dict[str, Any]:
    """``torch.testing.assert_close(got, ref, **tol)`` as a flag, with the largest absolute difference and
    the first failure's message (dicts of tensors: over ``got``'s keys, which ``ref`` must have)."""
    if isinstance(got, dict):
        diff = max((v - ref[k]).abs().max().item() for k, v in got.items())
        try:
            for k, v in got.items():
                torch.testing.assert_close(v, ref[k], **tol, msg=k)
            ok, why = True, None
        except AssertionError as exc:
            ok, why = False, str(exc).splitlines()[0]
        return {"max_abs_diff": diff, "agree": ok, "first_failure": why, "compared": sorted(got)}
    a, b = torch.tensor(list(got), dtype=torch.float64), torch.tensor(ref, dtype=torch.float64)
    try:
        torch.testing.assert_close(a, b, **tol)
        ok, why = True, None
    except AssertionError as exc:
        ok, why = False, " ".join(str(exc).split())
    return {"max_abs_diff": (a - b).abs().max().item(), "agree": ok, "first_failure": why}


def rank_main(rank: int, world: int, cfg: PPConfig, names: tuple[str, ...]) -> dict[str, Any]:
    """Build the implementations ``names`` on this rank and train them in rotating order; raw data."""
    rss_at_start = current_rss_mib()
    mesh = ParallelMesh(pipeline_parallel_size=world)
    spec = {name: (schedule, m) for name, schedule, m in cfg.impls()}
    p2p = P2PCounter()
    runners = {name: Runner(name, *spec[name], cfg, mesh, p2p) for name in names}
    batches = {m: make_batches(cfg.data_config(m), 0) for m in {spec[n][1] for n in names}}
    order = rotation(names, cfg.warmup + cfg.steps, cfg.block)
    loadavg = []
    with p2p.patched():
        for name, s in order:
            runners[name].step(*batches[runners[name].m][s])
            loadavg.append(os.getloadavg()[0])
    out: dict[str, Any] = {
        "rank": rank,
        "order": [name for name, _ in order],
        "rss_at_start_mib": rss_at_start,
        "peak_rss_mib": peak_rss_mib(),
        "loadavg_1min_per_step": loadavg,
        "runners": {
            n: {
                "times": r.timer.times,
                "cpu_times": r.timer.cpu_times,
                "phases": r.timer.phases,
                "losses": r.losses,
                "busy_s": r.busy_s,
                "total_s": r.total_s,
                "bubble": r.bubble,
                "peak_forwards_in_flight": r.peak_forwards,
                "peak_saved_bytes": r.peak_saved_bytes,
                "peak_rss_after_step_mib": r.peak_after_step,
                "recv_s": r.recv_s,
                "send_s": r.send_s,
                "recv_messages_per_step": r.recv_messages,
                "recv_bytes_per_step": r.recv_bytes,
                "pieces": r.pieces,
                "local_parameters": sum(p.numel() for p in r.params.values()),
            }
            for n, r in runners.items()
        },
    }
    correctness: dict[str, Any] = {}
    weight_tol = {"rtol": WEIGHT_RTOL, "atol": WEIGHT_ATOL_IN_LR * cfg.lr}
    for name, r in runners.items():
        ref = runners.get(f"unpipelined_m{r.m}")
        if r.runtime is None or ref is None:
            continue
        assert r.first_grads is not None and ref.first_grads is not None
        correctness[name] = {
            "losses": agreement(r.losses, ref.losses, LOSS_TOL),
            "first_step_grads": agreement(r.first_grads, ref.first_grads, GRAD_TOL),
            "final_weights": agreement(r.final_params(), ref.final_params(), weight_tol),
        }
    out["correctness"] = correctness
    return out


# ---------------------------------------------------------------------------------------------- report
def aggregate(cfg: PPConfig, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-implementation summaries, bubbles, in-flight counts, speed-ups and correctness."""
    w, p = cfg.warmup, cfg.world_size
    impls: dict[str, Any] = {}
    for name, schedule, m in cfg.impls():
        if name not in per_rank[0]["runners"]:
            continue
        rs = [r["runners"][name] for r in per_rank]
        d: dict[str, Any] = {
            "schedule": schedule,
            "microbatches": m,
            **timing(rs, w),
            "losses": rs[0]["losses"],
            "local_parameters_per_rank": [r["local_parameters"] for r in rs],
            "peak_forwards_in_flight_per_rank": [max(r["peak_forwards_in_flight"]) for r in rs],
            "peak_saved_mib_per_rank": [max(r["peak_saved_bytes"]) / 2**20 for r in rs],
            "peak_saved_bytes_per_rank_per_step": [r["peak_saved_bytes"] for r in rs],
        }
        if schedule != "unpipelined":
            v = cfg.chunks_of(schedule)
            mean_bubble = [statistics.fmean(b) for b in zip(*(r["bubble"] for r in rs), strict=True)]
            expected = [peak_in_flight(a, until="B") for a in build_schedule(schedule, p=p, m=m, v=v)]
            d.update(
                virtual_stages=v,
                pieces=rs[0]["pieces"],
                bubble_analytic=analytic_bubble(schedule, p=p, m=m, v=v),
                bubble_measured=statistics.median(mean_bubble[w:]),
                bubble_measured_per_rank=[statistics.median(r["bubble"][w:]) for r in rs],
                bubble_per_rank_per_step=[r["bubble"] for r in rs],
                busy_s_per_rank_per_step=[r["busy_s"] for r in rs],
                total_s_per_rank_per_step=[r["total_s"] for r in rs],
                in_flight_expected_per_rank=expected,
                in_flight_matches_schedule=d["peak_forwards_in_flight_per_rank"] == expected,
            )
            d["bubble_ratio_measured_to_analytic"] = d["bubble_measured"] / d["bubble_analytic"]
            busy = [statistics.median(r["busy_s"][w:]) for r in rs]
            total = [statistics.median(r["total_s"][w:]) for r in rs]
            recv = [statistics.median(r["recv_s"][w:]) for r in rs]
            send = [statistics.median(r["send_s"][w:]) for r in rs]
            d["idle_split_s_per_rank"] = {  # medians over steps: total = busy + recv + send + other
                "busy": busy,
                "recv": recv,
                "send": send,
                "other": [t - b - r - s for t, b, r, s in zip(total, busy, recv, send, strict=True)],
                "total": total,
            }
            # with the measured stage times and free transfers (GPipe / 1F1B only)
            d["bubble_modelled_from_stage_times"] = modelled_bubble(busy, m) if v == 1 else None
            d["recv_messages_per_step_per_rank"] = [r["recv_messages_per_step"] for r in rs]
            d["recv_bytes_per_step_per_rank"] = [r["recv_bytes_per_step"] for r in rs]
        impls[name] = d
    # speed-up over the unpipelined model with the same m (the k-th steps ran in the same round)
    for d in impls.values():
        ref = impls.get(f"unpipelined_m{d['microbatches']}")
        if d["schedule"] == "unpipelined" or ref is None:
            continue
        inverse = time_ratios(ref, d, w)
        speedup = inverse["ratio_of_medians"]
        d["speedup_vs_unpipelined"] = {
            "ratio_of_medians": speedup,
            "median_paired_ratio": inverse["median_paired_ratio"],
            "ideal": p * (1 - d["bubble_analytic"]),
            "efficiency": speedup / p,
        }
    # activation memory: 1F1B (and interleaved) against GPipe at the same m, on every rank
    activations: dict[str, Any] = {}
    for m in cfg.microbatch_list():
        gp = impls.get(f"gpipe_m{m}")
        if gp is None:
            continue
        for s in ("1f1b", "interleaved_1f1b"):
            other = impls.get(f"{s}_m{m}")
            if other is not None:
                activations[f"{s}_m{m}/gpipe_m{m}"] = {
                    "in_flight_per_rank": [
                        other["peak_forwards_in_flight_per_rank"],
                        gp["peak_forwards_in_flight_per_rank"],
                    ],
                    "peak_saved_mib_ratio_per_rank": [
                        a / b if b else None
                        for a, b in zip(
                            other["peak_saved_mib_per_rank"], gp["peak_saved_mib_per_rank"], strict=True
                        )
                    ],
                }
    correctness: dict[str, Any] = {}
    for name in impls:
        per = [r["correctness"][name] for r in per_rank if name in r["correctness"]]
        if not per:
            continue
        correctness[name] = {
            "losses_agree": all(c["losses"]["agree"] for c in per),
            "loss_max_abs_diff": max(c["losses"]["max_abs_diff"] for c in per),
            "first_step_grads_agree": all(c["first_step_grads"]["agree"] for c in per),
            "first_step_grad_max_abs_diff": max(c["first_step_grads"]["max_abs_diff"] for c in per),
            "weights_agree": all(c["final_weights"]["agree"] for c in per),
            "final_weight_max_abs_diff": max(c["final_weights"]["max_abs_diff"] for c in per),
            "final_weight_max_abs_diff_over_lr": max(c["final_weights"]["max_abs_diff"] for c in per)
            / cfg.lr,
            "parameters_compared": sum(len(c["first_step_grads"]["compared"]) for c in per),
            "failures": [
                c[k]["first_failure"]
                for c in per
                for k in ("losses", "first_step_grads", "final_weights")
                if c[k]["first_failure"]
            ],
        }
    load = per_rank[0]["loadavg_1min_per_step"]
    pipelined = [d for d in impls.values() if d["schedule"] != "unpipelined"]
    return {
        "implementations": impls,
        "activations_vs_gpipe": activations,
        "correctness": correctness,
        "correct": bool(correctness)
        and all(
            c["losses_agree"] and c["first_step_grads_agree"] and c["weights_agree"]
            for c in correctness.values()
        ),
        "in_flight_matches_schedule": all(d["in_flight_matches_schedule"] for d in pipelined),
        "loss_tol": LOSS_TOL,
        "grad_tol": GRAD_TOL,
        "weight_tol": {"rtol": WEIGHT_RTOL, "atol": WEIGHT_ATOL_IN_LR * cfg.lr},
        "order_rank0": per_rank[0]["order"],
        "loadavg_1min_during_run": load_summary(load),
        "interleaved_peak_rss_mib_per_rank": [r["peak_rss_mib"] for r in per_rank],
    }


def memory_runs(cfg: PPConfig) -> dict[str, Any] | None:
    """Peak RSS of GPipe and 1F1B at the largest ``m``, each alone in fresh processes."""
    m = max(cfg.microbatch_list())
    names = tuple(f"{s}_m{m}" for s in ("gpipe", "1f1b") if s in cfg.schedule_list())
    if not names:
        return None
    out: dict[str, Any] = {"steps": cfg.memory_steps, "microbatches": m}
    for name in names:
        per_rank, rss = run_alone(rank_main, cfg, name)
        out[name] = {
            **rss,
            "peak_rss_after_step_mib_per_rank": [
                r["runners"][name]["peak_rss_after_step_mib"] for r in per_rank
            ],
            "peak_saved_mib_per_rank": [
                max(r["runners"][name]["peak_saved_bytes"]) / 2**20 for r in per_rank
            ],
        }
    return out


def run(cfg: PPConfig) -> dict[str, Any]:
    """Launch ``cfg.world_size`` ranks with every implementation of ``cfg``; aggregated results."""
    names = tuple(name for name, _, _ in cfg.impls())
    per_rank = launch(rank_main, cfg.world_size, cfg, names, threads_per_rank=cfg.threads_per_rank)
    with torch.device("meta"):
        nparams = GPT(cfg.gpt_config()).num_parameters()
    return {
        "config": asdict(cfg),
        "model": {"name": "GPT", "num_parameters": nparams, **asdict(cfg.gpt_config())},
        **aggregate(cfg, per_rank),
    }


def print_table(cfg: PPConfig, result: dict[str, Any], memory: dict[str, Any] | None = None) -> None:
    impls = result["implementations"]
    p = cfg.world_size
    print(
        f"\np={p}: GPT {result['model']['num_parameters'] / 1e6:.2f}M params (n_layer={cfg.n_layer}, "
        f"n_embd={cfg.n_embd}, seq={cfg.seq}), micro-batch {cfg.micro_batch} rows, {p} ranks x "
        f"{cfg.threads_per_rank} thread, AdamW, {cfg.steps} measured + {cfg.warmup} warmup steps each"
    )
    cols = ["m", "median s", "IQR s", "speed-up", "bubble", "analytic", "modelled", "per rank", "recv s"]
    cols += ["in flight", "saved MiB", "loss |d|", "grad |d|"]
    per_rank = max(10, 5 * p + 3)  # "0.12/0.34/..." columns
    widths = [4, 10, 8, 10, 8, 10, 10, per_rank, per_rank, max(11, 3 * p + 3), max(12, 6 * p + 3), 10, 10]
    print(f"{'schedule':<18}" + "".join(f"{c:>{wd}}" for c, wd in zip(cols, widths, strict=True)))
    for d in impls.values():
        corr = result["correctness"].get(
            f"{d['schedule']}_m{d['microbatches']}",
            {"loss_max_abs_diff": None, "first_step_grad_max_abs_diff": None},
        )
        piped = d["schedule"] != "unpipelined"
        row = [
            str(d["microbatches"]),
            fmt(d["summary"]["median"]),
            fmt(d["summary"]["iqr"]),
            fmt(d["speedup_vs_unpipelined"]["ratio_of_medians"], ".2f") if piped else "1",
            fmt(d["bubble_measured"]) if piped else "-",
            fmt(d["bubble_analytic"]) if piped else "-",
            fmt(d["bubble_modelled_from_stage_times"]) if piped else "-",
            "/".join(f"{b:.2f}" for b in d["bubble_measured_per_rank"]) if piped else "-",
            "/".join(f"{b:.2f}" for b in d["idle_split_s_per_rank"]["recv"]) if piped else "-",
            "/".join(str(n) for n in d["peak_forwards_in_flight_per_rank"]),
            "/".join(f"{b:.1f}" for b in d["peak_saved_mib_per_rank"]),
            "ref" if not piped else fmt(corr["loss_max_abs_diff"], ".1e"),
            "ref" if not piped else fmt(corr["first_step_grad_max_abs_diff"], ".1e"),
        ]
        print(f"{d['schedule']:<18}" + "".join(f"{v:>{wd}}" for v, wd in zip(row, widths, strict=True)))
    verdict = "agree" if result["correct"] else "DISAGREE"
    worst = max((c["final_weight_max_abs_diff_over_lr"] for c in result["correctness"].values()), default=0.0)
    print(
        f"correctness vs unpipelined: {verdict} (losses, first-step gradients, final weights; worst final "
        f"weight |diff| {worst:.3f} lr); in-flight counts match the schedules: "
        f"{result['in_flight_matches_schedule']}"
    )
    if memory:
        for name in (k for k in memory if k not in ("steps", "microbatches")):
            mem = memory[name]
            print(
                f"{name} alone ({memory['steps']} steps): peak RSS per rank "
                + "/".join(f"{x:.0f}" for x in mem["peak_rss_mib_per_rank"])
                + " MiB, saved activations "
                + "/".join(f"{x:.1f}" for x in mem["peak_saved_mib_per_rank"])
                + " MiB"
            )
    load = result["loadavg_1min_during_run"]
    print(
        f"1-min load average during the run: {load['min']:.2f}-{load['max']:.2f} "
        f"(median {load['median']:.2f})"
    )


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> tuple[PPConfig, argparse.Namespace]:
    """``(config, namespace)`` from the command line (``argv`` defaults to ``sys.argv[1:]``)."""
    p = config_parser(PPConfig, name="pp")
    ns = p.parse_args(argv)
    base = QUICK if ns.quick else PPConfig()
    cfg = config_from_args(ns, base)
    if cfg.steps < 1 or cfg.warmup < 0 or cfg.block < 1 or cfg.world_size < 2:
        p.error("need --steps >= 1, --warmup >= 0, --block >= 1, --world-size >= 2")
    unknown = {s.strip() for s in cfg.schedules.split(",") if s.strip()} - set(ALL_SCHEDULES)
    if unknown or not cfg.schedule_list():
        p.error(f"--schedules must be a comma-separated subset of {','.join(ALL_SCHEDULES)}")
    try:
        ms = cfg.microbatch_list()
    except ValueError:
        ms = ()
    if not ms or min(ms) < 1:
        p.error(
            f"--microbatches must be a comma-separated list of positive integers; got {cfg.microbatches!r}"
        )
    if set(INTERLEAVED) & set(cfg.schedule_list()):
        bad = [m for m in ms if m % cfg.world_size]
        if cfg.virtual_stages < 2 or bad:
            p.error(
                f"{'/'.join(INTERLEAVED)} need --virtual-stages >= 2 and every m a multiple of"
                f" p={cfg.world_size} (got v={cfg.virtual_stages}, m={bad})"
            )
    return cfg, ns


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the tables, write the JSON; return the JSON payload."""
    cfg, ns = parse_args(argv)
    env = environment(threads_per_rank=cfg.threads_per_rank, world_size=cfg.world_size)
    code = git_state()
    wall = time.perf_counter()
    result = run(cfg)
    memory = memory_runs(cfg) if cfg.memory_steps > 0 else None
    pp4: dict[str, Any] | None = None
    if cfg.pp4 and cfg.world_size != 4:
        cfg4 = replace(cfg, world_size=4, memory_steps=0, pp4=False, **PP4)  # type: ignore[arg-type]
        pp4 = run(cfg4)
        pp4["note"] = "4 processes on the machine's cores: oversubscribed if fewer than 4 cores"
    wall = time.perf_counter() - wall
    payload: dict[str, Any] = {
        "benchmark": "pp",
        "description": "Pipeline parallel GPipe / 1F1B / interleaved 1F1B vs the unpipelined GPT: bubble, "
        "step time, activations in flight, loss and gradient equality",
        "environment": {**env, "loadavg_at_end": list(os.getloadavg()), "code": code},
        "reference": "unpipelined_m<m>: the whole GPT on every rank with gradient accumulation over the same "
        "m micro-batches, no communication: a single-process step under the same machine load",
        **result,
        "memory_alone": memory,
        "pp4": pp4,
        "wall_time_s": wall,
    }
    path = write_result("pp_quick" if ns.quick else "pp", payload, ns.out)
    print_table(cfg, result, memory)
    if pp4 is not None:
        print_table(replace(cfg, world_size=4, **PP4), pp4)  # type: ignore[arg-type]
    print(f"wall time {wall:.1f} s; wrote {path}")
    return payload


if __name__ == "__main__":
    main()
