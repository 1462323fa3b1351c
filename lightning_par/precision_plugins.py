"""Lightning's and Fabric's precision plugins mapped onto
:class:`~lightning_par.precision.ParallelPrecision`."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.plugins.precision.amp import MixedPrecision
from lightning.pytorch.plugins.precision.double import DoublePrecision
from lightning.pytorch.plugins.precision.half import HalfPrecision

from lightning_par.precision import PRECISION_MODES, ParallelPrecision


def scaler_options(plugin: Any) -> dict[str, Any] | None:
    """The loss-scale settings of a Lightning / Fabric ``MixedPrecision("16-mixed")``'s own GradScaler
    (``init_scale``, growth, backoff, interval), for ours; None without one. Before, a user's
    ``GradScaler(init_scale=128, growth_interval=1)`` was replaced by the defaults, silently."""
    scaler = getattr(plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    return {
        "init_scale": float(scaler.get_scale()),
        "growth_factor": float(scaler.get_growth_factor()),
        "backoff_factor": float(scaler.get_backoff_factor()),
        "growth_interval": int(scaler.get_growth_interval()),
    }


def convert_precision_plugin(plugin: Precision | None, *, zero_stage: int) -> Precision | None:
    """Map Lightning's precision plugins onto ours (the way Lightning's FSDP strategy enforces its own).

    At every stage, Lightning's ``"32-true"``, ``"64-true"``, ``"bf16-mixed"``, ``"16-mixed"`` and
    ``"bf16-true"`` become the matching ``ParallelPrecision`` (masters or not follow the stage: see the
    module docstring), so the clip norm and the fp16 verdict are global whatever the layout. Any other
    plugin (``"16-true"``, third-party ones) is kept at stage 0, where every rank holds whole gradients,
    and the strategy refuses it at setup under tensor or pipeline parallelism, where its norm would be a
    rank's local one; at stages 1-3 it is refused here with its name.
    """
    if plugin is None or isinstance(plugin, ParallelPrecision):
        return plugin
    if type(plugin) is Precision:  # Lightning's "32-true"
        return ParallelPrecision("32-true")
    if type(plugin) is MixedPrecision and plugin.precision in ("bf16-mixed", "16-mixed"):
        return ParallelPrecision(plugin.precision, loss_scale=scaler_options(plugin))
    if type(plugin) is HalfPrecision and plugin.precision == "bf16-true":
        return ParallelPrecision("bf16-true")
    if type(plugin) is DoublePrecision:
        return ParallelPrecision("64-true")
    if zero_stage == 0:
        return plugin
    raise ValueError(
        f"{type(plugin).__name__}({getattr(plugin, 'precision', '?')!r}) cannot be used with ZeRO stage"
        f" {zero_stage}: lightning_par's ParallelPrecision supports {PRECISION_MODES} there (fp32 masters in"
        " the shards, global-norm clipping); pass one of those precision strings or a ParallelPrecision."
    )
