"""Bucketed, overlapped gradient averaging over a data-parallel group (ZeRO stage 0).

Contract
--------
After ``loss.backward()`` returns on a synchronising step, every parameter's ``.grad`` holds

    g = (1 / N) * sum_{r < N} sum_{k in window} g_{r,k}

where ``N`` is the data-parallel size and the inner sum runs over the backward passes since the last
synchronising step (gradient accumulation under :meth:`GradSync.no_sync`). This is exactly the
gradient of the mean loss over the global batch when every rank and micro-batch uses a mean loss over
equally sized batches.

How
---
* Gradients live in one flat buffer laid out by :class:`~lightning_par.zero.layout.FlatLayout`; each
  ``param.grad`` is a view into it (one gradient copy, no separate reduction buffer).
* A post-accumulate-grad hook per parameter counts down its bucket; when a bucket is complete its
  asynchronous all-reduce is launched, so communication overlaps the rest of the backward pass.
  Buckets are launched strictly in index order, so every rank issues the same collectives in the
  same order.
* The bucket order is the reverse of registration order at first; after the first backward pass it
  is rebuilt once from the order in which gradients actually became ready (agreed from dp rank 0),
  so the first bucket launched is the first one completed.
* An end-of-backward callback launches what is left, waits, and checks unused parameters with one
  small all-reduce of per-parameter "missing" counts, so all ranks reach the same verdict: either a
  clear error naming the parameters, or (``find_unused_parameters=True``) gradients of parameters
  unused on every rank stay ``None`` while partially used ones are averaged with zeros. Never a hang.

Limits: one backward per synchronising step (accumulate with :meth:`no_sync`); reentrant activation
checkpointing (``use_reentrant=True``) is not supported, the non-reentrant kind is.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd import Variable
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from lightning_par.zero.layout import FlatLayout


class UnusedParametersError(RuntimeError):
    """Some parameters received no gradient in an accumulation window."""


class GradSync:
    """Averages the gradients of ``named_params`` over ``group`` during backward (see module docstring)."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        *,
        group: ProcessGroup,
        bucket_numel: int,
        find_unused_parameters: bool = False,
        rebuild_order: bool = True,
    ) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.find_unused_parameters = find_unused_parameters
        self._bucket_numel = bucket_numel
        named = [(n, p) for n, p in named_params if p.requires_grad]
        if not named:
            raise ValueError("GradSync got no parameters that require gradients.")
        # Reverse registration order approximates the order gradients become ready in backward.
        named.reverse()
        self._params: list[nn.Parameter] = [p for _, p in named]
        self._names: list[str] = [n for n, _ in named]
        dtypes = {p.dtype for p in self._params}
        devices = {p.device for p in self._params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(
                f"GradSync needs parameters of one dtype and device, got dtypes {sorted(map(str, dtypes))} on"
                f" {sorted(map(str, devices))}; cast the model first (the strategy's precision plugin does)."
            )
        self._sync = True
        self._order_pending = rebuild_order
        self._ready_order: list[int] = []
        self._callback_queued = False
        self._handles: list[RemovableHandle] = []
        self._slot_of: dict[int, int] = {}
        self._build(list(range(len(self._params))))
        for p in self._params:
            self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    # ------------------------------------------------------------------ layout
    def _build(self, order: list[int]) -> None:
        """(Re)build the flat buffer for parameters in ``order`` (indices into the current lists)."""
        self._params = [self._params[i] for i in order]
        self._names = [self._names[i] for i in order]
        self._slot_of = {id(p): i for i, p in enumerate(self._params)}
        self.layout = FlatLayout(
            names=self._names, shapes=[tuple(p.shape) for p in self._params], bucket_numel=self._bucket_numel
        )
        ref = self._params[0]
        old_grads = [p.grad for p in self._params]
        self.buffer = torch.zeros(self.layout.numel, dtype=ref.dtype, device=ref.device)
        self._views = [self.buffer[s.offset : s.end].view(s.shape) for s in self.layout.slots]
        for p, view, g in zip(self._params, self._views, old_grads, strict=True):
            if g is not None:
                view.copy_(g)
                p.grad = view
        self._touched = [False] * len(self._params)
        self._reset_backward_state()

    def _reset_backward_state(self) -> None:
        self._pending = [len(b.slots) for b in self.layout.buckets]
        self._ready_in_backward = [False] * len(self._params)
        self._next_bucket = 0
        self._works: list[dist.Work] = []

    # ------------------------------------------------------------------ hooks
    def _on_grad_ready(self, param: Tensor) -> None:
        slot = self._slot_of[id(param)]
        view = self._views[slot]
        grad = param.grad
        if grad is not None and grad.data_ptr() != view.data_ptr():
            # autograd allocated a fresh gradient (``.grad`` was None): fold it into the flat buffer
            if self._touched[slot]:
                view.add_(grad)
            else:
                view.copy_(grad)
            param.grad = view
        self._touched[slot] = True
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._finalize_backward)
        if self._ready_in_backward[slot]:
            raise RuntimeError(
                f"Parameter {self._names[slot]!r} received two gradients in one backward pass (reentrant"
                " activation checkpointing or two backward calls). Use non-reentrant checkpointing and one"
                " backward per step, accumulating under no_sync()/block_backward_sync()."
            )
        self._ready_in_backward[slot] = True
        if self._order_pending:
            self._ready_order.append(slot)
        bucket = self.layout.slots[slot].bucket
        self._pending[bucket] -= 1
        if self._sync:
            self._launch_ready()

    def _launch_ready(self) -> None:
        buckets = self.layout.buckets
        while self._next_bucket < len(buckets) and self._pending[self._next_bucket] == 0:
            self._launch(self._next_bucket)

    def _launch(self, index: int) -> None:
        bucket = self.layout.buckets[index]
        for i in bucket.slots:
            if not self._touched[i] and self._params[i].grad is None:
                self._views[i].zero_()  # stale values from an earlier window must not be averaged in
        flat = self.buffer[bucket.start : bucket.end]
        work = dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self.group, async_op=True)
        assert work is not None
        self._works.append(work)
        self._next_bucket = index + 1

    # ------------------------------------------------------------------ end of backward
    def _finalize_backward(self) -> None:
        self._callback_queued = False
        try:
            if self._sync:
                self._synchronize()
        finally:
            self._reset_backward_state()
        if self._order_pending:
            self._rebuild_from_ready_order()

    def _synchronize(self) -> None:
        while self._next_bucket < len(self.layout.buckets):
            self._launch(self._next_bucket)
        missing = torch.tensor(
            [0 if t else 1 for t in self._touched], dtype=torch.int32, device=self.buffer.device
        )
        works = [*self._works, dist.all_reduce(missing, group=self.group, async_op=True)]
        for work in works:
            assert work is not None
            work.wait()
        self._touched = [False] * len(self._params)
        counts = missing.tolist()
        if any(counts) and not self.find_unused_parameters:
            names = [n for n, c in zip(self._names, counts, strict=True) if c]
            raise UnusedParametersError(
                f"{len(names)} parameter(s) got no gradient on at least one data-parallel rank in this step:"
                f" {names[:8]}{' ...' if len(names) > 8 else ''}. If that is intended, pass"
                " find_unused_parameters=True to the strategy; otherwise use them in the loss or freeze them"
                " (requires_grad=False) before training."
            )
        for p, view, c in zip(self._params, self._views, counts, strict=True):
            p.grad = None if c == self.world else view

    def _rebuild_from_ready_order(self) -> None:
        self._order_pending = False
        seen = set(self._ready_order)
        order = self._ready_order + [i for i in range(len(self._params)) if i not in seen]
        self._ready_order = []
        if self.world > 1:
            # Autograd's order is deterministic for one graph, but a data-dependent graph could differ per
            # rank; the layout must be identical everywhere, so rank 0's order wins.
            agreed = torch.tensor(order, dtype=torch.int64, device=self.buffer.device)
            dist.broadcast(agreed, src=dist.get_global_rank(self.group, 0), group=self.group)
            order = agreed.tolist()
        if order != list(range(len(self._params))):
            touched = [self._touched[i] for i in order]
            self._build(order)
            self._touched = touched

    # ------------------------------------------------------------------ public
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communication, for the backward passes inside."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @property
    def params(self) -> list[nn.Parameter]:
        """Parameters in bucket order."""
        return list(self._params)

    def grad_buffer_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def remove(self) -> None:
        """Detach the hooks; gradients stay where they are."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def broadcast_module_states(module: nn.Module, *, group: ProcessGroup, src_index: int = 0) -> None:
    """Make every rank of ``group`` hold the parameters and buffers of its ``src_index``-th rank.

    Tensors are coalesced per dtype into one flat broadcast each, so this costs one collective per dtype.
    """
    if dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, src_index)
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.numel() > 0]
    by_key: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        by_key.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for items in by_key.values():
            flat = torch.cat([t.detach().reshape(-1) for t in items])
            dist.broadcast(flat, src=src, group=group)
            offset = 0
            for t in items:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def apply_data_parallel(
    module: nn.Module,
    *,
    group: ProcessGroup,
    bucket_size_mb: float = 25.0,
    find_unused_parameters: bool = False,
    sync_module_states: bool = True,
) -> GradSync:
    """ZeRO stage 0: plain data parallelism of ``module`` over ``group`` (see :class:`GradSync`)."""
    if bucket_size_mb <= 0:
        raise ValueError(f"bucket_size_mb must be > 0, got {bucket_size_mb}.")
    if sync_module_states:
        broadcast_module_states(module, group=group)
    params = list(module.named_parameters())
    element = next((p.element_size() for _, p in params), 4)
    bucket_numel = max(1, int(bucket_size_mb * 1024 * 1024) // element)
    return GradSync(
        params, group=group, bucket_numel=bucket_numel, find_unused_parameters=find_unused_parameters
    )
