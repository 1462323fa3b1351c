"""The flat gradient layout of :class:`~lightning_par.zero.grad_sync.GradSync`, its communication
buffers, and the bucket reductions in flight.

Contract
--------
:class:`GradBuckets` is the base of ``GradSync``; it declares the engine attributes it works on and holds
no state of its own beyond what its methods assign. It owns:

* the layout: :meth:`_build` lays the parameters out in a :class:`~lightning_par.zero.layout.FlatLayout`
  (buckets of ``bucket_numel`` elements, each padded to a multiple of N when sharded) and allocates the
  persistent buffers: the full flat gradient (``grad_sync="boundary"``, ``param.grad`` a view of it when
  the dtypes agree) and this rank's ``grad_shard`` (sharded); a rebuild carries over what was accumulated;
* the pool of short-lived bucket buffers (``grad_sync="every"``) and reduce-scatter outputs. Every pooled
  buffer has the largest bucket's size (or one rank's slice of it), so the pool never holds more buffers
  than were in flight at once;
* folding: a parameter's first gradient of a window is copied into its bucket, later ones are added;
* launching: buckets start strictly in index order (``_next_bucket`` advances only past buckets whose
  pending count reached zero), so every rank issues the same collectives in the same order;
* the in-flight queue, completed first in, first out. Sharded, rank ``r`` adds ``(1/N)`` times slice
  ``r`` of the SUM into ``grad_shard``; unsharded, the all-reduce averages in place. With transient
  buffers, a launch that leaves more than ``max_inflight`` buckets in flight waits for the oldest, so at
  most ``max_inflight + 1`` bucket buffers are alive at once;
* the reduced gradients' accessors: scaling, the shard's reset, a parameter's view, the byte count.

:func:`bucket_numel_for` turns a bucket size in MiB into elements of one dtype.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_par.collectives import low_precision_mean, reduce_scatter_flat
from lightning_par.zero.comm_hooks import CommHook, CommHookBucket, hook_result
from lightning_par.zero.layout import FlatLayout

__all__ = ["GradBuckets", "GradSyncPolicy", "ReduceOp", "bucket_numel_for", "strided"]

GradSyncPolicy = Literal["boundary", "every"]
ReduceOp = Literal["all_reduce", "reduce_scatter"]


def strided(grad: Tensor) -> Tensor:
    """``grad`` as a dense (strided) tensor. A sparse gradient (``nn.Embedding(sparse=True)``,
    ``nn.EmbeddingBag(sparse=True)``) has no storage to copy from and no data pointer; the flat buckets
    hold, reduce and hand the optimizer its dense equal (rows not looked up are zero), where torch's DDP
    all-reduces the sparse tensor itself. Same values, dense bytes on the wire."""
    return grad if grad.layout == torch.strided else grad.to_dense()


class GradBuckets:
    """Layout, buffers and in-flight reductions of a :class:`~lightning_par.zero.grad_sync.GradSync`
    (see the module docstring)."""

    group: ProcessGroup
    world: int
    rank: int
    shard: bool
    reduce_op: ReduceOp
    grad_sync: GradSyncPolicy
    max_inflight: int
    dtype: torch.dtype
    device: torch.device
    _bucket_numel: int
    _params: list[nn.Parameter]
    _names: list[str]
    layout: FlatLayout
    buffer: Tensor | None
    _views: list[Tensor]
    _touched: list[bool]
    _pool: dict[int, list[Tensor]]
    _all_pooled: list[Tensor]
    _hook: CommHook | None  # replaces a bucket's all-reduce (lightning_par.zero.comm_hooks)
    _hook_state: object
    _hook_views: list[tuple[list[nn.Parameter], list[tuple[int, int, tuple[int, ...]]]]]
    comm_dtype: torch.dtype | None  # fp16/bf16: reduce in that dtype (lightning_par.collectives)

    # ------------------------------------------------------------------ layout
    def _build(self, order: list[int]) -> None:
        """(Re)build buffers for parameters in ``order`` (indices into the current lists), carrying over
        what the old buffer accumulated (it may hold a gradient whose ``param.grad`` was released: a
        reduction dtype other than the parameters')."""
        carried: dict[int, Tensor] = {}
        if self.buffer is not None:
            for i, p in enumerate(self._params):
                if self._touched[i]:
                    carried[id(p)] = self._views[i].clone()
        self._params = [self._params[i] for i in order]
        self._names = [self._names[i] for i in order]
        self._slot_of = {id(p): i for i, p in enumerate(self._params)}
        self.layout = FlatLayout(
            names=self._names,
            shapes=[tuple(p.shape) for p in self._params],
            bucket_numel=self._bucket_numel,
            shard_count=self.world if self.shard else 1,
        )
        shard_offsets, off = [], 0
        for b in self.layout.buckets:
            shard_offsets.append(off)
            off += b.numel // self.layout.shard_count
        self._shard_offsets = shard_offsets
        self.buffer = None
        if self.grad_sync == "boundary":
            old = [carried.get(id(p), p.grad) for p in self._params]
            self.buffer = torch.zeros(self.layout.numel, dtype=self.dtype, device=self.device)
            self._views = [self.buffer[s.offset : s.end].view(s.shape) for s in self.layout.slots]
            for p, view, g in zip(self._params, self._views, old, strict=True):
                if g is not None:
                    view.copy_(strided(g))
                    p.grad = view if p.dtype == view.dtype else None
        self.grad_shard: Tensor | None = None
        if self.shard:
            self.grad_shard = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=self.device)
        self._pool = {}
        self._all_pooled = []
        # what a communication hook sees of each bucket: its parameters and their spans in the bucket,
        # fixed per layout (not rebuilt every step)
        self._hook_views = [
            (
                [self._params[i] for i in b.slots],
                [
                    (sl.offset - b.start, sl.end - b.start, sl.shape)
                    for sl in map(self.layout.slots.__getitem__, b.slots)
                ],
            )
            for b in self.layout.buckets
        ]
        self._touched = [False] * len(self._params)
        self._reset_backward_state()

    def _reset_backward_state(self) -> None:
        self._pending = [len(b.slots) for b in self.layout.buckets]
        self._ready_in_backward = [False] * len(self._params)
        self._next_bucket = 0
        self._bucket_bufs: dict[int, Tensor] = {}
        # (bucket, work, its flat buffer, a pooled reduce-scatter output, a low-precision mean)
        self._inflight: list[
            tuple[int, dist.Work | torch.futures.Future[Tensor], Tensor, Tensor | None, Tensor | None]
        ] = []

    # ------------------------------------------------------------------ buffers
    def _acquire(self, numel: int, *, slice_of_bucket: bool = False) -> Tensor:
        biggest = self.layout.largest_bucket
        cap = biggest // self.world if slice_of_bucket else biggest
        free = self._pool.setdefault(cap, [])
        if free:
            base = free.pop()
        else:
            base = torch.empty(cap, dtype=self.dtype, device=self.device)
            self._all_pooled.append(base)
        return base[:numel].zero_()

    def _release(self, buf: Tensor) -> None:
        base = next(b for b in self._all_pooled if b.data_ptr() == buf.data_ptr())
        self._pool.setdefault(base.numel(), []).append(base)

    def _bucket_buffer(self, index: int) -> Tensor:
        if self.buffer is not None:
            b = self.layout.buckets[index]
            return self.buffer[b.start : b.end]
        buf = self._bucket_bufs.get(index)
        if buf is None:
            buf = self._bucket_bufs[index] = self._acquire(self.layout.buckets[index].numel)
        return buf

    def _fold(self, slot: int, grad: Tensor) -> None:
        """Put one parameter's fresh gradient into its bucket (copy the first time, then add)."""
        s = self.layout.slots[slot]
        param = self._params[slot]
        if self.buffer is not None:
            view = self._views[slot]
            if grad.layout != torch.strided or grad.data_ptr() != view.data_ptr():
                if self._touched[slot]:
                    view.add_(grad)  # a sparse gradient adds into a dense view as it is
                else:
                    view.copy_(strided(grad))
                # a view of another dtype cannot be .grad: release the folded gradient instead
                param.grad = view if param.dtype == view.dtype else None
        else:
            start = self.layout.buckets[s.bucket].start
            self._bucket_buffer(s.bucket)[s.offset - start : s.end - start].view(s.shape).copy_(strided(grad))
            param.grad = None  # the full-size gradient is not kept: that is the point of "every"

    # ------------------------------------------------------------------ launch
    def _launch_ready(self) -> None:
        while self._next_bucket < len(self.layout.buckets) and self._pending[self._next_bucket] == 0:
            self._launch(self._next_bucket)

    def _launch(self, index: int) -> None:
        bucket = self.layout.buckets[index]
        if self.buffer is not None:
            for i in bucket.slots:
                if not self._touched[i] and self._params[i].grad is None:
                    self._views[i].zero_()  # stale values of an earlier window must not be reduced
        flat = self._bucket_buffer(index)
        if self.buffer is None:
            for i in bucket.slots:
                grad = self._params[i].grad
                if grad is not None:  # deferred in the first pass, which only recorded the order
                    self._fold(i, grad)
        out: Tensor | None = None
        low: Tensor | None = None
        work: dist.Work | torch.futures.Future[Tensor] | None
        if self.comm_dtype is not None:  # averaged in fp16/bf16: half the bytes
            work, low = low_precision_mean(
                flat, dtype=self.comm_dtype, group=self.group, scatter=self.reduce_op == "reduce_scatter"
            )
        elif self._hook is not None:  # the hook averages the bucket (checked: an all-reduce policy)
            params, spans = self._hook_views[index]
            is_last = index == len(self.layout.buckets) - 1
            bucket_view = CommHookBucket(
                index=index, buffer=flat, params=params, spans=spans, is_last=is_last
            )
            work = self._hook(self._hook_state, bucket_view)
        elif self.reduce_op == "reduce_scatter":
            out = self._acquire(bucket.numel // self.world, slice_of_bucket=True)
            work = reduce_scatter_flat(out, flat, group=self.group, async_op=True)
        else:
            op = dist.ReduceOp.SUM if self.shard else dist.ReduceOp.AVG
            work = dist.all_reduce(flat, op=op, group=self.group, async_op=True)
        assert work is not None
        self._inflight.append((index, work, flat, out, low))
        self._next_bucket = index + 1
        if self.buffer is None and len(self._inflight) > self.max_inflight:
            self._complete_oldest()  # back-pressure keeps at most max_inflight bucket buffers alive

    def _complete_oldest(self) -> None:
        index, work, flat, out, low = self._inflight.pop(0)
        scale = 1.0 / self.world  # a SUM (sharded) to average; a hook's result is averaged already
        if low is not None:
            work.wait()
            scale = 1.0
            if self.reduce_op == "reduce_scatter":
                out = low  # this rank's slice of the mean, added below (not a pooled buffer)
            else:
                flat.copy_(low)
        elif self._hook is not None:  # a hook's future (torch's C future: no isinstance check)
            result = hook_result(work.wait())
            if result.data_ptr() != flat.data_ptr():
                flat.copy_(result)
            scale = 1.0
        else:
            work.wait()
        if self.shard:
            assert self.grad_shard is not None
            bucket = self.layout.buckets[index]
            size = bucket.numel // self.world
            mine = out if out is not None else flat[self.rank * size : (self.rank + 1) * size]
            off = self._shard_offsets[index]
            # SUM then scale: Gloo's reduce-scatter has no AVG; the scale rides on the accumulation.
            self.grad_shard[off : off + size].add_(mine, alpha=scale)
            if out is not None and low is None:
                self._release(out)
        if self.buffer is None:
            self._release(flat)
            self._bucket_bufs.pop(index, None)

    # ------------------------------------------------------------------ the reduced gradients
    @torch.no_grad()
    def scale_grads(self, factor: float | Tensor) -> None:
        """Multiply the reduced gradients of the finished window by ``factor``: the shard (stages 1/2;
        attached copies are the sharded optimizer's to scale), or every ``param.grad`` (stage 0)."""
        if self.shard:
            assert self.grad_shard is not None
            self.grad_shard.mul_(factor)
            return
        assert self.buffer is not None
        self.buffer.mul_(factor)
        for p, view in zip(self._params, self._views, strict=True):
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                p.grad.mul_(factor)  # a copy in the parameter's dtype

    def zero_grad_shard(self) -> None:
        """Start a new accumulation window of the sharded gradient (after the optimizer step)."""
        if self.grad_shard is not None:
            self.grad_shard.zero_()

    def grad_view(self, param: nn.Parameter) -> Tensor | None:
        """Where ``param``'s gradient accumulates in the flat buffer (``grad_sync="boundary"``), in the
        reduction dtype; None for a parameter this engine does not manage or without a full buffer."""
        slot = self._slot_of.get(id(param))
        if slot is None or self.buffer is None:
            return None
        if not self._touched[slot]:
            self._views[slot].zero_()  # stale values of an earlier window
            self._touched[slot] = True
        return self._views[slot]

    def grad_bytes(self) -> dict[str, int]:
        """Bytes of gradient storage held by the engine on this rank."""
        item = self.dtype.itemsize
        full = self.buffer.numel() * item if self.buffer is not None else 0
        shard = self.grad_shard.numel() * item if self.grad_shard is not None else 0
        pooled = sum(t.numel() * t.element_size() for t in self._all_pooled)
        return {"full": full, "shard": shard, "bucket_pool": pooled}


def bucket_numel_for(bucket_size_mb: float, element_size: int) -> int:
    """Elements of ``element_size`` bytes in ``bucket_size_mb`` MiB (at least one)."""
    if not bucket_size_mb > 0:
        raise ValueError(f"bucket_size_mb must be > 0, got {bucket_size_mb}.")
    return max(1, int(bucket_size_mb * 1024 * 1024) // element_size)
