"""What a test reads back after a ``Trainer.fit`` on Gloo ranks, the same way for our strategy and for
Lightning's own, so a test compares the two with one call."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from lightning_par import HybridParallelStrategy


def final_state(module: nn.Module, strategy: Any) -> dict[str, Tensor]:
    """The whole model's state after ``fit``: under our strategy ``consolidated_state_dict()`` (called on
    every rank; the full state lands on rank 0), after which the strategy's process groups are destroyed
    so the next fit in the process starts afresh; under Lightning's strategies a copy of
    ``module.state_dict()``."""
    if isinstance(strategy, HybridParallelStrategy):
        state: dict[str, Tensor] = strategy.consolidated_state_dict()
        strategy.destroy_process_groups()
        return state
    return {k: v.detach().clone() for k, v in module.state_dict().items()}
