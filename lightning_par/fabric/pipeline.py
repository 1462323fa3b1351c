"""Pipeline parallelism in a Fabric loop: ``fabric.strategy.pipeline``.

A pipeline schedule owns the forward and backward of every micro-batch, so under
``pipeline_parallel_size > 1`` the loop hands the whole batch to one call, as with torchtitan's
``schedule.step`` or DeepSpeed's ``train_batch``::

    strategy = HybridParallelStrategy(pipeline_parallel_size=2, num_microbatches=4,
                                      pipeline_layers=hf_pipeline_layers)
    fabric = Fabric(strategy=strategy, devices=4); fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    for batch in loader:
        with fabric.no_backward_sync(model, enabled=accumulating):   # as in any Fabric loop
            loss = strategy.pipeline.step(batch, loss_fn=loss_fn, scale=1 / K)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step(); optimizer.zero_grad()

* :meth:`FabricPipeline.step` splits ``batch`` into ``num_microbatches`` (dim 0 of every tensor), runs the
  schedule's forwards and backwards (the fp16 loss scale and bf16 autocast applied as ``fabric.backward``
  and Fabric's module wrapper would), and, outside ``no_backward_sync``, sums tied gradients over their
  stages and reduces over data parallelism. ``loss_fn(output, micro_batch)`` runs on the last stage; it
  returns the loss, ``{"loss": loss, "metric": value, ...}``, or the token-exact form ``{"loss_sum": S,
  "tokens": n, ...}`` (:mod:`lightning_par.pipeline.steps`). Each micro-batch back-propagates its loss
  times ``scale``, over ``m`` (the mean over the batch); the returned loss is unscaled and the same on
  every pipeline rank: a tensor, or ``{"loss": ..., metrics...}`` when ``loss_fn`` reports metrics
  (with ``"tokens"``, the step's valid tokens, in the token-exact form, where ``scale`` cancels out if
  it is the same in every step of a window).
* :meth:`FabricPipeline.evaluate`: forward only, loss and ``metrics_fn(output, micro_batch)``'s metrics.
* :meth:`FabricPipeline.predict`: the last layer's outputs for the whole batch, on every pipeline rank.

What enters the first layer is ``input_fn(micro_batch)``, or by default ``batch["input_ids"]`` (a dict of
the keys the first layer lists in ``pipeline_input_keys``, e.g. ``hf_pipeline_layers``' ids, padding
mask and positions) for a mapping and ``batch[0]`` for a list or tuple.

Calling the module itself (``model(x)``) or ``fabric.backward`` under pp > 1 is refused with this rule:
other stages' layers are meta placeholders here, and the step has run every backward already.

Optimizers: one made before ``fabric.setup(model, optimizer)`` follows the cut by itself (its parameters
of other stages become their placeholders, which it never updates). Fabric refuses meta parameters in an
optimizer made after ``fabric.setup_module`` (the way under ``fabric.init_module(empty_init=True)``), so
there it takes this stage's parameters: ``AdamW(p for p in model.parameters() if not p.is_meta)``;
``fabric.setup_optimizers`` then completes its groups with the other stages' placeholders (by the same
rule on every stage, else refused), so checkpoints number its state as for the whole model.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_par.pipeline.apply import PipelineSplit
from lightning_par.pipeline.runtime import StepStats
from lightning_par.pipeline.steps import InputFn, LossFn, PipelineSteps, StepResult, layers_of, pipeline_parts
from lightning_par.zero.units import check_pipeline_units

if TYPE_CHECKING:
    from lightning_par.fabric.strategy import HybridParallelStrategy

_RULE = (
    "under pipeline_parallel_size > 1 a step is one call, loss = fabric.strategy.pipeline.step(batch,"
    " loss_fn=...), which runs every micro-batch's forward and backward on the stages that hold its"
    " layers (then clip and optimizer.step() as usual); evaluate with pipeline.evaluate(batch, loss_fn=...)"
    " and predict with pipeline.predict(batch)"
)


def build_fabric_pipeline(
    strategy: HybridParallelStrategy, module: nn.Module, split: PipelineSplit
) -> FabricPipeline:
    """The pipeline over this rank's chunks of ``split`` (after :func:`lightning_par.compose.compose`
    cut ``module``, before the engine is built); a ZeRO-3 unit policy that crosses a stage is refused
    first, on every rank alike."""
    pp, mesh = strategy.pipeline_parallel_size, strategy.mesh
    if strategy.zero_stage == 3:
        layers = layers_of(module, strategy.pipeline_layers)
        check_pipeline_units(module, strategy.zero3_units, layers=layers, pieces=split.pieces, pp_size=pp)
    assert strategy.num_microbatches is not None
    runtime, tied = pipeline_parts(
        module,
        split,
        mesh=mesh,
        schedule=strategy.pipeline_schedule,
        num_microbatches=strategy.num_microbatches,
        device=strategy.root_device,
        slack=strategy.pipeline_slack,
    )
    steps = PipelineSteps(runtime, tied, dp_group=mesh.dp_group, dp_size=mesh.dp_size)
    strategy.before_optimizer_step.append(steps.window_ended)  # removed at destroy_process_groups
    return FabricPipeline(strategy, steps)


def refuse_direct_call(module: nn.Module) -> RemovableHandle:
    """A forward pre-hook on the set-up module that refuses ``model(...)`` with the pipeline's rule
    (removed at the strategy's teardown)."""

    def refuse(_module: nn.Module, _args: Any) -> None:
        raise RuntimeError(f"The model cannot be called directly: {_RULE}.")

    # first: the split model's own refusal (pipeline/split_guard.py) names less of Fabric's calls
    return module.register_forward_pre_hook(refuse, prepend=True)


def refuse_backward() -> None:
    raise RuntimeError(f"fabric.backward is not used with pipeline parallelism: {_RULE}.")


class FabricPipeline:
    """The steps of lightning_par's Fabric strategy under pipeline parallelism (module docstring)."""

    def __init__(self, strategy: HybridParallelStrategy, steps: PipelineSteps) -> None:
        self._strategy = strategy
        self._steps = steps

    @property
    def num_microbatches(self) -> int:
        return self._steps.runtime.m

    @property
    def stats(self) -> StepStats | None:
        """Busy and total seconds of this rank's last training step (bubble = 1 - busy / total)."""
        return self._steps.runtime.last_stats

    @property
    def steps(self) -> PipelineSteps:
        """The Lightning-free pipeline steps underneath (runtime, tied parameters, metrics)."""
        return self._steps

    def _agree(self, loop: str, batch: Any) -> None:
        """The first batch of each kind of call is the same on every rank of the tp / pp groups."""
        if self._strategy.batches is not None:
            self._strategy.batches.check(loop, batch)

    @contextmanager
    def _context(self) -> Generator[None, None, None]:
        """Autocast as Fabric's module wrapper applies it, and at ZeRO-3 the root unit (embeddings, final
        norm, head: what no pipeline layer gathers) gathered around the step."""
        engine = self._strategy.engine
        if engine is None:
            raise RuntimeError("Set up the module first: fabric.setup(model, optimizer).")
        self._strategy.flush_optimizers()  # handed over by setup_optimizers: sharded at the first call
        gather = engine.forward_context() if engine.shards_params else nullcontext()
        with self._strategy.precision.forward_context(), gather:
            yield

    def step(
        self, batch: Any, *, loss_fn: LossFn, scale: float = 1.0, input_fn: InputFn | None = None
    ) -> Tensor | dict[str, Tensor]:
        """One training step on ``batch``: every micro-batch's forward and backward (module docstring)."""
        strategy = self._strategy
        scaler = strategy.precision.scaler
        if not torch.is_grad_enabled():  # every rank alike, before any transfer
            raise RuntimeError(
                "strategy.pipeline.step(...) trains (forward and backward) and was called with gradients"
                " disabled (torch.no_grad() / inference_mode()): use strategy.pipeline.evaluate(...) for a"
                " forward only, or call step outside the no_grad block."
            )
        self._agree("training", batch)
        strategy.open_window()
        with self._context():
            engine = strategy.engine
            assert engine is not None
            strategy._found_inf.clear()  # new gradients: the next clip or step unscales them
            result = self._steps.train(
                batch,
                loss_fn=loss_fn,
                input_fn=input_fn,
                engine=engine,
                factor=float(scale),
                loss_scale=scaler.scale if scaler is not None else 1.0,
                names=("loss_fn", "input_fn(batch) (pipeline.step's argument)"),
            )
        if strategy._grad_reads is not None:  # the first step's param.grad watch, before the reduction
            strategy._grad_reads.arm()
        self._steps.end_window(engine)  # outside no_backward_sync: tied sums, then the dp reduction
        return _returned(result)

    def evaluate(
        self,
        batch: Any,
        *,
        loss_fn: LossFn,
        metrics_fn: Callable[[Any, Any], Mapping[str, Any]] | None = None,
        input_fn: InputFn | None = None,
    ) -> Tensor | dict[str, Tensor]:
        """Forward only: the batch's loss (and metrics) on every pipeline rank."""
        self._agree("evaluation", batch)
        self._steps.metrics.forget("eval")  # each call's metrics_fn may return other names
        with self._context():
            result = self._steps.evaluate(
                batch,
                loss_fn=loss_fn,
                metrics_fn=metrics_fn,
                input_fn=input_fn,
                kind="eval",
                names=("loss_fn", "metrics_fn", "input_fn(batch) (pipeline.evaluate's argument)"),
            )
        return _returned(result)

    def predict(self, batch: Any, *, input_fn: InputFn | None = None) -> Tensor:
        """The last layer's outputs for ``batch``, concatenated over the micro-batches, on every rank."""
        self._agree("prediction", batch)
        with self._context():
            return self._steps.predict(
                batch, input_fn=input_fn, owner="input_fn(batch) (pipeline.predict's argument)"
            )


def _returned(result: StepResult) -> Tensor | dict[str, Tensor]:
    """The loss alone, or with metrics or a token count a dict (the metrics' names are agreed on every
    pipeline rank, so every rank returns the same shape)."""
    if not result.metrics and result.tokens is None:
        return result.loss
    out = {"loss": result.loss, **result.metrics}
    if result.tokens is not None:
        out["tokens"] = result.tokens
    return out
