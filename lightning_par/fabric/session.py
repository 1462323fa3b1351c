"""A Fabric session's state through the Fabric strategy: checkpoints, gathers, metrics, and its end.

:class:`FabricSession` is a base of :class:`lightning_par.fabric.HybridParallelStrategy`. ``fabric.save`` /
``fabric.load`` go to :mod:`lightning_par.fabric.checkpoint` (a sharded directory or one file; a
``filter`` writes the kept entries to one file, as litgpt's LoRA saves expect); ``all_gather`` is
differentiable over any group; torchmetrics objects kept outside the module are pointed at the
data-parallel group on request. ``teardown()`` leaves the whole model behind (``unshard_on_teardown``)
and removes the run's hooks; the mesh outlives it until :meth:`FabricSession.destroy_process_groups`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, SupportsIndex, cast

from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_par.data_reduce import MetricSync, front_door_gather
from lightning_par.fabric import checkpoint as fabric_checkpoint
from lightning_par.fabric.checkpoint_filtered import save_filtered
from lightning_par.fabric.processes import FabricProcesses
from lightning_par.grad_reads import GradReads
from lightning_par.module_dtypes import restore_norms
from lightning_par.owned_hooks import copy_or_share
from lightning_par.zero.engine_api import reads_own_state
from lightning_par.zero.leftovers import placeholder_names
from lightning_par.zero.stage3 import Stage3Engine

SETUP_ATTR = "_lightning_par_fabric_setup"  # set on a module a strategy has set up, until its teardown

if TYPE_CHECKING:
    from lightning_par.fabric.strategy import HybridParallelStrategy
    from lightning_par.mesh import ParallelMesh


def refuse_second_setup(module: nn.Module) -> None:
    """A module an earlier strategy set up and did not tear down (``SETUP_ATTR``), refused naming the fix."""
    mark = getattr(module, SETUP_ATTR, False)
    if mark == "pipeline":
        raise ValueError(
            "This module was split over pipeline stages by an earlier lightning_par Fabric strategy,"
            " now torn down (this rank keeps its stage's layers only): build a fresh model for another"
            " Fabric, loading the weights the first one saved (fabric.save / consolidated_state_dict())."
        )
    if mark:
        left = placeholder_names(module)
        raise ValueError(
            "This module was already set up by lightning_par's Fabric strategy: call fabric.setup() (or"
            " setup_module()) once per module and keep the returned object."
            + (
                f" It still holds ZeRO-3's placeholders in {len(left)} parameters (e.g. {left[:3]}): an"
                " earlier loop on it stopped before they were gathered back. Build the model again and"
                " fabric.load the last checkpoint into it."
                if left
                else ""
            )
        )


class FabricSession(FabricProcesses):
    """Checkpoints, gathers, metric groups and teardown of the Fabric strategy (see the module docstring)."""

    # set by HybridParallelStrategy.__init__ and setup_module()
    unshard_on_teardown: bool
    _torn_down: bool
    _grad_reads: GradReads | None
    _refusal: RemovableHandle | None
    _first_forward: RemovableHandle | None
    _buffer_hooks: list[RemovableHandle]
    _pending_hook: RemovableHandle | None
    _metric_sync: MetricSync
    before_optimizer_step: list[Callable[[], None]]
    _mesh: ParallelMesh | None

    def _launched(self) -> bool:
        return self._mesh is not None or self.module is not None

    def __deepcopy__(self, memo: dict[int, Any]) -> FabricSession:
        """``copy.deepcopy`` of what ``fabric.setup`` returned (an EMA or teacher copy: Fabric's wrapper holds
        its strategy) shares this strategy once it is launched: its process groups, mesh and engine belong to
        the session and cannot be copied (before, "cannot pickle 'ProcessGroup' object"; Fabric's ``"ddp"``
        copies). The copied module runs none of the engine's hooks (they act on the original only,
        :mod:`lightning_par.owned_hooks`). Before launch the strategy is copied like any object."""
        return copy_or_share(self, memo, share=self._launched())

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        """Pickled before launch like any object (a spawn launcher sends it to its processes); once launched
        refused naming what to save: ``torch.save(model)`` of ``fabric.setup``'s wrapper reached the
        session's process groups, "cannot pickle 'ProcessGroup' object" (under Fabric's ``"ddp"`` the file
        is written but its DDP wrapper cannot be loaded outside the run's process group)."""
        if not self._launched():
            return super().__reduce_ex__(protocol)
        raise TypeError(
            "lightning_par's Fabric strategy cannot be pickled once launched (it holds the run's process"
            " groups), nor can what fabric.setup returned, which holds it. Pickle the module itself,"
            " torch.save(model.module, f) (at ZeRO-3 inside `with fabric.strategy.gathered_params():`), or"
            " save its weights with fabric.save(path, {'model': model})."
        )

    @property
    def state_root(self) -> nn.Module | None:
        """The model whose own state reads this session marks (:func:`reads_own_state`)."""
        return self.module

    @property
    def _strategy(self) -> HybridParallelStrategy:
        """This object as the class the checkpoint functions take (of which this class is a base)."""
        return cast("HybridParallelStrategy", self)

    @override
    @reads_own_state
    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        if storage_options is not None:
            raise TypeError("storage_options is not supported by lightning_par's Fabric strategy.")
        target = Path(self.broadcast(str(path)))
        if filter is not None:  # litgpt's LoRA save: one file with the entries the filter keeps
            save_filtered(self._strategy, target, state, filter)
            return
        fabric_checkpoint.save(self._strategy, target, state)

    @override
    @reads_own_state
    def load_checkpoint(
        self,
        path: str | Path,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        return fabric_checkpoint.load(self._strategy, Path(self.broadcast(str(path))), state, strict=strict)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        # differentiable over any group (lightning_par.data_reduce.gather_stacked)
        return front_door_gather(tensor, group=group, sync_grads=sync_grads, mesh=self._mesh)

    def sync_metrics(self, *metrics: Any) -> None:
        """Point torchmetrics objects kept outside the set-up module (Fabric's usual
        ``metric = MeanMetric().to(fabric.device)``) at the data-parallel group, as the module's own are
        at setup: under tensor parallelism the ranks of a tp group hold the same samples, so a metric
        synced over the world counts each of them tp times (a ``SumMetric`` over 8 samples gave 16 at
        tp2); under a pipeline they take the last stage's result. A metric given its own
        ``process_group`` or ``dist_sync_fn`` is left alone, and every change is undone by
        :meth:`destroy_process_groups`. Call it after ``fabric.setup``; nothing to do without tp or pp."""
        self._metric_sync.add(list(metrics), mesh=self.mesh, pipelined=self._pipeline is not None)

    @reads_own_state
    def consolidated_state_dict(self) -> dict[str, Any]:
        """The full model state dict (every stage's, tp slice's and shard's parameters, trainable ones at
        master precision, and the buffers) on global rank 0, ``{}`` elsewhere; collective (see
        :mod:`lightning_par.checkpoint.full`)."""
        return fabric_checkpoint.consolidated(self._strategy)

    @override
    def teardown(self) -> None:
        self._torn_down = True
        if self._grad_reads is not None:
            self._grad_reads.end(quiet=True)
            self._grad_reads = None
        if self.engine is not None:
            if self.unshard_on_teardown:
                # a usable, whole model afterwards, as at the end of a Trainer fit (before, a ZeRO-3 model
                # was left with NaN placeholders and no hooks: it computed and pickled NaN without a word,
                # and stages 1/2 in mixed precision left their 16-bit compute copies)
                self.engine.unshard_all()
            self.engine.remove()
        if self._refusal is not None:
            self._refusal.remove()
            self._refusal = None
        if self._first_forward is not None:
            self._first_forward.remove()
            self._first_forward = None
        for handle in self._buffer_hooks:
            handle.remove()
        self._buffer_hooks = []
        if self._pending_hook is not None:
            self._pending_hook.remove()
            self._pending_hook = None
        if self.module is not None:  # the norm layers' fp32 wrappers of convert_module, as the Trainer's
            restore_norms(self.module)
            # set up again by another Fabric (a notebook's next cell), as Fabric's "ddp" allows; not a
            # model split over pipeline stages, of which this rank keeps its own stage only
            if self._pipeline is None:
                self.module.__dict__.pop(SETUP_ATTR, None)
            else:
                setattr(self.module, SETUP_ATTR, "pipeline")
        super().teardown()

    def destroy_process_groups(self) -> None:
        """Destroy this strategy's mesh groups when done with it, on every rank (a process that runs one
        Fabric loop after another; see :meth:`lightning_par.mesh.ParallelMesh.destroy`). A later launch
        builds new ones."""
        if isinstance(self.engine, Stage3Engine):  # no forward closes the last step's window of checks
            self.engine.end_read_windows()
        self._metric_sync.restore()  # kept past teardown, as the groups the metrics gather over
        if self._pipeline is not None:  # the tied-weight groups first: built over the mesh's ranks
            self._pipeline.steps.tied.destroy()
            if self._pipeline.steps.window_ended in self.before_optimizer_step:
                self.before_optimizer_step.remove(self._pipeline.steps.window_ended)
            self._pipeline = None
        if self._mesh is not None:
            self._mesh.destroy()
            self._mesh = None
