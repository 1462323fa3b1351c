"""``HybridParallelStrategy``: the Lightning adapter that composes the parallel mechanisms.

The strategy is thin on purpose. Its bases launch processes, initialise ``torch.distributed`` and build
one :class:`~lightning_par.mesh.ParallelMesh` (:mod:`lightning_par.strategy_env`), dispatch each step
(:mod:`lightning_par.strategy_steps`), wire the precision plugin (:mod:`lightning_par.strategy_precision`),
build the ZeRO engine (:mod:`lightning_par.strategy_engine`) and end a run
(:mod:`lightning_par.strategy_teardown`); here the mechanisms are applied in the documented order
(``docs/architecture.md``): tensor parallel, pipeline split, activation checkpointing
(:func:`lightning_par.compose.compose`, once per model), pretrained weights, ZeRO over the dp group,
precision, optimizer. Every mechanism lives in its own module and can be used without a ``Trainer``.
Nothing of the user's LightningModule is replaced for longer than a run: the hooks wrapped for a run
(:mod:`lightning_par.lightning_hooks`) are restored at teardown.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from typing_extensions import override

from lightning_par.batch_agreement import BatchAgreement
from lightning_par.checkpoint.load_pretrained import PretrainedPlan, PretrainedSource
from lightning_par.compose import compose
from lightning_par.data_reduce import MetricSync
from lightning_par.device_checks import check_optimizer_kernels, refuse_sync_batchnorm_on_cpu
from lightning_par.loss import TokenNormalizer
from lightning_par.module_dtypes import cast_frozen
from lightning_par.optimizer_checks import check_layout_optimizers
from lightning_par.peft_checks import refuse_grad_reading_adapters
from lightning_par.pipeline.lightning import LightningPipeline, pipeline_layers_of
from lightning_par.pipeline.partition import Cut, PartitionMethod, as_cut
from lightning_par.random_state import agree_random_state
from lightning_par.strategy_engine import StrategyEngine
from lightning_par.strategy_options import (
    PipelineSchedule,
    StartMethod,
    as_unit_policy,
    check_activation_checkpointing,
    check_fit_setup,
    check_options,
)
from lightning_par.strategy_teardown import StrategyTeardown
from lightning_par.summaries import guard_summaries
from lightning_par.zero.buffers import BufferSync
from lightning_par.zero.comm_hooks import CommHook, GatherDtype, HookName, check_comm_hook
from lightning_par.zero.engine import ReduceChoice
from lightning_par.zero.engine_api import Engine
from lightning_par.zero.grad_sync import GradSyncPolicy
from lightning_par.zero.leftovers import placeholder_names, refuse_left_placeholders
from lightning_par.zero.meta_loads import MetaLoads
from lightning_par.zero.units import UnitPolicy

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.accelerators import Accelerator


class HybridParallelStrategy(StrategyTeardown, StrategyEngine):
    """Data, ZeRO, tensor and pipeline parallelism for the Lightning ``Trainer``.

    Args:
        zero_stage: 0 = data parallel (bucketed, overlapped all-reduce), 1/2/3 = ZeRO stages.
        tensor_parallel_size: ranks per tensor-parallel group (adjacent ranks).
        pipeline_parallel_size: pipeline stages (outermost dimension).
            The data-parallel size is ``world_size / (tensor_parallel_size * pipeline_parallel_size)``.
        bucket_size_mb: size of a gradient communication bucket.
        grad_sync: stages 1/2: ``"boundary"`` reduces gradients once per optimizer step (default for
            stage 1), ``"every"`` after each micro-batch so gradient memory stays 1/N (default for stage 2).
        reduce_op: stages 1-3: ``"auto"`` (reduce-scatter on NCCL, all-reduce on Gloo), ``"all_reduce"`` or
            ``"reduce_scatter"``.
        zero3_units: stage 3: which modules gather their parameters together: module classes, class
            names (``"LlamaDecoderLayer"``, bare or dotted) or ``fnmatch`` patterns of module names (the
            outermost matches; default: the children of the outermost ``nn.ModuleList`` s, so a list
            inside a block, as a mixture's experts, stays in the block's unit). This and
            ``reshard_after_forward`` are refused at stages 0-2, where they would do nothing.
        reshard_after_forward: stage 3: free gathered parameters after each unit's forward (re-gather in
            backward: 3Ψ traffic, least memory) or keep them until backward (2Ψ traffic). ``None``
            (default): True, but False under pipeline parallelism, where units stay gathered across a
            step's micro-batches and their gradients are reduce-scattered once, after the last one.
        prefetch: stage 3: gather the next unit while the current one computes.
        meta_init: stage 3 (or with ``pretrained``): run ``configure_model()`` with parameters on the meta
            device (buffers stay real) and materialise only this rank's shard or slice, unit by unit, from
            ``pretrained`` or with each module's ``reset_parameters()``.
        pretrained: a full state dict to start from, read lazily and cut to this rank's ZeRO-3 shards and
            tensor-parallel slices: a ``torch.save`` file, a ``.safetensors`` file or index, a Hugging Face
            ``save_pretrained`` directory, or a mapping. Names may differ by a prefix (``model.``) or PEFT's
            ``.base_layer.``; trainable parameters the file lacks (LoRA adapters) are initialised.
        pretrained_strict: refuse file entries that match no model name.
        save_distributed_checkpoint: ``True`` (default): ZeRO 1-3, TP and PP checkpoints are directories
            written by every rank. ``False``: one ordinary Lightning checkpoint file written by rank 0
            (full weights and optimizer state, gathered one rank at a time), which
            ``LightningModule.load_from_checkpoint`` and ``torch.load`` read and any layout resumes from.
        broadcast_buffers: as DDP: before a forward that follows a synchronising training step, every
            rank takes the first data-parallel rank's buffers (BatchNorm statistics).
        allow_untested_optimizer: accept optimizers outside the built-in element-wise list at stages 1-3
            on your word that their update is element-wise (LBFGS-like ones are refused even then).
        activation_checkpointing: recompute each selected layer in backward instead of keeping its
            activations: ``True`` for every child of an ``nn.ModuleList`` (the blocks), or module classes /
            name patterns.
        unshard_on_teardown: stage 3: gather the whole model back into every rank when training ends, so
            the module is usable afterwards (turn off for models that do not fit one device: its
            parameters then stay NaN placeholders, read them with ``consolidated_state_dict()``); stages 1/2
            in mixed precision: the parameters go back from their 16-bit compute copies to the fp32
            masters' values, as under Lightning's own strategies.
        find_unused_parameters: allow parameters without gradients in a step (their ``.grad`` stays
            ``None`` when no rank used them); without it such parameters raise a clear error.
        comm_hook: gradient compression: ``"fp16"``/``"bf16"`` (gradient reductions in that dtype, stages
            0-3), ``"powersgd"`` (ours, rank ``powersgd_rank``; ``comm_hook_state``: a mapping of its other
            fields) or a DDP hook ``hook(state, bucket) -> Future[Tensor]`` (stages 0-2, ``comm_hook_state``
            default: the dp group); :mod:`lightning_par.zero.comm_hooks`. ``gather_dtype`` (stage 3):
            ``"bf16"``/``"fp16"``/``"int8"`` parameter all-gathers (int8: blockwise-quantized, as ZeRO++).
        tp_plan: tensor-parallel plan name (``"gpt"``, ``"llama"``, ``"llama_attention"``: the MLP, a mixture
            of experts, replicated) or ``{module pattern: style}``; default:
            the LightningModule's ``tp_plan`` attribute. Applied when ``tensor_parallel_size > 1``.
        sequence_parallel: split the activations between tensor-parallel regions along the sequence.
        num_microbatches: micro-batches per pipeline step (default ``2 * pipeline_parallel_size``).
        pipeline_schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"zb"`` (zero bubble) or
            ``"interleaved_zb"`` (zero bubble over ``virtual_stages`` chunks per rank).
        virtual_stages: model chunks per pipeline rank (the interleaved schedules need >= 2).
        pipeline_slack: ``1f1b`` / ``zb``: extra micro-batches in flight on every stage but the last,
            which absorb fluctuating action times for that many more micro-batches of activations
            (:mod:`lightning_par.pipeline.schedule`).
        partition_method: how layers are balanced over stages: ``"compute"`` (default: each layer's
            matrix-product weights, counted at every use, lookups free, so a tied LM head weighs its
            vocabulary-wide product and the embedding nothing), ``"parameters"``, ``"uniform"``,
            ``"profile"`` (measured time; uses the LightningModule's ``example_input_array``), or layer
            counts per piece (``[9, 5]``; ``p * v`` of them, in virtual-stage order); every rank cuts
            the same way (costs averaged over the job; :mod:`lightning_par.pipeline.partition`).
        process_group_backend: default ``"gloo"`` on CPUs and ``"cpu:gloo,cuda:nccl"`` on CUDA (NCCL for
            the step, Gloo for CPU-side objects); a backend that cannot move the root device's tensors
            (``"nccl"`` without CUDA, a Gloo-only group for a CUDA model) is refused at setup.
        timeout_s: timeout of collective operations, in seconds.
        start_method: ``"popen"`` (re-run the command, like Lightning's ``"ddp"``), ``"spawn"``, ``"fork"``
            or ``"forkserver"``. Ignored when processes are created externally (torchrun, SLURM).
    """

    strategy_name = "hybrid_parallel"

    def __init__(
        self,
        *,
        zero_stage: int = 0,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        bucket_size_mb: float = 25.0,
        grad_sync: GradSyncPolicy | None = None,
        reduce_op: ReduceChoice = "auto",
        find_unused_parameters: bool = False,
        zero3_units: UnitPolicy = None,
        reshard_after_forward: bool | None = None,
        prefetch: bool = True,
        meta_init: bool = True,
        activation_checkpointing: bool | UnitPolicy = False,
        unshard_on_teardown: bool = True,
        tp_plan: str | dict[str, str] | None = None,
        sequence_parallel: bool = False,
        num_microbatches: int | None = None,
        pipeline_schedule: PipelineSchedule = "1f1b",
        virtual_stages: int = 1,
        pipeline_slack: int = 0,
        partition_method: PartitionMethod | Sequence[int] = "compute",
        process_group_backend: str | None = None,
        timeout_s: float = 1800.0,
        start_method: StartMethod = "popen",
        pretrained: PretrainedSource | None = None,
        pretrained_strict: bool = True,
        save_distributed_checkpoint: bool = True,
        broadcast_buffers: bool = True,
        allow_untested_optimizer: bool = False,
        comm_hook: HookName | CommHook | None = None,
        comm_hook_state: Any = None,
        powersgd_rank: int = 1,
        gather_dtype: GatherDtype | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        zero3_units = as_unit_policy(zero3_units)  # type: ignore[assignment]
        activation_checkpointing = as_unit_policy(activation_checkpointing)  # type: ignore[assignment]
        num_microbatches = check_options(
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
                "unshard_on_teardown": unshard_on_teardown,
                "pretrained_strict": pretrained_strict,
                "save_distributed_checkpoint": save_distributed_checkpoint,
                "broadcast_buffers": broadcast_buffers,
                "allow_untested_optimizer": allow_untested_optimizer,
            },
        )
        check_activation_checkpointing(activation_checkpointing)
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
        self.zero_stage = zero_stage  # read by the precision_plugin setter, which the base class calls
        super().__init__(
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            process_group_backend=process_group_backend,
            timeout_s=timeout_s,
            start_method=start_method,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.bucket_size_mb = float(bucket_size_mb)
        self.grad_sync = grad_sync
        self.reduce_op: ReduceChoice = reduce_op
        self.find_unused_parameters = find_unused_parameters
        self.zero3_units = zero3_units
        self.tp_plan, self.sequence_parallel = tp_plan, sequence_parallel
        self.reshard_after_forward, self.prefetch, self.meta_init = reshard_after_forward, prefetch, meta_init
        self.activation_checkpointing = activation_checkpointing
        self.unshard_on_teardown = unshard_on_teardown
        self.pipeline_schedule = pipeline_schedule
        self.num_microbatches = num_microbatches
        self.virtual_stages, self.pipeline_slack = virtual_stages, pipeline_slack
        self.partition_method: Cut = as_cut(partition_method)
        self._pipeline: LightningPipeline | None = None
        self._engine: Engine | None = None
        # run before the strategy writes weights in place between optimizer steps (gathered_params with
        # writeback): FlashCheckpoint's fence, so its snapshot copy in flight finishes first
        self.before_state_write: list[Callable[[], None]] = []
        self._sharded_source: Path | None = None
        self._token_normalizer: TokenNormalizer | None = None
        self.pretrained = pretrained
        self.pretrained_strict = pretrained_strict
        self._pretrained: PretrainedPlan | None = None
        self._meta_loads: MetaLoads | None = None  # what the last configure_model() loaded into meta
        self.save_distributed_checkpoint = save_distributed_checkpoint
        self.broadcast_buffers = broadcast_buffers
        self.allow_untested_optimizer = allow_untested_optimizer
        self._buffer_sync = BufferSync(nn.Module(), group=None, enabled=False)  # type: ignore[arg-type]
        self._synced_batchnorm = False
        self._patched: list[str] = []  # hooks set on the user's LightningModule for a run, undone at teardown
        self._patched_callbacks: list[tuple[Any, list[str]]] = []  # the same on user callbacks
        self._metric_sync = MetricSync()  # torchmetrics over the data-parallel group, for a run

    # ------------------------------------------------------------------ composition
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """The composition, in the order of ``docs/architecture.md``; safe to run again on the same model
        (``fit`` then ``test``, a second ``fit``, another ``Trainer``): what rewrites the model (TP, PP,
        checkpointing) is applied once (:func:`lightning_par.compose.compose`), the rest is per run."""
        assert self.accelerator is not None
        assert self.model is not None and self.lightning_module is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._configure_precision(fitting=fitting)
        if fitting:  # callbacks that cannot serve this layout are refused before anything is built
            check_fit_setup(
                trainer,
                zero_stage=self.zero_stage,
                tensor_parallel_size=self.tensor_parallel_size,
                pipeline_parallel_size=self.pipeline_parallel_size,
                masters_separate=self._dtypes()[0] is not None,
            )
        # weights configure_model() loaded into meta parameters, by name, before anything is replaced
        meta_loaded = self._meta_loads.by_name(self.model) if self._meta_loads is not None else {}
        self._meta_loads = None
        if meta_loaded and self.pretrained is not None:
            raise ValueError(
                f"configure_model() loaded values into {len(meta_loaded)} parameters (e.g."
                f" {next(iter(meta_loaded))!r}) and pretrained= names weights too: give the weights one way,"
                " either pretrained=PATH or the load in configure_model()."
            )
        # parameters an interrupted run left as ZeRO-3 placeholders: refused when the first loop starts,
        # unless a checkpoint loads into them first (Lightning's load comes after setup)
        flash = any(getattr(cb, "restores_at_fit_start", False) for cb in getattr(trainer, "callbacks", []))
        left = placeholder_names(self.model)
        if left and self._kept_sharded and self._engine is not None and self._engine.shards_params:
            # this strategy's last fit kept them sharded: refused before a new engine replaces its shards
            refuse_left_placeholders(left, total=sum(1 for _ in self.model.parameters()), kept=True)
        self._kept_sharded = False
        self._left_placeholders = () if flash else tuple(left)
        if fitting:
            refuse_grad_reading_adapters(self.model, zero_stage=self.zero_stage)
            refuse_sync_batchnorm_on_cpu(
                self.model,
                device=self.root_device,
                converting=self._layer_sync is not None,
                fix="drop Trainer(sync_batchnorm=True) and any convert_sync_batchnorm() call for CPU runs.",
            )
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self._layer_sync is not None and fitting:  # as Lightning's DDP: for fitting only
            # BatchNorm statistics are synchronised over the data-parallel group only: tp ranks see the
            # same samples, and pipeline stages hold different layers
            self.model = nn.SyncBatchNorm.convert_sync_batchnorm(self.model, process_group=self.mesh.dp_group)
            self._synced_batchnorm = True
        module = self.lightning_module
        self._metric_sync.assign(module, mesh=self.mesh, pipelined=self.pipeline_parallel_size > 1)
        profile = self.partition_method == "profile"
        composition = compose(
            module,
            options=self._compose_options(),
            tp_group=self.mesh.tp_group if self.tensor_parallel_size > 1 else None,
            tp_rank=self.mesh.tp_rank,
            pp_rank=self.mesh.pp_rank,
            layers=(lambda: pipeline_layers_of(module)) if self.pipeline_parallel_size > 1 else None,
            sample=getattr(module, "example_input_array", None) if profile else None,
            cut_groups=(self.mesh.pp_group, self.mesh.dp_group, self.mesh.tp_group),
        )
        if composition.pipeline is not None:
            self._build_pipeline(module, composition.pipeline)
        self._materialize(fitting, meta_loaded)
        self._buffer_sync = BufferSync(
            self.model, group=self.mesh.dp_group, enabled=self.broadcast_buffers and fitting
        )
        # the ranks of a tp / pp group read one batch: their first batch of each loop is compared
        self._batches = BatchAgreement.of_mesh(self.mesh, device=self.root_device)
        if fitting:
            self._batches.expect("training")
        if fitting:
            assert self._engine is not None
            self.setup_optimizers(trainer)
            check_layout_optimizers(
                self.optimizers,
                pipeline=self._pipeline is not None,
                allow_untested=self.allow_untested_optimizer,
                names={id(p): n for n, p in self.model.named_parameters()},
            )
            check_optimizer_kernels(self.optimizers, device=self.root_device)
            self._engine.shard_optimizers(self.optimizers)
            self._guard_hooks()
        self._guard_placeholder_reads()  # evaluation runs (validate, test) at ZeRO-3 too
        if fitting:
            self._explain_zero_views()
        if self._pipeline is not None or (fitting and self.tensor_parallel_size > 1):
            # the summary or a graph logger would run the split model's forward, or count this rank's slices
            self._patched_callbacks += guard_summaries(
                trainer,
                pipelined=self._pipeline is not None,
                tp_size=self.tensor_parallel_size,
                fitting=fitting,
            )
        if self.model is not None:
            cast_frozen(self.model, self._frozen_dtype())
        self._setup_precision_groups()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        # the ranks of one model replica (tp, pp) start with one random state: dropout masks alike, and
        # in evaluation runs too (before, fit only: validate / predict sampling with generate(do_sample)
        # fed the tp ranks different tokens where the ranks were seeded apart)
        agree_random_state(groups=(self.mesh.tp_group, self.mesh.pp_group), device=self.root_device)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for stage in (0, 1, 2, 3):
            name = f"zero{stage}"
            if name not in strategy_registry:
                what = "data parallel" if stage == 0 else f"ZeRO stage {stage}"
                strategy_registry.register(
                    name, cls, description=f"lightning_par {what} (HybridParallelStrategy)", zero_stage=stage
                )
