"""The step side of :class:`~lightning_par.HybridParallelStrategy`: what runs around and inside each step.

:class:`StrategySteps` is a base of the strategy; it holds no state beyond the attributes declared on the
class, which the strategy's ``__init__``, ``setup()`` and ``teardown()`` own: the ZeRO engine, the
pipeline (when ``pipeline_parallel_size > 1``), the buffer synchronisation and the token normaliser
(created here on first use). It dispatches Lightning's training,
validation, test and predict steps, either to the LightningModule inside the engine's step context or,
under pipeline parallelism, to the pipeline schedule; it adapts ``backward``, ``block_backward_sync``
and ``optimizer_step`` to the engine's gradient windows, keeps a step that fp16 loss scaling skipped out
of the step count and the schedulers (``_guard_hooks``, called by ``setup()``; the hooks it sets are
undone at teardown), and wires token-exact loss normalisation into the engine's gradient synchronisation.
Nothing here builds or tears down anything.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par import lightning_hooks
from lightning_par.checkpoint.hook_edits import ZERO_VIEWS
from lightning_par.grad_reads import GradReads, refuse_none_reads
from lightning_par.layout_norms import layout_grad_norms
from lightning_par.loss import TokenNormalizer
from lightning_par.pipeline.lightning import LightningPipeline
from lightning_par.pipeline.runtime import StepStats
from lightning_par.precision import ParallelPrecision
from lightning_par.strategy_loops import StrategyLoops, loader_idx
from lightning_par.tensor_parallel.replicas import mismatch_message, replicated_grad_mismatch
from lightning_par.zero.buffers import BufferSync

if TYPE_CHECKING:
    import lightning.pytorch as pl


class StrategySteps(StrategyLoops):
    """Step dispatch, the engine's gradient windows and token normalisation (see the module docstring)."""

    # set by HybridParallelStrategy.__init__ and setup(); _engine and the mesh come from ZeroCheckpointIO
    _pipeline: LightningPipeline | None
    _token_normalizer: TokenNormalizer | None
    _token_calls = 0  # token_normalized() calls since the last gradient synchronisation
    _token_rescaled = False  # a window was rescaled since the last optimizer step
    _buffer_sync: BufferSync
    _patched: list[str]  # names of the LightningModule's hooks replaced for this run
    _patched_callbacks: list[tuple[Any, list[str]]]  # and of callbacks' hooks
    _grad_reads: GradReads | None = None  # the first optimizer step's param.grad watch (grad_reads.py)
    find_unused_parameters: bool
    _check_tp_replicas = False  # the first optimizer step compares the tp replicas' gradients (stage 0)
    before_state_write: list[Callable[[], None]]  # fences registered by snapshot writers (FlashCheckpoint)

    @property
    def pipeline_stats(self) -> StepStats | None:
        """Busy and total seconds of this rank's last pipeline step (bubble = 1 - busy / total)."""
        return self._pipeline.runtime.last_stats if self._pipeline is not None else None

    @contextmanager
    def _step_context(self, *, training: bool = False) -> Generator[None, None, None]:
        """Around every step: the engine's step context (the ZeRO-3 root unit gathered, a new window's
        gradients pointed into the flat buffer), buffers synchronised as DDP would. Under pipeline
        parallelism the pipeline manages its windows itself (it zeroes at a window's start, and Lightning
        zeroes ``param.grad`` after its backwards, which must not empty the buffer); only ZeRO-3's root
        unit (embeddings, final norm, head: what the pipeline's layers do not gather) is gathered here."""
        engine = self._engine
        gather = engine is not None and (self._pipeline is None or engine.shards_params)
        with engine.forward_context() if engine is not None and gather else nullcontext():
            self._buffer_sync.before_forward()
            yield
            # manual optimization: Lightning's "ddp" turns DDP's gradient sync off after each training
            # step's forward (manual_backward prepares it itself), so DDP syncs buffers before the very
            # first forward only, and each rank keeps its own statistics after it; as here
            module = self.lightning_module
            manual = module is not None and not module.automatic_optimization
            synchronising = training and not manual and (engine is None or engine.sync_enabled)
            self._buffer_sync.after_forward(synchronising=synchronising)
            self._scan_metrics_after_step()

    def _agree(self, loop: str, args: tuple[Any, ...]) -> None:
        self._scan_metrics(loop, args)
        if self._batches is not None and args:
            self._batches.check(loop, args[0])

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._agree("training", args)
        if self._pipeline is None:
            with self._step_context(training=True):
                return super().training_step(*args, **kwargs)
        plugin = self.precision_plugin
        scaler = plugin.scaler if isinstance(plugin, ParallelPrecision) else None
        assert self._engine is not None
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        self._open_pending_window()  # the schedule runs this step's backwards
        with self.precision_plugin.train_step_context(), self._step_context(training=True):
            return self._pipeline.training_step(
                args[0],
                batch_idx,
                engine=self._engine,
                optimizers=self.optimizers,
                loss_scale=scaler.scale if scaler is not None else 1.0,
            )

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        self._open_pending_window()
        if self._pipeline is not None:
            # the pipeline ran every backward inside training_step; Lightning has zeroed the optimizers'
            # gradients since (a new window), which leaves the engine's buffer alone: reduce it now
            assert self._engine is not None
            if self._grad_reads is not None:  # before the reduction: its end marks the gradients landed
                self._grad_reads.arm()
            self._pipeline.end_window(self._engine)
            return closure_loss
        if self._engine is not None:  # its reductions end with this pass, past reentrant checkpoints'
            self._engine.watch_backward(closure_loss)
        if self._grad_reads is not None:
            self._grad_reads.arm()
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _open_pending_window(self) -> None:
        """A backward begins a new gradient window once an optimizer has stepped: the last window's
        gradients are dropped only now, so several optimizers stepped after one backward (manual
        optimization of a model split over two optimizers) all find theirs."""
        if self._engine is not None:
            self._engine.open_window()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._agree("validation", args)
        if self._pipeline is not None:
            with self.precision_plugin.val_step_context(), self._step_context():
                return self._pipeline.eval_step(args[0], stage="val", dataloader_idx=loader_idx(args, kwargs))
        with self._step_context():
            output = super().validation_step(*args, **kwargs)
        self._after_eval_step(args, kwargs)
        return output

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._agree("test", args)
        if self._pipeline is not None:
            with self.precision_plugin.test_step_context(), self._step_context():
                return self._pipeline.eval_step(
                    args[0], stage="test", dataloader_idx=loader_idx(args, kwargs)
                )
        with self._step_context():
            output = super().test_step(*args, **kwargs)
        self._after_eval_step(args, kwargs)
        return output

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._agree("predict", args)
        if self._pipeline is not None:
            with self.precision_plugin.predict_step_context(), self._step_context():
                return self._pipeline.predict_step(args[0], dataloader_idx=loader_idx(args, kwargs))
        with self._step_context():
            output = super().predict_step(*args, **kwargs)
        self._after_eval_step(args, kwargs)
        return output

    # ------------------------------------------------------------------ uneven evaluation (ZeRO-3)
    def gathered_params(self, *, writeback: bool = False) -> AbstractContextManager[None]:
        """Entered by every rank: at ZeRO-3 the whole model is gathered on entry and stays whole until
        the exit, so code on one rank only (``if trainer.is_global_zero: model.generate(...)``) runs its
        forwards without the other ranks. With ``writeback=True`` (every rank, at ZeRO 1-3) the parameters
        inside are whole in their stored precision (the fp32 masters, not the 16-bit compute copy), and
        in-place writes to them (an EMA teacher's update, a clamp) are kept at the exit; every rank must
        make the same writes (checked before anything is written back). Elsewhere a no-op: the parameters
        are whole, and at ZeRO 1/2 writes to the compute copy reach the masters before the next update.
        Under tensor parallelism the parameters stay this rank's slices (``consolidated_state_dict()`` for
        whole weights) and every forward still communicates. After ``fit`` (the model whole, masters
        included) it does nothing. With ``writeback`` a ``FlashCheckpoint``
        copy still reading the weights finishes first."""
        if writeback:
            for fence in self.before_state_write:
                fence()
        engine = self._engine
        return engine.gathered(writeback=writeback) if engine is not None else nullcontext()

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
        self._token_rescaled = False  # the next window's gradients start anew
        if self._pipeline is not None:
            self._pipeline.window_ended()
        if self._engine is not None:  # stages 1/2: all-gather the updated parameters
            # the gradients of the others stay for their steps
            self._engine.after_step(open_window=False, optimizer=optimizer)
        self._end_grad_reads()  # a step skipped for an fp16 overflow never reached the update
        if self._check_tp_replicas:
            self._verify_tp_replicas()
        if self._step_skipped() and self.lightning_module is not None:
            lightning_hooks.uncount_step(self.lightning_module)
        return output

    def _end_grad_reads(self) -> None:
        """The first optimizer step's ``param.grad`` watch ends (``ParallelPrecision.before_update`` calls
        this before the optimizer's own update, which reads every parameter's ``grad``)."""
        reads, self._grad_reads = self._grad_reads, None
        if reads is not None:
            reads.end()

    def _verify_tp_replicas(self) -> None:
        """Once, after the first optimizer step with gradients (they are still in ``param.grad``): the
        tensor-parallel replicas' gradients agree (:mod:`lightning_par.tensor_parallel.replicas`)."""
        module = self.lightning_module
        assert module is not None
        if not any(p.grad is not None for p in module.parameters()):
            return  # a step the fp16 scaler skipped dropped them: the next one is checked
        self._check_tp_replicas = False
        mismatch = replicated_grad_mismatch(
            module, sharded=self._tp()["dims"], group=self.mesh.tp_group, device=self.root_device
        )
        if mismatch:
            raise RuntimeError(mismatch_message(mismatch, fabric=False))

    def _step_skipped(self) -> bool:
        plugin = self.precision_plugin
        return isinstance(plugin, ParallelPrecision) and plugin.last_step_skipped

    def _guard_hooks(self) -> None:
        """Hooks of the LightningModule adapted for this run (see :mod:`lightning_par.lightning_hooks`)."""
        module = self.lightning_module
        plugin = self.precision_plugin
        assert module is not None and self._engine is not None
        if isinstance(plugin, ParallelPrecision) and plugin.scaler is not None:
            self._patched += lightning_hooks.guard_schedulers(
                module,
                skipped=self._step_skipped,
                step_schedulers=lambda s: any(
                    c.scheduler is s and c.interval == "step" for c in self.lr_scheduler_configs
                ),
            )
        if self._pipeline is None:
            self._patched += lightning_hooks.lend_no_sync(module, no_sync=self.block_backward_sync)
        sharded = self._engine.sharded_state
        if (
            sharded is not None
        ):  # under a pipeline too (before, at ZeRO-1 pp2 it left the shards as they were)
            self._patched += lightning_hooks.guard_module_zero_grad(module, optimizers=self.optimizers)
        if sharded is not None and not module.automatic_optimization:
            self._patched += lightning_hooks.guard_toggling(
                module, sharded=sharded, optimizers=self.optimizers
            )
        if self.zero_stage >= 1 and self._pipeline is None:
            self._guard_grad_reads(module)

    def _guard_grad_reads(self, module: pl.LightningModule) -> None:
        """ZeRO 1-3: the gradient hooks the module and user callbacks override refuse ``param.grad`` reads
        that find None at every step (``grad_reads.refuse_none_reads``), after the first step's watch."""
        engine = self._engine
        unused = (lambda: engine.unused_param_ids) if self.find_unused_parameters and engine else None
        names = {id(p): n for n, p in module.named_parameters()}  # once: requires_grad is read at the read

        def refused(where: str) -> AbstractContextManager[None]:
            return refuse_none_reads(names, zero_stage=self.zero_stage, where=where, unused=unused)

        self._guard_module_and_callbacks(
            module, lambda obj: lightning_hooks.guard_grad_reads(obj, refused=refused)
        )

    def _guard_placeholder_reads(self) -> None:
        """The module's and user callbacks' fit-, epoch- and batch-level hooks run inside
        ``lightning_hooks.hook_context`` (ZeRO-3's placeholder reads refused, 16-bit dtype clashes
        explained; the evaluation hooks among them for ``validate`` / ``test`` / ``predict`` too)."""
        module = self.lightning_module
        context = lightning_hooks.hook_context(self._engine, self.precision_plugin)
        if module is None or context is None:
            return
        self._guard_module_and_callbacks(
            module, lambda obj: lightning_hooks.guard_placeholder_reads(obj, refused=context)
        )

    def _explain_zero_views(self) -> None:
        """With whole-file checkpoints, on the ranks other than 0: the save hooks' in-place writes into the
        expanded zeros they get there are explained (``lightning_hooks.explain_zero_views``)."""
        module = self.lightning_module
        if module is None or self.is_global_zero or self.save_distributed_checkpoint or not self._sharded():
            return
        self._guard_module_and_callbacks(
            module, lambda obj: lightning_hooks.explain_zero_views(obj, why=ZERO_VIEWS)
        )

    def _guard_module_and_callbacks(
        self, module: pl.LightningModule, guard: Callable[[Any], list[str]]
    ) -> None:
        """``guard(obj)`` (one of :mod:`lightning_par.lightning_hooks`' functions) on the module and on each
        of the Trainer's callbacks; the names each set are kept for the teardown's restore."""
        self._patched += guard(module)
        for callback in module.trainer.callbacks:  # type: ignore[attr-defined]
            names = guard(callback)
            if names:
                self._patched_callbacks.append((callback, names))

    # ------------------------------------------------------------------ gradient norms for logging
    def grad_norm(
        self, module: nn.Module | None = None, norm_type: float | str = 2.0, group_separator: str = "/"
    ) -> dict[str, Tensor | float]:
        """Lightning's ``grad_norm(module, norm_type)`` for this layout, from ``on_before_optimizer_step``:
        each parameter's gradient p-norm under the same keys (``grad_2.0_norm/<name>`` and
        ``grad_2.0_norm_total``), for the gradients the optimizer is about to apply, equal on every rank.

        Lightning's function reads ``param.grad`` of this rank, which at ZeRO 1-3 is None; here each
        element is counted once over the layout (:mod:`lightning_par.layout_norms`), so every rank must
        call it. ``module`` defaults to the LightningModule; names are relative to it, as Lightning's."""
        root = self.lightning_module
        assert root is not None, "grad_norm() needs the strategy set up (call it from a hook)"
        return layout_grad_norms(
            root,
            module,
            engine=self._engine,
            mesh=self.mesh,
            device=self.root_device,
            norm_type=norm_type,
            group_separator=group_separator,
        )

    # ------------------------------------------------------------------ token normalisation
    def token_normalized(self, loss_sum: Tensor, n_tokens: int | Tensor) -> Tensor:
        """Token-exact accumulation: return this from ``training_step`` instead of a mean loss.

        ``loss_sum`` is the sum of the micro-batch's token losses and ``n_tokens`` its number of valid
        tokens (see :func:`lightning_par.loss.token_loss_sum`). At the end of the accumulation window the
        gradients are rescaled so that they equal the gradient of (sum of all token losses) / (number of
        valid tokens) over all micro-batches and data-parallel ranks, however unevenly the tokens are
        spread. The returned value is ``loss_sum`` itself; log ``loss_sum / n_tokens`` for display.
        Call it in every training step of a window or in none, on every rank alike; in manual
        optimization, run the window's backwards but the last inside :meth:`block_backward_sync`.
        """
        if self._engine is None:
            raise RuntimeError("token_normalized() is for training_step, after the strategy's setup().")
        if self._pipeline is not None:  # only the last stage would count, only its gradients be rescaled
            raise RuntimeError(
                "token_normalized() does not apply under pipeline parallelism: return {'loss_sum': sum of"
                " the token losses, 'tokens': number of valid tokens} from pipeline_loss instead, and the"
                " pipeline normalises every stage's gradients by the window's tokens."
            )
        if self._token_normalizer is None:
            self._token_normalizer = TokenNormalizer(group=self.mesh.dp_group, device=self.root_device)
            self._engine.on_synchronized(self._apply_token_normalization)
        self._token_normalizer.add(n_tokens)
        self._token_calls += 1
        return loss_sum

    def _apply_token_normalization(self) -> None:
        """At a gradient synchronisation: the window's gradients (of summed token losses) become the
        gradient of the global token mean. A window that did not call :meth:`token_normalized` (a loss
        returned as a mean after token-exact epochs) is left alone; before, its gradients were scaled by
        ``N / c`` as a window of one token. Each rank of the dp group calls it in the same windows (the
        count is all-reduced)."""
        assert self._token_normalizer is not None and self._engine is not None
        module = self.lightning_module
        assert module is not None
        calls, self._token_calls = self._token_calls, 0
        if calls == 0:
            return
        if self._token_rescaled:
            # the buffer holds the earlier synchronisations' rescaled gradients: a second factor would
            # scale them again (manual optimization whose backwards all synchronise)
            raise RuntimeError(
                "token_normalized(): a second gradient synchronisation before the optimizer step. Each"
                " backward of a manual-optimization accumulation window synchronises unless it runs"
                " inside `with self.trainer.strategy.block_backward_sync():` (all but the window's last"
                " backward), as Lightning's automatic optimization does; the token count of the whole"
                " window then normalises its gradients once."
            )
        self._token_rescaled = True
        # Lightning divides each micro-batch loss by accumulate_grad_batches in automatic optimization
        loss_scale = 1.0 / module.trainer.accumulate_grad_batches if module.automatic_optimization else 1.0
        factor = self._token_normalizer.grad_scale(loss_scale=loss_scale, dp_size=self.mesh.dp_size)
        self._engine.scale_grads(factor)
