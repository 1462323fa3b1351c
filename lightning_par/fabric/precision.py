"""Fabric's precision plugins mapped onto :class:`~lightning_par.precision.ParallelPrecision`.

``Fabric(precision="bf16-mixed")`` builds Fabric's own ``MixedPrecision``; the Fabric strategy replaces it
by the matching ``ParallelPrecision``, whose clip norm and fp16 verdict are global over the shards (the
same mapping the Trainer strategy applies to Lightning's plugins). ``ParallelPrecision`` is a Fabric
``Precision`` too, so Fabric's module wrapper uses its ``forward_context`` and ``convert_input``.
"""

from __future__ import annotations

from lightning.fabric.plugins.precision import Precision

from lightning_par.precision import PRECISION_MODES, ParallelPrecision
from lightning_par.precision_plugins import equivalent_precision


def to_parallel_precision(plugin: Precision) -> ParallelPrecision:
    """``plugin`` as a ``ParallelPrecision``; a plugin with no equivalent is refused with its name."""
    if isinstance(plugin, ParallelPrecision):
        return plugin
    if (ours := equivalent_precision(plugin)) is not None:
        return ours
    raise ValueError(
        f"{type(plugin).__name__}({getattr(plugin, 'precision', '?')!r}) cannot be used with lightning_par's"
        f" Fabric strategy: it supports precision {PRECISION_MODES} (fp32 masters in the shards, global-norm"
        " clipping); pass one of those, or a lightning_par ParallelPrecision plugin."
    )
