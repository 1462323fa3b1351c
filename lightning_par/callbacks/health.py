"""``NodeHealthCheck``: find slow or broken ranks before they waste a run.

At ``fit`` start, before the model is built, every rank runs

* a matmul benchmark: ``matmul_repeats`` products of two ``matmul_size`` x ``matmul_size`` fp32 matrices
  on its device (GFLOP/s; a non-finite result is a failure);
* a collective-bandwidth probe: ``comm_repeats`` all-reduces of ``bandwidth_mb`` MiB over the world and,
  under ``HybridParallelStrategy``, within its data- and tensor-parallel groups (bus bandwidth
  ``2 (n - 1) / n * bytes / seconds``, NCCL's convention; a wrong sum is a failure).

One gather brings every rank's figures to every rank, so all reach the same verdict: a rank is named
(rank, host, figure, median) if a probe failed or its figure is worse than the median by more than
``slow_factor`` (or below an absolute ``min_gflops`` / ``min_bus_gbps``). With ``action="fail"`` every
rank then raises a ``RuntimeError`` before training; with ``"warn"`` rank 0 warns and training starts.
A slow link slows every member of its group alike: compare the groups' figures in :attr:`results`.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_par.callbacks import _dist

log = logging.getLogger(__name__)

HealthAction = Literal["fail", "warn"]
_ACTIONS = ("fail", "warn")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_seconds(size: int, repeats: int, device: torch.device) -> float:
    """Seconds per ``size`` x ``size`` fp32 matmul on ``device``; raises if the product is not finite."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g).to(device)
    b = torch.randn(size, size, generator=g).to(device)
    c = a @ b  # warm-up (kernels, caches)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        c = a @ b
    _sync(device)
    seconds = (time.perf_counter() - start) / repeats
    if not bool(torch.isfinite(c).all()):
        raise ArithmeticError("the matmul produced non-finite values")
    return seconds


def all_reduce_seconds(numel: int, repeats: int, device: torch.device, group: Any) -> float:
    """Seconds per all-reduce of ``numel`` fp32 over ``group``; raises if the sum is wrong."""
    size = dist.get_world_size(group)
    rank = dist.get_rank()
    x = torch.full((numel,), float(rank + 1), device=device)
    dist.all_reduce(x, group=group)  # warm-up; also the correctness check
    ranks = dist.get_process_group_ranks(group) if group is not None else range(size)
    expected = float(sum(r + 1 for r in ranks))
    if not bool((x == expected).all()):
        raise ArithmeticError(f"all-reduce gave {float(x[0])}, expected {expected}")
    dist.barrier(group=group)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(x, group=group)
    _sync(device)
    return (time.perf_counter() - start) / repeats


class NodeHealthCheck(Callback):
    """Probe every rank's compute and communication at fit start (see the module docstring).

    Attributes:
        results: every rank's figures ``{"rank", "host", "matmul_gflops", "comm": {group: bus GB/s},
            "errors"}``, after ``setup``.
        problems: the lines naming slow or failing ranks (empty if all are healthy).
    """

    def __init__(
        self,
        *,
        matmul_size: int = 1024,
        matmul_repeats: int = 5,
        bandwidth_mb: float = 16.0,
        comm_repeats: int = 3,
        slow_factor: float = 2.0,
        min_gflops: float | None = None,
        min_bus_gbps: float | None = None,
        action: HealthAction = "fail",
    ) -> None:
        for name, value in (
            ("matmul_size", matmul_size),
            ("matmul_repeats", matmul_repeats),
            ("comm_repeats", comm_repeats),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"NodeHealthCheck: {name} must be a positive integer, got {value!r}.")
        if not bandwidth_mb > 0:
            raise ValueError(f"NodeHealthCheck: bandwidth_mb must be > 0, got {bandwidth_mb!r}.")
        if not slow_factor > 1:
            raise ValueError(f"NodeHealthCheck: slow_factor must be > 1, got {slow_factor!r}.")
        if action not in _ACTIONS:
            raise ValueError(f"NodeHealthCheck: action must be one of {_ACTIONS}, got {action!r}.")
        self.matmul_size = matmul_size
        self.matmul_repeats = matmul_repeats
        self.bandwidth_mb = float(bandwidth_mb)
        self.comm_repeats = comm_repeats
        self.slow_factor = float(slow_factor)
        self.min_gflops = min_gflops
        self.min_bus_gbps = min_bus_gbps
        self.action: HealthAction = action
        self.results: list[dict[str, Any]] = []
        self.problems: list[str] = []

    def _groups(self, trainer: pl.Trainer) -> dict[str, Any]:
        if not _dist.initialized() or trainer.world_size < 2:
            return {}
        groups: dict[str, Any] = {"world": None}
        mesh = getattr(trainer.strategy, "_mesh", None)
        if mesh is not None:
            if 1 < mesh.dp_size < trainer.world_size:
                groups["dp"] = mesh.dp_group
            if mesh.tp_size > 1:
                groups["tp"] = mesh.tp_group
        return groups

    def _probe(self, trainer: pl.Trainer) -> dict[str, Any]:
        device = trainer.strategy.root_device
        mine: dict[str, Any] = {"rank": trainer.global_rank, "host": _dist.HOST, "comm": {}, "errors": []}
        try:
            seconds = matmul_seconds(self.matmul_size, self.matmul_repeats, device)
            mine["matmul_gflops"] = 2 * self.matmul_size**3 / seconds / 1e9
        except Exception as exc:
            mine["errors"].append(f"matmul: {type(exc).__name__}: {exc}")
        numel = int(self.bandwidth_mb * 2**20 / 4)
        for name, group in self._groups(trainer).items():
            try:
                n = dist.get_world_size(group)
                seconds = all_reduce_seconds(numel, self.comm_repeats, device, group)
                mine["comm"][name] = 2 * (n - 1) / n * numel * 4 / seconds / 1e9
            except Exception as exc:
                mine["errors"].append(f"all-reduce over {name}: {type(exc).__name__}: {exc}")
        return mine

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.results = _dist.gather_objects(self._probe(trainer))
        self.problems = self._judge(self.results)
        if trainer.is_global_zero:
            for r in self.results:
                comm = ", ".join(f"{k} {v:.2f} GB/s" for k, v in r["comm"].items())
                log.info(
                    "NodeHealthCheck: rank %d (%s): matmul %.1f GFLOP/s%s",
                    r["rank"],
                    r["host"],
                    r.get("matmul_gflops", float("nan")),
                    f"; all-reduce bus bandwidth {comm}" if comm else "",
                )
        if not self.problems:
            return
        text = "NodeHealthCheck: " + "; ".join(self.problems)
        if self.action == "fail":
            raise RuntimeError(
                text + ". Stopping before training (action='fail'); replace or drain these nodes."
            )
        rank_zero_warn(text)

    def _judge(self, results: list[dict[str, Any]]) -> list[str]:
        out = [f"rank {r['rank']} ({r['host']}) failed: {e}" for r in results for e in r["errors"]]

        def check(label: str, unit: str, values: dict[int, float], floor: float | None) -> None:
            if not values:
                return
            median = statistics.median(values.values())
            for rank, v in sorted(values.items()):
                host = results[rank]["host"]
                if not math.isfinite(v) or v * self.slow_factor < median:
                    out.append(
                        f"rank {rank} ({host}): {label} {v:.3g} {unit}, median {median:.3g}"
                        f" (slow_factor {self.slow_factor:g})"
                    )
                elif floor is not None and v < floor:
                    out.append(f"rank {rank} ({host}): {label} {v:.3g} {unit}, below the minimum {floor:g}")

        check(
            "matmul",
            "GFLOP/s",
            {r["rank"]: r["matmul_gflops"] for r in results if "matmul_gflops" in r},
            self.min_gflops,
        )
        for name in sorted({k for r in results for k in r["comm"]}):
            values = {r["rank"]: r["comm"][name] for r in results if name in r["comm"]}
            check(f"all-reduce over {name}", "GB/s bus bandwidth", values, self.min_bus_gbps)
        return out
