"""Shared helpers for the benchmarks: launching CPU/Gloo ranks, timing steps, peak memory, JSON results.

What every benchmark measures with these helpers
------------------------------------------------
* **Step time**: wall clock (``time.perf_counter``) around one whole training step on each rank, with a
  barrier (outside the timed region) before every step so ranks start together. The first ``warmup``
  steps of each implementation are recorded in the JSON but excluded from the statistics.
  Statistics are the median and the inter-quartile range (IQR = q75 - q25) because CPU timings on a
  shared machine have heavy right tails; a mean would be dominated by them.
* **CPU time** per step (``time.process_time``, all threads of the rank): the work done, without the
  waiting; steadier than wall time when other programs share the cores.
* **Peak RSS**: ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` of a rank, i.e. the *high-water mark* of
  its resident set over the process' whole life. It never goes down, so two implementations measured in
  one process share one number; compare implementations only when each ran in its own processes. A
  forked rank's mark starts at the parent's resident size at fork time (the imported torch, ~150 MiB).
* **Results**: one JSON file per run in ``benchmarks/results/<name>.json`` with the environment (torch
  and lightning versions, CPU count, threads per rank, load average, date, command line) and all raw
  step times.

Ranks are forked (tens of milliseconds, against 1-2 s for spawn), each with one torch thread, and join
a Gloo group through ``MASTER_ADDR``/``MASTER_PORT`` (``env://``), like ranks started by ``torchrun``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import multiprocessing as mp
import os
import platform
import resource
import shlex
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

RESULTS_DIR = Path(__file__).resolve().parent / "results"

__all__ = [
    "RESULTS_DIR",
    "StepTimer",
    "Summary",
    "config_from_args",
    "config_parser",
    "environment",
    "fmt",
    "free_port",
    "launch",
    "load_summary",
    "loss_agreement",
    "peak_rss_mib",
    "per_impl",
    "run_alone",
    "slowest",
    "summarize",
    "time_ratios",
    "timing",
    "write_result",
]


# ---------------------------------------------------------------------------------------------- launch
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    threads: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    queue: Any,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # hand every failure, assertions included, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    threads_per_rank: int = 1,
    timeout: float = 1800.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked Gloo ranks; return results by rank.

    ``fn`` must return picklable plain Python data (lists, dicts, floats), not tensors. Each rank uses
    ``threads_per_rank`` torch threads. A failing rank raises ``RuntimeError`` here with its traceback.
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, threads_per_rank, fn, args, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, payload = queue.get(timeout=timeout)
            if not ok:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break  # the other ranks are probably blocked in a collective
            results[rank] = payload
    except Exception as exc:  # queue.Empty on timeout
        errors.append(f"no result from all ranks within {timeout:.0f} s ({exc!r})")
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 1)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("benchmark ranks failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]


# ---------------------------------------------------------------------------------------------- timing
@dataclass(frozen=True)
class Summary:
    """Statistics of the measured (post-warmup) step times, in seconds."""

    n: int
    median: float
    iqr: float
    q25: float
    q75: float
    min: float
    max: float
    mean: float

    def as_dict(self) -> dict[str, float | int]:
        return dict(self.__dict__)


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of already sorted values."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def slowest(per_rank: Sequence[Any], *keys: str | int) -> list[float]:
    """Per step, the largest value over ranks of ``per_rank[r][keys[0]][keys[1]]...`` (a list per rank):
    a synchronous step takes as long as its slowest rank."""
    series = []
    for r in per_rank:
        for k in keys:
            r = r[k]
        series.append(r)
    return [max(values) for values in zip(*series, strict=True)]


def _bool_flag(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def timing(rs: Sequence[Any], warmup: int) -> dict[str, Any]:
    """Timing of one implementation from its per-rank records (each with ``times``, ``cpu_times`` and
    ``phases`` lists, one entry per step): the slowest rank's step times and their summary after
    ``warmup``, the CPU time (mean over ranks), the median of each phase (slowest rank), raw series."""
    step_times = slowest(rs, "times")
    cpu = [statistics.fmean(v) for v in zip(*(r["cpu_times"] for r in rs), strict=True)]
    return {
        "summary": summarize(step_times[warmup:]).as_dict(),
        "cpu_summary": summarize(cpu[warmup:]).as_dict(),
        "phase_medians_s": {
            ph: statistics.median(slowest(rs, "phases", ph)[warmup:]) for ph in rs[0]["phases"]
        },
        "step_times_s": step_times,
        "step_times_per_rank_s": [r["times"] for r in rs],
        "cpu_times_per_rank_s": [r["cpu_times"] for r in rs],
    }


def per_impl(per_rank: Sequence[Any], name: str) -> list[dict[str, Any]]:
    """The ``times``/``cpu_times``/``phases`` records of implementation ``name`` of every rank, from rank
    results keyed by implementation (``r["times"][name]``), for :func:`timing`."""
    return [{k: r[k][name] for k in ("times", "cpu_times", "phases")} for r in per_rank]


def time_ratios(a: Any, b: Any, warmup: int) -> dict[str, Any]:
    """Step time of implementation ``a`` over reference ``b`` (both :func:`timing` results of the same
    interleaved run): ratio of medians, median of the per-round ratios (the k-th measured steps of both
    ran next to each other), and the CPU-time ratio of medians."""
    pairs = [x / y for x, y in zip(a["step_times_s"][warmup:], b["step_times_s"][warmup:], strict=True)]
    return {
        "ratio_of_medians": a["summary"]["median"] / b["summary"]["median"],
        "median_paired_ratio": statistics.median(pairs),
        "cpu_ratio_of_medians": a["cpu_summary"]["median"] / b["cpu_summary"]["median"],
        "paired_ratios": pairs,
    }


def loss_agreement(losses: Sequence[float], reference: Sequence[float], *, rtol: float) -> dict[str, Any]:
    """Largest absolute and relative difference of two loss trajectories, and whether they agree."""
    diffs = [abs(x - y) for x, y in zip(losses, reference, strict=True)]
    rel = [d / max(abs(y), 1e-12) for d, y in zip(diffs, reference, strict=True)]
    return {"loss_max_abs_diff": max(diffs), "loss_max_rel_diff": max(rel), "losses_agree": max(rel) <= rtol}


def fmt(value: float | None, spec: str = ".3f") -> str:
    """``value`` formatted with ``spec``, or ``-`` when it is missing (tables)."""
    return "-" if value is None else format(value, spec)


def config_parser(config_cls: type, *, name: str) -> argparse.ArgumentParser:
    """An argument parser with ``--quick``, ``--out`` and one flag per field of the dataclass
    ``config_cls`` (``--n-layer`` for ``n_layer``; booleans take true/false); see :func:`config_from_args`."""
    p = argparse.ArgumentParser(description=(sys.modules[config_cls.__module__].__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny smoke configuration (overrides the defaults)")
    defaults = config_cls()
    for f in dataclasses.fields(config_cls):
        typ = type(getattr(defaults, f.name))
        conv: Any = _bool_flag if typ is bool else typ
        flag = "--" + f.name.replace("_", "-")
        p.add_argument(flag, type=conv, default=None, dest=f.name, metavar=typ.__name__.upper())
    p.add_argument("--out", default=None, help=f"JSON path (default benchmarks/results/{name}[_quick].json)")
    return p


def config_from_args(ns: argparse.Namespace, base: Any) -> Any:
    """``base`` (a dataclass) with every config flag that was given on the command line applied."""
    names = {f.name for f in dataclasses.fields(base)}
    overrides = {k: v for k, v in vars(ns).items() if k in names and v is not None}
    return dataclasses.replace(base, **overrides)


def load_summary(load: Sequence[float]) -> dict[str, Any]:
    """Min, median and max of the 1-minute load averages sampled during a run."""
    return {
        "min": min(load),
        "median": statistics.median(load),
        "max": max(load),
        "note": "includes the benchmark's own 2 busy ranks (an otherwise idle machine reads ~2)",
    }


def run_alone(rank_main: Callable[..., Any], cfg: Any, name: str) -> tuple[list[Any], dict[str, Any]]:
    """Run implementation ``name`` alone in fresh processes for ``cfg.memory_steps`` steps (no warmup):
    every rank's result and the peak and start RSS per rank (``peak_rss_mib`` / ``rss_at_start_mib`` of
    the rank results)."""
    alone = dataclasses.replace(cfg, steps=cfg.memory_steps, warmup=0)
    per_rank = launch(rank_main, cfg.world_size, alone, (name,), threads_per_rank=cfg.threads_per_rank)
    rss = {
        "peak_rss_mib_per_rank": [r["peak_rss_mib"] for r in per_rank],
        "rss_at_start_mib_per_rank": [r["rss_at_start_mib"] for r in per_rank],
    }
    return per_rank, rss


def summarize(values: Sequence[float]) -> Summary:
    """Median, IQR, extremes and mean of ``values`` (which must be non-empty)."""
    if not values:
        raise ValueError("summarize() needs at least one value.")
    s = sorted(values)
    q25, q75 = _quantile(s, 0.25), _quantile(s, 0.75)
    return Summary(
        n=len(s),
        median=statistics.median(s),
        iqr=q75 - q25,
        q25=q25,
        q75=q75,
        min=s[0],
        max=s[-1],
        mean=statistics.fmean(s),
    )


@dataclass
class StepTimer:
    """Wall-clock times of successive steps; the first ``warmup`` are kept but not summarised.

    Use ``with timer.step(): ...`` around one step, optionally ``timer.phase("backward")`` inside it to
    split the step into named phases (their times are kept per step alongside the total).

    ``cpu_times`` holds the CPU time of the whole process (all threads, communication threads included)
    per step: it does not count time spent waiting, but also hardly grows when other programs compete for
    the cores, so it is a steadier measure of the *work* per step on a busy machine than the wall time.
    """

    warmup: int = 0
    times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)
    phases: dict[str, list[float]] = field(default_factory=dict)

    @contextmanager
    def step(self) -> Iterator[None]:
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.times.append(time.perf_counter() - start)
            self.cpu_times.append(time.process_time() - cpu_start)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases.setdefault(name, []).append(time.perf_counter() - start)

    @property
    def measured(self) -> list[float]:
        """Step times after the warmup."""
        return self.times[self.warmup :]

    def summary(self) -> Summary:
        return summarize(self.measured)

    def phase_medians(self) -> dict[str, float]:
        """Median time of each phase over the measured steps."""
        return {k: statistics.median(v[self.warmup :]) for k, v in self.phases.items() if v[self.warmup :]}


# ---------------------------------------------------------------------------------------------- memory
def peak_rss_mib() -> float:
    """High-water mark of this process' resident set size, in MiB (never decreases; see module doc)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


# ---------------------------------------------------------------------------------------------- results
def _version(dist_name: str) -> str | None:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def environment(*, threads_per_rank: int, world_size: int) -> dict[str, Any]:
    """What a result depends on besides the benchmark's own settings."""
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        # orig_argv keeps "-m package.module" (sys.argv[0] would be the module's file path)
        "command": shlex.join([Path(sys.executable).name, *getattr(sys, "orig_argv", sys.argv)[1:]]),
        "argv": list(sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": _version("lightning"),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        # other work on the machine distorts CPU timings: a load above ~world_size means contention
        "loadavg_1_5_15min": list(os.getloadavg()),
        "world_size": world_size,
        "threads_per_rank": threads_per_rank,
        "backend": "gloo",
    }


def write_result(name: str, payload: dict[str, Any], out: str | Path | None = None) -> Path:
    """Write ``payload`` as JSON to ``out`` (default ``benchmarks/results/<name>.json``); return the path."""
    path = Path(out) if out is not None else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)
    return path
