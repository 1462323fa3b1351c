"""One entry point for ZeRO stages 0-2 over a data-parallel group.

``apply_zero(module, group=..., stage=...)`` installs the gradient engine on the module and returns a
:class:`ZeroEngine`; ``engine.shard_optimizers([...])`` then rebuilds the user's optimizers over this rank's
shard (stages 1/2). A training step is the usual ``loss.backward()`` / ``optimizer.step()`` followed by
``engine.after_step()``, which re-gathers the updated parameters.

Policies (``Literal`` strings, checked):

* ``grad_sync``: ``"boundary"`` (default for stage 1) reduces once per optimizer step and keeps a full
  local gradient buffer; ``"every"`` (default for stage 2) reduces each micro-batch into the shard so
  gradient memory stays at 1/N plus the in-flight buckets. Both give the same result.
* ``reduce_op``: ``"auto"`` picks reduce-scatter on NCCL and all-reduce on Gloo, where reduce-scatter plus
  all-gather cost about 3x an all-reduce (measured: benchmarks/README.md); the results are identical.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from lightning_par.zero.comm_hooks import CommHook
from lightning_par.zero.compressor_state import compressor_step_skipped, load_compressor_state
from lightning_par.zero.grad_sync import (
    GradSync,
    GradSyncPolicy,
    ReduceOp,
    broadcast_module_states,
    bucket_numel_for,
)
from lightning_par.zero.powersgd import PowerSGDState
from lightning_par.zero.sharded_optimizer import ShardedOptimizer

ZeroStage = Literal[0, 1, 2]
ReduceChoice = Literal["auto", "all_reduce", "reduce_scatter"]


def resolve_reduce_op(choice: ReduceChoice, group: ProcessGroup) -> ReduceOp:
    if choice not in ("auto", "all_reduce", "reduce_scatter"):
        raise ValueError(f"reduce_op must be 'auto', 'all_reduce' or 'reduce_scatter', got {choice!r}.")
    if choice != "auto":
        return choice
    return "all_reduce" if dist.get_backend(group) == "gloo" else "reduce_scatter"


def default_grad_sync(stage: int) -> GradSyncPolicy:
    return "every" if stage == 2 else "boundary"


@dataclass
class ZeroEngine:
    """The gradient engine and (stages 1/2) the sharded optimizers of one module."""

    stage: int
    sync: GradSync
    module: nn.Module
    master_dtype: torch.dtype | None = None
    compute_dtype: torch.dtype | None = None
    allow_untested_optimizer: bool = False
    # non-synchronising passes mark the optimizers' gradients, so that a zero_grad() inside a window drops
    # it (GradWindow._mark_window); not under a pipeline, whose schedule runs a window's micro-batches
    # inside Lightning's training_step, before Lightning zeroes the gradients of that new window
    marks_passes: bool = True
    sharded: ShardedOptimizer | None = field(default=None)

    def shard_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Stages 1/2: rebuild ``optimizers`` over this rank's shard (a no-op at stage 0, and where this
        rank trains nothing: a pipeline stage whose layers are all frozen, whose optimizers hold only the
        other stages' placeholders)."""
        if self.stage == 0 or not optimizers or not self.sync.params:
            return
        names = {p: n for n, p in self.module.named_parameters()}
        if self.sharded is not None:  # optimizers sharded again (a new fit): the old hooks go
            self.sharded.remove()
        self.sharded = ShardedOptimizer(
            sync=self.sync,
            optimizers=optimizers,
            param_names=names,
            master_dtype=self.master_dtype,
            compute_dtype=self.compute_dtype,
            allow_untested_optimizer=self.allow_untested_optimizer,
            marks_passes=self.marks_passes,
        )

    def after_step(self, *, open_window: bool = True, optimizer: Optimizer | None = None) -> None:
        """Stages 1/2: all-gather the updated parameters and (``open_window``) start a new gradient
        window; without it the window's gradients stay for another optimizer's step until
        :meth:`open_window`, which drops those of the optimizers that stepped (``optimizer``, or all)."""
        if self.sharded is not None:
            self.sharded.after_step(open_window=open_window, optimizer=optimizer)

    def open_window(self) -> None:
        """Stages 1/2: after an update, drop the window's gradients (masters' and the reduced shard);
        nothing before one. The front doors call it at every backward."""
        if self.sharded is not None:
            self.sharded.open_window()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.sync.no_sync():
            yield

    @contextmanager
    def forward_context(self) -> Iterator[None]:
        """Around a step: a new window's gradients go straight into the flat buffer (parameters are
        always whole below stage 3, so nothing is gathered)."""
        self.sync.prepare_window()
        yield

    def on_synchronized(self, listener: Callable[[], None]) -> None:
        self.sync.on_synchronized(listener)

    def scale_grads(self, factor: float | Tensor) -> None:
        """Multiply the window's reduced gradients by ``factor``, wherever the optimizer reads them."""
        self.sync.scale_grads(factor)
        if self.sharded is not None:
            self.sharded.scale_attached(factor)

    def flush(self) -> None:
        """Reduce the window's accumulated gradients now (see :meth:`GradSync.flush`)."""
        self.sync.flush()

    def watch_backward(self, root: Tensor) -> None:
        """The backward about to start from ``root`` ends the pass (see :meth:`GradSync.watch_backward`)."""
        self.sync.watch_backward(root)

    def grad_view(self, param: nn.Parameter) -> Tensor | None:
        """Where ``param``'s gradient accumulates before the reduction (see :meth:`GradSync.grad_view`)."""
        return self.sync.grad_view(param)

    @property
    def sync_enabled(self) -> bool:
        return self.sync.sync_enabled

    @property
    def unused_param_ids(self) -> frozenset[int]:
        """Ids of the parameters no rank used in the last synchronised window (``find_unused_parameters``:
        their ``grad`` stays None, as under DDP)."""
        params = self.sync.params
        return frozenset(id(params[i]) for i in self.sync.unused)

    def freeze_order(self, names: Sequence[str]) -> None:
        """Fix the bucket order (a checkpoint's, if it names the same parameters) before loading state. An
        order the sharded optimizers already hold state in stays (a checkpoint restored inside the same
        fit, as Lightning's learning-rate finder restores the one it saved before its trial steps, after
        the first backward learnt another order; before, that failed: "The ZeRO layout changed after the
        optimizer took a step"); a checkpoint's state is loaded by parameter name, whatever either order
        (:func:`lightning_par.checkpoint.rank_state.load` matches positions and checks the order)."""
        if self.sharded is not None and self.sharded.holds_state():
            return
        self.sync.set_order(names if sorted(names) == sorted(self.sync.names) else self.sync.names)

    @property
    def sharded_state(self) -> ShardedOptimizer | None:
        """Fragments and rebuilt optimizers (stages 1/2), for checkpoints; None at stage 0."""
        return self.sharded

    # -- state access (checkpoints, snapshots, memory reports): the same methods at every stage
    shards_params = False  # parameters are whole on every rank below stage 3

    def bucket_order(self) -> list[str]:
        """The flat bucket order of the parameters (checkpoints record it so fragments match on load)."""
        return list(self.sync.names)

    def param_shards(self) -> list[tuple[str, int, int, Tensor]]:
        """Parameter pieces held as shards: none below stage 3 (the parameters are whole)."""
        return []

    sharded_param_ids: frozenset[int] = frozenset()  # no parameter is sharded below stage 3

    def load_param_shards(self, values: Callable[[str, int, int], Tensor | None]) -> None:
        """Nothing to load below stage 3: whole parameters load through ``module.load_state_dict``."""

    def masters_changed(self) -> None:
        """The values behind ``sharded_state.fragment_table()`` were written from outside (a checkpoint, a
        snapshot, a weight average swapped in): every rank's whole parameters follow them, the compute
        copies cast from separate fp32 masters (one all-gather per bucket at stages 1/2; nothing at
        stage 0, whose parameters are written whole)."""
        if self.sharded is not None:
            self.sharded.refresh_params()

    def on_relayout(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after the fragments of ``sharded_state.fragment_table()`` moved (the bucket
        order rebuilt at the first backward or set from a checkpoint): each rank owns other elements."""
        self.sync.on_relayout(listener)

    def unshard_all(self) -> None:
        """Parameters are whole below stage 3; with separate fp32 masters (stages 1/2 in mixed precision)
        they are left as whole copies of the masters instead of the 16-bit compute copies."""
        if self.sharded is not None:
            self.sharded.leave_whole_masters()

    def gathered(self, *, writeback: bool = False) -> AbstractContextManager[None]:
        """Parameters are whole below stage 3 (a no-op); with ``writeback`` at stages 1/2 with separate
        fp32 masters they are whole copies of the masters inside (:meth:`ShardedOptimizer.whole_masters`)."""
        if writeback and self.sharded is not None:
            return self.sharded.whole_masters()
        return nullcontext()

    def comm_state(self, *, average: bool = False) -> dict[str, Any] | None:
        """The gradient compressor's state by parameter name (our PowerSGD's iteration, Q and residuals),
        None without a stateful compressor. ``average=True`` replaces the residuals by their mean over the
        dp group (collective), which any dp size resumes from (:mod:`lightning_par.zero.powersgd`)."""
        state = self.sync.hook_state
        if not isinstance(state, PowerSGDState):
            return None
        return state.state_dict({p: n for n, p in self.module.named_parameters()}, average=average)

    def load_comm_state(self, saved: Mapping[str, Any] | None) -> None:
        """Restore :meth:`comm_state`'s output (a warning when this run has no compressor to take it)."""
        load_compressor_state(self.sync.hook_state, saved, dict(self.module.named_parameters()))

    def step_skipped(self) -> None:
        """The fp16 loss scaler skipped this step: a stateful compressor (PowerSGD) drops what the
        non-finite gradient put into its state (:func:`~.compressor_state.compressor_step_skipped`)."""
        compressor_step_skipped(self.sync.hook_state)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes the engine holds on this rank: ``gradients`` (full buffer and shard), ``comm`` (the bucket
        pool) and, when optimizers are sharded, ``optimizer_state`` (with the fp32 masters)."""
        g = self.sync.grad_bytes()
        out = {"gradients": g["full"] + g["shard"], "comm": g["bucket_pool"]}
        if self.sharded is not None:
            out["optimizer_state"] = self.sharded.optimizer_state_bytes()
            # (before, left out: a probe found 4 bytes per parameter / N unreported under reduce_dtype="bf16")
            out["gradients"] += self.sharded.grad_copy_bytes()
        return out

    def remove(self) -> None:
        self.sync.remove()
        if self.sharded is not None:
            self.sharded.remove()


def apply_zero(
    module: nn.Module,
    *,
    group: ProcessGroup,
    stage: int,
    bucket_size_mb: float = 25.0,
    grad_sync: GradSyncPolicy | None = None,
    reduce_op: ReduceChoice = "auto",
    find_unused_parameters: bool = False,
    master_dtype: torch.dtype | None = None,
    compute_dtype: torch.dtype | None = None,
    grad_dtype: torch.dtype | None = None,
    sync_module_states: bool = True,
    allow_untested_optimizer: bool = False,
    comm_hook: CommHook | None = None,
    comm_hook_state: object = None,
    comm_dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    marks_passes: bool = True,
) -> ZeroEngine:
    """Install ZeRO ``stage`` (0, 1 or 2) on ``module`` over ``group``; see the module docstring.

    Mixed precision (stages 1/2): ``compute_dtype`` (bf16/fp16) is what forward and backward use; the
    parameters' current dtype (fp32) becomes the master dtype kept only in this rank's shard;
    ``grad_dtype`` is the reduction dtype (default: the parameters' current dtype). ``comm_hook``
    replaces each bucket's all-reduce (:mod:`lightning_par.zero.comm_hooks`); with a hook, ``"auto"``
    picks the all-reduce and the window is reduced at its boundary. ``comm_dtype`` (fp16/bf16) runs every
    gradient reduction in that dtype instead. ``device``: the communication device, for a module with
    nothing to train on this rank (a pipeline stage whose layers are all frozen). ``marks_passes``: see
    :attr:`ZeroEngine.marks_passes` (False under a pipeline).
    """
    if isinstance(stage, bool) or stage not in (0, 1, 2):
        raise ValueError(f"apply_zero handles stages 0, 1 and 2, got {stage!r}.")
    if grad_sync is not None and grad_sync not in ("boundary", "every"):
        raise ValueError(f"grad_sync must be 'boundary' or 'every', got {grad_sync!r}.")
    if stage == 0 and compute_dtype is not None:
        raise ValueError(
            "A low-precision compute dtype with fp32 masters needs the masters in ZeRO shards: use zero_stage"
            " 1, 2 or 3, or Lightning's own autocast precision at stage 0."
        )
    if stage == 0 and grad_sync == "every":
        raise ValueError("grad_sync='every' needs a sharded gradient: use zero_stage 1 or 2.")
    params = list(module.named_parameters())
    bucket_numel = bucket_numel_for(bucket_size_mb, next((p.element_size() for _, p in params), 4))
    op = resolve_reduce_op(reduce_op, group) if comm_hook is None or reduce_op != "auto" else "all_reduce"
    if comm_hook is not None and grad_sync is None:
        grad_sync = "boundary"  # a hook reduces the accumulated window once
    if isinstance(comm_hook_state, PowerSGDState):
        comm_hook_state.bind(module)  # which parameters it leaves uncompressed (embeddings)
    if sync_module_states:
        broadcast_module_states(module, group=group)
    sync = GradSync(
        params,
        group=group,
        bucket_numel=bucket_numel,
        shard=stage > 0,
        reduce_op=op,
        grad_sync=grad_sync or default_grad_sync(stage),
        find_unused_parameters=find_unused_parameters,
        grad_dtype=grad_dtype,
        comm_hook=comm_hook,
        comm_hook_state=comm_hook_state,
        comm_dtype=comm_dtype,
        device=device,
    )
    sync.attach_to(module)
    return ZeroEngine(
        stage=stage,
        sync=sync,
        module=module,
        master_dtype=master_dtype,
        compute_dtype=compute_dtype,
        allow_untested_optimizer=allow_untested_optimizer,
        marks_passes=marks_passes,
    )


def apply_data_parallel(
    module: nn.Module,
    *,
    group: ProcessGroup,
    bucket_size_mb: float = 25.0,
    find_unused_parameters: bool = False,
    sync_module_states: bool = True,
) -> GradSync:
    """ZeRO stage 0, plain data parallelism: after backward every ``param.grad`` is the dp average."""
    engine = apply_zero(
        module,
        group=group,
        stage=0,
        bucket_size_mb=bucket_size_mb,
        find_unused_parameters=find_unused_parameters,
        sync_module_states=sync_module_states,
    )
    return engine.sync
