"""Executes a pipeline schedule on this rank: forwards, backwards and the point-to-point transfers.

Contract of :meth:`PipelineRuntime.train_step`: with micro-batches ``0..m-1`` and ``loss_fn(output, i)``
the loss of micro-batch ``i`` on the last virtual stage, the gradients accumulated in every chunk's
parameters equal those of ``(1/m) Σ_i loss_i`` through the whole model, and the returned value is that
mean (broadcast so every pipeline rank returns the same number). Transfers are asynchronous sends and
blocking receives with a tag per (kind, virtual stage, micro-batch), so no ordering between different
transfers is needed; the schedule's dependency order makes progress certain (see
:func:`~lightning_par.pipeline.schedule.check_schedule`). Every activation is preceded by a small
shape header (8 integers), so micro-batch shapes may differ between training and evaluation; a gradient
has the shape of the receiver's own output.

Time spent computing is recorded per step (``last_stats``: busy and total seconds), so the bubble
fraction ``1 - busy / total`` of each rank can be reported.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_par.pipeline.schedule import Action, build_schedule

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]


@dataclass
class StepStats:
    busy_s: float = 0.0
    total_s: float = 0.0

    @property
    def bubble(self) -> float:
        return 1.0 - self.busy_s / self.total_s if self.total_s > 0 else 0.0


class PipelineRuntime:
    """Runs ``schedule`` (name) over ``chunks``, this rank's model chunks (chunk ``c`` is virtual stage
    ``c * p + s``), on the pipeline group ``group``."""

    def __init__(
        self,
        *,
        chunks: Sequence[nn.Module],
        group: ProcessGroup,
        schedule: str,
        num_microbatches: int,
    ) -> None:
        self.group = group
        self.p = dist.get_world_size(group)
        self.s = dist.get_rank(group)
        self.v = len(chunks)
        self.m = num_microbatches
        self.chunks = list(chunks)
        self.actions: list[Action] = build_schedule(schedule, p=self.p, m=self.m, v=self.v)[self.s]
        self.last = self.p * self.v - 1
        self.last_stats = StepStats()
        first = next((t for chunk in self.chunks for t in chunk.parameters() if not t.is_meta), None)
        self.device = first.device if first is not None else torch.device("cpu")

    # ------------------------------------------------------------------ p2p
    def _peer(self, g: int) -> int:
        return dist.get_global_rank(self.group, g % self.p)

    def _tag(self, kind: int, g: int, mb: int) -> int:
        return (mb * (self.last + 1) + g) * 4 + kind

    def _send(self, t: Tensor, *, to_g: int, from_g: int, mb: int, kind: str, works: list[Any]) -> None:
        t = t.detach().contiguous()
        if kind == "act":  # the receiver knows gradient shapes (its own output's), not activation shapes
            header = torch.zeros(8, dtype=torch.int64)
            header[0], header[1] = t.dim(), _DTYPES.index(t.dtype)
            header[2 : 2 + t.dim()] = torch.tensor(t.shape)
            works.append((dist.isend(header, self._peer(to_g), tag=self._tag(2, from_g, mb)), header))
        tag = self._tag(0 if kind == "act" else 1, from_g, mb)
        works.append((dist.isend(t, self._peer(to_g), tag=tag), t))  # the tensor lives until the wait

    def _recv(self, *, from_g: int, mb: int, kind: str, like: Tensor | None = None) -> Tensor:
        if like is not None:
            shape, dtype = like.shape, like.dtype
        else:
            header = torch.zeros(8, dtype=torch.int64)
            dist.recv(header, self._peer(from_g), tag=self._tag(2, from_g, mb))
            ndim = int(header[0])
            shape, dtype = torch.Size(header[2 : 2 + ndim].tolist()), _DTYPES[int(header[1])]
        buf = torch.empty(shape, dtype=dtype)
        dist.recv(buf, self._peer(from_g), tag=self._tag(0 if kind == "act" else 1, from_g, mb))
        return buf

    # ------------------------------------------------------------------ steps
    def train_step(
        self,
        *,
        inputs: Sequence[Any] | None,
        loss_fn: Callable[[Any, int], Tensor],
        no_sync: Callable[[], AbstractContextManager[None]] = nullcontext,
        sync_last: bool = True,
    ) -> Tensor:
        """Forward and backward of all micro-batches; ``inputs[i]`` feeds virtual stage 0 (rank 0 only).
        Every backward runs inside ``no_sync()`` (gradient accumulation), except this rank's last when
        ``sync_last`` (else the caller ends the window itself, e.g. with a flush)."""
        start = time.perf_counter()
        busy = 0.0
        works: list[Any] = []
        saved: dict[tuple[int, int], tuple[Any, Tensor]] = {}
        losses = torch.zeros(self.m)
        last_backward = max(i for i, a in enumerate(self.actions) if a.kind == "B")
        for index, action in enumerate(self.actions):
            g = action.chunk * self.p + self.s
            if action.kind == "F":
                x = self._input(g, action.mb, inputs)
                t0 = time.perf_counter()
                out = self.chunks[action.chunk](x)
                if g == self.last:
                    loss = loss_fn(out, action.mb) / self.m
                    losses[action.mb] = loss.detach().float()
                    out = loss
                busy += time.perf_counter() - t0
                if g < self.last:
                    self._send(out, to_g=g + 1, from_g=g, mb=action.mb, kind="act", works=works)
                saved[(action.chunk, action.mb)] = (x, out)
            else:
                x, out = saved.pop((action.chunk, action.mb))
                grad = (
                    None if g == self.last else self._recv(from_g=g + 1, mb=action.mb, kind="grad", like=out)
                )
                context = nullcontext() if index == last_backward and sync_last else no_sync()
                t0 = time.perf_counter()
                with context:
                    torch.autograd.backward(out, grad)
                busy += time.perf_counter() - t0
                if g > 0 and isinstance(x, Tensor) and x.grad is not None:
                    self._send(x.grad, to_g=g - 1, from_g=g, mb=action.mb, kind="grad", works=works)
        for work, _ in works:
            work.wait()
        loss = self._broadcast_loss(losses.sum())
        self.last_stats = StepStats(busy_s=busy, total_s=time.perf_counter() - start)
        return loss

    @torch.no_grad()
    def forward_step(self, *, inputs: Sequence[Any] | None, loss_fn: Callable[[Any, int], Tensor]) -> Tensor:
        """Forward only (evaluation): the mean of ``loss_fn`` over the micro-batches, on every rank."""
        works: list[Any] = []
        losses = torch.zeros(self.m)
        for i in range(self.m):
            for c in range(self.v):
                g = c * self.p + self.s
                x = self._input(g, i, inputs, grad=False)
                out = self.chunks[c](x)
                if g == self.last:
                    losses[i] = loss_fn(out, i).float()
                else:
                    self._send(out, to_g=g + 1, from_g=g, mb=i, kind="act", works=works)
        for work, _ in works:
            work.wait()
        return self._broadcast_loss(losses.mean())

    @torch.no_grad()
    def predict_step(self, *, inputs: Sequence[Any] | None) -> Tensor:
        """Forward only: the last virtual stage's outputs of all micro-batches, concatenated along dim 0
        and broadcast, so every pipeline rank returns the same tensor (one header and one broadcast)."""
        works: list[Any] = []
        outputs: list[Tensor] = []
        for i in range(self.m):
            for c in range(self.v):
                g = c * self.p + self.s
                x = self._input(g, i, inputs, grad=False)
                out = self.chunks[c](x)
                if g == self.last:
                    if not isinstance(out, Tensor):
                        raise TypeError(
                            "predict under pipeline parallelism needs the last layer to return a tensor, got"
                            f" {type(out).__name__}."
                        )
                    outputs.append(out)
                else:
                    self._send(out, to_g=g + 1, from_g=g, mb=i, kind="act", works=works)
        for work, _ in works:
            work.wait()
        src = self._peer(self.last)
        header = torch.zeros(8, dtype=torch.int64, device=self.device)
        result = torch.cat(outputs).contiguous() if outputs else None
        if result is not None:
            header[0], header[1] = result.dim(), _DTYPES.index(result.dtype)
            header[2 : 2 + result.dim()] = torch.tensor(result.shape, device=self.device)
        dist.broadcast(header, src=src, group=self.group)
        if result is None:
            ndim = int(header[0])
            shape = torch.Size(header[2 : 2 + ndim].tolist())
            result = torch.empty(shape, dtype=_DTYPES[int(header[1])], device=self.device)
        dist.broadcast(result, src=src, group=self.group)
        return result

    def _input(self, g: int, mb: int, inputs: Sequence[Any] | None, *, grad: bool = True) -> Any:
        if g == 0:
            if inputs is None:
                raise ValueError("The first pipeline stage needs the micro-batch inputs.")
            return inputs[mb]
        x = self._recv(from_g=g - 1, mb=mb, kind="act")
        if grad and x.is_floating_point():
            x.requires_grad_(True)
        return x

    def _broadcast_loss(self, value: Tensor) -> Tensor:
        out = value.detach().float().reshape(1).clone()
        dist.broadcast(out, src=self._peer(self.last), group=self.group)
        return out[0]
