"""The loop side of :class:`~lightning_par.HybridParallelStrategy`: what runs when Lightning's loops start
and end, before any step.

:class:`StrategyLoops` is a base of :class:`~lightning_par.strategy_steps.StrategySteps` and declares the
attributes it reads (the engine, the pipeline, the mesh, the batch agreement). At each loop's start it
checks what a step could not undo: under a pipeline, a last batch on some dp rank too small for the
micro-batches (training, validation, test, predict; refused on every rank before the first batch); at
ZeRO-3, data-parallel ranks whose evaluation batch counts differ (joined, :mod:`lightning_par.eval_join`,
or refused with the fix), and a dataloader that gives some rank no batch. After each evaluation step of
an uneven loop, a rank whose batches are over serves the others' gathers.

"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.data import has_len
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from typing_extensions import override

from lightning_par.batch_agreement import BatchAgreement
from lightning_par.checkpoint.strategy_io import ZeroCheckpointIO
from lightning_par.data_reduce import MetricSync
from lightning_par.eval_join import (
    EvalJoin,
    check_every_rank_has_batches,
    counts_differ,
    eval_count_table,
    last_batch_sizes,
    loop_dataloaders,
    plan_eval_join,
    refuse_short_last_batches,
    refuse_uneven_short_batches,
)
from lightning_par.pipeline.lightning import LightningPipeline
from lightning_par.zero.leftovers import refuse_left_placeholders
from lightning_par.zero.stage3_join import Stage3Join


def loader_idx(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The ``dataloader_idx`` of an evaluation step's arguments, as Lightning passes them (third
    positional, or absent with one dataloader: 0)."""
    return int(args[2] if len(args) > 2 else kwargs.get("dataloader_idx", 0))


def _defined_by(cls: type, name: str) -> type | None:
    return next((c for c in cls.__mro__ if name in vars(c)), None)


def _predict_step_unserved(module: pl.LightningModule) -> bool:
    """A ``predict_step`` of the user's own that no ``pipeline_predict`` stands for: none is defined, or
    the step was overridden in a subclass of the class that defines it."""
    if not is_overridden("predict_step", module):
        return False
    step, hook = _defined_by(type(module), "predict_step"), _defined_by(type(module), "pipeline_predict")
    return hook is None or (step is not None and step is not hook and issubclass(step, hook))


def _batches_reached(trainer: pl.Trainer) -> int | float:
    """How far into the current epoch's training batches this fit can go: all of them, unless
    ``max_steps`` ends it earlier (then at most ``done + steps left x accumulation``, the largest
    accumulation a ``GradientAccumulationScheduler`` will set counted, an upper bound: a window started
    before a resume ends sooner). A short last batch the run never reaches is not refused."""
    count = trainer.num_training_batches
    if trainer.max_steps < 0 or math.isinf(count):
        return count
    accumulate = max(
        [trainer.accumulate_grad_batches]
        + [
            max(c.scheduling.values())
            for c in trainer.callbacks  # type: ignore[attr-defined]
            if isinstance(c, GradientAccumulationScheduler)
        ]
    )
    done = trainer.fit_loop.epoch_loop.batch_progress.current.ready  # restored by a mid-epoch resume
    done = done if done < count else 0  # resumed at an epoch's end: the next epoch starts at its first
    return min(count, done + max(trainer.max_steps - trainer.global_step, 0) * accumulate)


class StrategyLoops(ZeroCheckpointIO):
    """Loop starts and ends: the batch checks and ZeRO-3's uneven evaluation (see the module docstring)."""

    # set by HybridParallelStrategy.__init__ and setup(); _engine and the mesh come from ZeroCheckpointIO
    _pipeline: LightningPipeline | None
    _eval_join: EvalJoin | None = None  # the running evaluation loop's, when its dp ranks' counts differ
    _batches: BatchAgreement | None = None  # the tp / pp ranks' first batches compared (batch_agreement.py)
    _metric_sync: MetricSync  # torchmetrics over the data-parallel group (data_reduce.py)
    _loop_runs = 0  # loop runs started (fit, each validation run, test, predict): metric rescans key on it
    _metric_scan: tuple[Any, ...] | None = None  # the loop run and epoch whose first step rescanned
    _metric_scan_after = False  # that first step not yet rescanned after it

    def _refuse_placeholders(self) -> None:
        """The first loop of a run starts: parameters that were ZeRO-3 placeholders at setup and that no
        checkpoint loaded into since would train or evaluate on NaN (:mod:`lightning_par.zero.leftovers`)."""
        names, self._left_placeholders = self._left_placeholders, ()
        module = self.lightning_module
        if names and module is not None:
            refuse_left_placeholders(list(names), total=sum(1 for _ in module.parameters()))

    @override
    def on_train_start(self) -> None:
        """Under a pipeline: a training dataloader whose last batch on some dp rank cannot fill the
        micro-batches is refused on every rank before the first step (before: at that batch, after most
        of an epoch, on the ranks that had it)."""
        super().on_train_start()
        self._refuse_placeholders()
        self._loop_runs += 1
        pipeline, module = self._pipeline, self.lightning_module
        if pipeline is None or module is None:
            return
        trainer = module.trainer
        loaders = loop_dataloaders(trainer, "training")
        lasts = last_batch_sizes(loaders, [_batches_reached(trainer)] * len(loaders))
        table = [lasts]
        if self.mesh.dp_size > 1:
            table = eval_count_table(lasts, group=self.mesh.dp_group, device=self.root_device)
        refuse_short_last_batches(table, num_microbatches=pipeline.runtime.m, loop="training")

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._refuse_placeholders()
        self._start_eval_loop("validation")

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._refuse_placeholders()
        self._start_eval_loop("test")

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._refuse_placeholders()
        self._start_eval_loop("predict")
        module = self.lightning_module
        if module is not None and self._pipeline is not None and _predict_step_unserved(module):
            # the schedule runs the pipeline layers, not the user's step: say so rather than return
            # something the user's predict_step would not have (before: the last stage's raw outputs)
            rank_zero_warn(
                f"{type(module).__name__}.predict_step is not run under pipeline parallelism: trainer.predict"
                " returns the last stage's outputs (the pipeline layers' output) for each batch, on every"
                " rank. Define pipeline_predict(output, batch) for what predict should return (it runs on"
                " the last stage, per micro-batch), or post-process the outputs after trainer.predict."
            )

    @override
    def on_validation_end(self) -> None:
        self._end_eval_join()
        super().on_validation_end()

    @override
    def on_test_end(self) -> None:
        self._end_eval_join()
        super().on_test_end()

    @override
    def on_predict_end(self) -> None:
        self._end_eval_join()
        super().on_predict_end()

    @override
    def process_dataloader(self, dataloader: object) -> object:
        engine = self._engine
        if isinstance(engine, Stage3Join) and self.mesh.dp_size > 1:
            check_every_rank_has_batches(
                len(dataloader) if has_len(dataloader) else None,
                group=self.mesh.dp_group,
                device=self.root_device,
            )
        return super().process_dataloader(dataloader)

    def _scan_metrics(self, loop: str, args: tuple[Any, ...]) -> None:
        """At the first step of each loop run, training epoch and evaluation dataloader (``args``: the
        step's), before it and once after it, and before and after every other step what was added to
        a container the last scan walked (:meth:`MetricSync.refresh`): metrics made since setup (in a hook,
        ``on_validation_epoch_start`` say, in that first step, per dataloader, or kept in a nested dict
        attribute) and those of the Trainer's callbacks and datamodule sync over the data-parallel group
        too (before, they gathered over the world: a sum doubled at tp2). Every rank scans at the same
        steps; a scan walks the module once."""
        module = self.lightning_module
        if module is None:
            return
        part = module.current_epoch if loop == "training" else loader_idx(args, {})
        key = (loop, self._loop_runs, part)
        if key == self._metric_scan:  # what was added since (in a hook after the last step)
            self._metric_sync.refresh(mesh=self.mesh, pipelined=self._pipeline is not None)
            return
        self._metric_scan, self._metric_scan_after = key, True
        self._rescan_metrics(module)

    def _scan_metrics_after_step(self) -> None:
        """After every step: metrics the first step made (after the scan before it), or any step, into a
        container the last scan walked (``self.counts.setdefault(label, SumMetric())`` at batch 5)."""
        module = self.lightning_module
        if module is not None and self._metric_scan_after:
            self._metric_scan_after = False
            self._rescan_metrics(module)
        else:
            self._metric_sync.refresh(mesh=self.mesh, pipelined=self._pipeline is not None)

    def _rescan_metrics(self, module: pl.LightningModule) -> None:
        trainer: Any = module._trainer  # None when the module is used outside a Trainer's run
        others = [*trainer.callbacks, trainer.datamodule] if trainer is not None else []
        roots = [module, *(o for o in others if o is not None)]
        self._metric_sync.rescan(*roots, mesh=self.mesh, pipelined=self._pipeline is not None)

    def _start_eval_loop(self, loop_name: str) -> None:
        """The evaluation loop starting now: its first batch awaited by the tp / pp batch agreement; under
        a pipeline the dp ranks' last batches checked against the micro-batches; the dp ranks' batch
        counts compared (:mod:`lightning_par.eval_join`): at ZeRO-3 uneven counts are joined, under a
        pipeline its dp token mean is left out."""
        self._loop_runs += 1
        if self._batches is not None:  # the loop's first batch is compared over the tp / pp groups
            self._batches.expect(loop_name)
        self._eval_join = None
        engine = self._engine
        zero3 = isinstance(engine, Stage3Join)
        pipeline = self._pipeline
        if not (pipeline is not None or (zero3 and self.mesh.dp_size > 1)):
            return  # nothing communicates over dp in this evaluation, and no batch is cut
        module = self.lightning_module
        assert module is not None
        loop = module.trainer._active_loop
        assert loop is not None and isinstance(loop.max_batches, list)  # an evaluation loop's, per dataloader
        k = len(loop.max_batches)
        if self.mesh.dp_size == 1:
            return  # a pipeline's short batch runs in fewer micro-batches (pipeline.steps.evaluate)
        lasts = []
        if pipeline is not None and zero3:  # the dp ranks' short last batches must agree in size
            lasts = last_batch_sizes(loop_dataloaders(module.trainer, loop_name), loop.max_batches)
        both = eval_count_table(
            [*loop.max_batches, *lasts], group=self.mesh.dp_group, device=self.root_device
        )
        table = [row[:k] for row in both]
        if pipeline is not None:
            refuse_uneven_short_batches(
                [row[k:] for row in both], num_microbatches=pipeline.runtime.m, loop=loop_name
            )
            pipeline.uneven_eval = counts_differ(table)
        if not isinstance(engine, Stage3Join):
            return
        self._eval_join = plan_eval_join(
            table, rank=self.mesh.dp_rank, pipelined=self._pipeline is not None, loop=loop_name
        )
        step = getattr(module, f"{loop_name}_step")
        if self._eval_join is not None and is_param_in_hook_signature(step, "dataloader_iter", explicit=True):
            raise ValueError(
                f"{loop_name}_step(dataloader_iter) takes its own batches, so the strategy cannot tell when"
                " this rank's are over while the data-parallel ranks' batch counts differ at ZeRO-3. Give"
                " every rank the same number of batches, or take a batch argument."
            )
        engine.joining = self._eval_join is not None

    def _end_eval_join(self) -> None:
        if isinstance(self._engine, Stage3Join):
            self._engine.joining = False
        self._eval_join = None

    def _after_eval_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """After this rank's last batch of a dataloader in an uneven loop: serve the others' gathers."""
        join = self._eval_join
        if join is None:
            return
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        dataloader_idx = loader_idx(args, kwargs)
        loop = self.lightning_module.trainer._active_loop  # type: ignore[union-attr]
        assert loop is not None and isinstance(self._engine, Stage3Join)
        if join.ends_dataloader(batch_idx, dataloader_idx, last_batch=loop.batch_progress.is_last_batch):
            self._engine.serve_gathers()
            if dataloader_idx == len(join.counts) - 1:
                # every rank is past its last batch (serve_gathers returns on all together): the epoch-end
                # hooks run synced again, a generate() there with synced_gpus (before, joining stayed on
                # until on_*_end and a rank whose generation ran longer met the other's teardown gather)
                self._engine.joining = False
