"""Dynamic loss scaling for fp16, agreed across every rank that holds a piece of the gradient.

fp16 has 5 exponent bits: small gradients underflow to zero unless the loss is multiplied by a scale
``S`` before backward (gradients scale with it) and the gradients are divided by ``S`` before the
optimizer uses them. ``S`` adapts:

* if any gradient element on any rank is inf/NaN after unscaling, the step is skipped **on every rank**
  (one all-reduce of a flag over the groups that partition the gradient) and, once ``hysteresis``
  consecutive overflows have been seen, ``S`` is multiplied by ``backoff_factor``;
* after ``growth_interval`` consecutive clean steps, ``S`` is multiplied by ``growth_factor``.

Defaults follow ``torch.amp.GradScaler`` and DeepSpeed: ``S = 2**16``, growth 2 every 2000 clean steps,
backoff 0.5; ``hysteresis=1`` backs off at the first overflow (DeepSpeed's default is 2).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_par.grad_norm import by_device_dtype, group_size


class DynamicLossScaler:
    """Scale, unscale-and-check, and update (see the module docstring)."""

    def __init__(
        self,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = 1.0,
    ) -> None:
        if not init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale}.")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}.")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}.")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(
                f"growth_interval and hysteresis must be >= 1, got {growth_interval}, {hysteresis}."
            )
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self._clean_steps = 0
        self._overflows_left = hysteresis
        self.skipped_steps = 0

    def scale_loss(self, loss: Tensor) -> Tensor:
        return loss * self.scale

    @torch.no_grad()
    def unscale_and_check(
        self,
        grads: Sequence[Tensor],
        *,
        groups: Sequence[ProcessGroup | None],
        device: torch.device,
    ) -> bool:
        """Divide ``grads`` by the scale in place; return True if any rank of ``groups`` saw inf/NaN.

        One fused non-finite check and unscale per (device, dtype) of ``grads`` on the device, one
        all-reduce (MAX) of the flag per group of ``groups`` (``[None]`` for the default world group), so
        every rank that shares the step reaches the same verdict, and one host read of it: the step's only
        host synchronisation under fp16. ``device`` is the communication device, where the flag lives.
        """
        found = torch.zeros(1, dtype=torch.float32, device=device)
        for (dev, _), tensors in by_device_dtype(grads).items():
            flag = found if dev == found.device else torch.zeros(1, dtype=torch.float32, device=dev)
            inv = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, inv)
            if flag is not found:
                found = torch.maximum(found, flag.to(found.device, non_blocking=True))
        for group in groups:
            if group_size(group) > 1:
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found.item())  # the verdict must reach the host: it decides whether to step

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.skipped_steps += 1
            self._clean_steps = 0
            self._overflows_left -= 1
            if self._overflows_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
                self._overflows_left = self.hysteresis
            return
        self._overflows_left = self.hysteresis
        self._clean_steps += 1
        if self._clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self._clean_steps = 0

    def get_scale(self) -> float:
        """The current scale (torch's ``GradScaler.get_scale``, which loggers call)."""
        return self.scale

    def grad_scaler_state(self) -> dict[str, Any]:
        """This state in ``torch.amp.GradScaler.state_dict()``'s format."""
        return {
            "scale": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self._clean_steps,
        }

    def load_grad_scaler_state(self, state: Mapping[str, Any]) -> None:
        """The scale and clean-step count of a ``torch.amp.GradScaler.state_dict()``."""
        self.scale = float(state["scale"])
        self._clean_steps = int(state.get("_growth_tracker", 0))
        self._overflows_left = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "clean_steps": self._clean_steps,
            "overflows_left": self._overflows_left,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._overflows_left = int(state["overflows_left"])
        self.skipped_steps = int(state["skipped_steps"])
