"""EMA and SWA of the weights for the ``Trainer`` at any layout: Lightning's ``WeightAveraging`` contract
on :class:`lightning_par.averaging.WeightAverages`.

:class:`ShardedWeightAveraging` and :class:`ShardedEMA` behave as Lightning's ``WeightAveraging`` and
``EMAWeightAveraging``: ``should_update(step_idx=..., epoch_idx=...)`` decides after every optimizer step
and every epoch (the first update copies the weights), validation during ``fit`` runs on the averaged
weights, the model takes them when training ends, and a checkpoint's ``state_dict`` is the averaged model
with the current one under ``current_model_state``. What differs is where the average lives: each rank
averages what it owns (ZeRO 1-3: its fragments of the fp32 masters; tensor or pipeline parallelism: its
slice or stage), so the average costs ``1/dp`` of the fp32 model per rank and nothing is communicated per
update. Under :class:`~lightning_par.HybridParallelStrategy` a sharded checkpoint keeps each rank's averages
in its own file (``consolidate()`` writes Lightning's layout); a single-file checkpoint, and Lightning's
own strategies, get Lightning's layout directly, so checkpoints move between the two callbacks.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_par.averaging import (
    AvgFn,
    MultiAvgFn,
    WeightAverages,
    averaging_rule,
    ema_rule,
    full_pieces,
    snapshot_pieces,
)
from lightning_par.checkpoint.averages import (
    CHECKPOINT_ENTRY,
    gather_averaged_state,
    pieces_from_entries,
    rank_entry,
)
from lightning_par.checkpoint.optimizer_state import Pieces
from lightning_par.checkpoint.sharded import RANK_ENTRIES_KEY, SNAPSHOT_AVERAGES_KEY, WRITE_HOOKS_KEY
from lightning_par.checkpoint.strategy_io import ZeroCheckpointIO
from lightning_par.checkpoint.tp_reshard import TPInfo, global_shapes, localize, tp_info


class ShardedWeightAveraging(Callback):
    """Lightning's ``WeightAveraging`` for every layout (module docstring). ``avg_fn`` is torch's
    per-tensor ``avg_fn(average, current, n_averaged)`` (``torch.optim.swa_utils.get_ema_avg_fn()``), or
    ``multi_avg_fn`` its in-place form over lists (``get_ema_multi_avg_fn()``), as Lightning's callback
    passes them to ``AveragedModel``; neither averages with equal weights (SWA). ``use_buffers`` averages
    the floating-point buffers too (BatchNorm statistics); other buffers keep the model's values.
    Override :meth:`should_update` to choose when. The averages live beside what each rank holds (its
    shards, slices or stage, on the model's device): Lightning's ``device=`` has no counterpart."""

    def __init__(
        self, *, avg_fn: AvgFn | None = None, multi_avg_fn: MultiAvgFn | None = None, use_buffers: bool = True
    ) -> None:
        self._rule = averaging_rule(avg_fn=avg_fn, multi_avg_fn=multi_avg_fn)
        self._use_buffers = use_buffers
        self._averages: WeightAverages | None = None
        self._fitting = False
        self._loaded: tuple[Pieces, dict[str, Tensor], int] | None = None
        # the loaded pieces are of the whole parameters (a checkpoint read before the strategy's setup, when
        # no tensor-parallel slice exists yet): cut to this rank's slices at on_fit_start
        self._loaded_whole = False
        # after fit: the update count of the averages the model took at the end, which a checkpoint saved
        # then records; a fit resumed from it starts its averages from the loaded (averaged) weights
        self._ended_n_averaged: int | None = None
        self._resume_from_model: int | None = None
        self._latest_update_step = 0  # optimizer steps taken at the last update (Lightning's bookkeeping)
        self._latest_update_epoch = -1

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """After optimizer step ``step_idx`` (zero-based) or epoch ``epoch_idx``: update the average? The
        default updates after every optimizer step."""
        return step_idx is not None

    @property
    def averages(self) -> WeightAverages | None:
        """The averages of the running fit (None outside ``fit``)."""
        return self._averages

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._fitting = stage == "fit"

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after the strategy's setup: the engine and its fragments exist
        strategy = trainer.strategy
        ours = strategy if isinstance(strategy, ZeroCheckpointIO) else None
        self._averages = WeightAverages(
            pl_module,
            ours.engine if ours is not None else None,
            group=ours.mesh.dp_group if ours is not None else None,
            rule=self._rule,
            use_buffers=self._use_buffers,
            before_write=partial(_fence_snapshot_copies, trainer),
        )
        if self._loaded is not None:  # a checkpoint restored before the strategy's setup (ZeRO 0-2)
            pieces, buffers, n_averaged = self._loaded
            if self._loaded_whole:
                _, tp = _coordinates(trainer, pl_module)
                pieces = localize(pieces, global_shapes(pl_module, tp), tp)
            self._averages.load(pieces, buffers, n_averaged=n_averaged)
            self._loaded, self._loaded_whole = None, False
        if self._resume_from_model is not None:  # restored before the strategy's setup (ZeRO 0-2)
            self._start_from_model(self._resume_from_model)
        self._ended_n_averaged = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            if self._averages is not None and self._averages.n_averaged > 0:
                self._ended_n_averaged = self._averages.n_averaged
            self._averages, self._fitting = None, False

    def _start_from_model(self, n_averaged: int) -> None:
        """The averages take the model's weights (which are the averaged ones: a checkpoint saved after a
        fit) and go on from ``n_averaged`` updates, as Lightning's averaged model, saved then, does."""
        assert self._averages is not None
        self._averages.n_averaged = 0
        self._averages.update()  # the first update copies the weights
        self._averages.n_averaged = n_averaged
        self._resume_from_model = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._update_after_step(trainer)

    def _update_after_step(self, trainer: pl.Trainer) -> None:
        """The update after the optimizer step just taken, if due and not done yet (a snapshot taken
        earlier in the same hook ran it: the guard keeps it to once per step, as Lightning's)."""
        step_idx = trainer.global_step - 1  # zero-based, like epoch_idx
        if trainer.global_step > self._latest_update_step and self.should_update(step_idx=step_idx):
            assert self._averages is not None
            self._averages.update()
            self._latest_update_step = trainer.global_step

    def snapshot_entry(self, trainer: pl.Trainer) -> dict[str, Any] | None:
        """This rank's averages for a ``FlashCheckpoint`` snapshot of the step just taken: brought up to
        date first (the snapshot may be taken before this callback's own ``on_train_batch_end``), then the
        live tensors (:meth:`WeightAverages.state_dict` with ``clone=False``), which the snapshot copies
        before the next write (every write fences the copy). None outside ``fit``."""
        if self._averages is None:
            return None
        self._update_after_step(trainer)
        return self._averages.state_dict(clone=False)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epoch = trainer.current_epoch
        if epoch > self._latest_update_epoch and self.should_update(epoch_idx=epoch):
            assert self._averages is not None
            self._averages.update()
            self._latest_update_epoch = epoch

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._averages is not None
        self._averages.copy_to_targets()

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._fitting and self._averages is not None:
            self._averages.swap()

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._fitting and self._averages is not None:
            self._averages.swap()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"latest_update_step": self._latest_update_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._latest_update_step = state_dict["latest_update_step"]

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        averages = self._averages
        if averages is None and self._ended_n_averaged is not None:
            # after fit the model holds the averaged weights (Lightning's callback saves them as both the
            # model and the average then); before, the count was dropped and a fit resumed from this
            # checkpoint restarted the average (0.04 off Lightning's after one epoch of a small net)
            n = torch.tensor(self._ended_n_averaged, dtype=torch.long)
            checkpoint["averaging_state"] = {"n_averaged": n}
            sharded = (
                isinstance(trainer.strategy, ZeroCheckpointIO) and trainer.strategy.writes_sharded_checkpoints
            )
            if not sharded and checkpoint.get("state_dict"):  # one file: Lightning's layout
                checkpoint["current_model_state"] = checkpoint["state_dict"]
            return
        if averages is None:
            rank_zero_info(
                "ShardedWeightAveraging: a checkpoint saved outside fit holds the model as it is (after fit:"
                " the averaged weights), without the averaging state."
            )
            return
        checkpoint["averaging_state"] = {"n_averaged": torch.tensor(averages.n_averaged, dtype=torch.long)}
        if isinstance(trainer.strategy, ZeroCheckpointIO):
            # copied out when the checkpoint is written: a flash snapshot's dump, never written, costs nothing
            hooks = checkpoint.setdefault(WRITE_HOOKS_KEY, [])
            hooks.append(lambda written: self._write(trainer, pl_module, written, averages))
        else:
            self._write(trainer, pl_module, checkpoint, averages)

    def _write(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        checkpoint: dict[str, Any],
        averages: WeightAverages,
    ) -> None:
        """Put the averages into ``checkpoint``: this rank's records under ``RANK_ENTRIES_KEY`` when the
        strategy writes per-rank files, else Lightning's layout (collective under our strategy)."""
        strategy = trainer.strategy
        dp_rank, tp = _coordinates(trainer, pl_module)
        if isinstance(strategy, ZeroCheckpointIO) and strategy.writes_sharded_checkpoints:
            entry = rank_entry(averages, dp_rank=dp_rank, tp_rank=int(tp["rank"]))
            checkpoint.setdefault(RANK_ENTRIES_KEY, {})[CHECKPOINT_ENTRY] = entry
            return
        # one file: Lightning's layout, the averaged model under "state_dict"
        current = checkpoint["state_dict"]
        ours = isinstance(strategy, ZeroCheckpointIO)
        averaged = gather_averaged_state(averages, current, pl_module, tp=tp, dp_rank=dp_rank, gather=ours)
        if averaged is not None and current:  # other ranks of a consolidated save hold no state
            checkpoint["current_model_state"] = current
            checkpoint["state_dict"] = averaged

    def load_snapshot_entry(self, entry: dict[str, Any]) -> None:
        """Take :meth:`snapshot_entry`'s averages back: this rank's own elements (same layout), or every
        writer's (a snapshot resharded to another dp size or stage), cut to what this rank averages."""
        pieces, buffers, n_averaged = (
            snapshot_pieces(entry["params"]),
            entry["buffers"],
            int(entry["n_averaged"]),
        )
        if self._averages is None:
            self._loaded, self._loaded_whole = (pieces, buffers, n_averaged), False  # at on_fit_start
        else:
            self._averages.load(pieces, buffers, n_averaged=n_averaged)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        strategy = trainer.strategy
        _, tp = _coordinates(trainer, pl_module)
        shapes = global_shapes(pl_module, tp)
        n_averaged = int((checkpoint.get("averaging_state") or {}).get("n_averaged", 0))
        entries = (
            strategy.checkpoint_rank_entries(CHECKPOINT_ENTRY)
            if isinstance(strategy, ZeroCheckpointIO)
            else None
        )
        snapshot = (checkpoint.get(SNAPSHOT_AVERAGES_KEY) or {}).get(self.state_key)
        if snapshot is not None:  # a FlashCheckpoint snapshot
            self.load_snapshot_entry(snapshot)
            return
        if entries:
            pieces, buffers = pieces_from_entries(entries, shapes)
        elif "current_model_state" in checkpoint:
            pieces, buffers = full_pieces(checkpoint["state_dict"], pl_module)
            # the model was loaded from "state_dict", the averaged weights: it takes its own back
            strategy.load_model_state_dict(
                {**checkpoint, "state_dict": checkpoint["current_model_state"]},
                strict=pl_module.strict_loading,
            )
        elif "averaging_state" in checkpoint:
            # saved after a fit (per-rank files): the model, loaded already, holds the averaged weights
            if self._averages is None:
                self._resume_from_model = n_averaged  # at on_fit_start
            else:
                self._start_from_model(n_averaged)
            return
        else:
            rank_zero_warn(
                "ShardedWeightAveraging: the checkpoint holds no weight averages (it was saved without this"
                " callback); the average starts again from the loaded weights."
            )
            return
        if self._averages is None:
            # ZeRO 0-2 restore before the strategy's setup, where tensor parallelism has not cut the model
            # yet (before, cut here: no slices, so every tp rank took the first elements of each whole
            # tensor): applied, and cut, at on_fit_start
            self._loaded, self._loaded_whole = (pieces, buffers, n_averaged), True
        else:
            self._averages.load(localize(pieces, shapes, tp), buffers, n_averaged=n_averaged)


def _fence_snapshot_copies(trainer: pl.Trainer) -> None:
    """Wait for every ``FlashCheckpoint`` copy in flight: it reads the weights and the averages off the
    training thread until the next optimizer step, and a swap for validation, the epoch's update or the
    end's copy would otherwise tear it (the snapshot held averaged weights as the model's)."""
    from lightning_par.callbacks.flash import FlashCheckpoint  # (flash's snapshot code imports this module)

    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, FlashCheckpoint):
            callback.store.fence()


class ShardedEMA(ShardedWeightAveraging):
    """Lightning's ``EMAWeightAveraging`` at any layout: ``a := decay * a + (1 - decay) * w`` after every
    ``update_every_n_steps``-th optimizer step from ``update_starting_at_step``, and after every epoch from
    ``update_starting_at_epoch`` when that is given."""

    def __init__(
        self,
        *,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        update_starting_at_epoch: int | None = None,
        use_buffers: bool = True,
    ) -> None:
        super().__init__(use_buffers=use_buffers)
        self._rule = ema_rule(decay)
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self.update_starting_at_epoch = update_starting_at_epoch

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        if step_idx is not None:
            started = self.update_starting_at_step is None or step_idx >= self.update_starting_at_step
            if started and self.update_every_n_steps > 0 and step_idx % self.update_every_n_steps == 0:
                return True
        if epoch_idx is not None and self.update_starting_at_epoch is not None:
            return epoch_idx >= self.update_starting_at_epoch
        return False


def _coordinates(trainer: pl.Trainer, pl_module: pl.LightningModule) -> tuple[int, TPInfo]:
    """(dp rank, tensor-parallel coordinates) of this process; under Lightning's strategies (0, none)."""
    strategy = trainer.strategy
    if isinstance(strategy, ZeroCheckpointIO):
        rank, size = strategy.tp_coordinates()
        return strategy.mesh.dp_rank, tp_info(pl_module, rank=rank, size=size)
    return 0, tp_info(pl_module, rank=0, size=1)  # every rank holds the whole model: each is a "first"
