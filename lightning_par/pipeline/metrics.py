"""Metrics of the user's own under pipeline parallelism: computed on the last stage, the same everywhere.

Under pp > 1 only the last virtual stage sees a micro-batch's output, so the pipeline protocol lets it
compute more than the loss:

* ``pipeline_loss(output, batch)`` may return a mapping ``{"loss": tensor, "acc": ..., ...}``: the loss
  is trained on, the other entries are metrics;
* ``pipeline_eval(output, batch) -> Mapping[str, Tensor]`` (optional) adds metrics to validation and
  test steps (no gradient);
* for a token-exact loss (masked or padded targets, :mod:`lightning_par.loss`), ``pipeline_loss`` returns
  ``{"loss_sum": S, "tokens": n, ...metrics}``: the sum of the micro-batch's token losses and its number
  of valid tokens (:func:`~lightning_par.loss.token_loss_sum` computes both). These two are summed over
  the step's micro-batches instead of averaged, reach every rank in the same broadcast as the metrics
  (in float64, so counts stay exact), and the step's loss is ``Σ S / Σ n``. The gradient rescaling that
  makes the window's gradient the global token mean is :class:`~lightning_par.pipeline.steps.
  PipelineSteps`'; the count has to reach every stage because every stage's gradients are rescaled.

A metric is a scalar per micro-batch; the step's value is the mean over its micro-batches (equal sizes:
the batch mean). :class:`PipelineMetrics` gathers them on the last stage and broadcasts them over the
pipeline group at the step's end (one broadcast of one vector), so every rank logs the same numbers.
The names are agreed once per kind of step (``"train"``, ``"val"``, ``"test"``) with an object broadcast
from the last stage, which also carries a bad metric's description, so every rank raises the same error
at the first step instead of waiting on a collective. Later steps must return the same names: the vector
ends with a flag the last stage sets when they changed (or a value went bad; the step then logs NaN).
The other ranks copy the flag into host memory without waiting (a pinned buffer and an event on CUDA)
and look at it at the next step's end, by when that copy has long been queued: so no rank reads the
device inside the step that produced the flag, and every rank raises the same error at the same point,
the end of the step after the change, instead of leaving the others waiting on a collective. A change
in the very last step of a run is logged as NaN only. Metrics that appear only after the first step of
a kind, when none were agreed, are not logged (a warning on the last stage says so).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

SUMS = ("loss_sum", "tokens")  # the token-exact loss form: summed over a step's micro-batches


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
        self._form: bool | None = None  # this step's loss form: True for a token-loss sum
        self._late_warned: set[str] = set()
        # the last broadcast's verdict, looked at by the next finish(): (kind, names, CUDA event of the
        # flag's copy into self._flag or None, the last stage's description of the change or None)
        self._pending: tuple[str, list[str], Any, str | None] | None = None
        self._flag: Tensor | None = None  # host copy of the flag (pinned on CUDA), ranks but the last

    def start(self, m: int) -> None:
        """A new step of ``m`` micro-batches."""
        self._sums, self._error, self._m, self._form = {}, None, m, None

    def loss_of(self, result: Any, *, weight: float = 1.0, where: str) -> tuple[Tensor, bool]:
        """The loss in ``pipeline_loss``'s ``result`` and whether it is a token-loss sum: a tensor, a
        mapping with ``"loss"``, or one with ``"loss_sum"`` and ``"tokens"`` (module docstring); the other
        entries of a mapping are recorded as metrics (last stage only)."""
        if not isinstance(result, Mapping):
            return result, False
        summed = "loss_sum" in result
        if summed == ("loss" in result) or (summed and "tokens" not in result):
            raise PipelineMetricError(
                f"{where} returned a mapping with keys {sorted(result)}: return the loss tensor,"
                " {'loss': loss, 'metric': value, ...}, or for a token-exact loss {'loss_sum': sum of the"
                " token losses, 'tokens': number of valid tokens, 'metric': value, ...}."
            )
        if self._form not in (None, summed):
            self._error = self._error or (
                f"{where} returned 'loss' for some micro-batches and 'loss_sum' for others in one step:"
                " return one form every time."
            )
        self._form = summed
        if summed:
            tokens = result["tokens"]
            if isinstance(tokens, Tensor) and tokens.numel() == 1 and not tokens.dtype.is_complex:
                count = tokens.detach().reshape(()).to(self.device, torch.float64)
            elif isinstance(tokens, int) and not isinstance(tokens, bool):
                count = torch.tensor(float(tokens), dtype=torch.float64, device=self.device)
            else:
                shape = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
                raise PipelineMetricError(
                    f"{where} returned 'tokens' as {shape}: it must be the number of valid tokens of the"
                    " micro-batch, an int or a one-element tensor."
                )
            for name, value in (("loss_sum", result["loss_sum"].detach().double()), ("tokens", count)):
                self._sums[name] = self._sums[name] + value if name in self._sums else value
        others = {k: v for k, v in result.items() if k not in ("loss", *SUMS)}
        self.add(others, weight=weight, where=where)
        return result["loss_sum" if summed else "loss"], summed

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
            if name in SUMS:
                self._error = self._error or (
                    f"{where} returned the metric {name!r}: that name is reserved for the token-exact loss"
                    " ({'loss_sum': ..., 'tokens': ...} from pipeline_loss); rename the metric."
                )
                continue
            if name == "loss":  # before, Lightning's "You called self.log(val_loss, ...) twice"
                self._error = self._error or (
                    f"{where} returned the metric 'loss': the pipeline logs pipeline_loss's loss as"
                    " train_loss / val_loss / test_loss already; rename the metric."
                )
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                value = torch.tensor(float(value), dtype=torch.float32, device=self.device)
            if not isinstance(value, Tensor) or value.numel() != 1 or not value.is_floating_point():
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                self._error = self._error or (
                    f"{where} returned the metric {name!r} as {shape}: a metric must be one floating-point"
                    " number per micro-batch (a mean), so the step's value is their mean."
                )
                continue
            term = value.detach().float().reshape(()).to(self.device) * (weight / self._m)
            self._sums[name] = self._sums[name] + term if name in self._sums else term

    def forget(self, kind: str) -> None:
        """The next :meth:`finish` of ``kind`` agrees its metric names anew (one object broadcast): for
        calls whose metrics may differ each time (Fabric's ``evaluate``: a loop's validation and test
        calls with other ``metrics_fn``; before, a new name came back as the old one's NaN)."""
        self._names.pop(kind, None)

    def finish(self, kind: str) -> dict[str, Tensor]:
        """The step's metric means on every pipeline rank (collective over the pipeline group); raises
        on every rank if the previous step's metrics changed (module docstring)."""
        self._verdict()
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
        problem: str | None = None
        if self.is_last:
            problem = self._error or (None if sorted(self._sums) == names else "other names")
        if not names:
            if self._sums and kind not in self._late_warned:
                self._late_warned.add(kind)
                warnings.warn(
                    f"Pipeline parallelism, {kind} step: metrics {sorted(self._sums)} appeared after the"
                    " first step, which had none; they are not logged. Return every metric from the first"
                    " step on.",
                    stacklevel=2,
                )
            return {}
        # [metric means and SUMS..., flag]: flag 1 when this step's metrics differ from the agreed ones;
        # float64, so that a token count stays an exact integer
        vector = torch.zeros(len(names) + 1, dtype=torch.float64, device=self.device)
        if problem is None and self.is_last:
            vector[:-1] = torch.stack([self._sums[n].double() for n in names])
        elif problem is not None:
            vector.fill_(float("nan"))
            vector[-1] = 1.0
        dist.broadcast(vector, src=self.src, group=self.group)
        event = None
        if not self.is_last:  # the last stage knows the verdict already
            cuda = vector.device.type == "cuda"
            if self._flag is None:
                self._flag = torch.empty(1, dtype=torch.float64, device="cpu", pin_memory=cuda)
            self._flag.copy_(vector[-1:], non_blocking=cuda)
            if cuda:
                event = torch.cuda.Event()
                event.record()
        detail = f"{sorted(self._sums)} ({problem})" if problem is not None else None
        self._pending = (kind, names, event, detail)
        values = vector[:-1].unbind()
        return {n: v if n in SUMS else v.float() for n, v in zip(names, values, strict=True)}

    def _verdict(self) -> None:
        """Raise :class:`PipelineMetricError` on every rank if the last broadcast flagged a change."""
        if self._pending is None:
            return
        kind, names, event, detail = self._pending
        self._pending = None
        if self.is_last or self._flag is None:
            changed = detail is not None
        else:
            if event is not None:
                event.synchronize()  # the previous step's copy: queued a whole step ago
            changed = bool(self._flag[0] != 0)  # host memory
        if changed:
            payload = [detail]
            dist.broadcast_object_list(payload, src=self.src, group=self.group, device=self.device)
            raise PipelineMetricError(
                f"Pipeline parallelism, {kind} step: the metrics changed from {names} to {payload[0]};"
                " return the same names every step (reported by the last stage)."
            )
