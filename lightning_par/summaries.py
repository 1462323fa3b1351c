"""Lightning's model summary callbacks under tensor and pipeline parallelism.

``ModelSummary`` (on by default) and ``RichModelSummary`` describe the LightningModule at fit start:

* under a pipeline no rank can run the module's ``forward`` (each holds its own stage's layers;
  :mod:`lightning_par.pipeline.split_guard` refuses the call), yet the summary runs it on
  ``example_input_array`` to show input and output sizes, and a logger with ``log_graph=True`` traces it:
  a fit with an example input (which ``partition_method="profile"`` needs) failed at its start. The
  callbacks' ``on_fit_start`` now runs with the example input hidden (the user's own hooks still see it),
  and graph logging is skipped with a warning;
* under tensor parallelism each sharded parameter is this rank's slice, so the counts (per layer, total,
  trainable, the size in MB) were ``1/tp`` of the model's for those parameters (11.4 K of a 22.7 K Llama
  at tp2). The counts now take each sharded parameter at its full size, as Lightning's own DTensor-based
  strategies report it.

:func:`guard_summaries` sets instance attributes on the callbacks and loggers for one run; the strategy
removes them at teardown (:func:`lightning_par.lightning_hooks.restore`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_par.lightning_hooks import install
from lightning_par.tensor_parallel.layers import TP_DIM_ATTR

__all__ = ["guard_summaries"]

# marks the wrappers set here (not lightning_hooks' GUARDED, which the ZeRO-3 placeholder guard sets on a
# user's ModelSummary subclass first: checking that one left such a subclass without these fixes)
_SUMMARY = "_lightning_par_summary"


class _FullSizeSummary(Summary):
    """Lightning's summary with each tensor-parallel slice counted at its full size (``tp_size`` slices of
    equal size, as the checkpoints' full shapes are)."""

    def __init__(self, model: pl.LightningModule, *, max_depth: int, tp_size: int) -> None:
        self._tp_size = tp_size
        super().__init__(model, max_depth=max_depth)

    def _count(self, module: nn.Module, *, trainable: bool = False) -> int:
        return sum(
            p.numel() * (self._tp_size if hasattr(p, TP_DIM_ATTR) else 1)
            for p in module.parameters()
            if p.requires_grad or not trainable
        )

    @property
    def param_nums(self) -> list[int]:
        modules = dict(self._model.named_modules())
        return [self._count(modules[name]) for name in self._layer_summary]

    @property
    def total_parameters(self) -> int:
        return self._count(self._model)

    @property
    def trainable_parameters(self) -> int:
        return self._count(self._model, trainable=True)


@contextmanager
def _example_hidden(module: pl.LightningModule) -> Iterator[bool]:
    """``module.example_input_array`` set to None inside (put back after); False where it cannot be set (a
    read-only property of the user's), with a warning."""
    example = module.example_input_array
    if example is None:
        yield True
        return
    try:
        module.example_input_array = None
    except AttributeError:  # a property without a setter
        rank_zero_warn(
            "Pipeline parallelism: the model summary is skipped. It would run the LightningModule's forward"
            " on example_input_array, which no pipeline stage can (each holds its own stage's layers), and"
            " this module's example_input_array is a read-only property, which cannot be hidden from it."
            " Give the property a setter (or set self.example_input_array in __init__) to get the summary."
        )
        yield False
        return
    try:
        yield True
    finally:
        module.example_input_array = example


def guard_summaries(
    trainer: pl.Trainer, *, pipelined: bool, tp_size: int, fitting: bool
) -> list[tuple[Any, list[str]]]:
    """For this run: under a pipeline (``pipelined``) each ``ModelSummary`` callback's ``on_fit_start``
    runs with the example input hidden (the summary lists the layers without input and output shapes, as
    for a model without one) and a logger that would trace the model's graph (``log_graph=True``) skips
    it with a warning; under tensor parallelism (``tp_size > 1``) the summaries count each slice at its
    full size. The summary runs at fit start only (``fitting``); Lightning logs the graph at the start of
    every trainer function (``validate``, ``test``, ``predict`` too). The user's own hooks see the example
    input throughout. The (object, names) set, for :func:`~lightning_par.lightning_hooks.restore`."""
    patched: list[tuple[Any, list[str]]] = []
    for callback in trainer.callbacks if fitting else []:  # type: ignore[attr-defined]
        if not isinstance(callback, ModelSummary) or getattr(callback.on_fit_start, _SUMMARY, False):
            continue
        names = []
        if tp_size > 1:

            def summary(
                trainer: pl.Trainer, module: pl.LightningModule, _depth: int = callback._max_depth
            ) -> Summary:
                return _FullSizeSummary(module, max_depth=_depth, tp_size=tp_size)

            install(callback, "_summary", summary)
            names.append("_summary")
        if pipelined:

            def on_fit_start(
                trainer: pl.Trainer,
                module: pl.LightningModule,
                _inner: Callable[..., Any] = callback.on_fit_start,
            ) -> None:
                with _example_hidden(module) as hidden:
                    if hidden:
                        _inner(trainer, module)

            setattr(on_fit_start, _SUMMARY, True)
            install(callback, "on_fit_start", on_fit_start)
            names.append("on_fit_start")
        if names:
            patched.append((callback, names))
    for logger in trainer.loggers if pipelined else []:
        if not getattr(logger, "_log_graph", False) or getattr(logger.log_graph, _SUMMARY, False):
            continue

        def log_graph(model: Any, input_array: Any = None) -> None:
            rank_zero_warn(
                "Pipeline parallelism: the logger's log_graph is skipped: tracing the model's graph runs its"
                " forward, which no pipeline stage can (each holds its own stage's layers)."
            )

        setattr(log_graph, _SUMMARY, True)
        install(logger, "log_graph", log_graph)
        patched.append((logger, ["log_graph"]))
    return patched
