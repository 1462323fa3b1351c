"""The pipeline inside Lightning's loop: one ``training_step`` runs the whole schedule for a batch.

The LightningModule tells the strategy its network through three methods (the pipeline protocol):

* ``pipeline_layers(self) -> Sequence[nn.Module]``: ordered; the output of layer ``i`` feeds ``i + 1``
  (between stages one tensor or a flat tuple of tensors, :mod:`lightning_par.pipeline.mail`);
* ``pipeline_input(self, batch)``: what enters layer 0 (default: ``batch["input_ids"]`` for a mapping,
  as Hugging Face's collators make, or a dict of the entries the first layer lists in its
  ``pipeline_input_keys``, e.g. ``input_ids``, ``attention_mask`` and ``position_ids`` for
  ``hf_pipeline_layers``; else ``batch[0]``);
* ``pipeline_loss(self, output, batch) -> Tensor``: the loss of the last layer's output, or a mapping
  ``{"loss": loss, "acc": ..., ...}`` whose other entries are metrics, logged as ``train_acc`` (training),
  ``val_acc`` / ``test_acc`` (evaluation);
* ``pipeline_eval(self, output, batch) -> Mapping[str, Tensor]`` (optional): more metrics for validation
  and test, logged as ``val_<name>`` / ``test_<name>`` (see :mod:`lightning_par.pipeline.metrics`);
* ``pipeline_predict(self, output, batch) -> Tensor`` (optional): what ``predict`` returns for a
  micro-batch (e.g. ``output.argmax(-1)``), computed on the last stage (only its result is broadcast);
  default: the last layer's output. The module's own ``predict_step`` is not run (warned when it is
  overridden and ``pipeline_predict`` is not).

``pipeline_eval`` and ``pipeline_predict`` may take a ``dataloader_idx`` keyword too: with several
evaluation or prediction dataloaders it says which one the batch came from (as the third argument of
Lightning's ``validation_step`` / ``predict_step``; 0 with one dataloader).

Token-exact loss (the pipeline's form of ``HybridParallelStrategy.token_normalized``): ``pipeline_loss``
returns ``{"loss_sum": S_i, "tokens": n_i, ...}``, the summed token losses of micro-batch ``i`` and its
valid tokens; every stage's gradients become the gradient of ``Σ S / T``, ``T`` the window's valid tokens
over its steps and the data-parallel ranks, however unevenly the tokens fall
(:mod:`lightning_par.pipeline.steps`, with ``factor = 1/K``, ``K = accumulate_grad_batches``). The logged
loss is the step's ``Σ S / Σ n``. Without this form the step's loss is the mean of the micro-batch means,
which weights the tokens of sparse micro-batches more.

:class:`LightningPipeline` runs each batch through the Lightning-free
:class:`~lightning_par.pipeline.steps.PipelineSteps` (split into ``m`` micro-batches) and returns the mean
loss, identical on every pipeline rank, after all forwards and backwards: Lightning's own ``backward`` is then
a no-op (the strategy skips it). Each micro-batch loss is divided by ``accumulate_grad_batches`` (what
Lightning does to a step's loss) and, with fp16, multiplied by the loss scale. Validation and test run
the pipeline forward only and log ``val_loss`` / ``test_loss`` (in the token-exact form the token mean
over the data-parallel ranks' batches) and the metrics; the LightningModule's own
``training_step`` / ``validation_step`` are not called (a step's outputs exist only on the last stage:
the protocol's methods are what runs there). Metrics are means over the micro-batches, broadcast from
the last stage so every rank logs the same values. A batch that does not divide by ``m`` (a ragged last
batch) is cut into micro-batches one sample apart, and each micro-batch's loss and metrics are weighted
by its size, so the step still sees the batch mean; a batch smaller than ``m`` is refused with the fix.
Prediction returns the last layer's outputs (or ``pipeline_predict``'s) for the whole batch on every
pipeline rank.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from lightning_par.pipeline.apply import TiedGradients
from lightning_par.pipeline.micro_batches import micro_weights, split_batch
from lightning_par.pipeline.runtime import PipelineRuntime
from lightning_par.pipeline.steps import PipelineSteps, StepResult, default_input, layers_of, token_mean
from lightning_par.zero.engine_api import Engine

__all__ = [
    "LightningPipeline",
    "default_input",
    "micro_weights",
    "pipeline_layers_of",
    "split_batch",
    "token_mean",
]


def _takes_dataloader_idx(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` accepts a ``dataloader_idx`` keyword (named, or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: called as (output, batch)
        return False
    return any(
        p.kind is p.VAR_KEYWORD or (p.name == "dataloader_idx" and p.kind is not p.POSITIONAL_ONLY)
        for p in params
    )


def _for_loader(fn: Any, dataloader_idx: int, *, takes: bool) -> Any:
    """``fn`` with ``dataloader_idx`` bound when it ``takes`` one (:func:`_takes_dataloader_idx`, asked
    once per module rather than per step)."""
    return functools.partial(fn, dataloader_idx=dataloader_idx) if takes else fn


def pipeline_layers_of(module: pl.LightningModule) -> Sequence[nn.Module]:
    """The LightningModule's ``pipeline_layers()``."""
    return layers_of(module)


class LightningPipeline(PipelineSteps):
    """Runs training/evaluation steps of ``module`` through ``runtime``; ``tied`` keeps the copies of
    parameters shared by several stages equal."""

    def __init__(
        self,
        module: pl.LightningModule,
        runtime: PipelineRuntime,
        tied: TiedGradients,
        *,
        dp_group: ProcessGroup | None = None,
        dp_size: int = 1,
    ) -> None:
        super().__init__(runtime, tied, dp_group=dp_group, dp_size=dp_size)
        self.module = module
        # set by the strategy per evaluation loop: the dp ranks run different numbers of batches
        self.uneven_eval = False
        if not module.automatic_optimization:
            raise ValueError(
                "Manual optimization with pipeline_parallel_size > 1 is not supported: the pipeline runs"
                " every micro-batch's forward and backward inside one training_step. Use automatic"
                " optimization, or pipeline_parallel_size=1."
            )
        if not callable(getattr(module, "pipeline_loss", None)):
            raise TypeError(
                f"Pipeline parallelism needs {type(module).__name__}.pipeline_loss(output, batch)."
            )
        extra = getattr(module, "pipeline_eval", None)
        if extra is not None and not callable(extra):
            raise TypeError(
                f"{type(module).__name__}.pipeline_eval must be a method (output, batch) -> dict."
            )
        self._eval_metrics = extra
        self._eval_takes_idx = extra is not None and _takes_dataloader_idx(extra)
        predict = getattr(module, "pipeline_predict", None)
        if predict is not None and not callable(predict):
            raise TypeError(
                f"{type(module).__name__}.pipeline_predict must be a method (output, batch) -> Tensor."
            )
        self._predict_fn = predict
        self._predict_takes_idx = predict is not None and _takes_dataloader_idx(predict)
        to_input = getattr(module, "pipeline_input", None)
        self._input_fn = to_input if callable(to_input) else None
        self._owner = f"{type(module).__name__}.pipeline_input(batch)"

    def training_step(
        self,
        batch: Any,
        batch_idx: int,
        *,
        engine: Engine,
        optimizers: Sequence[Optimizer],
        loss_scale: float = 1.0,
    ) -> Tensor:
        """All micro-batches forward and backward (every backward without data-parallel reduction);
        returns the mean loss. The caller ends the accumulation window afterwards with
        :meth:`end_window`: the strategy does it in ``backward``, which Lightning calls after it has
        zeroed the optimizers' gradients of a new window (the engine's buffer keeps them)."""
        accumulate = self.module.trainer.accumulate_grad_batches
        if batch_idx % accumulate == 0:
            # a new window: the engine's buffer must not hold the previous window's gradients
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            self.module.zero_grad(set_to_none=True)
        result = self.train(
            batch,
            loss_fn=self.module.pipeline_loss,  # type: ignore[arg-type]
            input_fn=self._input_fn,
            engine=engine,
            factor=1.0 / accumulate,
            loss_scale=loss_scale,
            names=("pipeline_loss", self._owner),
        )
        self.module.log("train_loss", result.loss, prog_bar=True)
        for name, metric in result.metrics.items():
            self.module.log(f"train_{name}", metric)
        return result.loss.detach()

    def predict_step(self, batch: Any, *, dataloader_idx: int = 0) -> Tensor:
        """The last stage's outputs for ``batch`` (micro-batch outputs concatenated, each through the
        module's ``pipeline_predict`` when it has one), on every rank."""
        return self.predict(
            batch,
            input_fn=self._input_fn,
            owner=self._owner,
            predict_fn=_for_loader(self._predict_fn, dataloader_idx, takes=self._predict_takes_idx),
        )

    def eval_step(self, batch: Any, *, stage: str, dataloader_idx: int = 0) -> Tensor:
        result: StepResult = self.evaluate(
            batch,
            loss_fn=self.module.pipeline_loss,  # type: ignore[arg-type]
            metrics_fn=_for_loader(self._eval_metrics, dataloader_idx, takes=self._eval_takes_idx),
            input_fn=self._input_fn,
            kind=stage,
            names=("pipeline_loss", "pipeline_eval", self._owner),
        )
        # the token-exact form: the token mean over the dp ranks' batches (their own means would weigh a
        # rank's tokens by how few it had); the same on every rank, so sync_dist leaves it as it is. When
        # the ranks run different numbers of batches no per-step all-reduce can match: this rank's own
        # token mean, which sync_dist averages over the ranks (lightning_par.eval_join)
        loss = result.loss if self.uneven_eval else self.dp_token_mean(result)
        self.module.log(f"{stage}_loss", loss, sync_dist=True, prog_bar=stage == "val")
        for name, metric in result.metrics.items():
            self.module.log(f"{stage}_{name}", metric, sync_dist=True)
        return loss
