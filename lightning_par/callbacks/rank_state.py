"""What one rank must save to continue training exactly, and how it is put back: the Trainer's snapshot
adapter (Fabric's is :mod:`lightning_par.fabric.flash`; both share
:mod:`lightning_par.checkpoint.rank_state`).

A snapshot is *per rank* and *same layout*: rank ``r`` saves what it holds and, after a restart with the
same world size, model and parallel layout, rank ``r`` loads it back (a change of layout is refused with
the differences named; use a sharded checkpoint, which reshards, for that). The state of a rank is::

    {"lightning": Lightning's checkpoint dict (trainer._checkpoint_connector.dump_checkpoint()) without
                  the model and optimizer entries: loop progress, callbacks' state, LR schedulers,
                  precision plugin (loss scaler), hyper-parameters, datamodule state, user hooks' keys,
     "model", "optim": this rank's model and optimizer trees (lightning_par.checkpoint.rank_state),
     "rng":       torch / CUDA / numpy / Python generator states,
     "data":      epoch and number of batches of the current epoch already trained on,
     "fingerprint": model parameter names and shapes, optimizers, strategy and layout}

:func:`capture` returns this tree with the *live* tensors (no copies) plus the set of storages that only
an optimizer step changes (parameters, masters, optimizer state): the caller may copy those after the
training thread has moved on, until the next optimizer step. :func:`restore` puts a tree back through
Lightning's own restore methods (loops, callbacks, schedulers, precision) and loads model and optimizer
state directly (same layout, so positions and fragments match). Supported strategies:
``HybridParallelStrategy`` (ZeRO 0-3, tensor parallel) and Lightning's DDP and single-device strategies.
Two private pieces of Lightning are used because no public hook does their job: the checkpoint
connector (the checkpoint dict without a file, and restoring loops and callbacks from a dict) and the fit
loop's data fetcher (moving a resumed epoch to the batch where the snapshot was taken).
"""

from __future__ import annotations

import copy
import itertools
import warnings
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import RandomSampler
from torch.utils.data.dataloader import _DatasetKind, _SingleProcessDataLoaderIter

from lightning_par.callbacks.averaging import ShardedWeightAveraging
from lightning_par.callbacks.resume import Found
from lightning_par.checkpoint import rank_state as core
from lightning_par.checkpoint.sharded import RANK_ENTRIES_KEY, SNAPSHOT_AVERAGES_KEY, WRITE_HOOKS_KEY
from lightning_par.checkpoint.strategy_io import ZeroCheckpointIO
from lightning_par.zero.engine_api import Engine


def check_supported(strategy: Any) -> None:
    """Raise a ``TypeError`` for strategies whose per-rank state this adapter does not know."""
    if isinstance(strategy, ZeroCheckpointIO | DDPStrategy | SingleDeviceStrategy):
        return
    raise TypeError(
        f"FlashCheckpoint supports lightning_par's HybridParallelStrategy (ZeRO 0-3, tensor parallel) and"
        f" Lightning's DDP and single-device strategies, not {type(strategy).__name__}."
    )


def _engine(trainer: pl.Trainer) -> Engine | None:
    strategy = trainer.strategy
    return strategy.engine if isinstance(strategy, ZeroCheckpointIO) else None


def capture(trainer: pl.Trainer) -> tuple[dict[str, Any], set[int]]:
    """This rank's training state (live tensors) and the storages safe to copy until the next step."""
    module = trainer.lightning_module
    assert module is not None
    # weight averages (ShardedEMA): this step's update first, if this snapshot runs before the callback's
    # own hook, so the averages and the callback's state agree; then the live tensors, copied with the
    # weights (every later write of them waits for the copy)
    averages = {}
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, ShardedWeightAveraging):
            entry = callback.snapshot_entry(trainer)
            if entry is not None:
                averages[callback.state_key] = entry
    # Lightning offers no public way to get its checkpoint dict without writing a file
    lightning = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    lightning.pop("state_dict", None)
    lightning.pop("optimizer_states", None)
    # the averaging callback's checkpoint forms (its write hook under our strategy, its records or
    # Lightning's layout under Lightning's): a snapshot carries the averages as above instead
    for key in (WRITE_HOOKS_KEY, RANK_ENTRIES_KEY, "current_model_state"):
        lightning.pop(key, None)
    model, optim, step_tensors = core.capture(module, _engine(trainer), trainer.optimizers)
    if averages:
        lightning[SNAPSHOT_AVERAGES_KEY] = averages
        for entry in averages.values():
            step_tensors.extend(t for *_, t in entry["params"])
            step_tensors.extend(entry["buffers"].values())
    progress = trainer.fit_loop.epoch_loop.batch_progress
    state = {
        "lightning": lightning,
        "model": model,
        "optim": optim,
        "rng": _collect_rng_states(include_cuda=True),
        "data": {
            "epoch": trainer.current_epoch,
            "batches": progress.current.ready,
            "epoch_end": bool(progress.is_last_batch),
            "accumulate": trainer.accumulate_grad_batches,
        },
    }
    return state, core.storages(step_tensors)


def fingerprint(trainer: pl.Trainer) -> dict[str, Any]:
    """What must be equal for a snapshot to load: strategy, world size, parameters, optimizers, layout."""
    strategy = trainer.strategy
    module = trainer.lightning_module
    assert module is not None
    layout = strategy.layout_metadata() if isinstance(strategy, ZeroCheckpointIO) else None
    return core.fingerprint(
        module,
        trainer.optimizers,
        strategy=type(strategy).__name__,
        world_size=trainer.world_size,
        layout=layout,
    )


def resharded(trainer: pl.Trainer, found: Found, *, keep_global_batch: bool) -> dict[str, Any]:
    """This rank's state from *every* part of a snapshot written at another data-parallel size or ZeRO
    stage, for :func:`restore`: the loops, callbacks, schedulers and RNG of the writer with this rank's
    number (writer 0 if there is none), the model and optimizer trees of all writers (under
    ``"resharded"``), and the position in the epoch moved to the new size.

    Positions: the data consumed so far is ``batches x old_dp`` per-rank batches, so a rank at the new
    size has done ``batches x old_dp / new_dp`` of its own (Lightning's ``DistributedSampler`` deals the
    same epoch order out to any number of ranks). With ``keep_global_batch`` the accumulation becomes
    ``accumulate x old_dp / new_dp`` (``trainer.accumulate_grad_batches`` is set), so every optimizer
    step sees the same samples as before; otherwise the global batch changes with the dp size. Raises a
    ``ValueError`` naming the numbers when either count is not whole.
    """
    strategy = trainer.strategy
    if (
        isinstance(strategy, ZeroCheckpointIO)
        and strategy.tp_coordinates()[1] * strategy.layout.pipeline_parallel_size > 1
    ):
        raise ValueError(
            f"FlashCheckpoint: the snapshot of step {found.step} was written by {found.world_size} ranks and"
            f" this job has {trainer.world_size}; resharding a snapshot needs tensor_parallel_size=1 and"
            " pipeline_parallel_size=1. Run with the original number of processes (nothing was loaded)."
        )
    old, new = found.world_size, trainer.world_size
    base = found.parts.get(trainer.global_rank, found.parts[0])
    data = dict(base["data"])
    accumulate = int(data.get("accumulate", trainer.accumulate_grad_batches))
    target = accumulate * old // new if keep_global_batch else trainer.accumulate_grad_batches
    batches = int(data["batches"]) * old
    if (keep_global_batch and accumulate * old % new) or batches % new or (batches // new) % target:
        raise ValueError(
            f"FlashCheckpoint: cannot continue the snapshot of step {found.step} (dp {old}, accumulation"
            f" {accumulate}, {data['batches']} batches into epoch {data['epoch']}) at dp {new}"
            f"{' with the same global batch' if keep_global_batch else ''}: the batches done per rank"
            f" ({batches} / {new}) or the accumulation ({accumulate} x {old} / {new}) would not be whole."
            " Run with a dp size that divides them, or with the original one (nothing was loaded)."
        )
    data["batches"] = batches // new
    if keep_global_batch and target != trainer.accumulate_grad_batches:
        rank_zero_warn(
            f"FlashCheckpoint: dp {old} -> {new}: accumulate_grad_batches {trainer.accumulate_grad_batches}"
            f" -> {target}, so the global batch stays {accumulate * old} micro-batches per step."
        )
        trainer.accumulate_grad_batches = target
    lightning = copy.deepcopy(base["lightning"])
    if SNAPSHOT_AVERAGES_KEY in lightning:  # weight averages: every writer's fragments, cut on load
        for key, entry in lightning[SNAPSHOT_AVERAGES_KEY].items():
            entry["params"] = [
                piece
                for w in range(old)
                for piece in found.parts[w]["lightning"][SNAPSHOT_AVERAGES_KEY][key]["params"]
            ]
    progress = lightning.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
    if progress is not None:
        # per-rank batch counts at the new size. The snapshot was taken in on_train_batch_end, with
        # "completed" one behind "ready" (Lightning counts the batch completed after that hook and adds
        # it when it restarts there): the batches are ``ready * old / new``, and every counter moves by
        # the same amount, so the lag stays one batch (scaling each counter alone made it old / new
        # batches: a snapshot at the end of an epoch resumed inside it, repeating its last batches)
        for counts in (progress["total"], progress["current"]):
            shift = counts["ready"] * old // new - counts["ready"]
            for name, value in counts.items():
                counts[name] = value + shift
    parts = [(found.parts[w]["model"], found.parts[w]["optim"]) for w in range(old)]
    names = found.header["fingerprint"].get("optimizers", [])
    return {
        **base,
        "lightning": lightning,
        "data": data,
        "resharded": parts,
        "model": parts[0][0],
        "fingerprint_optimizers": names,
    }


def restore(trainer: pl.Trainer, state: dict[str, Any], *, full: bool) -> None:
    """Put ``state`` back into the trainer, this rank's model and optimizers.

    ``full=True`` (resume): everything, including loops, callbacks and datamodule state; the data
    position and RNG follow in :func:`resume_data_and_rng` once the data loader exists.
    ``full=False`` (roll back): model, optimizers, LR schedulers and precision state only; the loop keeps
    going forward.
    """
    module = trainer.lightning_module
    assert module is not None
    # Lightning's restore_* methods read the checkpoint they are handed through the connector; there is
    # no public entry point that restores loops and callbacks from a dict
    connector = trainer._checkpoint_connector
    checkpoint = dict(state["lightning"])
    checkpoint["state_dict"] = state["model"]
    connector._loaded_checkpoint = checkpoint
    try:
        if full:
            connector.restore_datamodule()
            call._call_lightning_module_hook(trainer, "on_load_checkpoint", checkpoint)
        if "resharded" in state:
            names = [o["param_names"] for o in state["fingerprint_optimizers"]]
            core.load_resharded(
                module, _engine(trainer), trainer.optimizers, state["resharded"], param_names=names
            )
        else:
            core.load(module, _engine(trainer), trainer.optimizers, checkpoint["state_dict"], state["optim"])
        if full:
            connector.restore_callbacks()  # weight averages too (ShardedWeightAveraging.on_load_checkpoint)
            connector.restore_loops()
        else:  # a roll back: the averages return to the snapshot's too (they took the diverged steps)
            saved = checkpoint.get(SNAPSHOT_AVERAGES_KEY) or {}
            for callback in trainer.callbacks:  # type: ignore[attr-defined]
                if isinstance(callback, ShardedWeightAveraging) and callback.state_key in saved:
                    callback.load_snapshot_entry(saved[callback.state_key])
        connector.restore_precision_plugin_state()
        connector.restore_lr_schedulers()
    finally:
        connector._loaded_checkpoint = {}


def resume_data_and_rng(trainer: pl.Trainer, state: dict[str, Any]) -> str:
    """After :func:`restore`, before the first resumed batch is fetched (``on_train_start``): move the
    training data to where the snapshot was taken and put the generators back; return what was done.

    Lightning restarts a map-style loader at the start of its epoch; here its index sampler skips the
    batches already trained on (no data is loaded for them), so the rest of the epoch comes in the same
    order as in an uninterrupted run. Other loaders are advanced batch by batch. The order is exact for
    samplers determined by (seed, epoch), such as the ``DistributedSampler`` Lightning injects.
    """
    data = state["data"]
    fit_loop = trainer.fit_loop
    fetcher = fit_loop._data_fetcher
    combined = fit_loop._combined_loader
    done = "nothing to reposition"
    if data["epoch_end"] or data["batches"] <= 0 or fetcher is None or combined is None:
        _set_rng_states(state["rng"])
        if fetcher is not None and combined is not None and data["epoch_end"]:
            iter(fetcher)  # a new epoch's iterator draws its seed from the restored generator, as it did
        return done
    skip = int(data["batches"])
    epoch = trainer.current_epoch
    for dl in combined.flattened:
        _set_sampler_epoch(dl, epoch)
        if isinstance(getattr(dl, "sampler", None), RandomSampler):
            rank_zero_warn(
                "FlashCheckpoint: the training loader's RandomSampler draws each epoch's order from a random"
                " generator when the epoch starts, so the rest of this epoch comes in another order than"
                " without the restart; use a sampler whose order follows (seed, epoch), such as"
                " DistributedSampler (which Lightning uses with several processes), for an exact resume."
            )
    iterators = getattr(combined._iterator, "iterators", None) or []
    if (
        len(iterators) == 1
        and isinstance(iterators[0], _SingleProcessDataLoaderIter)
        and iterators[0]._dataset_kind == _DatasetKind.Map
        and iterators[0]._num_yielded == 0
    ):
        it = iterators[0]
        it._sampler_iter = itertools.islice(it._sampler_iter, skip, None)
        it._num_yielded = skip
        done = f"skipped the first {skip} batches of epoch {epoch} by index"
    elif isinstance(fetcher, _DataLoaderIterDataFetcher):
        done = "could not reposition a dataloader_iter training_step: the epoch restarts"
    else:
        iter(fetcher)
        for _ in range(skip):
            next(fetcher)
        fetcher.fetched -= skip  # the loop adds the batches already done itself
        done = f"skipped the first {skip} batches of epoch {epoch} by loading them"
    if done.startswith("skipped"):
        # handled here: Lightning's warning that a mid-epoch resume of this loader is unreliable is moot
        warnings.filterwarnings(
            "ignore", message=r"You're resuming from a checkpoint that ended before the epoch"
        )
    _set_rng_states(state["rng"])
    return done
