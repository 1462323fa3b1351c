"""Bucketed, overlapped gradient reduction over a data-parallel group (ZeRO stages 0, 1 and 2).

Contract
--------
Let ``N`` be the data-parallel size and ``g_{r,k}`` rank ``r``'s gradient in backward pass ``k`` of an
accumulation window (the passes since the last synchronising one; :meth:`GradSync.no_sync` marks the
non-final passes, as Lightning's ``block_backward_sync`` does). When the window's final backward returns:

* unsharded (stage 0): every ``param.grad`` holds ``ḡ = (1/N) Σ_r Σ_k g_{r,k}``;
* sharded (stages 1/2): ``grad_shard`` holds this rank's slice of ``ḡ`` (slice ``r`` of every bucket, see
  :class:`~lightning_par.zero.layout.FlatLayout`) and ``param.grad`` is ``None``.

With mean losses over equally sized micro-batches this is exactly the gradient of the global batch.

When communication happens (``grad_sync``)
-----------------------------------------
* ``"boundary"``: gradients accumulate locally in one persistent flat buffer (``param.grad`` is a view
  into it) and are reduced once, in the final pass. Fewest collectives; gradient memory = full size.
* ``"every"`` (sharded only): every pass reduces its gradients into ``grad_shard`` (accumulating), using
  short-lived bucket buffers; ``param.grad`` is freed as soon as it is copied into its bucket. Gradient
  memory = 1/N plus at most ``max_inflight`` buckets (plus autograd's own per-parameter gradients).

How
---
A post-accumulate-grad hook per parameter folds its gradient into the bucket and counts the bucket down;
a complete bucket's asynchronous collective starts at once, so communication overlaps the rest of the
backward pass. Buckets start strictly in index order, so all ranks issue the same collectives in the same
order. The first backward pass only records the order in which gradients become ready; at its end the
layout is rebuilt in that order (rank 0's order, broadcast) and everything is reduced, so from then on
the first bucket to fill is the first one sent. An end-of-backward callback waits for all collectives and
checks unused parameters with one small all-reduce of per-parameter "missing" counts, so all ranks reach
the same verdict: a clear error naming them, or (``find_unused_parameters=True``) parameters that no
rank used keep ``grad=None`` while partially used ones are averaged with zeros. Never a hang.

The layout, the buffers and the reductions in flight are :class:`~lightning_par.zero.grad_buckets.GradBuckets`
the layout's order (learnt in the first backward, adopted from a checkpoint, extended by parameters made
trainable) :class:`~lightning_par.zero.grad_order.GradOrder`, and the window's events others listen to
:class:`~lightning_par.zero.sync_events.SyncEvents` (the base classes);
:mod:`lightning_par.zero.broadcast` holds the module-state broadcast.

Limits: one backward per pass (accumulate with :meth:`no_sync`). Reentrant activation checkpointing
(``use_reentrant=True``) runs each region's backward as a nested pass: the front doors hand the loss to
:meth:`GradSync.watch_backward`, so the window ends with the outer pass; a parameter used in two such
regions gets two gradients in one pass and is refused. Parameters made trainable after construction:
unsharded, the buckets are rebuilt with them before the next training forward; sharded, they are refused
(:mod:`lightning_par.zero.trainable`).
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

from lightning_par.owned_hooks import for_owner
from lightning_par.zero.broadcast import broadcast_module_states, broadcast_tensors
from lightning_par.zero.comm_hooks import CommHook
from lightning_par.zero.grad_buckets import GradSyncPolicy, ReduceOp, bucket_numel_for
from lightning_par.zero.grad_order import GradOrder
from lightning_par.zero.layout import FlatLayout
from lightning_par.zero.sync_events import SyncEvents
from lightning_par.zero.trainable import TrainableSet
from lightning_par.zero.unused import MissingGradients, UnusedParametersError

__all__ = [
    "GradSync",
    "GradSyncPolicy",
    "ReduceOp",
    "UnusedParametersError",
    "broadcast_module_states",
    "broadcast_tensors",
    "bucket_numel_for",
]


class GradSync(GradOrder, SyncEvents):
    """Reduces the gradients of ``named_params`` over ``group`` during backward (see module docstring).

    Args:
        named_params: the parameters (those not requiring grad, and meta placeholders, are ignored), in
            registration order.
        group: the data-parallel process group.
        bucket_numel: elements per communication bucket.
        shard: reduce into this rank's shard (ZeRO 1/2) instead of averaging everywhere (ZeRO 0).
        reduce_op: for ``shard=True``: ``"reduce_scatter"`` moves half the bytes of ``"all_reduce"``;
            Gloo's all-reduce is the faster of the two on CPUs.
        grad_sync: ``"boundary"`` or ``"every"`` (sharded only), see the module docstring.
        find_unused_parameters: allow parameters without gradients.
        max_inflight: with ``grad_sync="every"``, buckets allowed in flight before the hook waits.
        grad_dtype: dtype of the gradient buffers and of the reduction (default: the parameters'). With
            low-precision parameters, fp32 reduces without rounding each rank's contribution to 8 bits of
            mantissa; ``param.grad`` is then never a view of the buffer (dtypes differ), so each backward's
            gradient is folded in and released.
        comm_hook, comm_hook_state: a DDP communication hook that replaces each bucket's all-reduce and
            its state (:mod:`lightning_par.zero.comm_hooks`).
        comm_dtype: ``torch.float16``/``torch.bfloat16``: every reduction (all-reduce or reduce-scatter,
            at the boundary or every pass) moves the bucket in that dtype, pre-divided by N, and the mean
            is added back at the gradient dtype (:func:`lightning_par.collectives.low_precision_mean`).
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        *,
        group: ProcessGroup,
        bucket_numel: int,
        shard: bool = False,
        reduce_op: ReduceOp = "all_reduce",
        grad_sync: GradSyncPolicy = "boundary",
        find_unused_parameters: bool = False,
        rebuild_order: bool = True,
        max_inflight: int = 4,
        grad_dtype: torch.dtype | None = None,
        comm_hook: CommHook | None = None,
        comm_hook_state: object = None,
        comm_dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        """``device``: the communication device where no parameter tells it (a rank with nothing to train:
        a pipeline stage whose layers are all frozen reduces nothing, but joins the window's counts)."""
        if grad_sync not in ("boundary", "every"):
            raise ValueError(f"grad_sync must be 'boundary' or 'every', got {grad_sync!r}.")
        if reduce_op not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"reduce_op must be 'all_reduce' or 'reduce_scatter', got {reduce_op!r}.")
        if grad_sync == "every" and not shard:
            raise ValueError("grad_sync='every' needs a sharded gradient (ZeRO stage 1 or 2).")
        if comm_hook is not None and (grad_sync == "every" or (shard and reduce_op == "reduce_scatter")):
            raise ValueError(
                "A communication hook replaces an all-reduce of the accumulated gradient: it needs"
                " grad_sync='boundary' and, at ZeRO 1/2, reduce_op='all_reduce' (got grad_sync="
                f"{grad_sync!r}, reduce_op={reduce_op!r})."
            )
        if comm_dtype not in (None, torch.float16, torch.bfloat16) or (comm_dtype and comm_hook):
            raise ValueError(
                f"comm_dtype must be None, float16 or bfloat16 without a hook, got {comm_dtype}."
            )
        self._hook, self._hook_state = comm_hook, comm_hook_state
        self.comm_dtype = comm_dtype
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.shard = shard
        self.reduce_op: ReduceOp = reduce_op if shard else "all_reduce"
        self.grad_sync: GradSyncPolicy = grad_sync
        self.find_unused_parameters = find_unused_parameters
        self.max_inflight = max(1, max_inflight)
        self._bucket_numel = bucket_numel
        # meta tensors (other pipeline stages' layers) have no gradient here
        named = [(n, p) for n, p in named_params if p.requires_grad and not p.is_meta]
        dtypes = {p.dtype for _, p in named}
        devices = {p.device for _, p in named}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(
                f"GradSync needs parameters of one dtype and device, got dtypes {sorted(map(str, dtypes))} on"
                f" {sorted(map(str, devices))}; cast the model first (the strategy's precision plugin does)."
            )
        # Reverse registration order approximates the order gradients become ready in backward.
        named.reverse()
        self._params: list[nn.Parameter] = [p for _, p in named]
        self._names: list[str] = [n for n, _ in named]
        self.dtype = grad_dtype or (self._params[0].dtype if self._params else torch.float32)
        self.device = self._params[0].device if self._params else (device or torch.device("cpu"))
        self._sync = True
        self._rebuild_order = rebuild_order
        self._order_pending = rebuild_order
        self._ready_order: list[int] = []
        self._callback_queued = False
        SyncEvents.__init__(self)
        self._pass_started = False  # a gradient of the running backward pass has arrived
        # Free communication buffers, keyed by capacity (a full bucket, or one rank's slice of it). Every
        # pooled buffer has the largest bucket's size, so the pool never holds more buffers than were
        # in flight at once, whatever the mix of bucket sizes.
        self._pool: dict[int, list[Tensor]] = {}
        self._all_pooled: list[Tensor] = []
        self.layout: FlatLayout
        self.buffer: Tensor | None = None
        self._views: list[Tensor] = []
        self._touched: list[bool] = []
        # ids of the parameters given a reduced gradient since the window's views were zeroed (stage 0)
        self._reduced_in_window: set[int] = set()
        self.unused: frozenset[int] = frozenset()
        self._handles: list[RemovableHandle] = []  # the module hooks of attach_to
        self._grad_hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._params]
        self._trainable = TrainableSet(named_params, managed=self._params)
        self._build(list(range(len(self._params))))

    # ------------------------------------------------------------------ hooks
    def watch_backward(self, root: Tensor) -> None:
        """Run the end-of-backward work when the backward pass started from ``root`` ends. Without this,
        it is queued from the first gradient hook, in whichever pass that hook runs: under a reentrant
        checkpoint (``use_reentrant=True``) each region's backward is a nested pass of its own, whose end
        comes before the earlier layers' gradients."""
        if root.requires_grad:
            root.register_hook(self._on_root_grad)

    def _on_root_grad(self, grad: Tensor) -> None:
        self._emit(self._before_listeners)  # the pass starts: nothing has accumulated yet
        self._queue_finalize()

    def _queue_finalize(self, grad: Tensor | None = None) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._finalize_backward)

    def _on_grad_ready(self, param: Tensor) -> None:
        if not self._pass_started:  # the pass's first gradient (see on_pass_start)
            self._pass_started = True
            self._emit(self._pass_listeners)
        slot = self._slot_of.get(id(param))
        if slot is None:  # a user's hook before this one returned a value, which torch hands on; its own
            return  # error ("... should return None") follows
        self._queue_finalize()
        if self._ready_in_backward[slot]:
            raise RuntimeError(
                f"Parameter {self._names[slot]!r} received two gradients in one backward pass (used in two"
                " reentrant checkpoint regions, or two backward calls, or in forwards on both sides of a"
                " gathered_params(writeback=True) inside the step in 16-bit mixed precision: its fp32"
                " copies give the parameters new gradient accumulators). Use non-reentrant checkpointing"
                " there, and one backward per step, accumulating under no_sync()/block_backward_sync();"
                " enter gathered_params before the step's first forward or after its backward."
            )
        self._ready_in_backward[slot] = True
        if self._order_pending:
            # First pass: only record the order; the layout is rebuilt and reduced at its end.
            self._ready_order.append(slot)
            if self.buffer is not None and param.grad is not None:
                self._fold(slot, param.grad)
            self._touched[slot] = True
            return
        if param.grad is not None:
            self._fold(slot, param.grad)
        self._touched[slot] = True
        bucket = self.layout.slots[slot].bucket
        self._pending[bucket] -= 1
        if self.communicating:
            self._launch_ready()

    @property
    def communicating(self) -> bool:
        """Whether the backward pass running now reduces its gradients."""
        return self._sync or self.grad_sync == "every"

    # ------------------------------------------------------------------ end of backward
    def _finalize_backward(self) -> None:
        self._callback_queued = False
        try:
            if self._order_pending:
                self._rebuild_from_ready_order()
            if self.communicating:
                while self._next_bucket < len(self.layout.buckets):
                    self._launch(self._next_bucket)
            if self._sync:
                missing = self._start_missing_count()
            while self._inflight:
                self._complete_oldest()
            if self._sync:
                self._finish_window(missing)
            else:
                self._emit(self._pass_end_listeners)
        finally:
            self._reset_backward_state()
            self._pass_started = False

    def flush(self) -> None:
        """End the accumulation window now, outside any backward pass: reduce what the window's backwards
        accumulated under :meth:`no_sync` as if its final backward had just finished. Used where the last
        backward cannot be the reducing one (a pipeline step sums tied gradients across stages first)."""
        if self.buffer is None:
            raise RuntimeError("flush() needs grad_sync='boundary' (the gradients must still be whole).")
        previous, self._sync = self._sync, True
        try:
            self._reset_backward_state()
            for i in range(len(self.layout.buckets)):
                self._launch(i)
            missing = self._start_missing_count()
            while self._inflight:
                self._complete_oldest()
            self._finish_window(missing)
        finally:
            self._sync = previous
            self._reset_backward_state()

    @property
    def sync_enabled(self) -> bool:
        """False inside :meth:`no_sync` (a non-final pass of an accumulation window)."""
        return self._sync

    def _start_missing_count(self) -> MissingGradients:
        return MissingGradients(
            self._touched,
            names=self._names,
            group=self.group,
            device=self.device,
            find_unused_parameters=self.find_unused_parameters,
            params=self._params,
        )

    def _finish_window(self, missing: MissingGradients) -> None:
        self._touched = [False] * len(self._params)
        self.unused = missing.finish()  # raises, naming them, if gradients are missing and not allowed
        # the gradient pipeline, in this order (see lightning_par.precision): attach (param.grad, or the
        # sharded optimizer's masters), then whoever rescales what was attached (token normalisation)
        for i, p in enumerate(self._params):
            if self.shard:
                p.grad = None
            elif i in self.unused:
                # unused in this pass: what earlier passes of the window reduced stays (re-reduced as it
                # was, unchanged), as DDP leaves a gradient; None if there is none (a new window's view)
                if id(p) not in self._reduced_in_window:
                    p.grad = None
            else:  # a view when the dtypes agree, else a copy in the parameter's dtype
                view = self._views[i]
                p.grad = view if p.dtype == self.dtype else view.to(p.dtype)
                self._reduced_in_window.add(id(p))
        self._emit(self._attachers)
        self._emit(self._sync_listeners)

    # ------------------------------------------------------------------ public
    def prepare_window(self) -> None:
        """Before a forward that starts a new window: point every ``param.grad`` at its (zeroed) view so
        autograd accumulates straight into the flat buffer, with no per-step gradient allocation (page
        faults) and no copy in the hook. Only when all ``.grad`` are None (``zero_grad(set_to_none=True)``,
        Lightning's default): gradients someone keeps on purpose are left alone."""
        if torch.is_grad_enabled():
            self._follow_trainable()
            self._emit(self._before_listeners)
        if self.buffer is None or not torch.is_grad_enabled() or not self._params:
            return  # (no parameters: a frozen module, or a pipeline stage of frozen layers)
        if self.buffer.dtype != self._params[0].dtype:
            return
        with torch._C.DisableTorchFunction():  # the engine's own read, not one grad_reads should see
            kept = any(p.grad is not None for p in self._params)
        if kept:
            return
        self.buffer.zero_()
        self._reduced_in_window = set()
        for p, view in zip(self._params, self._views, strict=True):
            p.grad = view

    def attach_to(self, module: nn.Module) -> None:
        """Call :meth:`prepare_window` before every forward of ``module`` (eagerly, also when a compiled
        ``module`` would trace it: it edits the buckets, Python state a graph would not replay)."""
        hook = for_owner(module, lambda _m, _a: self.prepare_window(), eager=True)
        self._handles.append(module.register_forward_pre_hook(hook))

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Mark the backward passes inside as non-final passes of an accumulation window."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @property
    def touched(self) -> list[bool]:
        """Per parameter (layout order): whether the window's passes so far gave it a gradient."""
        return list(self._touched)

    @torch.no_grad()
    def drop_local(self, slots: Sequence[int]) -> None:
        """Forget what the window accumulated locally for the parameters at ``slots`` (``"boundary"``: their
        views of the full buffer zeroed; ``optimizer.zero_grad()`` inside a window, as DDP's drops
        ``param.grad``); the next gradient of each starts afresh."""
        if self.buffer is None:
            return
        for slot in slots:
            self._views[slot].zero_()
            self._touched[slot] = False

    @property
    def hook_state(self) -> object:
        """The communication hook's state (None without a hook)."""
        return self._hook_state

    @property
    def params(self) -> list[nn.Parameter]:
        """Parameters in layout order."""
        return list(self._params)

    @property
    def names(self) -> list[str]:
        return list(self._names)

    def remove(self) -> None:
        """Detach the hooks; gradients stay where they are."""
        for handle in self._handles + self._grad_hooks:
            handle.remove()
        self._handles, self._grad_hooks = [], []
