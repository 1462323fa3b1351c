"""Per-step guards: ``StragglerDetector`` (slow ranks in the log) and ``LossGuard`` (bad steps skipped or
rolled back).

``StragglerDetector`` times each rank's *forward* (batch start to backward: no collectives there under
data parallelism and ZeRO 0-2, so it measures the rank's own speed; a whole step is equalised by the
gradient collectives) and its whole step, on the host clock, or on a GPU with CUDA events read at each
check (the host only launches the kernels). Every ``every_n_steps`` steps one gather brings all ranks'
means to every rank, and ranks slower than ``slow_factor`` x the median are logged with host and figure.

``LossGuard`` keeps every micro-batch's loss and judges them before the optimizer step with *one*
all-reduce of ``[sum of finite losses, number of non-finite ones]`` per micro-batch, so every rank
reaches the same verdict: the step is
bad if any rank's loss is NaN/Inf, or if the mean loss exceeds ``spike_factor`` x its running mean (an
exponential moving average of good steps, after ``warmup_steps``). A bad step is then, on all ranks:

* ``"skip"``: gradients are dropped before the optimizer step, so weights and optimizer state stay
  untouched (the batch is consumed and the step counted, like an fp16 overflow step);
* ``"rollback"``: weights, optimizer, LR schedulers and precision state are restored from the newest
  snapshot of the trainer's ``FlashCheckpoint`` (memory first), and the step's gradients dropped; the
  loop goes on with the next batches, so the data around the spike is not replayed.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_par.callbacks import _dist
from lightning_par.callbacks.flash import FlashCheckpoint

log = logging.getLogger(__name__)

LossAction = Literal["skip", "rollback"]
_ACTIONS = ("skip", "rollback")


class StragglerDetector(Callback):
    """Log ranks whose forward is slower than ``slow_factor`` x the median (see the module docstring).

    Attributes:
        reports: one entry per check: ``{"step", "ranks": [{"rank", "host", "forward_s", "step_s"}],
            "slow": [ranks]}``.
    """

    def __init__(self, *, every_n_steps: int = 50, slow_factor: float = 1.5) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(
                f"StragglerDetector: every_n_steps must be a positive integer, got {every_n_steps!r}."
            )
        if not slow_factor > 1:
            raise ValueError(f"StragglerDetector: slow_factor must be > 1, got {slow_factor!r}.")
        self.every_n_steps = every_n_steps
        self.slow_factor = float(slow_factor)
        self.reports: list[dict[str, Any]] = []
        self._reset()

    def _reset(self) -> None:
        # (start, end) marks of each forward and each step since the last check: host clock readings,
        # or on a GPU events on the current stream, read only at the check (one wait per check)
        self._forwards: list[tuple[Any, Any]] = []
        self._steps: list[tuple[Any, Any]] = []
        self._start: Any = 0.0
        self._last_check = -1

    @staticmethod
    def _mark(trainer: pl.Trainer) -> Any:
        """Now, on the clock the rank's work runs on: a GPU runs its kernels after the host has launched
        them, so a host clock there would time the launches, not the device's forward (a throttled GPU
        would not show)."""
        if trainer.strategy.root_device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def _seconds(marks: list[tuple[Any, Any]]) -> float:
        total = 0.0
        for start, end in marks:
            if isinstance(end, float):
                total += end - start
            else:
                end.synchronize()  # done already but for the last one: the check's one wait
                total += start.elapsed_time(end) / 1000.0
        return total

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._start = self._mark(trainer)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self._forwards.append((self._start, self._mark(trainer)))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._steps.append((self._start, self._mark(trainer)))
        step = trainer.global_step
        if (
            trainer.fit_loop.epoch_loop._should_accumulate()
            or step % self.every_n_steps
            or step == self._last_check
        ):
            return
        last = self._last_check
        self._last_check = step
        count = len(self._steps)
        mine = (self._seconds(self._forwards) / count, self._seconds(self._steps) / count, _dist.HOST)
        self._forwards, self._steps = [], []
        if last < 0:
            return  # the first window includes start-up costs: measure from here on
        ranks: list[dict[str, Any]] = [
            {"rank": r, "host": host, "forward_s": fwd, "step_s": stp}
            for r, (fwd, stp, host) in enumerate(_dist.gather_objects(mine))
        ]
        key = "forward_s" if all(r["forward_s"] > 0 for r in ranks) else "step_s"
        median = statistics.median(r[key] for r in ranks)
        slow = [r for r in ranks if median > 0 and r[key] > self.slow_factor * median]
        self.reports.append({"step": step, "ranks": ranks, "slow": [r["rank"] for r in slow], "metric": key})
        if trainer.is_global_zero:
            for r in slow:
                log.warning(
                    "StragglerDetector: step %d: rank %d (%s) %s %.4f s, %.1fx the median %.4f s",
                    step,
                    r["rank"],
                    r["host"],
                    key,
                    r[key],
                    r[key] / median,
                    median,
                )
            log.info(
                "StragglerDetector: step %d: %s per rank %s", step, key, [round(r[key], 4) for r in ranks]
            )


class LossGuard(Callback):
    """Skip or roll back steps whose loss is non-finite or spikes (see the module docstring).

    Args:
        action: ``"skip"`` or ``"rollback"`` (needs a ``FlashCheckpoint`` among the trainer's callbacks).
        spike_factor: a mean loss above this multiple of the running mean is a spike; None: only NaN/Inf.
        ema_decay: decay of the running mean of good steps' losses.
        warmup_steps: good steps before spikes are judged (the early loss falls fast).
        max_consecutive: this many bad steps in a row raise a ``RuntimeError`` (the run is broken).

    Attributes:
        events: one entry per bad update: ``{"step", "reason", "action", "restored_step"}``, where ``step``
            is ``trainer.global_step`` during it (the updates completed before it).
    """

    def __init__(
        self,
        *,
        action: LossAction = "skip",
        spike_factor: float | None = 5.0,
        ema_decay: float = 0.98,
        warmup_steps: int = 20,
        max_consecutive: int = 5,
    ) -> None:
        if action not in _ACTIONS:
            raise ValueError(f"LossGuard: action must be one of {_ACTIONS}, got {action!r}.")
        if spike_factor is not None and not spike_factor > 1:
            raise ValueError(f"LossGuard: spike_factor must be > 1 or None, got {spike_factor!r}.")
        if not 0 < ema_decay < 1:
            raise ValueError(f"LossGuard: ema_decay must be in (0, 1), got {ema_decay!r}.")
        if warmup_steps < 0 or max_consecutive < 1:
            raise ValueError("LossGuard: warmup_steps must be >= 0 and max_consecutive >= 1.")
        self.action: LossAction = action
        self.spike_factor = spike_factor
        self.ema_decay = ema_decay
        self.warmup_steps = warmup_steps
        self.max_consecutive = max_consecutive
        self.events: list[dict[str, Any]] = []
        self._ema: float | None = None
        self._good_steps = 0
        self._window: list[float] = []
        self._pending: list[Tensor] = []
        self._bad: str | None = None
        self._consecutive = 0
        self._flash: FlashCheckpoint | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        flashes = [cb for cb in trainer.callbacks if isinstance(cb, FlashCheckpoint)]  # type: ignore[attr-defined]
        if self.action == "rollback" and not flashes:
            raise ValueError(
                "LossGuard(action='rollback') restores FlashCheckpoint snapshots: add a FlashCheckpoint"
                " callback."
            )
        self._flash = flashes[0] if flashes else None

    def state_dict(self) -> dict[str, Any]:
        return {"ema": self._ema, "good_steps": self._good_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._ema = state_dict.get("ema")
        self._good_steps = int(state_dict.get("good_steps", 0))

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        # kept on its device and judged with the step's other micro-batches: no sync per micro-batch
        self._pending.append(loss.detach().float().reshape(()))

    def _judge(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The verdict on this step's micro-batches, agreed by all ranks through one all-reduce of
        ``[finite loss or 0, non-finite flag]`` per micro-batch."""
        if not self._pending:
            return
        losses = torch.stack(self._pending).double()
        self._pending = []
        finite = torch.isfinite(losses)
        local = torch.cat([torch.where(finite, losses, torch.zeros_like(losses)), (~finite).double()])
        totals = _dist.all_reduce(local, op="sum", device=trainer.strategy.root_device)  # the one host read
        k = len(losses)
        # Lightning hands backward the loss divided by the accumulation steps: judge the micro-batch's own
        scale = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
        for total, nonfinite in zip(totals[:k], totals[k:], strict=True):
            mean = total / trainer.world_size * scale
            if nonfinite:
                self._bad = self._bad or f"non-finite loss on {int(nonfinite)} rank(s)"
            elif (
                self.spike_factor is not None
                and self._ema is not None
                and self._good_steps >= self.warmup_steps
                and mean > self.spike_factor * self._ema
            ):
                self._bad = (
                    self._bad
                    or f"loss spike: {mean:.4g} > {self.spike_factor:g} x running mean {self._ema:.4g}"
                )
            else:
                self._window.append(mean)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        self._judge(trainer, pl_module)
        if self._bad is None:
            return
        restored = None
        if self.action == "rollback":
            assert self._flash is not None
            restored = self._flash.rollback(trainer)
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None  # torch optimizers leave parameters without gradients untouched
        step = trainer.global_step
        self.events.append(
            {"step": step, "reason": self._bad, "action": self.action, "restored_step": restored}
        )
        what = "skipped" if restored is None else f"rolled back to the snapshot of step {restored}"
        rank_zero_warn(f"LossGuard: step {step}: {self._bad}; the update was {what}.")
        self._consecutive += 1
        if self._consecutive >= self.max_consecutive:
            raise RuntimeError(
                f"LossGuard: {self._consecutive} bad steps in a row (last: {self._bad}); stopping the run."
            )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.fit_loop.epoch_loop._should_accumulate():
            return
        self._judge(trainer, pl_module)  # a step whose optimizer step did not run is judged here
        if self._bad is None and self._window:
            loss = sum(self._window) / len(self._window)
            self._ema = (
                loss if self._ema is None else self.ema_decay * self._ema + (1 - self.ema_decay) * loss
            )
            self._good_steps += 1
            self._consecutive = 0
        self._bad = None
        self._window = []
