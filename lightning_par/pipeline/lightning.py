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
  and test, logged as ``val_<name>`` / ``test_<name>`` (see :mod:`lightning_par.pipeline.metrics`).

Token-exact loss (the pipeline's form of ``HybridParallelStrategy.token_normalized``): ``pipeline_loss``
returns ``{"loss_sum": S_i, "tokens": n_i, ...}``, the summed token losses of micro-batch ``i`` and its
valid tokens. Each micro-batch then back-propagates ``S_i`` (scaled by the constant ``c = 1/(m K)``,
``K = accumulate_grad_batches``), the step's count ``Σ n_i`` reaches every pipeline rank with the
metrics, and when the window's gradients have been reduced over data parallelism (an average over its
``N`` ranks), every stage multiplies them by ``N / (c T)`` with ``T`` the window's valid tokens summed over
its steps and the data-parallel ranks (:class:`~lightning_par.loss.TokenNormalizer`): the gradient of
``Σ S / T``, however unevenly the tokens fall on micro-batches, steps and ranks. The logged loss is the
step's ``Σ S / Σ n``. Without this form the step's loss is the mean of the micro-batch means, which
weights the tokens of sparse micro-batches more.

:class:`LightningPipeline` splits each batch into ``m`` micro-batches (along dim 0 of every tensor),
feeds them through :class:`~lightning_par.pipeline.runtime.PipelineRuntime` and returns the mean loss,
identical on every pipeline rank, after all forwards and backwards: Lightning's own ``backward`` is then
a no-op (the strategy skips it). Each micro-batch loss is divided by ``accumulate_grad_batches`` (what
Lightning does to a step's loss) and, with fp16, multiplied by the loss scale. Validation and test run
the pipeline forward only and log ``val_loss`` / ``test_loss`` and the metrics; the LightningModule's own
``training_step`` / ``validation_step`` are not called (a step's outputs exist only on the last stage:
the protocol's methods are what runs there). Metrics are means over the micro-batches, broadcast from
the last stage so every rank logs the same values. A batch that does not divide by ``m`` (a ragged last
batch) is cut into micro-batches one sample apart, and each micro-batch's loss and metrics are weighted
by its size, so the step still sees the batch mean; a batch smaller than ``m`` is refused with the fix.
Prediction returns the last layer's outputs for the whole batch on every pipeline rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from lightning_par.loss import TokenNormalizer
from lightning_par.mesh import ParallelMesh
from lightning_par.pipeline.apply import PipelineSplit, TiedGradients
from lightning_par.pipeline.metrics import PipelineMetrics
from lightning_par.pipeline.runtime import PipelineRuntime
from lightning_par.zero.engine import Engine


def split_batch(batch: Any, m: int) -> list[Any]:
    """``m`` micro-batches of ``batch``: every tensor split along dim 0, in equal parts when the size
    divides by ``m``, else in parts one sample apart (a ragged last batch; see :func:`micro_weights`)."""
    if isinstance(batch, Tensor):
        if batch.shape[0] < m:
            raise ValueError(
                f"A batch of {batch.shape[0]} samples cannot fill num_microbatches={m}: use a batch size of"
                f" at least {m} (with drop_last=True if the dataset leaves a smaller last batch), or fewer"
                " micro-batches."
            )
        return list(batch.tensor_split(m))
    if isinstance(batch, (list, tuple)):
        parts = [split_batch(b, m) for b in batch]
        return [type(batch)(p[i] for p in parts) for i in range(m)]
    if isinstance(batch, dict):
        parts_d = {k: split_batch(v, m) for k, v in batch.items()}
        return [{k: v[i] for k, v in parts_d.items()} for i in range(m)]
    return [batch] * m


def _samples(micro: Any) -> int | None:
    """The leading size of the first tensor in a micro-batch (None without tensors)."""
    if isinstance(micro, Tensor):
        return int(micro.shape[0])
    values = micro.values() if isinstance(micro, dict) else micro if isinstance(micro, (list, tuple)) else []
    return next((n for n in map(_samples, values) if n is not None), None)


def micro_weights(micro: list[Any]) -> list[float]:
    """``m n_i / N`` per micro-batch of ``n_i`` of ``N`` samples: the factor that makes the mean of the
    micro-batch means (what the schedule computes) the mean over the batch's samples; all 1.0 when the
    micro-batches are equal (any ragged split is then weighted exactly)."""
    sizes = [_samples(mb) for mb in micro]
    if any(n is None for n in sizes) or len(set(sizes)) == 1:
        return [1.0] * len(micro)
    total = sum(n for n in sizes if n is not None)
    return [len(micro) * n / total for n in sizes if n is not None]


def default_input(micro: Any, *, owner: str, keys: Sequence[str] | None = None) -> Any:
    """What enters the first layer when ``owner`` (the LightningModule's class name) defines no
    ``pipeline_input``: for a mapping, ``micro["input_ids"]``, or with ``keys`` (the first layer's
    ``pipeline_input_keys``) a dict of the entries of ``keys`` the mapping has, the first required;
    ``micro[0]`` for a list or tuple."""
    first = keys[0] if keys else "input_ids"
    if isinstance(micro, Mapping):
        if first in micro:
            return {k: micro[k] for k in keys if k in micro} if keys else micro[first]
    elif isinstance(micro, (list, tuple)) and micro:
        return micro[0]
    keys_of = f" with keys {sorted(micro)}" if isinstance(micro, Mapping) else ""
    raise TypeError(
        f"Pipeline parallelism: a batch of type {type(micro).__name__}{keys_of} has no default input"
        f" (batch[{first!r}] for a mapping, batch[0] for a list or tuple): define {owner}.pipeline_input("
        "batch), returning what the first pipeline layer takes."
    )


def token_mean(metrics: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Pop the token-exact form's ``loss_sum`` and ``tokens`` from a step's ``metrics``; return the token
    mean ``loss_sum / tokens`` (``float32``; 0 when no token is valid) and the count."""
    tokens, loss_sum = metrics.pop("tokens"), metrics.pop("loss_sum")
    return (loss_sum / tokens.clamp(min=1)).float(), tokens


def pipeline_layers_of(module: pl.LightningModule) -> Sequence[nn.Module]:
    layers = getattr(module, "pipeline_layers", None)
    if not callable(layers):
        raise TypeError(
            f"Pipeline parallelism needs {type(module).__name__}.pipeline_layers() -> Sequence[nn.Module]"
            " (the ordered layers; output of layer i feeds layer i+1) and pipeline_loss(output, batch); the"
            " model does not expose its layers."
        )
    result = list(layers())
    if not result or not all(isinstance(layer, nn.Module) for layer in result):
        raise TypeError(f"{type(module).__name__}.pipeline_layers() must return a non-empty list of modules.")
    return result


class LightningPipeline:
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
        self.module = module
        self.runtime = runtime
        self.tied = tied
        self.dp_size = dp_size
        # the token-exact loss form's window count (module docstring), created on every pipeline rank;
        # _token_steps counts the window's steps that used the form, _listening the engine told to rescale
        self.tokens = TokenNormalizer(group=dp_group, device=runtime.device)
        self._token_steps = 0
        self._listening: Engine | None = None
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
        # what the first layer takes from a dict batch by default (its pipeline_input_keys, e.g. the
        # ids, padding mask and positions of hf_pipeline_layers' embedding); only pipeline rank 0 feeds it
        first = runtime.chunks[0] if runtime.s == 0 else None
        while isinstance(first, nn.Sequential) and len(first) > 0:
            first = first[0]
        self._input_keys: Sequence[str] | None = getattr(first, "pipeline_input_keys", None)
        last = dist.get_global_rank(runtime.group, runtime.last % runtime.p)
        self.metrics = PipelineMetrics(group=runtime.group, src=last, device=runtime.device)

    def _inputs(self, micro: list[Any]) -> list[Any]:
        to_input = getattr(self.module, "pipeline_input", None)
        if callable(to_input):
            return [to_input(mb) for mb in micro]
        owner = type(self.module).__name__
        return [default_input(mb, owner=owner, keys=self._input_keys) for mb in micro]

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
        if batch_idx % self.module.trainer.accumulate_grad_batches == 0:
            # a new window: the engine's buffer must not hold the previous window's gradients
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            self.module.zero_grad(set_to_none=True)
        no_sync = engine.no_sync
        m = self.runtime.m
        micro = split_batch(batch, m)
        weights = micro_weights(micro)
        accumulate = self.module.trainer.accumulate_grad_batches

        def loss_fn(output: Any, i: int) -> Tensor:
            result = self.module.pipeline_loss(output, micro[i])  # type: ignore[operator]
            loss, summed = self.metrics.loss_of(result, weight=weights[i], where="pipeline_loss")
            # a token-loss sum needs no size weight: the sums of a ragged split add up exactly
            return loss * ((1.0 if summed else weights[i]) / accumulate * loss_scale)

        self.metrics.start(m)
        mean = self.runtime.train_step(
            inputs=self._inputs(micro),
            loss_fn=loss_fn,
            no_sync=no_sync,
            sync_last=False,
            grad_of=engine.grad_view,  # zb's weight-gradient passes add into the engine's buffer
        )
        # undo the scaling of the returned number: it is the mean loss, for logging
        value = mean * accumulate / loss_scale
        metrics = self.metrics.finish("train")
        if "tokens" in metrics:
            value = self._count_tokens(metrics, engine)
        self.module.log("train_loss", value, prog_bar=True)
        for name, metric in metrics.items():
            self.module.log(f"train_{name}", metric)
        return value.detach()

    def _count_tokens(self, metrics: dict[str, Tensor], engine: Engine) -> Tensor:
        """Add the step's valid tokens to the window's count, have ``engine`` rescale the window's
        gradients (module docstring), and return the step's token-mean loss; pops the two sums."""
        mean, tokens = token_mean(metrics)
        self.tokens.add(tokens.round())
        self._token_steps += 1
        if self._listening is not engine:
            engine.on_synchronized(lambda: self._rescale(engine))
            self._listening = engine
        return mean

    def _rescale(self, engine: Engine) -> None:
        if self._token_steps == 0 or self._listening is not engine:  # a window without the token form
            return
        self._token_steps = 0
        scale = 1.0 / (self.runtime.m * self.module.trainer.accumulate_grad_batches)
        engine.scale_grads(self.tokens.grad_scale(loss_scale=scale, dp_size=self.dp_size))

    def end_window(self, engine: Engine) -> None:
        """At the last step of an accumulation window: sum tied gradients over their stages, then reduce
        over dp (``block_backward_sync`` disables both on the other steps)."""
        if engine.sync_enabled:
            self.tied.exchange(grad_of=engine.grad_view)
            engine.flush()

    def predict_step(self, batch: Any) -> Tensor:
        """The last stage's outputs for ``batch`` (micro-batch outputs concatenated), on every rank."""
        micro = split_batch(batch, self.runtime.m)
        return self.runtime.predict_step(inputs=self._inputs(micro))

    def eval_step(self, batch: Any, *, stage: str) -> Tensor:
        micro = split_batch(batch, self.runtime.m)
        weights = micro_weights(micro)

        def loss_fn(output: Any, i: int) -> Tensor:
            result = self.module.pipeline_loss(output, micro[i])  # type: ignore[operator]
            loss, summed = self.metrics.loss_of(result, weight=weights[i], where="pipeline_loss")
            if self._eval_metrics is not None:
                self.metrics.add(
                    self._eval_metrics(output, micro[i]), weight=weights[i], where="pipeline_eval"
                )
            return loss if summed else loss * weights[i]

        self.metrics.start(self.runtime.m)
        loss = self.runtime.forward_step(inputs=self._inputs(micro), loss_fn=loss_fn)
        metrics = self.metrics.finish(stage)
        if "tokens" in metrics:  # the batch's token mean
            loss, _ = token_mean(metrics)
        self.module.log(f"{stage}_loss", loss, sync_dist=True, prog_bar=stage == "val")
        for name, metric in metrics.items():
            self.module.log(f"{stage}_{name}", metric, sync_dist=True)
        return loss


def build_pipeline(
    module: pl.LightningModule,
    split: PipelineSplit,
    *,
    mesh: ParallelMesh,
    schedule: str,
    num_microbatches: int,
    device: torch.device,
    slack: int = 0,
) -> LightningPipeline:
    """This rank's pipeline over its chunks of ``split``, communicating on ``device`` (the strategy's root
    device: the chunks may still be on the meta device here); tied parameters summed over their holders
    (collective over the world: every rank creates every tied group)."""
    runtime = PipelineRuntime(
        chunks=split.chunks,
        group=mesh.pp_group,
        schedule=schedule,
        num_microbatches=num_microbatches,
        device=device,
        slack=slack,
    )
    tied = TiedGradients(
        module, local=split.local, pp_group=mesh.pp_group, pp_groups=mesh.layout.groups("pp")
    )
    return LightningPipeline(module, runtime, tied, dp_group=mesh.dp_group, dp_size=mesh.dp_size)
