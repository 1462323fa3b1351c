"""A quiet CPU ``Trainer`` for a test's fits on Gloo ranks, and what the test reads back after ``fit``, the
same way for our strategy and for Lightning's own, so a test compares the two with one call."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import Tensor, nn

from lightning_par import HybridParallelStrategy
from lightning_par.state_guard import reads_of


def cpu_trainer(strategy: Any, *, devices: int = 2, **options: Any) -> pl.Trainer:
    """``pl.Trainer`` on ``devices`` CPU processes without logger, checkpoints, progress bar or model
    summary; ``options`` (``max_steps``, ``accumulate_grad_batches``, ...) pass through."""
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def rank_state(module: nn.Module) -> dict[str, Tensor]:
    """This rank's own entries of ``module.state_dict()``, copied: under tensor parallelism its slices,
    under a pipeline its stage's tensors (other stages' meta placeholders left out). A user's
    ``state_dict()`` of such a model is refused (it would not hold the model's weights); a test reads
    them deliberately, as the strategies' own reads do."""
    with reads_of(module)():
        entries = module.state_dict().items()
    return {k: v.detach().clone() for k, v in entries if not v.is_meta}


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


def fit_refused(trainer: pl.Trainer, module: pl.LightningModule, strategy: Any) -> str | None:
    """``trainer.fit(module)``: the message of the ``RuntimeError`` it raised (our strategy's process
    groups then destroyed, as :func:`final_state` does), or None when the fit finished."""
    try:
        trainer.fit(module)
    except RuntimeError as error:
        if isinstance(strategy, HybridParallelStrategy):
            strategy.destroy_process_groups()
        return str(error)
    return None


def fabric_setup_refused(fabric: Any, model: nn.Module, optimizer: Any) -> str | None:
    """``fabric.setup(model, optimizer)`` with our Fabric strategy: the message of the ``ValueError`` it
    raised, or None when the setup went through; the strategy's process groups destroyed either way."""
    try:
        fabric.setup(model, optimizer)
    except ValueError as error:
        return str(error)
    finally:
        fabric.strategy.destroy_process_groups()
    return None
