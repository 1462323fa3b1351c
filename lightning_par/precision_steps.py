"""The step side of :class:`~lightning_par.precision.ParallelPrecision` (its base class): the optimizer
step with fp16's unscale-and-check, the hooks between the closure and the update, the clip by the global
norm, and the plugin's checkpoint state.

Contract
--------
In a step, in this order: the closure (forward, backward: the engine reduces and attaches the gradients),
then under ``"16-mixed"`` one unscale of this optimizer's gradients with an overflow verdict agreed over
``step_groups`` (a non-finite gradient skips the step on every rank: ``zero_grad()``, ``on_skip``, the
scale backs off), then Lightning's hooks and clipping (``_after_closure``), ``before_update``, and the
optimizer's update. ``clip_grad_by_norm`` scales the gradients by ``min(1, c / (||g|| + eps))`` with
``||g||`` the norm over every rank of ``grad_norm_groups``: tensor-parallel replicas (``tp_group``) and
second copies of tied parameters count once; the norm is kept in ``last_grad_norm`` on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.plugins.precision.amp import MixedPrecision
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par.grad_norm import clip_grad_norm_
from lightning_par.loss_scaler import DynamicLossScaler
from lightning_par.pipeline.apply import NORM_SKIP_ATTR
from lightning_par.tensor_parallel.layers import TP_DIM_ATTR

# where Lightning's MixedPrecision keeps its GradScaler state in a Trainer checkpoint (its class name)
_LIGHTNING_AMP_KEY = MixedPrecision.__qualname__


class PrecisionSteps(Precision):
    """The optimizer step, clipping and checkpoint state of the precision plugin (module docstring)."""

    scaler: DynamicLossScaler | None
    device: torch.device
    step_groups: tuple[ProcessGroup | None, ...]
    grad_norm_groups: tuple[ProcessGroup, ...]
    tp_group: ProcessGroup | None
    last_step_skipped: bool
    last_grad_norm: Tensor | None
    before_update: Callable[[], None] | None
    on_skip: Callable[[], None] | None

    @property
    def norm_dtype(self) -> torch.dtype:
        """The dtype gradient norms accumulate in: fp64 under ``"64-true"``, else fp32."""
        return torch.float64 if self.precision == "64-true" else torch.float32

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizable,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        self.last_step_skipped = False
        self.last_grad_norm = None  # set again if this step clips
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            return None  # the training step returned None: nothing to unscale or step
        assert isinstance(optimizer, Optimizer)
        grads = [p.grad for p in self.main_params(optimizer) if p.grad is not None]
        found_inf = self.scaler.unscale_and_check(grads, groups=self.step_groups, device=self.device)
        if found_inf:
            self.scaler.update(True)
            self.last_step_skipped = True
            optimizer.zero_grad(set_to_none=True)
            if self.on_skip is not None:
                self.on_skip()
            return closure_result
        self._after_closure(model, optimizer)  # hooks and clipping see unscaled gradients
        output = optimizer.step(**kwargs)
        self.scaler.update(False)
        return output

    @override
    def _after_closure(self, model: pl.LightningModule, optimizer: Any) -> None:
        super()._after_closure(model, optimizer)
        if self.before_update is not None:
            self.before_update()

    @override
    def main_params(self, optimizer: Optimizer) -> Iterator[nn.Parameter]:
        """The optimizer's parameters that live on this rank: under pipeline parallelism an optimizer's
        groups hold the other stages' parameters as meta placeholders, which never carry a gradient."""
        for group in optimizer.param_groups:
            yield from (p for p in group["params"] if not p.is_meta)

    @override
    def clip_grad_by_norm(
        self, optimizer: Optimizer, clip_val: int | float, *, norm_type: float = 2.0
    ) -> None:
        """Clip ``optimizer``'s gradients by their global ``norm_type`` norm over ``grad_norm_groups``
        (tp-replicated parameters and second copies of tied ones counted once); the norm is kept in
        ``last_grad_norm`` (on the device)."""
        params = [p for p in self.main_params(optimizer) if p.grad is not None]
        # copies of a parameter tied across pipeline stages: scaled like the others, counted once
        skip = [p.grad for p in params if getattr(p, NORM_SKIP_ATTR, False)]
        params = [p for p in params if not getattr(p, NORM_SKIP_ATTR, False)]
        if self.tp_group is None:
            grads = [p.grad for p in params]
            self.last_grad_norm = clip_grad_norm_(
                grads,  # type: ignore[arg-type]
                float(clip_val),
                groups=self.grad_norm_groups,
                extra=skip,  # type: ignore[arg-type]
                norm_type=norm_type,
                device=self.device,
                dtype=self.norm_dtype,
            )
            return
        sharded = [p.grad for p in params if hasattr(p, TP_DIM_ATTR)]
        replicated = [p.grad for p in params if not hasattr(p, TP_DIM_ATTR)]
        self.last_grad_norm = clip_grad_norm_(
            sharded,  # type: ignore[arg-type]
            float(clip_val),
            groups=self.grad_norm_groups,
            replicated=[(replicated, self.tp_group)],  # type: ignore[list-item]
            extra=skip,  # type: ignore[arg-type]
            norm_type=norm_type,
            device=self.device,
            dtype=self.norm_dtype,
        )

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"precision": self.precision, **({"scaler": self.scaler.state_dict()} if self.scaler else {})}

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """fp16: the loss scale also under Lightning's ``MixedPrecision`` key, in torch's GradScaler format,
        so a run resumed with ``strategy="ddp"`` continues from this scale."""
        if self.scaler is not None:
            checkpoint.setdefault(_LIGHTNING_AMP_KEY, self.scaler.grad_scaler_state())

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """fp16: a checkpoint written under Lightning's ``MixedPrecision`` (a ``"ddp"`` run) gives its
        GradScaler's scale and growth count (before, they were dropped and the scale restarted); our own
        entry, when present, is loaded after this and wins."""
        if self.scaler is None or type(self).__qualname__ in checkpoint:
            return
        amp = checkpoint.get(_LIGHTNING_AMP_KEY)
        if isinstance(amp, Mapping) and "scale" in amp:
            self.scaler.load_grad_scaler_state(amp)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["scaler"])


__all__ = ["PrecisionSteps"]
