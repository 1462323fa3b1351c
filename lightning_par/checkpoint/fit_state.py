"""The engine a checkpoint written after ``test()`` / ``validate()`` reads: the fit's optimizer state.

Lightning keeps the optimizers of the last ``fit`` through later evaluation runs, and ``"ddp"``
checkpoints their state there (``fit`` -> ``test(ckpt_path="best")`` -> ``trainer.save_checkpoint``).
An evaluation run builds another engine (ZeRO-3's units again; none below stage 3), which holds no
optimizer fragments, so the save failed at ZeRO 1-3 (``KeyError`` on a fragment tensor). The strategy
keeps the fit's engine for that; :class:`FitState` shows the evaluation engine's model (its shards at
ZeRO-3) with the fit engine's optimizer fragments, bucket order and compressor state.
"""

from __future__ import annotations

from typing import Any

from lightning_par.zero.engine_api import Engine

__all__ = ["FitState"]


class FitState:
    """``current`` (the evaluation run's engine, or None) with the optimizer side of ``fit``."""

    def __init__(self, current: Engine | None, fit: Engine) -> None:
        self._current, self._fit = current, fit

    @property
    def sharded_state(self) -> Any:
        return self._fit.sharded_state

    def bucket_order(self) -> list[str]:
        return self._fit.bucket_order()

    def comm_state(self, *, average: bool = False) -> dict[str, Any] | None:
        return self._fit.comm_state(average=average)

    def __getattr__(self, name: str) -> Any:  # the model side: the current engine (the fit's below stage 3)
        return getattr(self._current if self._current is not None else self._fit, name)
