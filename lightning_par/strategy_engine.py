"""The engine side of :class:`~lightning_par.HybridParallelStrategy`: what ``setup()`` hands to the ZeRO
engine, and how ``configure_model()`` builds on the meta device.

:class:`StrategyEngine` is a base of the strategy and holds no state of its own: the options it reads are
the strategy's constructor arguments, kept as attributes of the same names. ``_build_engine`` is step 7
of the composition (``docs/architecture.md``), after ``_build_pipeline`` (the runtime of step 5's split)
and ``_materialize`` (step 6, the weights into the model below stage 3): ZeRO over the data-parallel
group, for evaluation runs too (stage 3 shards there as well); an evaluation run after a fit keeps the
fit's engine for its optimizer state. ``model_sharded_context`` is Lightning's hook around
``configure_model()``: with ``meta_init`` at stage 3, or with ``pretrained`` weights, parameters are built
on the meta device and what user code loads into them is recorded, to be applied to the shards at setup.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from lightning_par.build import ZeroOptions, build_engine
from lightning_par.checkpoint.load_pretrained import PretrainedPlan, PretrainedSource, load_pretrained_once
from lightning_par.compose import ComposeOptions
from lightning_par.grad_reads import GradReads
from lightning_par.memory import MemoryReport, measure_memory
from lightning_par.pipeline.apply import PipelineSplit
from lightning_par.pipeline.lightning import LightningPipeline, pipeline_layers_of
from lightning_par.pipeline.partition import Cut
from lightning_par.pipeline.steps import pipeline_parts
from lightning_par.precision import ParallelPrecision
from lightning_par.strategy_env import MeshStrategy
from lightning_par.strategy_options import PipelineSchedule
from lightning_par.strategy_precision import StrategyPrecision
from lightning_par.strategy_steps import StrategySteps
from lightning_par.zero.init_seeds import agree_seed
from lightning_par.zero.meta_buffers import materialize_buffers
from lightning_par.zero.meta_build import meta_build, move_real_tensors
from lightning_par.zero.meta_init import ValuesFn, materialize_local
from lightning_par.zero.meta_loads import MetaLoads
from lightning_par.zero.units import UnitPolicy, check_pipeline_units


class StrategyEngine(StrategySteps, StrategyPrecision, MeshStrategy):
    """The ZeRO engine's construction and the meta-device build (see the module docstring)."""

    # set by HybridParallelStrategy.__init__
    find_unused_parameters: bool
    meta_init: bool
    pretrained: PretrainedSource | None
    _meta_loads: MetaLoads | None  # what the last configure_model() loaded into meta parameters
    tp_plan: str | dict[str, str] | None
    sequence_parallel: bool
    virtual_stages: int
    partition_method: Cut
    activation_checkpointing: bool | UnitPolicy
    zero3_units: UnitPolicy
    pipeline_schedule: PipelineSchedule
    num_microbatches: int | None
    pipeline_slack: int
    pretrained_strict: bool

    def _compose_options(self) -> ComposeOptions:
        return ComposeOptions(
            tensor_parallel_size=self.tensor_parallel_size,
            tp_plan=self.tp_plan,
            sequence_parallel=self.sequence_parallel,
            pipeline_parallel_size=self.pipeline_parallel_size,
            virtual_stages=self.virtual_stages,
            partition_method=self.partition_method,
            activation_checkpointing=self.activation_checkpointing,
        )

    def _build_pipeline(self, module: pl.LightningModule, split: PipelineSplit) -> None:
        """Step 5 of the composition, its pipeline split: the runtime over this rank's stage of ``split``
        (at ZeRO-3 the unit policy is checked against the cut first, before any collective: every rank
        refuses alike); a second setup (fit, then test) destroys the previous pipeline's tie groups
        first."""
        assert self.num_microbatches is not None and self.model is not None
        if self.zero_stage == 3:
            layers, pp = pipeline_layers_of(module), self.pipeline_parallel_size
            check_pipeline_units(self.model, self.zero3_units, layers=layers, pieces=split.pieces, pp_size=pp)
        if self._pipeline is not None:
            self._pipeline.tied.destroy()
        runtime, tied = pipeline_parts(
            module,
            split,
            mesh=self.mesh,
            schedule=self.pipeline_schedule,
            num_microbatches=self.num_microbatches,
            device=self.root_device,
            slack=self.pipeline_slack,
        )
        mesh = self.mesh
        self._pipeline = LightningPipeline(
            module, runtime, tied, dp_group=mesh.dp_group, dp_size=mesh.dp_size
        )

    def _materialize(self, fitting: bool, meta_loaded: dict[str, Tensor]) -> None:
        """Step 6 of the composition: the weights (``pretrained=``, or what ``configure_model()`` loaded
        into meta parameters: ``meta_loaded``, by name) into the model below stage 3 (stage 3
        materialises unit by unit, into its shards), then the engine; parameters the source lacks are
        drawn alike on every rank."""
        assert self.model is not None
        plan: PretrainedPlan | None = None
        if self.pretrained is not None or meta_loaded:
            plan = load_pretrained_once(
                self.model,
                self.pretrained if self.pretrained is not None else meta_loaded,
                tp_rank=self.mesh.tp_rank,
                tp_size=self.tensor_parallel_size,
                strict=self.pretrained_strict and self.pretrained is not None,
                partial=self.pretrained is None,  # configure_model() loaded some: the rest is initialised
            )
        try:
            values = plan.value if plan is not None else None
            if self.zero_stage != 3:
                seed = 0
                if values is not None:
                    mesh = self.mesh
                    groups = (mesh.dp_group, mesh.tp_group, mesh.pp_group)
                    seed = agree_seed(torch.initial_seed() % 2**31, groups=groups, device=self.root_device)
                materialize_local(self.model, device=self.root_device, values=values, seed=seed)
            self._build_engine(fitting, values)
        finally:
            if plan is not None:  # the weights are in the model or its shards now
                plan.close()

    def _build_engine(self, fitting: bool, values: ValuesFn | None) -> None:
        """Step 7 of the composition: ZeRO over the dp group (stage 3 for evaluation too)."""
        assert self.model is not None
        plugin = self.precision_plugin
        if fitting and isinstance(plugin, ParallelPrecision):
            plugin.check_trainable(self.model.named_parameters())
        compute, reduce = self._dtypes()
        # an evaluation run after a fit (test, validate: one or several) keeps the fit's engine for its
        # optimizer state, which Lightning keeps and checkpoints (checkpoint/fit_state.py)
        fit = self._engine if self._engine is not None and self._engine.sharded_state is not None else None
        fit = fit if fit is not None else self._fit_engine
        self._fit_engine = fit if not fitting and self.optimizers else None
        self._engine = engine = build_engine(
            self.model,
            options=ZeroOptions.of(self),
            group=self.mesh.dp_group,
            device=self.root_device,
            compute_dtype=compute,
            grad_dtype=reduce,
            frozen_dtype=self._frozen_dtype(),
            fitting=fitting,
            values=values,
            pipelined=self.pipeline_parallel_size > 1,
            seed_groups=(self.mesh.tp_group, self.mesh.pp_group),
        )
        # param.grad is None at ZeRO 1-3: reads that find nothing are refused in the first optimizer step
        self._grad_reads = GradReads.for_engine(
            self.model,
            engine if fitting else None,
            zero_stage=self.zero_stage,
            pipelined=self.pipeline_parallel_size > 1,
            find_unused_parameters=self.find_unused_parameters,
        )
        plugin = self.precision_plugin
        if isinstance(plugin, ParallelPrecision):  # the watch ends before the optimizer's own update
            plugin.before_update = self._end_grad_reads if self._grad_reads is not None else None
            plugin.on_skip = self._engine.step_skipped if self._engine is not None else None
        # at stage 0 user code sees param.grad: the tp replicas' gradients are compared at the first step
        self._check_tp_replicas = fitting and self.tensor_parallel_size > 1 and self.zero_stage == 0

    @override
    def model_to_device(self) -> None:
        """Real parameters and buffers move to this rank's device; meta parameters (meta init, other
        pipeline stages) stay where they are, to be materialised by the engine or pretrained weights.
        Meta buffers (a model built under ``torch.device("meta")``) are computed here, on the device."""
        assert self.model is not None
        move_real_tensors(self.model, self.root_device)
        materialize_buffers(self.model, device=self.root_device)

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """With ``meta_init`` at stage 3, or with pretrained weights to load, ``configure_model()`` builds
        the parameters on the meta device (buffers stay real): no rank ever holds the initialised model."""
        if not (self.meta_init and (self.zero_stage == 3 or self.pretrained is not None)):
            yield
            return
        # weights the user's code loads there (load_state_dict, PEFT's from_pretrained) would land in meta
        # tensors: recorded, and loaded into the shards at setup (lightning_par.zero.meta_loads); so are
        # the model's own init writes, replayed when each unit gets storage (lightning_par.zero.meta_writes)
        loads = MetaLoads()
        fixes = (
            "build the model from its config and pass the weights as HybridParallelStrategy(pretrained=PATH)"
            " (read into each rank's shards), or load them with load_state_dict (applied to the shards at"
            " setup), or set meta_init=False (the whole model is built on every rank first)."
        )
        with meta_build("configure_model()", fixes, loads):
            yield
        self._meta_loads = loads

    def memory_report(self) -> MemoryReport:
        """Bytes of parameters, gradients, optimizer state, buffers and communication buffers on this rank."""
        assert self.lightning_module is not None
        return measure_memory(self.lightning_module, self._engine, self.optimizers)
