"""A pipeline step on a batch, Lightning-free: what both front doors run under pipeline parallelism.

:class:`PipelineSteps` takes a whole batch, splits it into the runtime's ``m`` micro-batches (along dim 0
of every tensor), feeds them through :class:`~lightning_par.pipeline.runtime.PipelineRuntime` and
returns the step's loss and metrics, identical on every pipeline rank. The caller supplies

* ``loss_fn(output, micro_batch)``: on the last stage, the loss of the last layer's output, as a tensor,
  as ``{"loss": loss, "metric": value, ...}``, or in the token-exact form ``{"loss_sum": S_i, "tokens":
  n_i, ...}`` (:mod:`lightning_par.pipeline.metrics`);
* ``input_fn(micro_batch)`` (optional): what enters the first layer (default :func:`default_input`).

Gradient arithmetic of :meth:`PipelineSteps.train`: micro-batch ``i`` back-propagates its loss times
``factor`` (the caller's constant, e.g. ``1/K`` for an accumulation window of ``K`` steps) and the fp16
loss scale, divided by ``m`` (a mean over the micro-batches; a ragged split weights each by its size).
In the token-exact form it back-propagates ``c S_i`` with ``c = factor / m``; the step's count ``Σ n_i``
reaches every pipeline rank with the metrics, and when the window's gradients have been reduced over
data parallelism (a mean over ``N`` ranks) every stage multiplies them by ``N / (c T)``, ``T`` the
window's valid tokens over its steps and the dp ranks (:class:`~lightning_par.loss.TokenNormalizer`):
the gradient of ``Σ S / T`` however unevenly tokens fall. Every backward runs without data-parallel
reduction; :meth:`PipelineSteps.end_window` sums tied gradients over their stages and then reduces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_par.loss import TokenNormalizer
from lightning_par.mesh import ParallelMesh
from lightning_par.pipeline.apply import PipelineSplit, TiedGradients
from lightning_par.pipeline.metrics import PipelineMetrics
from lightning_par.pipeline.micro_batches import eval_micro_count, micro_weights, split_batch
from lightning_par.pipeline.runtime import PipelineRuntime
from lightning_par.zero.engine_api import Engine

LossFn = Callable[[Any, Any], Any]  # (last layer's output, micro-batch) -> tensor or mapping
InputFn = Callable[[Any], Any]  # micro-batch -> what the first layer takes


@contextmanager
def stage_random_state(device: torch.device) -> Iterator[None]:
    """Within: the global random state seeded from one draw of it, restored at the exit, so the schedule
    moves the global generators by that one draw on every pipeline stage. The stages run other layers
    (dropout in some, none in others), and a schedule on the global state left each stage's generators
    elsewhere: the next batch's random augmentation in a Lightning hook, or a collate on the main
    process, then differed between the stages, whose first and last layers must see one batch, silently
    (the tp/pp batch check compares a loop's first batch only). Each step's dropout masks still differ
    (another seed per step). One read of a CPU draw per step (the seed's value), no device sync."""
    # the CPU generator on every device: a read of host memory, not a device sync
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64, device="cpu"))
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.random.default_generator.manual_seed(seed)
        if devices:
            with torch.cuda.device(device):  # this rank's device, the one fork_rng restores
                torch.cuda.manual_seed(seed)
        yield


def _trainable_loss(loss: Any, *, where: str) -> Tensor:
    """``loss`` as a 0-dim tensor, or a ``TypeError`` naming ``where`` and what it must return (before:
    torch's "'float' object has no attribute 'detach'", an ``expand`` error for a per-token loss,
    "element 0 of tensors does not require grad" for a detached one). Raised on the last stage; the other
    stages then stop on the lost connection (NCCL: its timeout), so this rank's error is the one to read."""
    if isinstance(loss, Tensor) and loss.numel() == 1 and loss.is_floating_point() and loss.requires_grad:
        return loss.reshape(())
    got = (
        f"a tensor of shape {tuple(loss.shape)}, dtype {loss.dtype}, requires_grad={loss.requires_grad}"
        if isinstance(loss, Tensor)
        else f"a {type(loss).__name__}"
    )
    raise TypeError(
        f"{where} must return the micro-batch's loss as a one-element floating-point tensor computed from"
        f" the output (a mean over its samples: reduction='mean', not detached), or a mapping holding it;"
        f" it returned {got}. (Raised on the last pipeline stage; the others stop on its lost connection.)"
    )


def default_input(micro: Any, *, owner: str, keys: Sequence[str] | None = None) -> Any:
    """What enters the first layer when ``owner`` (where the user would define the input function)
    gives none: for a mapping, ``micro["input_ids"]``, or with ``keys`` (the first layer's
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
        f" (batch[{first!r}] for a mapping, batch[0] for a list or tuple): define {owner}, returning what"
        " the first pipeline layer takes."
    )


def token_mean(metrics: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Pop the token-exact form's ``loss_sum`` and ``tokens`` from a step's ``metrics``; return the token
    mean ``loss_sum / tokens`` (``float32``; 0 when no token is valid) and the count."""
    tokens, loss_sum = metrics.pop("tokens"), metrics.pop("loss_sum")
    return (loss_sum / tokens.clamp(min=1)).float(), tokens


def layers_of(
    module: nn.Module, layers: Callable[[nn.Module], Sequence[nn.Module]] | None = None
) -> list[nn.Module]:
    """The ordered pipeline layers of ``module``: ``layers(module)`` when given (e.g.
    :func:`~lightning_par.pipeline.hf_pipeline_layers`), else its ``pipeline_layers()`` method."""
    name = type(module).__name__
    if layers is None:
        method = getattr(module, "pipeline_layers", None)
        if not callable(method):
            raise TypeError(
                f"Pipeline parallelism needs the model's ordered layers (the output of layer i feeds layer"
                f" i+1): define {name}.pipeline_layers() -> Sequence[nn.Module], or pass a function of the"
                " model that returns them (e.g. lightning_par.pipeline.hf_pipeline_layers)."
            )
        result = list(method())
    else:
        result = list(layers(module))
    if not result or not all(isinstance(layer, nn.Module) for layer in result):
        raise TypeError(f"The pipeline layers of {name} must be a non-empty list of modules.")
    return result


@dataclass
class StepResult:
    """A pipeline step's loss (float32, 0-dim, the same on every pipeline rank) and its metrics; in the
    token-exact form ``loss`` is the step's token mean and ``tokens`` its valid tokens."""

    loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)
    tokens: Tensor | None = None


class PipelineSteps:
    """Training, evaluation and prediction steps of one rank's pipeline (see the module docstring).

    Args:
        runtime: this rank's runtime over its chunks.
        tied: the parameters held by several stages, summed at a window's end.
        dp_group, dp_size: the data-parallel group (for the token count) and its size.
    """

    def __init__(
        self,
        runtime: PipelineRuntime,
        tied: TiedGradients,
        *,
        dp_group: ProcessGroup | None = None,
        dp_size: int = 1,
    ) -> None:
        self.runtime = runtime
        self.tied = tied
        self.dp_group, self.dp_size = dp_group, dp_size
        # the token-exact form's window count, on every pipeline rank; _token_steps counts the window's
        # steps that used the form, _token_c their constant c, _listening the engine told to rescale
        self.tokens = TokenNormalizer(group=dp_group, device=runtime.device)
        self._token_steps = 0
        self._token_c = 1.0
        self._listening: Engine | None = None
        self._token_rescaled = False  # a synchronisation rescaled this window's gradients already
        # what the first layer takes from a dict batch by default (its pipeline_input_keys, e.g. the ids,
        # padding mask and positions of hf_pipeline_layers' embedding); only pipeline rank 0 feeds it
        first = runtime.chunks[0] if runtime.s == 0 else None
        while isinstance(first, nn.Sequential) and len(first) > 0:
            first = first[0]
        self.input_keys: Sequence[str] | None = getattr(first, "pipeline_input_keys", None)
        last = dist.get_global_rank(runtime.group, runtime.last % runtime.p)
        self.metrics = PipelineMetrics(group=runtime.group, src=last, device=runtime.device)

    def inputs(self, micro: list[Any], input_fn: InputFn | None, *, owner: str) -> list[Any]:
        """What enters the first layer for each micro-batch (``owner`` names where ``input_fn`` would
        come from, for the error without one)."""
        if input_fn is not None:
            return [input_fn(mb) for mb in micro]
        return [default_input(mb, owner=owner, keys=self.input_keys) for mb in micro]

    def train(
        self,
        batch: Any,
        *,
        loss_fn: LossFn,
        input_fn: InputFn | None,
        engine: Engine,
        factor: float = 1.0,
        loss_scale: float = 1.0,
        names: tuple[str, str] = ("pipeline_loss", "pipeline_input(batch)"),
    ) -> StepResult:
        """Every micro-batch's forward and backward, without data-parallel reduction (the caller ends
        the window with :meth:`end_window`); ``names`` are the loss and input functions' names as the
        user knows them, for errors."""
        m = self.runtime.m
        micro = split_batch(batch, m)
        weights = micro_weights(micro)

        def wrapped(output: Any, i: int) -> Tensor:
            loss, summed = self.metrics.loss_of(loss_fn(output, micro[i]), weight=weights[i], where=names[0])
            loss = _trainable_loss(loss, where=names[0])
            # a token-loss sum needs no size weight: the sums of a ragged split add up exactly
            return loss * ((1.0 if summed else weights[i]) * factor * loss_scale)

        self.metrics.start(m)
        with stage_random_state(self.runtime.device):
            mean = self.runtime.train_step(
                inputs=self.inputs(micro, input_fn, owner=names[1]),
                loss_fn=wrapped,
                no_sync=engine.no_sync,
                sync_last=False,
                grad_of=engine.grad_view,  # zb's weight-gradient passes add into the engine's buffer
            )
        metrics = self.metrics.finish("train")
        if "tokens" not in metrics:  # undo the scaling of the returned number: it is for logging
            return StepResult(loss=mean / (factor * loss_scale), metrics=metrics)
        loss, tokens = token_mean(metrics)
        self.tokens.add(tokens.round())
        self._token_steps += 1
        self._token_c = factor / m
        if self._listening is not engine:
            engine.on_synchronized(lambda: self._rescale(engine))
            self._listening = engine
        return StepResult(loss=loss, metrics=metrics, tokens=tokens)

    def _rescale(self, engine: Engine) -> None:
        if self._token_steps == 0 or self._listening is not engine:  # a window without the token form
            return
        if self._token_rescaled:
            # the buffer holds the earlier synchronisation's rescaled gradients beside this one's: a
            # second factor would scale them again (before: silently, 7.5e-2 off one process in a probe)
            raise RuntimeError(
                "The token-exact pipeline loss ({'loss_sum': ..., 'tokens': ...}): a second gradient"
                " synchronisation before the optimizer step. Run every step of an accumulation window but"
                " the last inside `with fabric.no_backward_sync(model):` (Lightning's Trainer does so for"
                " accumulate_grad_batches); the window's token count then normalises its gradients once."
            )
        self._token_rescaled = True
        self._token_steps = 0
        engine.scale_grads(self.tokens.grad_scale(loss_scale=self._token_c, dp_size=self.dp_size))

    def window_ended(self) -> None:
        """At the optimizer step: the next synchronisation starts another window."""
        self._token_rescaled = False

    def end_window(self, engine: Engine) -> None:
        """At the last step of an accumulation window: sum tied gradients over their stages, then reduce
        over dp (a step inside the engine's ``no_sync()`` does neither)."""
        if engine.sync_enabled:
            self.tied.exchange(grad_of=engine.grad_view)
            engine.flush()

    def evaluate(
        self,
        batch: Any,
        *,
        loss_fn: LossFn,
        metrics_fn: Callable[[Any, Any], Mapping[str, Any]] | None,
        input_fn: InputFn | None,
        kind: str,
        names: tuple[str, str, str] = ("pipeline_loss", "pipeline_eval", "pipeline_input(batch)"),
    ) -> StepResult:
        """Forward only: the batch's loss and metrics (``loss_fn``'s and ``metrics_fn(output, micro)``'s)
        on every pipeline rank; ``kind`` names the step (``"val"``, ``"test"``) for the metric names'
        agreement. A batch smaller than ``num_microbatches`` runs in fewer (:func:`eval_micro_count`)."""
        m = eval_micro_count(batch, self.runtime.m)
        micro = split_batch(batch, m)
        weights = micro_weights(micro)

        def wrapped(output: Any, i: int) -> Tensor:
            loss, summed = self.metrics.loss_of(loss_fn(output, micro[i]), weight=weights[i], where=names[0])
            if metrics_fn is not None:
                self.metrics.add(metrics_fn(output, micro[i]), weight=weights[i], where=names[1])
            return loss if summed else loss * weights[i]

        self.metrics.start(m)
        inputs = self.inputs(micro, input_fn, owner=names[2])
        loss = self.runtime.forward_step(inputs=inputs, loss_fn=wrapped, m=m)
        metrics = self.metrics.finish(kind)
        if "tokens" not in metrics:
            return StepResult(loss=loss, metrics=metrics)
        loss, tokens = token_mean(metrics)  # the batch's token mean
        return StepResult(loss=loss, metrics=metrics, tokens=tokens)

    def dp_token_mean(self, result: StepResult) -> Tensor:
        """The token mean of a token-exact step's batches over the data-parallel group, ``Σ S / Σ n`` (one
        all-reduce of two float64 values; collective over dp), the same on every rank; the step's own
        loss without the token form or data parallelism."""
        if result.tokens is None or self.dp_size == 1:
            return result.loss
        pair = torch.stack([result.loss.double() * result.tokens, result.tokens.double()])
        dist.all_reduce(pair, group=self.dp_group)
        return (pair[0] / pair[1].clamp(min=1)).float()

    def predict(
        self,
        batch: Any,
        *,
        input_fn: InputFn | None,
        owner: str = "pipeline_input(batch)",
        predict_fn: Callable[[Any, Any], Any] | None = None,
    ) -> Tensor:
        """The last stage's outputs for ``batch`` (micro-batch outputs concatenated), on every rank;
        ``predict_fn(output, micro_batch)`` turns each micro-batch's output into what is returned, on the
        last stage (the LightningModule's ``pipeline_predict``)."""
        m = eval_micro_count(batch, self.runtime.m)
        micro = split_batch(batch, m)
        transform = (lambda out, i: predict_fn(out, micro[i])) if predict_fn is not None else None
        return self.runtime.predict_step(
            inputs=self.inputs(micro, input_fn, owner=owner), transform=transform, m=m
        )


def pipeline_parts(
    module: nn.Module,
    split: PipelineSplit,
    *,
    mesh: ParallelMesh,
    schedule: str,
    num_microbatches: int,
    device: torch.device,
    slack: int = 0,
) -> tuple[PipelineRuntime, TiedGradients]:
    """This rank's runtime over its chunks of ``split``, communicating on ``device`` (the root device: the
    chunks may still be on the meta device here), and the tied parameters of ``module`` summed over their
    holders (collective over the world: every rank creates every tied group)."""
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
    return runtime, tied
