"""Lightning's and Fabric's precision plugins mapped onto
:class:`~lightning_par.precision.ParallelPrecision`."""

from __future__ import annotations

from typing import Any

from lightning.fabric.plugins import precision as fabric_plugins
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


def equivalent_precision(plugin: Any) -> ParallelPrecision | None:
    """The ``ParallelPrecision`` matching one of Lightning's or Fabric's own plugins (their exact classes:
    ``Precision`` is ``"32-true"``, ``MixedPrecision`` ``"bf16-mixed"`` / ``"16-mixed"`` with its scaler's
    settings, ``HalfPrecision("bf16-true")``, ``DoublePrecision``); None for any other (a subclass, a
    third-party plugin, ``"16-true"``)."""
    kind, mode = type(plugin), getattr(plugin, "precision", None)
    if kind in (Precision, fabric_plugins.Precision):
        return ParallelPrecision("32-true")
    if kind in (MixedPrecision, fabric_plugins.MixedPrecision) and mode in ("bf16-mixed", "16-mixed"):
        return ParallelPrecision(mode, loss_scale=scaler_options(plugin))
    if kind in (HalfPrecision, fabric_plugins.HalfPrecision) and mode == "bf16-true":
        return ParallelPrecision("bf16-true")
    if kind in (DoublePrecision, fabric_plugins.DoublePrecision):
        return ParallelPrecision("64-true")
    return None


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
    if (ours := equivalent_precision(plugin)) is not None:
        return ours
    if zero_stage == 0:
        return plugin
    raise ValueError(
        f"{type(plugin).__name__}({getattr(plugin, 'precision', '?')!r}) cannot be used with ZeRO stage"
        f" {zero_stage}: lightning_par's ParallelPrecision supports {PRECISION_MODES} there (fp32 masters in"
        " the shards, global-norm clipping); pass one of those precision strings or a ParallelPrecision."
    )
