"""``ParallelPrecision``: the precision plugin of :class:`~lightning_par.HybridParallelStrategy`.

Besides the numeric mode, the plugin owns gradient clipping, because under ZeRO (and later tensor and
pipeline parallelism) the optimizer's parameters hold only pieces of the model: the norm used to clip is
the *global* norm over all pieces (:func:`lightning_par.grad_norm.global_grad_norm`), computed with one
all-reduce over the groups the strategy sets in :attr:`ParallelPrecision.grad_norm_groups`.
"""

from __future__ import annotations

from typing import Literal

from lightning.pytorch.plugins.precision import Precision
from torch.distributed import ProcessGroup
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par.grad_norm import clip_grad_norm_

PrecisionMode = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true"]
_MODES = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")


class ParallelPrecision(Precision):
    """Precision plugin for sharded training.

    Args:
        precision: ``"32-true"``. (The low-precision modes with fp32 master weights in the ZeRO shards
            are a separate feature and raise ``NotImplementedError`` until it lands.)
    """

    def __init__(self, precision: PrecisionMode = "32-true") -> None:
        if precision not in _MODES:
            raise ValueError(f"precision must be one of {_MODES}, got {precision!r}.")
        if precision != "32-true":
            raise NotImplementedError(
                f"precision={precision!r} with fp32 master weights in the ZeRO shards is not implemented in"
                " this version of lightning_par; use precision='32-true' (or zero_stage=0, which accepts"
                " Lightning's own mixed-precision plugins)."
            )
        super().__init__()
        self.precision = precision
        self.grad_norm_groups: tuple[ProcessGroup, ...] = ()

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        grads = [p.grad for p in self.main_params(optimizer) if p.grad is not None]
        clip_grad_norm_(grads, float(clip_val), groups=self.grad_norm_groups)


def convert_precision_plugin(plugin: Precision | None, *, zero_stage: int) -> Precision | None:
    """Map Lightning's precision plugins onto ours (the way Lightning's FSDP strategy enforces its own)."""
    if plugin is None or isinstance(plugin, ParallelPrecision):
        return plugin
    if type(plugin) is Precision:  # Lightning's "32-true"
        return ParallelPrecision("32-true")
    if zero_stage == 0:
        return plugin  # plain data parallel holds full gradients: Lightning's own plugins are exact
    raise NotImplementedError(
        f"{type(plugin).__name__} cannot be used with ZeRO stage {zero_stage}: the sharded optimizer needs"
        " lightning_par's ParallelPrecision (precision='32-true' in this version), because clipping must use"
        " the global gradient norm over all shards."
    )
