"""What callers outside ``zero/`` may use of a ZeRO engine, at any stage: the :class:`Engine` and
:class:`ShardedState` protocols (stages 0-2: :class:`~lightning_par.zero.engine.ZeroEngine`; stage 3:
:class:`~lightning_par.zero.stage3.Stage3Engine`), and the marking of the front doors' own reads of the
model's state (:func:`own_state_reads`, :func:`reads_own_state`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_par.state_guard import reads_of

__all__ = ["Engine", "ShardedState", "own_state_reads", "reads_own_state"]


class Engine(Protocol):
    """What the front doors, the checkpoint code and the snapshot code need of a ZeRO engine (stages 0-2
    or 3). Every method means the same at every stage, so no caller outside ``zero/`` branches on the
    engine's class:

    * ``shards_params``: whether parameters live as shards (stage 3); ``param_shards()`` lists them as
      ``(name, lo, hi, view)`` (empty below stage 3) and ``load_param_shards(values)`` overwrites them.
    * ``sharded_state``: the optimizer fragments (stages 1-3), None when optimizers are not sharded.
    * ``bucket_order()``: the flat order fragments follow (empty at stage 3, whose units follow the
      module), restored by ``freeze_order`` before fragments are loaded.
    * ``masters_changed()``: after the fragments (fp32 masters or shards) were written, the whole
      parameters every rank computes with follow. ``on_relayout(listener)``: told when fragments move.
    * ``unshard_all()``: leave whole parameters behind, trainable ones at master precision (after
      training).
    * ``gathered(writeback=...)``: whole parameters for code outside a step, entered by every rank
      (``strategy.gathered_params``); with ``writeback`` in their stored precision, writes kept.
    * ``memory_bytes()``: bytes by category; keys present override what a caller would count itself.
    * ``comm_state()`` / ``load_comm_state()``: the gradient compressor's state for checkpoints (None
      when there is none).
    * ``watch_backward(loss)``: called with the tensor a backward starts from, before it starts; the
      engine's end-of-backward work then waits for that pass, past the nested passes of reentrant
      activation checkpoints.

    The front doors' own traversals of ``module.state_dict()``, which stage 3 (and tensor / pipeline
    parallelism) otherwise refuse, are marked on the model itself: :func:`own_state_reads`.
    """

    stage: int
    module: nn.Module

    def shard_optimizers(self, optimizers: Sequence[Optimizer]) -> None: ...
    def no_sync(self) -> AbstractContextManager[None]: ...
    def forward_context(self) -> AbstractContextManager[None]: ...
    def on_synchronized(self, listener: Callable[[], None]) -> None: ...
    def scale_grads(self, factor: float | Tensor) -> None: ...
    def flush(self) -> None: ...
    def watch_backward(self, root: Tensor) -> None: ...
    def grad_view(self, param: nn.Parameter) -> Tensor | None: ...
    @property
    def sync_enabled(self) -> bool: ...
    @property
    def unused_param_ids(self) -> frozenset[int]: ...
    def freeze_order(self, names: Sequence[str]) -> None: ...
    def after_step(self, *, open_window: bool = True, optimizer: Optimizer | None = None) -> None: ...
    def open_window(self) -> None: ...

    @property
    def sharded_state(self) -> ShardedState | None: ...

    # state access, identical in meaning at stages 0-3 (callers never ask which engine they hold)
    @property
    def shards_params(self) -> bool: ...

    @property
    def sharded_param_ids(self) -> frozenset[int]: ...

    def bucket_order(self) -> list[str]: ...
    def param_shards(self) -> list[tuple[str, int, int, Tensor]]: ...
    def load_param_shards(self, values: Callable[[str, int, int], Tensor | None]) -> None: ...
    def masters_changed(self) -> None: ...
    def on_relayout(self, listener: Callable[[], None]) -> None: ...
    def unshard_all(self) -> None: ...
    def gathered(self, *, writeback: bool = False) -> AbstractContextManager[None]: ...
    def memory_bytes(self) -> dict[str, int]: ...
    def comm_state(self, *, average: bool = False) -> dict[str, Any] | None: ...
    def load_comm_state(self, saved: Mapping[str, Any] | None) -> None: ...
    def step_skipped(self) -> None: ...
    def remove(self) -> None: ...


class ShardedState(Protocol):
    """This rank's fragments of the parameters and the optimizers rebuilt over them."""

    @property
    def master_key(self) -> str | None: ...
    def fragment_table(self) -> list[tuple[str, int, int, Tensor]]: ...
    def group_params(self, index: int) -> list[list[nn.Parameter]]: ...
    def stepped_tensors(self) -> list[Tensor]: ...


def own_state_reads(module: nn.Module | None) -> AbstractContextManager[None]:
    """Mark the strategies' own reads of the whole model's ``state_dict()`` (checkpoints, exports,
    snapshots): wrap them in this. The marks are the model's
    (:func:`~lightning_par.state_guard.reads_of`), which ZeRO-3's and the tensor-parallel and pipeline
    guards read; nothing to mark before there is a model."""
    return reads_of(module)() if module is not None else nullcontext()


class _HasModel(Protocol):
    @property
    def state_root(self) -> nn.Module | None: ...


_S = TypeVar("_S", bound=_HasModel)
_P = ParamSpec("_P")
_R = TypeVar("_R")


def reads_own_state(method: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
    """A front door's method (checkpoint save or load, export) that runs under
    :func:`own_state_reads` of its model (``state_root``)."""

    @functools.wraps(method)
    def wrapper(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with own_state_reads(self.state_root):
            return method(self, *args, **kwargs)

    return wrapper
