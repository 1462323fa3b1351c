"""Executes a pipeline schedule on this rank: forwards, backwards and the point-to-point transfers.

Contract of :meth:`PipelineRuntime.train_step`: with micro-batches ``0..m-1`` and ``loss_fn(output, i)``
the loss of micro-batch ``i`` on the last virtual stage, the gradients accumulated in every chunk's
parameters equal those of ``(1/m) Σ_i loss_i`` through the whole model, and the returned value is that
mean (a tensor on :attr:`PipelineRuntime.device`, broadcast so every pipeline rank returns the same
number). The tensor that leaves a chunk towards another rank must be one tensor.

Transfers (NCCL rules, the same code on Gloo): every transfer goes through
``torch.distributed.batch_isend_irecv`` in the batches of :mod:`lightning_par.pipeline.p2p`, one batch
after each unit round of the schedule, matched by order and never by tag; the plan of every rank is
checked (pairing and absence of deadlock, simulated in pure Python) before its first use, so a plan that
could hang is refused with a ``ValueError`` instead of run. A batch is posted as soon as the rank reaches
it, but waited for only where its data is used: a received tensor right before the action that consumes
it, sends at the end of the step (their tensors stay referenced until then). So a rank whose next action
does not depend on a transfer computes on instead of waiting for its peer to reach the same batch (the
interleaved schedule's chunks), and since every batch is posted no later than with waiting at each
batch, the checked plan cannot deadlock. Under NCCL a wait only orders the compute stream after the
transfers; the host runs on.
Every tensor handed to a p2p op or a collective lives on :attr:`PipelineRuntime.device`.

Shapes are agreed once per shape change, not per micro-batch. Each step (training or evaluation) starts
with ONE broadcast of one int64 from pipeline rank 0: the id of the step's input signature (kind of step,
shapes and dtypes of the micro-batch inputs), which ranks ``> 0`` read on the host (the one host read per
step; it also makes a collective over the whole group the group's first call, which NCCL requires
before partial batches of p2p ops). A signature seen before reuses the activation shapes learnt then;
a new one (the first step, the first evaluation, a ragged last batch) makes that step send a shape header
(8 int64s on the device) before every activation, each read once on the host. So activation shapes must
follow from the input signature: a sender checks every activation against the shape agreed for it
(metadata, no device sync) and raises if it differs (its peers then wait until the group's timeout).
Gradients have the receiver's own output shape. Micro-batch losses accumulate in a tensor on the
device; nothing is copied to the host per micro-batch (prediction reads its result's header once).

Time spent computing is recorded per step (``last_stats``: busy and total seconds), so the bubble
fraction ``1 - busy / total`` of each rank can be reported.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_par.pipeline.p2p import (
    Batch,
    Item,
    Transfer,
    check_plan,
    forward_only,
    header_of,
    plan,
    stage_of,
)
from lightning_par.pipeline.schedule import SPLIT_BACKWARD, Action, build_schedule
from lightning_par.pipeline.weight_grad import GradOf, WeightGradSplit
from lightning_par.zero.meta_init import target_device

_DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool,
]  # fmt: skip
_HEADER = 8  # int64s: ndim, dtype index, up to 6 sizes
Layout = dict[Transfer, tuple[torch.Size, torch.dtype]]


@dataclass
class StepStats:
    busy_s: float = 0.0
    total_s: float = 0.0

    @property
    def bubble(self) -> float:
        return 1.0 - self.busy_s / self.total_s if self.total_s > 0 else 0.0


@dataclass
class _Mail:
    """One step's tensors in transit: ``outbox`` (computed, waiting for their batch), ``inbox`` (received
    or handed over, waiting for their action), and the activation shapes (``layout``) of this rank's
    transfers, learnt from headers when ``learn``."""

    layout: Layout
    learn: bool
    inbox: dict[Transfer, Tensor] = field(default_factory=dict)
    outbox: dict[Transfer, Tensor] = field(default_factory=dict)
    # (virtual stage, mb) -> (input, output) of a forward awaiting its backward; a received gradient
    # takes its output's shape
    saved: dict[tuple[int, int], tuple[Any, Tensor]] = field(default_factory=dict)
    # posted and not waited for: a received transfer's works (waited before its use); sends' works and
    # tensors (waited at the end of the step)
    pending: dict[Transfer, list[Any]] = field(default_factory=dict)
    sending: list[tuple[list[Any], Tensor]] = field(default_factory=list)

    def take(self, t: Transfer) -> Tensor:
        """A received (or handed over) tensor, after waiting for its transfer."""
        for work in self.pending.pop(t, []):
            work.wait()
        return self.inbox.pop(t)

    def settle(self) -> None:
        """Wait for every transfer still in flight (the step's end)."""
        for works, _ in self.sending:
            for work in works:
                work.wait()
        for works in self.pending.values():
            for work in works:
                work.wait()
        self.sending, self.pending = [], {}


class PipelineRuntime:
    """Runs ``schedule`` (name) over ``chunks``, this rank's model chunks (chunk ``c`` is virtual stage
    ``c * p + s``), on the pipeline group ``group``. ``device`` (communication device) defaults to the
    device of the chunks' first real parameter or buffer (the strategy's root device), else the current
    CUDA device under NCCL, else the CPU. ``slack``: extra micro-batches in flight for ``1f1b`` / ``zb``
    (:mod:`lightning_par.pipeline.schedule`)."""

    def __init__(
        self,
        *,
        chunks: Sequence[nn.Module],
        group: ProcessGroup,
        schedule: str,
        num_microbatches: int,
        device: torch.device | None = None,
        slack: int = 0,
    ) -> None:
        self.group = group
        self.p = dist.get_world_size(group)
        self.s = dist.get_rank(group)
        self.v = len(chunks)
        self.m = num_microbatches
        self.chunks = list(chunks)
        self._schedules = {
            "train": build_schedule(schedule, p=self.p, m=self.m, v=self.v, slack=slack),
            "forward": forward_only(p=self.p, m=self.m, v=self.v),
        }
        self.actions: list[Action] = self._schedules["train"][self.s]
        # zb / interleaved_zb split each backward: input gradients in B, matrix-product weights in W
        self._split = WeightGradSplit(self.chunks, rank=self.s) if schedule in SPLIT_BACKWARD else None
        self.schedule = schedule
        self._last_backward = [a for a in self.actions if a.kind == "B"][-1]
        self.last = self.p * self.v - 1
        self.last_stats = StepStats()
        self.device = device if device is not None else _comm_device(nn.ModuleList(self.chunks), group)
        self._programs: dict[tuple[str, bool], list[Item]] = {}
        self._ids: dict[Any, int] = {}  # pipeline rank 0: (kind, input signature) -> shape id
        self._layouts: dict[int, Layout] = {}  # shape id -> activation shapes of this rank's transfers

    # ------------------------------------------------------------------ p2p
    def _peer(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank)

    def _program(self, kind: str, *, headers: bool) -> list[Item]:
        """This rank's items, planned and checked for every rank on first use (milliseconds)."""
        key = (kind, headers)
        if key not in self._programs:
            programs = plan(self._schedules[kind], p=self.p, v=self.v, headers=headers)
            check_plan(programs, p=self.p, v=self.v)
            self._programs[key] = programs[self.s]
        return self._programs[key]

    def _begin(self, kind: str, inputs: Sequence[Any] | None) -> tuple[int, _Mail]:
        """Agree on the step's shape id (module docstring); a new id means this step learns shapes."""
        ident = -1
        if self.s == 0:
            if inputs is None:
                raise ValueError("The first pipeline stage needs the micro-batch inputs.")
            signature = (kind, tuple(_signature(x) for x in inputs))
            ident = self._ids.setdefault(signature, len(self._ids))
        if self.p > 1:
            flag = torch.full((1,), ident, dtype=torch.int64, device=self.device)
            dist.broadcast(flag, src=self._peer(0), group=self.group)
            ident = int(flag.item()) if self.s != 0 else ident  # the one host read of a step
        known = ident in self._layouts
        return ident, _Mail(layout=self._layouts[ident] if known else {}, learn=not known)

    def _send(self, t: Transfer, value: Any, *, mail: _Mail) -> None:
        if not isinstance(value, Tensor):
            raise TypeError(f"A pipeline stage must pass one tensor to the next, got {type(value).__name__}.")
        tensor = value.detach()
        if t.dst % self.p == self.s:  # the next virtual stage is on this rank (p = 1): no transfer
            mail.inbox[t] = tensor.clone()
            return
        tensor = tensor.contiguous()
        if t.kind == "act":
            if mail.learn:
                mail.layout[t] = (tensor.shape, tensor.dtype)
                mail.outbox[header_of(t)] = self._header(tensor)
            elif mail.layout[t] != (tensor.shape, tensor.dtype):
                raise RuntimeError(
                    f"Virtual stage {t.src} produced {tuple(tensor.shape)} {tensor.dtype} for micro-batch"
                    f" {t.mb}, but {tuple(mail.layout[t][0])} {mail.layout[t][1]} was agreed for inputs"
                    " of this signature: activation shapes must follow from the input shapes."
                )
        mail.outbox[t] = tensor

    def _header(self, tensor: Tensor) -> Tensor:
        if tensor.dim() > _HEADER - 2 or tensor.dtype not in _DTYPES:
            raise TypeError(f"Cannot send a {tensor.dim()}-d {tensor.dtype} tensor between pipeline stages.")
        values = [tensor.dim(), _DTYPES.index(tensor.dtype), *tensor.shape]
        return torch.tensor(values + [0] * (_HEADER - len(values)), dtype=torch.int64, device=self.device)

    def _buffer(self, t: Transfer, mail: _Mail) -> Tensor:
        if t.kind == "hdr":
            return torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        if t.kind == "grad":  # the gradient of this rank's own output
            out = mail.saved[(t.dst, t.mb)][1]
            return torch.empty(out.shape, dtype=out.dtype, device=self.device)
        shape, dtype = mail.layout[t]
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _exchange(self, batch: Batch, mail: _Mail) -> None:
        """Post ``batch`` in one ``batch_isend_irecv``; its waits are deferred to the uses (module
        docstring), except for headers, read on the host at once (learning steps only)."""
        ops, tensors = [], []
        for op in batch.ops:
            if op.send:
                tensor = mail.outbox.pop(op.transfer)
            else:
                tensor = mail.inbox[op.transfer] = self._buffer(op.transfer, mail)
            send_or_recv = dist.isend if op.send else dist.irecv
            ops.append(dist.P2POp(send_or_recv, tensor, self._peer(op.peer), self.group))
            tensors.append(tensor)
        works = list(dist.batch_isend_irecv(ops))
        # Gloo returns a work per op; NCCL one for the coalesced batch, which every op then waits on
        per_op = [[w] for w in works] if len(works) == len(ops) else [works] * len(ops)
        for op, tensor, mine in zip(batch.ops, tensors, per_op, strict=True):
            if op.send:
                mail.sending.append((mine, tensor))
            else:
                mail.pending[op.transfer] = mine
        for op in batch.ops:
            t = op.transfer
            if not op.send and t.kind == "hdr":  # learning steps only: one host read per header
                mail.layout[Transfer("act", t.src, t.dst, t.mb)] = _decode(mail.take(t))

    def _finish(self, ident: int, mail: _Mail) -> None:
        mail.settle()
        if mail.learn:
            self._layouts[ident] = mail.layout

    # ------------------------------------------------------------------ steps
    def train_step(
        self,
        *,
        inputs: Sequence[Any] | None,
        loss_fn: Callable[[Any, int], Tensor],
        no_sync: Callable[[], AbstractContextManager[None]] = nullcontext,
        sync_last: bool = True,
        grad_of: GradOf | None = None,
    ) -> Tensor:
        """Forward and backward of all micro-batches; ``inputs[i]`` feeds virtual stage 0 (rank 0 only).
        Every backward runs inside ``no_sync()`` (gradient accumulation), except this rank's last when
        ``sync_last`` (else the caller ends the window itself, e.g. with a flush). With a split backward
        (``zb``, ``interleaved_zb``), the weight-gradient passes add into ``grad_of(param)`` (the engine's
        accumulation buffer) or ``param.grad``; they come after the last backward, so a caller with an
        engine must end the window itself (``sync_last=False``)."""
        if self._split is not None and sync_last and no_sync is not nullcontext:
            raise ValueError(
                f"pipeline_schedule={self.schedule!r} runs weight-gradient passes after the last backward:"
                " call train_step(sync_last=False) and end the accumulation window afterwards"
                " (engine.flush())."
            )
        with self._split.attached() if self._split is not None else nullcontext():
            return self._train_step(inputs, loss_fn, no_sync, sync_last, grad_of)

    def _train_step(
        self,
        inputs: Sequence[Any] | None,
        loss_fn: Callable[[Any, int], Tensor],
        no_sync: Callable[[], AbstractContextManager[None]],
        sync_last: bool,
        grad_of: GradOf | None,
    ) -> Tensor:
        start = time.perf_counter()
        busy = 0.0
        ident, mail = self._begin("train", inputs)
        losses = torch.zeros(self.m, device=self.device)
        split = self._split
        for item in self._program("train", headers=mail.learn):
            if isinstance(item, Batch):
                self._exchange(item, mail)
                continue
            action = item.action
            g = stage_of(action, rank=self.s, p=self.p)
            if action.kind == "F":
                x = self._input(g, action.mb, inputs, mail, grad=True)
                t0 = time.perf_counter()
                with split.forward((g, action.mb)) if split is not None else nullcontext():
                    out = self.chunks[action.chunk](x)
                if g == self.last:
                    loss = loss_fn(out, action.mb) / self.m
                    losses[action.mb] = loss.detach().float()
                    out = loss
                busy += time.perf_counter() - t0
                mail.saved[(g, action.mb)] = (x, out)
                if g < self.last:
                    self._send(Transfer("act", g, g + 1, action.mb), out, mail=mail)
            elif action.kind == "W":
                assert split is not None
                t0 = time.perf_counter()
                split.weights((g, action.mb), grad_of)
                busy += time.perf_counter() - t0
            else:
                x, out = mail.saved.pop((g, action.mb))
                grad = None if g == self.last else mail.take(Transfer("grad", g + 1, g, action.mb))
                context = nullcontext() if action == self._last_backward and sync_last else no_sync()
                t0 = time.perf_counter()
                with context:
                    if split is not None:
                        split.backward(out, grad, x, chunk=action.chunk, key=(g, action.mb))
                    else:
                        torch.autograd.backward(out, grad)
                busy += time.perf_counter() - t0
                if g > 0:  # the upstream stage waits for a gradient in any case: zeros if x got none
                    dx = x.grad if x.grad is not None else torch.zeros_like(x)
                    self._send(Transfer("grad", g, g - 1, action.mb), dx, mail=mail)
        self._finish(ident, mail)
        loss = self._broadcast_loss(losses.sum())
        self.last_stats = StepStats(busy_s=busy, total_s=time.perf_counter() - start)
        return loss

    def _forward_only(self, inputs: Sequence[Any] | None, on_last: Callable[[Any, int], None]) -> None:
        """Every micro-batch through this rank's chunks (no grad); ``on_last(output, i)`` on the last
        virtual stage."""
        ident, mail = self._begin("forward", inputs)
        for item in self._program("forward", headers=mail.learn):
            if isinstance(item, Batch):
                self._exchange(item, mail)
                continue
            g, mb = stage_of(item.action, rank=self.s, p=self.p), item.action.mb
            out = self.chunks[item.action.chunk](self._input(g, mb, inputs, mail, grad=False))
            if g == self.last:
                on_last(out, mb)
            else:
                self._send(Transfer("act", g, g + 1, mb), out, mail=mail)
        self._finish(ident, mail)

    @torch.no_grad()
    def forward_step(self, *, inputs: Sequence[Any] | None, loss_fn: Callable[[Any, int], Tensor]) -> Tensor:
        """Forward only (evaluation): the mean of ``loss_fn`` over the micro-batches, on every rank."""
        losses = torch.zeros(self.m, device=self.device)

        def record(out: Any, i: int) -> None:
            losses[i] = loss_fn(out, i).float()

        self._forward_only(inputs, record)
        return self._broadcast_loss(losses.mean())

    @torch.no_grad()
    def predict_step(self, *, inputs: Sequence[Any] | None) -> Tensor:
        """Forward only: the last virtual stage's outputs of all micro-batches, concatenated along dim 0
        and broadcast, so every pipeline rank returns the same tensor (one header, read on the host once
        per call, and one broadcast)."""
        outputs: list[Tensor] = []

        def record(out: Any, i: int) -> None:
            if not isinstance(out, Tensor):
                raise TypeError(
                    "predict under pipeline parallelism needs the last layer to return a tensor, got"
                    f" {type(out).__name__}."
                )
            outputs.append(out)

        self._forward_only(inputs, record)
        src = self._peer(self.last % self.p)
        result = torch.cat(outputs).contiguous() if outputs else None
        header = (
            self._header(result)
            if result is not None
            else torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        )
        dist.broadcast(header, src=src, group=self.group)
        if result is None:
            shape, dtype = _decode(header)
            result = torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(result, src=src, group=self.group)
        return result

    def _input(self, g: int, mb: int, inputs: Sequence[Any] | None, mail: _Mail, *, grad: bool) -> Any:
        if g == 0:
            if inputs is None:
                raise ValueError("The first pipeline stage needs the micro-batch inputs.")
            return inputs[mb]
        x = mail.take(Transfer("act", g - 1, g, mb))
        if grad and x.is_floating_point():
            x.requires_grad_(True)
        return x

    def _broadcast_loss(self, value: Tensor) -> Tensor:
        out = value.detach().float().reshape(1).clone()
        dist.broadcast(out, src=self._peer(self.last % self.p), group=self.group)
        return out[0]


def _comm_device(chunks: nn.Module, group: ProcessGroup) -> torch.device:
    # a chunk without real tensors still talks over CUDA under NCCL
    nccl = "nccl" in str(dist.get_backend(group))
    fallback = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    return target_device(chunks, default=fallback)


def _decode(header: Tensor) -> tuple[torch.Size, torch.dtype]:
    """Shape and dtype from a header (a host read: only in steps that learn shapes, and in predict)."""
    ndim, dtype, *sizes = header.tolist()
    return torch.Size(sizes[:ndim]), _DTYPES[dtype]


def _signature(value: Any) -> Any:
    """What decides the activation shapes of a micro-batch input: tensor shapes and dtypes, the
    structure around them, and small exact scalars (sequence lengths, flags); not float values."""
    if isinstance(value, Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_signature(x) for x in value))
    if isinstance(value, dict):
        return ("dict", tuple((repr(k), _signature(x)) for k, x in value.items()))
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    return type(value).__qualname__
