"""A compressor's state across a skipped step and across checkpoints: PowerSGD's error-feedback
residuals and shared ``Q`` (ours, :mod:`.powersgd`, or torch's ``PowerSGDState``) restarted after a step
the fp16 loss scaler skipped, restored from a checkpoint, or merged from the per-rank states of another
data-parallel size (the mean residual, so the gradient mass not yet applied is kept in total).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState as TorchPowerSGDState

from lightning_par.zero.powersgd import PowerSGDState


def compressor_step_skipped(state: object) -> None:
    """Restart a PowerSGD state (ours, or torch's ``PowerSGDState`` given with its ``powerSGD_hook``) after
    a step the fp16 loss scaler skipped (see :meth:`PowerSGDState.step_skipped`); other hooks keep no
    gradients between steps."""
    if isinstance(state, PowerSGDState):
        state.step_skipped()
        return
    if isinstance(state, TorchPowerSGDState):
        # torch's hook fills these again when missing: zero residuals, Q redrawn from its seeded generator
        state.error_dict.clear()
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
        state.iter = max(0, state.iter - 1)


def load_compressor_state(
    state: object, saved: Mapping[str, Any] | None, params: Mapping[str, nn.Parameter]
) -> None:
    """Give a checkpoint's compressor state (``saved``, None if it had none) to this run's hook state:
    restored into our :class:`PowerSGDState`; dropped with a warning when this run has none (its
    residuals are gradient mass not yet applied: the user should know they are lost)."""
    if saved is None:
        return
    if isinstance(state, PowerSGDState):
        state.load_state_dict(saved, params)
        return
    warnings.warn(
        "The checkpoint holds PowerSGD state (error-feedback residuals), but this run does not compress"
        " with comm_hook='powersgd': the residuals are dropped.",
        stacklevel=2,
    )


def merge_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One state from the per-rank states of another data-parallel size: the mean residual (see the
    module docstring) and the shared ``Q`` and iteration of the first."""
    if not states:
        raise ValueError("merge_states needs at least one state.")
    first = dict(states[0])
    first["error"] = {
        name: torch.stack([s["error"][name].float() for s in states]).mean(0).to(e.dtype)
        for name, e in states[0]["error"].items()
        if all(name in s["error"] for s in states)
    }
    return first


__all__ = ["compressor_step_skipped", "load_compressor_state", "merge_states"]
