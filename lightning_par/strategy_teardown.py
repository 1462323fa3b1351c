"""The end of a run of :class:`~lightning_par.HybridParallelStrategy`: what ``teardown()`` leaves behind.

:class:`StrategyTeardown` is a base of the strategy and holds no state of its own. After a run the model is
whole again on every rank at master precision (``unshard_on_teardown``), the hooks and wrappers set for
the run are removed and the user's LightningModule and callbacks get their own methods back; after an
exception nothing is gathered (the other ranks may not join) and rank 0 says what the model holds
instead. The process groups outlive ``teardown`` for ``consolidated_state_dict()`` and
``trainer.save_checkpoint`` after ``fit``; :meth:`destroy_process_groups` ends them.
"""

from __future__ import annotations

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.trainer.states import TrainerStatus
from torch import nn
from typing_extensions import override

from lightning_par import lightning_hooks
from lightning_par.data_reduce import MetricSync
from lightning_par.module_dtypes import restore_norms
from lightning_par.precision import ParallelPrecision
from lightning_par.strategy_env import MeshStrategy
from lightning_par.strategy_precision import StrategyPrecision
from lightning_par.strategy_steps import StrategySteps
from lightning_par.zero.buffers import BufferSync


class StrategyTeardown(StrategySteps, StrategyPrecision, MeshStrategy):
    """Teardown and the process groups' end (see the module docstring)."""

    # set by HybridParallelStrategy.__init__ and setup()
    unshard_on_teardown: bool
    _kept_sharded = False  # the last fit ended with the model sharded (unshard_on_teardown=False)
    _synced_batchnorm: bool
    _metric_sync: MetricSync

    @override
    def teardown(self) -> None:
        if self._grad_reads is not None:
            self._grad_reads.end(quiet=True)
            self._grad_reads = None
        plugin = self.precision_plugin
        if isinstance(plugin, ParallelPrecision):
            plugin.before_update = plugin.on_skip = None
        if self._engine is not None:
            # leave a usable, whole model behind, at master precision; not after an exception, which may
            # have stopped this rank alone (a failed restore): its peers would never join the gathers and
            # the error would wait in them instead of surfacing
            if self.unshard_on_teardown and not self._interrupted():
                self._engine.unshard_all()
                self._note_master_dtype()
            elif self.unshard_on_teardown:
                self._warn_left_as_held()
            # kept sharded on purpose: the next run on this strategy would replace the shards (setup)
            self._kept_sharded = not self.unshard_on_teardown and not self._interrupted()
            # hooks go; the engine stays so trainer.save_checkpoint() after fit still sees the shards
            # (the next setup() builds a new one)
            self._engine.remove()
        self._token_normalizer = None
        self._token_calls, self._token_rescaled = 0, False
        if self.lightning_module is not None:
            restore_norms(self.lightning_module)  # the norm layers' fp32 wrappers of convert_module
            lightning_hooks.restore(self.lightning_module, self._patched)  # the class's own methods again
        self._patched = []
        for callback, names in self._patched_callbacks:
            lightning_hooks.restore(callback, names)
        self._patched_callbacks = []
        if self._synced_batchnorm and self._layer_sync is not None and self.model is not None:
            self.model = self._layer_sync.revert(self.model)
        self._synced_batchnorm = False
        self._buffer_sync = BufferSync(nn.Module(), group=None, enabled=False)  # type: ignore[arg-type]
        module = self.lightning_module
        if module is None or not any(p.is_meta for p in module.parameters()):
            super().teardown()
        else:
            self._teardown_with_meta(module)

    def _warn_left_as_held(self) -> None:
        """After a fit an exception stopped, say what the model holds where it is not the user's model: the
        ZeRO-3 placeholders, or the 16-bit compute copies of the masters (a retry on the same module object
        would start from them, silently rounded)."""
        assert self._engine is not None
        plugin = self.precision_plugin
        if self._engine.shards_params:
            held = "ZeRO-3's NaN placeholders (each rank's shard is in the engine)"
        elif isinstance(plugin, ParallelPrecision) and plugin.uses_masters:
            # back in the masters' dtype, as a finished fit leaves them (a local cast, no gather): a
            # resume then loads fp32 values into fp32 parameters (before, the next run took the 16-bit
            # copies for the model's own dtype and trained in it, or failed on mixed dtypes)
            master = torch.float32  # ParallelPrecision's masters
            module = self.lightning_module
            if module is not None:
                for p in module.parameters():
                    if p.requires_grad and p.dtype == plugin.compute_dtype:
                        p.data = p.data.to(master)
                self._note_master_dtype()  # self.dtype as a finished fit leaves it
            held = (
                f"the {plugin.compute_dtype} compute copies' values, cast back to {master} (rounded: the"
                " exact masters are in the shards)"
            )
        else:
            return
        rank_zero_warn(
            f"The run stopped with an exception, so the model's parameters were not gathered back (the other"
            f" ranks may not join): they hold {held}. Before fitting again, resume from a checkpoint"
            " (trainer.fit(model, ckpt_path=...): the last one written holds the trained weights) or rebuild"
            " the model."
        )

    def _interrupted(self) -> bool:
        """Whether the Trainer is tearing down after an exception (Lightning marks it interrupted first)."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        return trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED

    def destroy_process_groups(self) -> None:
        """Destroy the process groups this strategy created (its mesh, the pipeline's tied-weight groups)
        when done with it: after ``fit`` and anything that needs them afterwards
        (``consolidated_state_dict()``, ``trainer.save_checkpoint``), on every rank. They are kept past
        ``teardown`` for those calls; a later ``fit`` or ``test`` with this strategy builds new ones. A
        process that runs many Trainers (``lightning-par-train -m`` calls this after every job) would
        otherwise slow down with every group left alive (:meth:`ParallelMesh.destroy`)."""
        self._metric_sync.restore()  # kept past teardown: metrics read in on_fit_end or after fit
        if self._pipeline is not None:
            self._pipeline.tied.destroy()
            self._pipeline = None
        if self._mesh is not None:
            self._mesh.destroy()
            self._mesh = None
