"""The Fabric front door: ZeRO stages 0-3, tensor and pipeline parallelism and mixed precision for
``Fabric(strategy=...)`` loops.

``Fabric(strategy=HybridParallelStrategy(zero_stage=3), precision="bf16-mixed")`` or, after
``import lightning_par``, ``Fabric(strategy="zero2")``. The mechanisms are the ones the Trainer strategy
composes (``lightning_par.zero``, ``lightning_par.precision``, ``lightning_par.checkpoint``); this class
only maps Fabric's calls onto them (with its bases: :mod:`.processes` for the process group, mesh and
precision plugin, :mod:`.session` for checkpoints, gathers and teardown, :mod:`.steps` and
:mod:`.optimizers`):

* ``fabric.setup(model, optimizer)`` / ``setup_module`` + ``setup_optimizers``: the ZeRO engine over the
  data-parallel group, the optimizers rebuilt over this rank's shards (their ``fused``/``foreach``
  options kept). The module keeps its parameter objects (ZeRO replaces ``.data``), so an optimizer may
  be made before ``setup_module``, but not from meta parameters (stage 3 replaces those; refused, with
  the rule). A module is set up once.
* ``fabric.backward(loss)``: fp16 loss scaling, then autograd; the engine reduces during backward.
  ``fabric.no_backward_sync(model, enabled=True)`` marks non-final accumulation passes.
* ``fabric.clip_gradients(model, optimizer, max_norm=...)``: the global norm over the shards (fp16:
  gradients are unscaled and the overflow verdict agreed first, once per step).
* ``optimizer.step()``: skipped on every rank after an fp16 overflow; then the engine's ``after_step``
  (stages 1/2 all-gather the updated parameters).
* ``fabric.init_module(empty_init=True)`` at stage 3: meta parameters, materialised shard by shard.
* ``fabric.save`` / ``fabric.load`` / ``fabric.load_raw``: see :mod:`lightning_par.fabric.checkpoint`.
* ``tensor_parallel_size > 1`` with ``tp_plan`` (a shipped plan name or ``{pattern: style}``): the module
  is made tensor-parallel in ``setup_module`` by the same :func:`lightning_par.compose.compose` the
  Trainer strategy calls (once per module), ZeRO then shards over the data-parallel group, the clip norm
  sums over dp and tp, and Fabric's distributed sampler splits data over the dp ranks only.
* ``pipeline_parallel_size > 1``: the module's ordered layers (``pipeline_layers(module)``, e.g.
  :func:`lightning_par.pipeline.hf_pipeline_layers`, or the module's ``pipeline_layers()``) are cut into
  stages in ``setup_module`` (:mod:`lightning_par.fabric.setup`), the same split as under the Trainer; an
  optimizer made before follows the placeholders of other stages' parameters; a step is one call to
  ``fabric.strategy.pipeline.step(batch, loss_fn=...)`` (:mod:`lightning_par.fabric.pipeline`), the
  clip norm sums over the stages too, and ``fabric.save`` writes each stage's share.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_par.batch_agreement import BatchAgreement
from lightning_par.build import ZeroOptions, build_engine
from lightning_par.data_reduce import MetricSync
from lightning_par.device_checks import refuse_sync_batchnorm_on_cpu
from lightning_par.fabric.optimizers import FabricOptimizers
from lightning_par.fabric.pipeline import FabricPipeline, build_fabric_pipeline, refuse_direct_call
from lightning_par.fabric.session import SETUP_ATTR, FabricSession, refuse_second_setup
from lightning_par.fabric.setup import (
    Replaced,
    compose_module,
    init_context,
    refuse_forward_before_optimizers,
    sync_buffers,
)
from lightning_par.fabric.steps import FabricSteps
from lightning_par.grad_reads import GradReads
from lightning_par.mesh import ParallelMesh
from lightning_par.module_dtypes import cast_frozen
from lightning_par.owned_hooks import for_owner
from lightning_par.pipeline.partition import Cut, PartitionMethod, as_cut
from lightning_par.random_state import agree_random_state
from lightning_par.strategy_options import (
    PipelineSchedule,
    as_unit_policy,
    check_activation_checkpointing,
    check_options,
)
from lightning_par.zero.comm_hooks import CommHook, GatherDtype, HookName, check_comm_hook
from lightning_par.zero.engine_api import Engine
from lightning_par.zero.meta_buffers import materialize_buffers
from lightning_par.zero.meta_build import move_real_tensors
from lightning_par.zero.stage3 import Stage3Engine
from lightning_par.zero.units import UnitPolicy


class _EngineSyncControl(_BackwardSyncControl):
    def __init__(self, strategy: HybridParallelStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager[None]:
        engine = self._strategy.engine
        return engine.no_sync() if enabled and engine is not None else nullcontext()


class HybridParallelStrategy(FabricSteps, FabricOptimizers, FabricSession):
    """ZeRO stages 0-3 with ``ParallelPrecision`` for Lightning Fabric (see the module docstring).

    Args:
        zero_stage: 0 (replicated, bucketed all-reduce), 1, 2 or 3.
        bucket_size_mb, grad_sync, reduce_op, find_unused_parameters, zero3_units, reshard_after_forward,
        prefetch, allow_untested_optimizer, comm_hook, comm_hook_state, powersgd_rank, gather_dtype: as for
            the Trainer's ``lightning_par.HybridParallelStrategy``.
        meta_init: at stage 3, ``fabric.init_module(empty_init=True)`` builds on the meta device.
        save_distributed_checkpoint: ``fabric.save`` writes a sharded directory (default) or, with
            ``False``, one torch file with the full state dict and full optimizer state in torch's format.
        unshard_on_teardown: ``fabric.strategy.teardown()`` (on every rank: collective) leaves the whole
            model behind, as the Trainer's strategy does when ``fit`` ends: at stage 3 gathered into every
            rank, at stages 1/2 with separate fp32 masters the parameters take the masters' values. Turn
            off for a model that does not fit one device: its ZeRO-3 parameters then stay NaN placeholders
            and the module is no longer usable (read its weights with ``consolidated_state_dict()``).
        broadcast_buffers: as DDP (and Fabric's ``"ddp"``): before a forward that follows a synchronising
            training forward (gradients enabled, not inside ``no_backward_sync``), and before the first,
            every rank takes the first data-parallel rank's buffers (BatchNorm statistics).
        tensor_parallel_size, tp_plan, sequence_parallel, activation_checkpointing: as for the Trainer
            strategy (see the module docstring).
        pipeline_parallel_size, num_microbatches, pipeline_schedule, virtual_stages, pipeline_slack,
            partition_method: as for the Trainer strategy (see the module docstring).
        pipeline_layers: under pipeline parallelism, a function of the module returning its ordered layers
            (default: the module's ``pipeline_layers()`` method).
        process_group_backend: as for the Trainer strategy (checked against the root device at setup).
    """

    def __init__(
        self,
        *,
        zero_stage: int = 0,
        bucket_size_mb: float = 25.0,
        grad_sync: Literal["boundary", "every"] | None = None,
        reduce_op: Literal["auto", "all_reduce", "reduce_scatter"] = "auto",
        find_unused_parameters: bool = False,
        zero3_units: UnitPolicy = None,
        reshard_after_forward: bool | None = None,
        prefetch: bool = True,
        meta_init: bool = True,
        save_distributed_checkpoint: bool = True,
        unshard_on_teardown: bool = True,
        broadcast_buffers: bool = True,
        allow_untested_optimizer: bool = False,
        comm_hook: HookName | CommHook | None = None,
        comm_hook_state: Any = None,
        powersgd_rank: int = 1,
        gather_dtype: GatherDtype | None = None,
        tensor_parallel_size: int = 1,
        tp_plan: str | Mapping[str, str] | None = None,
        sequence_parallel: bool = False,
        activation_checkpointing: bool | UnitPolicy = False,
        pipeline_parallel_size: int = 1,
        num_microbatches: int | None = None,
        pipeline_schedule: PipelineSchedule = "1f1b",
        virtual_stages: int = 1,
        pipeline_slack: int = 0,
        partition_method: PartitionMethod | Sequence[int] = "compute",
        pipeline_layers: Callable[[nn.Module], Sequence[nn.Module]] | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout_s: float = 1800.0,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        zero3_units = as_unit_policy(zero3_units)  # type: ignore[assignment]
        activation_checkpointing = as_unit_policy(activation_checkpointing)  # type: ignore[assignment]
        self.num_microbatches = check_options(
            zero_stage=zero_stage,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            bucket_size_mb=bucket_size_mb,
            grad_sync=grad_sync,
            reduce_op=reduce_op,
            tp_plan=tp_plan,
            num_microbatches=num_microbatches,
            pipeline_schedule=pipeline_schedule,
            virtual_stages=virtual_stages,
            pipeline_slack=pipeline_slack,
            partition_method=partition_method,
            timeout_s=timeout_s,
            start_method=start_method,
            zero3_units=zero3_units,
            reshard_after_forward=reshard_after_forward,
            prefetch=prefetch,
            sequence_parallel=sequence_parallel,
            flags={
                "find_unused_parameters": find_unused_parameters,
                "meta_init": meta_init,
                "save_distributed_checkpoint": save_distributed_checkpoint,
                "unshard_on_teardown": unshard_on_teardown,
                "broadcast_buffers": broadcast_buffers,
                "allow_untested_optimizer": allow_untested_optimizer,
            },
        )
        check_activation_checkpointing(activation_checkpointing)
        if pipeline_layers is not None and not callable(pipeline_layers):
            raise ValueError(f"pipeline_layers must be a function of the module, got {pipeline_layers!r}.")
        check_comm_hook(
            comm_hook,
            powersgd_rank=powersgd_rank,
            comm_hook_state=comm_hook_state,
            gather_dtype=gather_dtype,
            zero_stage=zero_stage,
            reduce_op=reduce_op,
            grad_sync=grad_sync,
        )
        self.comm_hook, self.comm_hook_state, self.powersgd_rank = comm_hook, comm_hook_state, powersgd_rank
        self.gather_dtype = gather_dtype
        self.unshard_on_teardown = unshard_on_teardown
        self._torn_down = False
        self.zero_stage = zero_stage
        self.tensor_parallel_size = tensor_parallel_size
        self.tp_plan = tp_plan
        self.sequence_parallel = sequence_parallel
        self.activation_checkpointing = activation_checkpointing
        self.pipeline_parallel_size, self.pipeline_schedule = pipeline_parallel_size, pipeline_schedule
        self.virtual_stages, self.pipeline_slack = virtual_stages, pipeline_slack
        self.partition_method: Cut = as_cut(partition_method)
        self.pipeline_layers = pipeline_layers
        self.bucket_size_mb = float(bucket_size_mb)
        self.grad_sync = grad_sync
        self.reduce_op = reduce_op
        self.find_unused_parameters = find_unused_parameters
        self.zero3_units = zero3_units
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
        self.meta_init = meta_init
        self.save_distributed_checkpoint = save_distributed_checkpoint
        self.broadcast_buffers = broadcast_buffers
        self.allow_untested_optimizer = allow_untested_optimizer
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=timeout_s),
            start_method=start_method,
        )
        self._backward_sync_control = _EngineSyncControl(self)
        self._mesh: ParallelMesh | None = None
        self._launch_store: torch.distributed.TCPStore | None = None  # rank 0 hosts it
        self.engine: Engine | None = None
        self.module: nn.Module | None = None
        self._optimizers: list[Optimizer] = []
        # optimizers from fabric.setup_optimizers(...), which hands them over one call each: sharded
        # together at the first use (a forward, a pipeline call, a checkpoint, a read of .optimizers)
        self._pending: list[Optimizer] = []
        self._pending_hook: RemovableHandle | None = None
        self._pipeline: FabricPipeline | None = None
        self._refusal: RemovableHandle | None = None  # the hook refusing model(...) under a pipeline
        self._buffer_hooks: list[RemovableHandle] = []  # BufferSync around the module's forward
        # the tp / pp ranks' first batches compared (batch_agreement.py): the pipeline's steps, or the
        # module's first forward through a pre-hook (removed after it)
        self.batches: BatchAgreement | None = None
        self._first_forward: RemovableHandle | None = None
        self._before_optimizers: RemovableHandle | None = None  # refuse_forward_before_optimizers
        # this window's fp16 verdict per optimizer (by id), once its gradients are unscaled
        self._found_inf: dict[int, bool] = {}
        self.before_optimizer_step: list[Callable[[], None]] = []
        # parameters that tensor or pipeline parallelism replaced, by their old identity: an optimizer made
        # before setup_module is pointed at the replacements (kept until the optimizers are set up)
        self._replaced: Replaced = {}
        self._metric_sync = MetricSync()  # torchmetrics over the data-parallel group

    # ------------------------------------------------------------------ setup
    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager[None]:
        return init_context(self, empty_init=empty_init)

    @override
    def module_to_device(self, module: nn.Module) -> None:
        """Real tensors move to the root device; meta parameters wait for the engine (stage 3); meta
        buffers (a model built under ``torch.device("meta")``) are computed on the device."""
        refuse_second_setup(module)  # Fabric moves a module before it sets it up
        move_real_tensors(module, self.root_device)
        materialize_buffers(module, device=self.root_device)

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[nn.Module, list[Optimizer], Any | None]:
        module = self.setup_module(module)
        self._setup_optimizers(optimizers)
        return module, optimizers, scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:  # type: ignore[override]
        refuse_second_setup(module)
        if self.module is not None:
            after = (
                " This strategy was torn down (fabric.strategy.teardown()): for another model, create a new"
                " Fabric with a new strategy."
                if self._torn_down
                else ""
            )
            raise ValueError(
                "lightning_par's Fabric strategy sets up one module per Fabric (its ZeRO engine and"
                " checkpoints follow that module); wrap several networks in one nn.Module. A frozen module"
                " beside it (a teacher, a reference model) needs no setup: fabric.to_device(module). To"
                " evaluate a saved checkpoint, fabric.load it into the model already set up." + after
            )
        refuse_sync_batchnorm_on_cpu(  # as Fabric's "ddp", whose DDP wrapper refuses them at setup
            module,
            device=self.root_device,
            converting=False,
            fix="leave the BatchNorm layers unconverted on CPU.",
        )
        self.module_to_device(module)
        # the model-changing steps (tensor parallel, pipeline split, activation checkpointing), once per
        # model, as the Trainer strategy applies them
        composition, self._replaced = compose_module(self, module)
        if composition.pipeline is not None:
            self._pipeline = build_fabric_pipeline(self, module, composition.pipeline)
        compute, reduce = self.precision.engine_dtypes()
        self.engine = build_engine(
            module,
            options=ZeroOptions.of(self),
            group=self.mesh.dp_group,
            device=self.root_device,
            compute_dtype=compute,
            grad_dtype=reduce,
            frozen_dtype=self.precision.frozen_storage_dtype(),
            pipelined=self._pipeline is not None,
            seed_groups=(self.mesh.tp_group, self.mesh.pp_group),
        )
        # param.grad is None at ZeRO 1-3: reads that find nothing are refused in the first optimizer step
        self._grad_reads = GradReads.for_engine(
            module,
            self.engine,
            zero_stage=self.zero_stage,
            pipelined=self._pipeline is not None,
            find_unused_parameters=self.find_unused_parameters,
            defer=True,  # a Fabric loop has no teardown to take a raising mode off the stack
        )
        # at stage 0 the loop sees param.grad: the tp replicas' gradients are compared at the first step
        self._check_tp_replicas = self.mesh.tp_size > 1 and self.zero_stage == 0
        cast_frozen(module, self.precision.frozen_storage_dtype())
        self._buffer_hooks = sync_buffers(self, module)
        self._before_optimizers = refuse_forward_before_optimizers(
            module, zero_stage=self.zero_stage, precision=self.precision
        )
        self._metric_sync.assign(module, mesh=self.mesh, pipelined=self._pipeline is not None)
        setattr(module, SETUP_ATTR, True)
        self.module = module
        if isinstance(self.engine, Stage3Engine):  # its parameters are placeholders until a step gathers
            self.engine.refuse_reads_until_step(
                "after fabric.setup() and before the first step (an init after sharding, such as"
                " torchtitan's model.init_weights(), or a weight read such as a norm or a copy)"
            )
        self.batches = BatchAgreement.of_mesh(self.mesh, device=self.root_device)
        # the ranks of one model replica (tp, pp) start with one random state: dropout masks alike
        agree_random_state(groups=(self.mesh.tp_group, self.mesh.pp_group), device=self.root_device)
        if self._pipeline is not None:
            self._refusal = refuse_direct_call(module)
            for loop in ("training", "evaluation", "prediction"):
                self.batches.expect(loop)
        elif self.mesh.tp_size > 1:
            self.batches.expect("forward")
            # eager inside a compiled model: the check reads its verdict on the host (a graph break)
            self._first_forward = module.register_forward_pre_hook(
                for_owner(module, self._check_first_input, eager=True), with_kwargs=True
            )
        return module

    def _check_first_input(self, _module: nn.Module, args: Any, kwargs: Any) -> None:
        """The module's first forward: its inputs are the same on every tensor-parallel rank."""
        handle, self._first_forward = self._first_forward, None
        if handle is not None:
            handle.remove()
        if self.batches is not None:
            self.batches.check("forward", (args, kwargs))

    @property
    def pipeline(self) -> FabricPipeline:
        """The pipeline steps (``pipeline_parallel_size > 1``, after ``fabric.setup``): see
        :mod:`lightning_par.fabric.pipeline`."""
        if self._pipeline is None:
            raise RuntimeError(
                "strategy.pipeline exists under pipeline_parallel_size > 1, after fabric.setup(model, ...);"
                f" here pipeline_parallel_size={self.pipeline_parallel_size} and no pipeline is set up."
            )
        return self._pipeline

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for stage in (0, 1, 2, 3):
            name = f"zero{stage}"
            if name not in strategy_registry:
                strategy_registry.register(
                    name, cls, description=f"lightning_par ZeRO stage {stage} (Fabric)", zero_stage=stage
                )
