"""The precision side of :class:`~lightning_par.HybridParallelStrategy`: one precision path at every stage.

:class:`StrategyPrecision` is a base of the strategy; it holds no state of its own beyond Lightning's
``_precision_plugin``. Whatever plugin the ``Trainer`` passes is converted to
:class:`~lightning_par.precision.ParallelPrecision` where the ZeRO stage needs it
(:func:`~lightning_par.precision_plugins.convert_precision_plugin`); at setup its stage-dependent defaults are
resolved, a foreign plugin is refused where it would decide per rank, the engine's (compute, reduction)
dtypes are read from it, and it is given the mesh groups over which clip norms and fp16 overflow
verdicts must agree.
"""

from __future__ import annotations

import torch
from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from typing_extensions import override

from lightning_par.build import set_precision_groups
from lightning_par.checkpoint.strategy_io import ZeroCheckpointIO
from lightning_par.precision import ParallelPrecision
from lightning_par.precision_plugins import convert_precision_plugin


class StrategyPrecision(ZeroCheckpointIO):
    """The strategy's precision plugin and its wiring to the mesh (see the module docstring)."""

    # set by MeshStrategy.__init__; zero_stage and the mesh come from ZeroCheckpointIO
    tensor_parallel_size: int
    pipeline_parallel_size: int

    @property
    @override
    def precision_plugin(self) -> Precision:
        plugin = self._precision_plugin
        return plugin if plugin is not None else ParallelPrecision("32-true")

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = convert_precision_plugin(plugin, zero_stage=self.zero_stage)

    def _configure_precision(self, *, fitting: bool) -> None:
        """One precision path at every stage: ours resolves its stage-dependent defaults; a plugin that is
        not ours (kept only at stage 0) is refused where its clip norm would be a rank's local one."""
        plugin = self.precision_plugin
        if isinstance(plugin, ParallelPrecision):
            plugin.configure(zero_stage=self.zero_stage, device=self.root_device, evaluating=not fitting)
            return
        if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1:
            raise ValueError(
                f"{type(plugin).__name__}({getattr(plugin, 'precision', '?')!r}) with tensor or pipeline"
                " parallelism would clip by each rank's local gradient norm and decide fp16 overflows per"
                " rank: use precision '32-true', 'bf16-mixed', '16-mixed' or 'bf16-true' (lightning_par's"
                " ParallelPrecision)."
            )

    def _dtypes(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        """(compute, reduction) dtypes for the engine (see ``ParallelPrecision.engine_dtypes``)."""
        plugin = self.precision_plugin
        return plugin.engine_dtypes() if isinstance(plugin, ParallelPrecision) else (None, None)

    def _frozen_dtype(self) -> torch.dtype | None:
        """The dtype frozen floating parameters are stored in (``ParallelPrecision.frozen_storage_dtype``)."""
        plugin = self.precision_plugin
        return plugin.frozen_storage_dtype() if isinstance(plugin, ParallelPrecision) else None

    def _setup_precision_groups(self) -> None:
        """Step 7: the groups over which the precision plugin's clip norm and fp16 verdicts agree."""
        plugin = self.precision_plugin
        if isinstance(plugin, ParallelPrecision):
            set_precision_groups(plugin, self.mesh, zero_stage=self.zero_stage)
            module = self.lightning_module
            if plugin.precision == "bf16-true" and module is not None:
                # the engine casts the compute copy through .data, which Lightning's dtype record does not
                # see: self.dtype said float32 over bf16 weights (x.to(self.dtype) then failed in a step)
                _note_module_dtype(module, plugin.compute_dtype)
        self.setup_precision_plugin()

    def _note_master_dtype(self) -> None:
        """After the model is whole again at teardown: under ``bf16-true`` its trainable parameters hold
        the fp32 masters at ZeRO 1-3 (bf16 at stage 0), which ``self.dtype`` says again."""
        plugin, module = self.precision_plugin, self.lightning_module
        if not isinstance(plugin, ParallelPrecision) or plugin.precision != "bf16-true" or module is None:
            return
        trainable = (p for p in module.parameters() if p.requires_grad and p.is_floating_point())
        first = next(trainable, None)
        if first is not None:
            _note_module_dtype(module, first.dtype)


def _note_module_dtype(module: nn.Module, dtype: torch.dtype) -> None:
    """Record ``dtype`` as the dtype of ``module`` and of every Lightning module within it (the
    ``self.dtype`` that Lightning's ``.to()`` keeps), where the engines changed their parameters' dtype
    without a ``.to()`` call."""
    for m in module.modules():
        if isinstance(m, _DeviceDtypeModuleMixin):
            m._dtype = dtype
