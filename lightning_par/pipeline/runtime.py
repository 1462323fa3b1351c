"""Executes a pipeline schedule on this rank: forwards, backwards and the point-to-point transfers.

Contract of :meth:`PipelineRuntime.train_step`: with micro-batches ``0..m-1`` and ``loss_fn(output, i)``
the loss of micro-batch ``i`` on the last virtual stage, the gradients accumulated in every chunk's
parameters equal those of ``(1/m) Σ_i loss_i`` through the whole model, and the returned value is that
mean (a tensor on :attr:`PipelineRuntime.device`, broadcast so every pipeline rank returns the same
number). What leaves a chunk towards the next is one tensor or a flat tuple of tensors (hidden states and
a mask, say; :mod:`lightning_par.pipeline.mail`): each tensor is its own p2p op, the floating-point ones
get gradients back.

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

Shapes are agreed once per shape change, not per micro-batch. Each call (one training or evaluation batch:
``k`` per optimizer step under accumulation ``k``) starts with ONE broadcast of one int64 from pipeline
rank 0: the id of the call's input signature (kind of step, shapes and dtypes of the micro-batch inputs),
which ranks ``> 0`` read on the host (their one host read per call: it sizes the receive buffers, so it
cannot wait on the device; it also makes a collective over the whole group the group's first call, which
NCCL requires before partial batches of p2p ops). A signature seen before reuses the activation shapes
learnt then; a new one (the first step, the first evaluation, a ragged last batch) makes that call send a
shape header (``mail.HEADER`` int64s on the device: the structure and every part's shape) before every
activation, each read once on the host. So activation shapes must follow from the input signature: a
sender checks every activation against the structure agreed for it (metadata, no device sync) and raises
if it differs (its peers then wait until the group's timeout). Gradients have the shapes of the receiver's
own output. Micro-batch losses accumulate in a tensor on the device; nothing is copied to the host per
micro-batch (prediction reads its result's header once).

``last_stats`` holds each step's busy and total seconds, for the rank's bubble ``1 - busy / total``.
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

from lightning_par.collectives import comm_device
from lightning_par.pipeline.mail import (
    HEADER,
    Layout,
    Mail,
    Spec,
    assemble,
    backward_args,
    decode,
    encode,
    floats,
    parts_of,
    signature,
)
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
from lightning_par.pipeline.predict_share import share_outputs
from lightning_par.pipeline.schedule import SPLIT_BACKWARD, Action, build_schedule
from lightning_par.pipeline.weight_grad import GradOf, WeightGradSplit
from lightning_par.zero.meta_build import target_device


@dataclass
class StepStats:
    busy_s: float = 0.0
    total_s: float = 0.0

    @property
    def bubble(self) -> float:
        return 1.0 - self.busy_s / self.total_s if self.total_s > 0 else 0.0


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
        self._schedules = {"train": build_schedule(schedule, p=self.p, m=self.m, v=self.v, slack=slack)}
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
        self._layouts: dict[int, Layout] = {}  # shape id -> activation structures of this rank's transfers

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

    def _begin(self, kind: str, inputs: Sequence[Any] | None) -> tuple[int, Mail]:
        """Agree on the step's shape id (module docstring); a new id means this step learns shapes."""
        ident = -1
        if self.s == 0:
            if inputs is None:
                raise ValueError("The first pipeline stage needs the micro-batch inputs.")
            key = (kind, tuple(signature(x) for x in inputs))
            ident = self._ids.setdefault(key, len(self._ids))
        if self.p > 1:
            flag = torch.full((1,), ident, dtype=torch.int64, device=self.device)
            dist.broadcast(flag, src=self._peer(0), group=self.group)
            ident = int(flag.item()) if self.s != 0 else ident  # the one host read of a call
        known = ident in self._layouts
        return ident, Mail(layout=self._layouts[ident] if known else {}, learn=not known)

    def _send(self, t: Transfer, value: Any, *, mail: Mail) -> None:
        """Queue ``value`` for transfer ``t``: an activation (a tensor or a tuple), or a gradient list."""
        if t.kind == "grad":  # its receiver takes it as a list, never assembled into a value
            tensors, is_tuple = [x.detach() for x in value], False
        else:
            parts, is_tuple = parts_of(value)
            tensors = [x.detach() for x in parts]
        if t.dst % self.p == self.s:  # the next virtual stage is on this rank (p = 1): no transfer
            mail.inbox[t] = [x.clone() for x in tensors]
            if is_tuple:
                mail.tuples.add(t)
            return
        tensors = [x.contiguous() for x in tensors]
        if t.kind == "act":
            spec = Spec(is_tuple, tuple((x.shape, x.dtype) for x in tensors))
            if mail.learn:
                mail.layout[t] = spec
                mail.outbox[header_of(t)] = [encode(spec, device=self.device)]
            elif mail.layout[t] != spec:
                raise RuntimeError(
                    f"Virtual stage {t.src} produced {spec.describe()} for micro-batch {t.mb}, but"
                    f" {mail.layout[t].describe()} was agreed for inputs of this signature: activation"
                    " shapes must follow from the input shapes."
                )
        mail.outbox[t] = tensors

    def _buffers(self, t: Transfer, mail: Mail) -> list[Tensor]:
        if t.kind == "hdr":
            return [torch.empty(HEADER, dtype=torch.int64, device=self.device)]
        if t.kind == "grad":  # the gradients of this rank's own output's floating-point parts
            out = mail.saved[(t.dst, t.mb)][1]
            return [torch.empty(o.shape, dtype=o.dtype, device=self.device) for o in floats(out)]
        return [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in mail.layout[t].parts]

    def _exchange(self, batch: Batch, mail: Mail) -> None:
        """Post ``batch`` in one ``batch_isend_irecv``, one op per tensor of each transfer; its waits are
        deferred to the uses (module docstring), except for headers, read on the host at once (learning
        steps only)."""
        ops, owned = [], []
        for op in batch.ops:
            if op.send:
                tensors = mail.outbox.pop(op.transfer)
            else:
                tensors = mail.inbox[op.transfer] = self._buffers(op.transfer, mail)
            send_or_recv = dist.isend if op.send else dist.irecv
            ops += [dist.P2POp(send_or_recv, x, self._peer(op.peer), self.group) for x in tensors]
            owned.append((op, tensors))
        works = list(dist.batch_isend_irecv(ops)) if ops else []
        # Gloo returns a work per op; NCCL one for the coalesced batch, which every transfer then waits on
        coalesced, first = len(works) != len(ops), 0
        for op, tensors in owned:
            mine = works if coalesced else works[first : first + len(tensors)]
            first += len(tensors)
            if op.send:
                mail.sending.append((mine, tensors))
            else:
                mail.pending[op.transfer] = mine
        for op in batch.ops:
            t = op.transfer
            if not op.send and t.kind == "hdr":  # learning steps only: one host read per header
                mail.layout[Transfer("act", t.src, t.dst, t.mb)] = decode(mail.take(t)[0])

    def _finish(self, ident: int, mail: Mail) -> None:
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
        losses = torch.zeros(self.m, dtype=torch.float32, device=self.device)
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
                grads = None if g == self.last else mail.take(Transfer("grad", g + 1, g, action.mb))
                context = nullcontext() if action == self._last_backward and sync_last else no_sync()
                t0 = time.perf_counter()
                with context:
                    if split is not None:
                        split.backward(out, grads, x, chunk=action.chunk, key=(g, action.mb))
                    else:
                        outs, dys = backward_args(out, grads)
                        if outs:
                            torch.autograd.backward(outs, dys)
                busy += time.perf_counter() - t0
                if g > 0:  # the upstream stage waits for its gradients in any case: zeros where x got none
                    dx = [p.grad if p.grad is not None else torch.zeros_like(p) for p in floats(x)]
                    self._send(Transfer("grad", g, g - 1, action.mb), dx, mail=mail)
        self._finish(ident, mail)
        loss = self._broadcast_loss(losses.sum())
        self.last_stats = StepStats(busy_s=busy, total_s=time.perf_counter() - start)
        return loss

    def _forward_only(
        self, inputs: Sequence[Any] | None, on_last: Callable[[Any, int], None], *, m: int
    ) -> None:
        """Every one of ``m`` micro-batches through this rank's chunks (no grad); ``on_last(output, i)`` on
        the last virtual stage. Every pipeline rank passes the same ``m`` (each cuts the same batch)."""
        kind = f"forward/{m}"  # a batch smaller than num_microbatches runs in fewer (steps.evaluate)
        if kind not in self._schedules:
            self._schedules[kind] = forward_only(p=self.p, m=m, v=self.v)
        ident, mail = self._begin(kind, inputs)
        for item in self._program(kind, headers=mail.learn):
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
    def forward_step(
        self, *, inputs: Sequence[Any] | None, loss_fn: Callable[[Any, int], Tensor], m: int | None = None
    ) -> Tensor:
        """Forward only (evaluation): the mean of ``loss_fn`` over ``m`` micro-batches, on every rank."""
        m = self.m if m is None else m
        losses = torch.zeros(m, dtype=torch.float32, device=self.device)

        def record(out: Any, i: int) -> None:
            losses[i] = loss_fn(out, i).float()

        self._forward_only(inputs, record, m=m)
        return self._broadcast_loss(losses.mean())

    @torch.no_grad()
    def predict_step(
        self,
        *,
        inputs: Sequence[Any] | None,
        transform: Callable[[Any, int], Any] | None = None,
        m: int | None = None,
    ) -> Tensor:
        """Forward only: the last virtual stage's outputs of all micro-batches (each passed through
        ``transform(output, micro-batch index)`` there first, when given), concatenated along dim 0 and
        broadcast, so every pipeline rank returns the same tensor (one header, read on the host once per
        call, and one broadcast)."""
        outputs: list[Tensor] = []
        failed: list[BaseException] = []  # on the last stage: raised on every rank after the schedule

        def record(out: Any, i: int) -> None:
            if failed:
                return
            what = "the last layer"
            try:
                if transform is not None:
                    out, what = transform(out, i), "pipeline_predict"
                if not isinstance(out, Tensor) or out.dim() == 0:
                    got = "a 0-dim tensor" if isinstance(out, Tensor) else type(out).__name__
                    raise TypeError(
                        f"predict under pipeline parallelism needs {what} to return a tensor with the"
                        f" micro-batch along dim 0 (the micro-batches' results are concatenated), got {got}."
                    )
                outputs.append(out.detach())
            except Exception as error:  # the schedule goes on: the other stages' transfers complete
                failed.append(error)

        self._forward_only(inputs, record, m=self.m if m is None else m)
        return share_outputs(
            outputs, failed, src=self._peer(self.last % self.p), group=self.group, device=self.device
        )

    def _input(self, g: int, mb: int, inputs: Sequence[Any] | None, mail: Mail, *, grad: bool) -> Any:
        if g == 0:
            if inputs is None:
                raise ValueError("The first pipeline stage needs the micro-batch inputs.")
            return inputs[mb]
        t = Transfer("act", g - 1, g, mb)
        is_tuple, tensors = mail.is_tuple(t), mail.take(t)
        for x in tensors:
            if grad and x.is_floating_point():
                x.requires_grad_(True)
        return assemble(tensors, is_tuple)

    def _broadcast_loss(self, value: Tensor) -> Tensor:
        out = value.detach().float().reshape(1).clone()
        dist.broadcast(out, src=self._peer(self.last % self.p), group=self.group)
        return out[0]


def _comm_device(chunks: nn.Module, group: ProcessGroup) -> torch.device:
    # a chunk without real tensors still talks over CUDA under NCCL
    return target_device(chunks, default=comm_device(group))
