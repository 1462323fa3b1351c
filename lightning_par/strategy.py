"""``HybridParallelStrategy``: the Lightning adapter that composes the parallel mechanisms.

The strategy is thin on purpose. It launches processes and initialises ``torch.distributed`` the way
Lightning's DDP does (``popen``/``spawn``/``fork`` launchers, or processes created externally by
``torchrun`` or SLURM via Lightning's cluster environments), builds one :class:`ParallelMesh`, and then
applies the mechanisms in the documented order (see ARCHITECTURE.md): tensor parallel, pipeline split,
activation checkpointing, ZeRO over the dp group, precision, optimizer. Every mechanism lives in its own
module and can be used without a ``Trainer``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par.activation_checkpointing import apply_activation_checkpointing
from lightning_par.checkpoint.strategy_io import ZeroCheckpointIO
from lightning_par.loss import TokenNormalizer
from lightning_par.memory import MemoryReport, measure_memory
from lightning_par.mesh import MeshLayout, ParallelMesh
from lightning_par.pipeline.apply import TiedGradients, apply_pipeline
from lightning_par.pipeline.lightning import LightningPipeline, pipeline_layers_of
from lightning_par.pipeline.partition import PartitionMethod
from lightning_par.pipeline.runtime import PipelineRuntime, StepStats
from lightning_par.precision import ParallelPrecision, convert_precision_plugin
from lightning_par.strategy_options import PipelineSchedule, StartMethod, check_options
from lightning_par.tensor_parallel import apply_tensor_parallel
from lightning_par.zero import apply_zero, broadcast_module_states
from lightning_par.zero.engine import Engine, ReduceChoice, resolve_reduce_op
from lightning_par.zero.grad_sync import GradSyncPolicy
from lightning_par.zero.stage3 import Stage3Engine
from lightning_par.zero.units import UnitPolicy

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.accelerators import Accelerator

log = logging.getLogger(__name__)


class HybridParallelStrategy(ZeroCheckpointIO):
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
        zero3_units: stage 3: which modules gather their parameters together: module classes or
            ``fnmatch`` patterns of module names (default: every child of an ``nn.ModuleList``).
        reshard_after_forward: stage 3: free gathered parameters after each unit's forward (re-gather in
            backward: 3Ψ traffic, least memory) or keep them until backward (2Ψ traffic).
        prefetch: stage 3: gather the next unit while the current one computes.
        meta_init: stage 3: run ``configure_model()`` on the meta device and materialise only this rank's
            shard, unit by unit, with each module's ``reset_parameters()``.
        activation_checkpointing: recompute each selected layer in backward instead of keeping its
            activations: ``True`` for every child of an ``nn.ModuleList`` (the blocks), or module classes /
            name patterns.
        unshard_on_teardown: stage 3: gather the whole model back into every rank when training ends, so
            the module is usable afterwards (turn off for models that do not fit one device).
        find_unused_parameters: allow parameters without gradients in a step (their ``.grad`` stays
            ``None`` when no rank used them); without it such parameters raise a clear error.
        tp_plan: tensor-parallel plan name (``"gpt"``, ``"llama"``) or ``{module pattern: style}``; default:
            the LightningModule's ``tp_plan`` attribute. Applied when ``tensor_parallel_size > 1``.
        sequence_parallel: split the activations between tensor-parallel regions along the sequence.
        num_microbatches: micro-batches per pipeline step (default ``2 * pipeline_parallel_size``).
        pipeline_schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"``.
        virtual_stages: model chunks per pipeline rank (``interleaved_1f1b`` needs >= 2).
        partition_method: how layers are balanced over stages: ``"uniform"``, ``"parameters"`` or
            ``"profile"`` (measured time; uses the LightningModule's ``example_input_array``).
        process_group_backend: ``"nccl"``/``"gloo"``; default from the device (NCCL on CUDA, Gloo on CPU).
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
        reshard_after_forward: bool = True,
        prefetch: bool = True,
        meta_init: bool = True,
        activation_checkpointing: bool | UnitPolicy = False,
        unshard_on_teardown: bool = True,
        tp_plan: str | dict[str, str] | None = None,
        sequence_parallel: bool = False,
        num_microbatches: int | None = None,
        pipeline_schedule: PipelineSchedule = "1f1b",
        virtual_stages: int = 1,
        partition_method: PartitionMethod = "parameters",
        process_group_backend: str | None = None,
        timeout_s: float = 1800.0,
        start_method: StartMethod = "popen",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
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
            partition_method=partition_method,
            timeout_s=timeout_s,
            start_method=start_method,
        )
        self.zero_stage = zero_stage  # read by the precision_plugin setter, which the base class calls
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.tensor_parallel_size = tensor_parallel_size
        self.pipeline_parallel_size = pipeline_parallel_size
        self.bucket_size_mb = float(bucket_size_mb)
        self.grad_sync = grad_sync
        self.reduce_op: ReduceChoice = reduce_op
        self.find_unused_parameters = find_unused_parameters
        self.zero3_units = zero3_units
        self.tp_plan = tp_plan
        self.sequence_parallel = sequence_parallel
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
        self.meta_init = meta_init
        self.activation_checkpointing = activation_checkpointing
        self.unshard_on_teardown = unshard_on_teardown
        self.pipeline_schedule = pipeline_schedule
        self.num_microbatches = num_microbatches
        self.virtual_stages = virtual_stages
        self.partition_method: PartitionMethod = partition_method
        self._pipeline: LightningPipeline | None = None
        self._tied: TiedGradients | None = None
        self._process_group_backend = process_group_backend
        self._timeout = timedelta(seconds=timeout_s)
        self._start_method: StartMethod = start_method
        self._num_nodes = 1
        self._mesh: ParallelMesh | None = None
        self._engine: Engine | None = None
        self._sharded_source: Path | None = None
        self._token_normalizer: TokenNormalizer | None = None

    # ------------------------------------------------------------------ precision
    @property
    @override
    def precision_plugin(self) -> Precision:
        plugin = self._precision_plugin
        return plugin if plugin is not None else ParallelPrecision("32-true")

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = convert_precision_plugin(plugin, zero_stage=self.zero_stage)

    # ------------------------------------------------------------------ topology
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        # Lightning asks custom strategies this to decide on distributed samplers.
        return True

    @property
    def mesh(self) -> ParallelMesh:
        if self._mesh is None:
            raise RuntimeError("The parallel mesh exists only after the strategy's setup_environment().")
        return self._mesh

    @property
    def layout(self) -> MeshLayout:
        """Mesh sizes; available before process groups exist (validated against the world size)."""
        return MeshLayout(
            world_size=self.num_nodes * self.num_processes,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
        )

    @override
    def tp_coordinates(self) -> tuple[int, int]:
        return (self._mesh.tp_rank if self._mesh is not None else 0), self.tensor_parallel_size

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Ranks of one tensor/pipeline group consume the same samples: split the data over dp only.
        if self._mesh is not None:
            return {"num_replicas": self._mesh.dp_size, "rank": self._mesh.dp_rank}
        coords = self.layout.coords(self.global_rank)
        return {"num_replicas": self.layout.data_parallel_size, "rank": coords.dp}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def engine(self) -> Engine | None:
        """The ZeRO engine (after ``setup`` for fitting), else ``None``."""
        return self._engine

    # ------------------------------------------------------------------ launch and init
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def setup_environment(self) -> None:
        # Validate the layout before any process group exists: a bad size fails fast on every rank.
        _ = self.layout
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = (
            self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        )
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        self._mesh = ParallelMesh(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            timeout=self._timeout,
        )
        log.info("lightning_par: %r", self._mesh)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        assert self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self.tensor_parallel_size > 1:
            self._apply_tensor_parallel()
        if self.pipeline_parallel_size > 1:
            self._apply_pipeline()
        if self.activation_checkpointing is not False:
            policy = None if self.activation_checkpointing is True else self.activation_checkpointing
            apply_activation_checkpointing(self.model, policy=policy)
        if self.zero_stage == 3:
            # parameters are sharded for evaluation too: a meta-initialised model exists only as shards
            self._engine = Stage3Engine(
                self.model,
                group=self.mesh.dp_group,
                units=self.zero3_units,
                reshard_after_forward=self.reshard_after_forward,
                prefetch=self.prefetch,
                reduce_op=resolve_reduce_op(self.reduce_op, self.mesh.dp_group),
                find_unused_parameters=self.find_unused_parameters,
                compute_dtype=self._dtypes()[0],
                grad_dtype=self._dtypes()[1],
            )
            if trainer.state.fn == TrainerFn.FITTING:
                self.setup_optimizers(trainer)
                self._engine.shard_optimizers(self.optimizers)
                self._guard_schedulers()
        elif trainer.state.fn == TrainerFn.FITTING:
            # Order of composition (ARCHITECTURE.md): TP, PP, checkpointing, then ZeRO over dp.
            self._engine = apply_zero(
                self.model,
                group=self.mesh.dp_group,
                stage=self.zero_stage,
                bucket_size_mb=self.bucket_size_mb,
                # a pipeline step's micro-batches are its accumulation window, reduced after the schedule
                grad_sync="boundary" if self.pipeline_parallel_size > 1 else self.grad_sync,
                reduce_op=self.reduce_op,
                find_unused_parameters=self.find_unused_parameters,
                compute_dtype=self._dtypes()[0],
                grad_dtype=self._dtypes()[1],
            )
            self.setup_optimizers(trainer)
            self._engine.shard_optimizers(self.optimizers)
            self._guard_schedulers()
        else:
            broadcast_module_states(self.model, group=self.mesh.dp_group)
        self._cast_unmanaged()
        plugin = self.precision_plugin
        if isinstance(plugin, ParallelPrecision):
            # each dp rank holds disjoint gradient pieces from stage 1 on, each tp rank its own tensor
            # shards: the clip norm sums over both, counting tp-replicated parameters once
            groups = [self.mesh.dp_group] if self.zero_stage > 0 else []
            if self.pipeline_parallel_size > 1:
                groups.append(self.mesh.pp_group)  # each stage holds different layers
            if self.tensor_parallel_size > 1:
                groups.append(self.mesh.tp_group)
                plugin.tp_group = self.mesh.tp_group
            plugin.grad_norm_groups = tuple(groups)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _apply_tensor_parallel(self) -> None:
        """Step 3 of the composition: the plan's modules become tensor-parallel over the tp group."""
        assert self.model is not None
        plan = self.tp_plan if self.tp_plan is not None else getattr(self.lightning_module, "tp_plan", None)
        if plan is None:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} needs a plan: pass tp_plan ('gpt', 'llama'"
                " or {module pattern: style}) or give the LightningModule a tp_plan attribute."
            )
        if any(p.is_meta for p in self.model.parameters()):
            raise ValueError(
                "Tensor parallelism slices real weights, but the model is on the meta device; with"
                " zero_stage=3 pass meta_init=False."
            )
        applied = apply_tensor_parallel(
            self.model, group=self.mesh.tp_group, plan=plan, sequence_parallel=self.sequence_parallel
        )
        log.info(
            "lightning_par: tensor parallel over %d ranks: %d modules",
            self.tensor_parallel_size,
            len(applied),
        )

    def _apply_pipeline(self) -> None:
        """Step 4 of the composition: keep this rank's chunks; sum tied gradients over their holders."""
        module = self.lightning_module
        assert module is not None and self.num_microbatches is not None
        layers = pipeline_layers_of(module)
        sample = getattr(module, "example_input_array", None) if self.partition_method == "profile" else None
        split = apply_pipeline(
            layers,
            pp_rank=self.mesh.pp_rank,
            pp_size=self.pipeline_parallel_size,
            virtual_stages=self.virtual_stages,
            method=self.partition_method,
            sample=sample,
        )
        runtime = PipelineRuntime(
            chunks=split.chunks,
            group=self.mesh.pp_group,
            schedule=self.pipeline_schedule,
            num_microbatches=self.num_microbatches,
        )
        tied = TiedGradients(
            module, local=split.local, pp_group=self.mesh.pp_group, pp_groups=self.mesh.layout.groups("pp")
        )
        self._tied = tied
        self._pipeline = LightningPipeline(module, runtime)
        # Lightning zeroes gradients after training_step, which here has already run the backwards;
        # the pipeline step zeroes them itself at the start of each accumulation window
        module.optimizer_zero_grad = lambda *args, **kwargs: None  # type: ignore[method-assign]
        log.info(
            "lightning_par: pipeline stage %d of %d holds layers %s",
            self.mesh.pp_rank,
            self.pipeline_parallel_size,
            [
                split.pieces[c * self.pipeline_parallel_size + self.mesh.pp_rank]
                for c in range(self.virtual_stages)
            ],
        )

    def _end_pipeline_window(self) -> None:
        """After a pipeline step: at the last step of an accumulation window, sum tied gradients over
        their stages, then reduce over dp (block_backward_sync disables both on the other steps)."""
        assert self._engine is not None and self._tied is not None
        if self._engine.sync_enabled:
            self._tied.exchange()
            self._engine.flush()

    @property
    def pipeline_stats(self) -> StepStats | None:
        """Busy and total seconds of this rank's last pipeline step (bubble = 1 - busy / total)."""
        return self._pipeline.runtime.last_stats if self._pipeline is not None else None

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if any(p.is_meta for p in self.model.parameters()):
            if self.zero_stage != 3:
                raise ValueError(
                    "The model has meta-device parameters, which only zero_stage=3 materialises (shard by"
                    " shard); create the model on a real device or use zero_stage=3."
                )
            return  # the stage-3 engine materialises each unit on this device
        self.model.to(self.root_device)

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Stage 3 with ``meta_init``: ``configure_model()`` builds the model on the meta device."""
        if self.zero_stage == 3 and self.meta_init:
            with torch.device("meta"):
                yield
        else:
            yield

    def _step_context(self) -> AbstractContextManager[None]:
        return self._engine.forward_context() if self._engine is not None else nullcontext()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            plugin = self.precision_plugin
            scale = (
                plugin.scaler.scale_loss if isinstance(plugin, ParallelPrecision) and plugin.scaler else None
            )
            engine = self._engine
            assert engine is not None and self.lightning_module is not None
            batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
            if batch_idx % self.lightning_module.trainer.accumulate_grad_batches == 0:
                # a new window: Lightning would zero the gradients after training_step, where the pipeline
                # already put them (its optimizer_zero_grad hook is a no-op in pipeline mode)
                for opt in self.optimizers:
                    opt.zero_grad(set_to_none=True)
                self.lightning_module.zero_grad(set_to_none=True)
            with self.precision_plugin.train_step_context():
                return self._pipeline.training_step(
                    args[0],
                    no_sync=engine.no_sync,
                    end_window=self._end_pipeline_window,
                    **({"loss_scale": scale} if scale is not None else {}),
                )
        with self._step_context():
            return super().training_step(*args, **kwargs)

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        if self._pipeline is not None:
            return closure_loss  # the pipeline ran every backward inside training_step
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            with self.precision_plugin.val_step_context():
                return self._pipeline.eval_step(args[0], stage="val")
        with self._step_context():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            with self.precision_plugin.test_step_context():
                return self._pipeline.eval_step(args[0], stage="test")
        with self._step_context():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            raise ValueError(
                "predict with pipeline_parallel_size > 1 is not supported; export the model first."
            )
        with self._step_context():
            return super().predict_step(*args, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this on every non-final accumulation step: skip all communication."""
        if self._engine is None:
            yield
            return
        with self._engine.no_sync():
            yield

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._engine is not None:
            self._engine.after_step()  # stages 1/2: all-gather the updated parameters
        if self._step_skipped():
            self._uncount_step()
        return output

    # ------------------------------------------------------------------ mixed precision
    def _dtypes(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        """(compute, reduction) dtypes for the engine; (None, None) in fp32: the parameters' own."""
        plugin = self.precision_plugin
        if isinstance(plugin, ParallelPrecision) and plugin.low_precision:
            return plugin.compute_dtype, plugin.reduce_dtype
        return None, None

    def _cast_unmanaged(self) -> None:
        """Frozen floating parameters (the engine casts the trainable ones) follow the compute dtype."""
        compute, _ = self._dtypes()
        if compute is None or self.model is None:
            return
        for p in self.model.parameters():
            if not p.requires_grad and p.is_floating_point() and not p.is_meta:
                p.data = p.data.to(compute)

    def _step_skipped(self) -> bool:
        plugin = self.precision_plugin
        return isinstance(plugin, ParallelPrecision) and plugin.last_step_skipped

    def _guard_schedulers(self) -> None:
        """With fp16 loss scaling, per-step LR schedulers do not advance on a skipped step: the module's
        ``lr_scheduler_step`` hook (through which Lightning steps them) is wrapped on this instance."""
        plugin = self.precision_plugin
        module = self.lightning_module
        if not isinstance(plugin, ParallelPrecision) or plugin.scaler is None or module is None:
            return
        inner = module.lr_scheduler_step
        if getattr(inner, "_lightning_par_guarded", False):
            return

        def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
            step_interval = any(
                c.scheduler is scheduler and c.interval == "step" for c in self.lr_scheduler_configs
            )
            if not (step_interval and self._step_skipped()):
                inner(scheduler, metric)

        lr_scheduler_step._lightning_par_guarded = True  # type: ignore[attr-defined]
        module.lr_scheduler_step = lr_scheduler_step  # type: ignore[method-assign]

    def _uncount_step(self) -> None:
        """A skipped step is not a step: undo the optimizer-step count Lightning is about to complete
        (``trainer.global_step``, which drives ``max_steps`` and step-based checkpointing)."""
        module = self.lightning_module
        if module is None or not module.automatic_optimization:
            return
        step = module.trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step
        # Lightning increments "completed" right after this hook returns; take one off first
        step.total.completed -= 1
        step.current.completed -= 1

    def token_normalized(self, loss_sum: Tensor, n_tokens: int | Tensor) -> Tensor:
        """Token-exact accumulation: return this from ``training_step`` instead of a mean loss.

        ``loss_sum`` is the sum of the micro-batch's token losses and ``n_tokens`` its number of valid
        tokens (see :func:`lightning_par.loss.token_loss_sum`). At the end of the accumulation window the
        gradients are rescaled so that they equal the gradient of (sum of all token losses) / (number of
        valid tokens) over all micro-batches and data-parallel ranks, however unevenly the tokens are
        spread. The returned value is ``loss_sum`` itself; log ``loss_sum / n_tokens`` for display.
        """
        if self._engine is None:
            raise RuntimeError("token_normalized() is for training_step, after the strategy's setup().")
        if self._token_normalizer is None:
            self._token_normalizer = TokenNormalizer(group=self.mesh.dp_group)
            self._engine.on_synchronized(self._apply_token_normalization)
        self._token_normalizer.add(n_tokens)
        return loss_sum

    def _apply_token_normalization(self) -> None:
        assert self._token_normalizer is not None and self._engine is not None
        module = self.lightning_module
        assert module is not None
        # Lightning divides each micro-batch loss by accumulate_grad_batches in automatic optimization
        loss_scale = 1.0 / module.trainer.accumulate_grad_batches if module.automatic_optimization else 1.0
        factor = self._token_normalizer.grad_scale(loss_scale=loss_scale, dp_size=self.mesh.dp_size)
        self._engine.scale_grads(factor)

    def memory_report(self) -> MemoryReport:
        """Bytes of parameters, gradients, optimizer state, buffers and communication buffers on this rank."""
        assert self.lightning_module is not None
        return measure_memory(self.lightning_module, self._engine, self.optimizers)

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(
        self,
        tensor: Tensor | Any,
        group: Any | None = None,
        reduce_op: ReduceOp | str | None = "mean",
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        if self._engine is not None:
            if isinstance(self._engine, Stage3Engine) and self.unshard_on_teardown:
                self._engine.unshard_all()  # leave a usable, whole model behind
            # hooks go; the engine stays so trainer.save_checkpoint() after fit still sees the shards
            # (the next setup() builds a new one)
            self._engine.remove()
        self._token_normalizer = None
        module = self.lightning_module
        if module is None or not any(p.is_meta for p in module.parameters()):
            super().teardown()
            return
        # Lightning's teardown moves the whole module to the CPU, which layers of other pipeline stages
        # (meta placeholders) cannot do: move only real tensors, then release the rest as it does.
        _optimizers_to_device(self.optimizers, torch.device("cpu"))
        with torch.no_grad():
            for t in (*module.parameters(), *module.buffers()):
                if not t.is_meta:
                    t.data = t.data.cpu()
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

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
