"""Metrics of the user's own under pipeline parallelism: computed on the last stage, the same everywhere.

Under pp > 1 only the last virtual stage sees a micro-batch's output, so the pipeline protocol lets it
compute more than the loss:

* ``pipeline_loss(output, batch)`` may return a mapping ``{"loss": tensor, "acc": ..., ...}``: the loss
  is trained on, the other entries are metrics;
* ``pipeline_eval(output, batch) -> Mapping[str, Tensor]`` (optional) adds metrics to validation and
  test steps (no gradient).

A metric is a scalar per micro-batch; the step's value is the mean over its micro-batches (equal sizes:
the batch mean). :class:`PipelineMetrics` gathers them on the last stage and broadcasts them over the
pipeline group at the step's end (one broadcast of one vector), so every rank logs the same numbers.
The names are agreed once per kind of step (``"train"``, ``"val"``, ``"test"``) with an object broadcast
from the last stage, which also carries a bad metric's description, so every rank raises the same error
at the first step instead of waiting on a collective. Later steps must return the same names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


class PipelineMetricError(ValueError):
    """A metric the last pipeline stage cannot report (raised on every pipeline rank)."""


class PipelineMetrics:
    """Per-step metric accumulation on the last stage and their broadcast (see the module docstring).

    Args:
        group: the pipeline process group.
        src: the global rank of the last virtual stage's holder.
        device: the communication device.
    """

    def __init__(self, *, group: ProcessGroup, src: int, device: torch.device) -> None:
        self.group = group
        self.src = src
        self.device = device
        self.is_last = dist.get_rank() == src
        self._names: dict[str, list[str]] = {}
        self._sums: dict[str, Tensor] = {}
        self._error: str | None = None
        self._m = 1

    def start(self, m: int) -> None:
        """A new step of ``m`` micro-batches."""
        self._sums, self._error, self._m = {}, None, m

    def loss_of(self, result: Any, *, weight: float = 1.0, where: str) -> Tensor:
        """The loss in ``pipeline_loss``'s ``result`` (a tensor, or a mapping with ``"loss"``); the other
        entries of a mapping are recorded as metrics (last stage only)."""
        if isinstance(result, Mapping):
            if "loss" not in result:
                raise PipelineMetricError(
                    f"{where} returned a mapping without 'loss' (keys {sorted(result)}): return the loss"
                    " tensor, or {'loss': loss, 'metric': value, ...}."
                )
            self.add({k: v for k, v in result.items() if k != "loss"}, weight=weight, where=where)
            return result["loss"]
        return result

    def add(self, values: Mapping[str, Any], *, weight: float = 1.0, where: str) -> None:
        """Record one micro-batch's metrics (last stage); ``weight`` is ``m n_i / N`` for a micro-batch
        of ``n_i`` of the batch's ``N`` samples (1 when they are equal): the step's value is the batch
        mean."""
        if not isinstance(values, Mapping):
            self._error = (
                self._error
                or f"{where} must return a mapping of metric names to scalars, got {type(values).__name__}."
            )
            return
        for name, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                value = torch.tensor(float(value), device=self.device)
            if not isinstance(value, Tensor) or value.numel() != 1 or not value.is_floating_point():
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                self._error = self._error or (
                    f"{where} returned the metric {name!r} as {shape}: a metric must be one floating-point"
                    " number per micro-batch (a mean), so the step's value is their mean."
                )
                continue
            term = value.detach().float().reshape(()).to(self.device) * (weight / self._m)
            self._sums[name] = self._sums[name] + term if name in self._sums else term

    def finish(self, kind: str) -> dict[str, Tensor]:
        """The step's metric means on every pipeline rank (collective over the pipeline group)."""
        if kind not in self._names:
            payload: list[Any] = [None]
            if self.is_last:
                payload[0] = {"error": self._error} if self._error else {"names": sorted(self._sums)}
            dist.broadcast_object_list(payload, src=self.src, group=self.group, device=self.device)
            if "error" in payload[0]:
                raise PipelineMetricError(
                    f"Pipeline parallelism, {kind} step: {payload[0]['error']} (reported by the last stage)."
                )
            self._names[kind] = payload[0]["names"]
        names = self._names[kind]
        if not names:
            return {}
        if self.is_last:
            if self._error or sorted(self._sums) != names:
                raise PipelineMetricError(
                    f"Pipeline parallelism, {kind} step: the metrics changed from {names} to"
                    f" {sorted(self._sums)} ({self._error or 'other names'}); return the same names"
                    " every step."
                )
            vector = torch.stack([self._sums[n] for n in names])
        else:
            vector = torch.empty(len(names), device=self.device)
        dist.broadcast(vector, src=self.src, group=self.group)
        return dict(zip(names, vector.unbind(), strict=True))
