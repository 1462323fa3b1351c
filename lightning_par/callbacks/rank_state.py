"""What one rank must save to continue training exactly, and how it is put back: the snapshot adapter.

A snapshot is *per rank* and *same layout*: rank ``r`` saves what it holds and, after a restart with the
same world size, model and parallel layout, rank ``r`` loads it back (a change of layout is refused with
the differences named; use a sharded checkpoint, which reshards, for that). The state of a rank is::

    {"lightning": Lightning's checkpoint dict (trainer._checkpoint_connector.dump_checkpoint()) without
                  the model and optimizer entries: loop progress, callbacks' state, LR schedulers,
                  precision plugin (loss scaler), hyper-parameters, datamodule state, user hooks' keys,
     "model":     this rank's module.state_dict(): replicated weights (DDP, ZeRO 0-2), or this rank's
                  tensor-parallel pieces; at ZeRO-3 only the buffers (the parameters are shards, below),
     "optim":     {"kind": "torch", "optimizers": [optimizer.state_dict(), ...]} for unsharded optimizers,
                  or {"kind": "fragments", ...} under ZeRO 1-3: for each optimizer its param-group
                  hyper-parameters and the records (name, lo, hi, {state}) of the fragments this rank owns
                  (the format of lightning_par.checkpoint.optimizer_state, with fp32 masters when they are
                  separate), the bucket order, and at stage 3 the parameter shards themselves
                  (trainable and frozen),
     "rng":       torch / CUDA / numpy / Python generator states,
     "data":      epoch and number of batches of the current epoch already trained on,
     "fingerprint": model parameter names and shapes, optimizers, strategy and layout}

:func:`capture` returns this tree with the *live* tensors (no copies) plus the set of storages that only
an optimizer step changes (parameters, masters, optimizer state): the caller may copy those after the
training thread has moved on, until the next optimizer step. :func:`restore` puts a tree back through
Lightning's own restore methods (loops, callbacks, schedulers, precision) and loads model and optimizer
state directly (same layout, so positions and fragments match). Supported strategies:
``HybridParallelStrategy`` (ZeRO 0-3, tensor parallel) and Lightning's DDP and single-device strategies.
"""

from __future__ import annotations

import itertools
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import RandomSampler
from torch.utils.data.dataloader import _DatasetKind, _SingleProcessDataLoaderIter

from lightning_par.checkpoint.optimizer_state import (
    cut,
    group_hyperparams,
    load_fragments,
    pieces_from_records,
)
from lightning_par.checkpoint.strategy_io import ZeroCheckpointIO
from lightning_par.zero.engine import ZeroEngine
from lightning_par.zero.sharded_optimizer import ShardedOptimizer
from lightning_par.zero.stage3 import Stage3Engine

Record = tuple[str, int, int, dict[str, Any]]


def check_supported(strategy: Any) -> None:
    """Raise a ``TypeError`` for strategies whose per-rank state this adapter does not know."""
    if isinstance(strategy, ZeroCheckpointIO | DDPStrategy | SingleDeviceStrategy):
        return
    raise TypeError(
        f"FlashCheckpoint supports lightning_par's HybridParallelStrategy (ZeRO 0-3, tensor parallel) and"
        f" Lightning's DDP and single-device strategies, not {type(strategy).__name__}."
    )


def _engine(trainer: pl.Trainer) -> Any:
    strategy = trainer.strategy
    return getattr(strategy, "_engine", None) if isinstance(strategy, ZeroCheckpointIO) else None


def _param_names(module: nn.Module) -> set[str]:
    return {n for n, _ in module.named_parameters(remove_duplicate=False)}


def _records(
    opt: Optimizer, table: Sequence[tuple[str, int, int, Tensor]], master_key: str | None
) -> list[Record]:
    """This rank's fragment records of ``opt`` as views of the live tensors (the format of
    :func:`lightning_par.checkpoint.optimizer_state.fragment_pieces`, without its CPU copies)."""
    owned = {id(p) for g in opt.param_groups for p in g["params"]}
    out: list[Record] = []
    for name, lo, hi, master in table:
        if id(master) not in owned:
            continue
        state = {
            k: v.detach().reshape(-1) if isinstance(v, Tensor) and v.dim() > 0 else v
            for k, v in opt.state.get(master, {}).items()
        }
        if master_key is not None:
            state[master_key] = master.detach().reshape(-1)
        if state:
            out.append((name, lo, hi, state))
    return out


def capture(trainer: pl.Trainer) -> tuple[dict[str, Any], set[int]]:
    """This rank's training state (live tensors) and the storages safe to copy until the next step."""
    module = trainer.lightning_module
    assert module is not None
    lightning = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    lightning.pop("state_dict", None)
    lightning.pop("optimizer_states", None)
    engine = _engine(trainer)
    sharded = engine.sharded_state if engine is not None else None
    model = OrderedDict((k, v) for k, v in module.state_dict().items() if not v.is_meta)
    optim: dict[str, Any]
    if sharded is not None:
        table = sharded.fragment_table()
        optim = {
            "kind": "fragments",
            "order": list(engine.sync.names) if isinstance(engine, ZeroEngine) else [],
            "optimizers": [
                {"param_groups": group_hyperparams(opt), "records": _records(opt, table, sharded.master_key)}
                for opt in trainer.optimizers
            ],
        }
        if isinstance(engine, Stage3Engine):
            params = _param_names(module)
            model = OrderedDict((k, v) for k, v in model.items() if k not in params)
            # every parameter piece this rank holds, trainable and frozen
            optim["shards"] = [(n, lo, hi, {"param": v.detach()}) for n, lo, hi, v in engine.shard_table()]
    else:
        optim = {"kind": "torch", "optimizers": [opt.state_dict() for opt in trainer.optimizers]}
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
        },
    }
    live: list[Tensor] = [p for p in module.parameters() if not p.is_meta]
    if isinstance(engine, Stage3Engine):
        live += [view for _, _, _, view in engine.shard_table()]
    for opt in trainer.optimizers:
        live += [p for g in opt.param_groups for p in g["params"]]
        live += [v for s in opt.state.values() for v in s.values() if isinstance(v, Tensor)]
    storages = {t.untyped_storage().data_ptr() for t in live if t.numel() and not t.is_meta}
    return state, storages


def fingerprint(trainer: pl.Trainer) -> dict[str, Any]:
    """What must be equal for a snapshot to load: strategy, world size, parameters, optimizers, layout."""
    strategy = trainer.strategy
    module = trainer.lightning_module
    assert module is not None
    if isinstance(strategy, ZeroCheckpointIO):
        meta = strategy.layout_metadata()
        keys = ("zero_stage", "world_size", "dp", "tp", "pp", "params", "optimizers")
        return {"strategy": type(strategy).__name__, **{k: meta[k] for k in keys if k in meta}}
    names = {id(p): n for n, p in module.named_parameters()}
    return {
        "strategy": type(strategy).__name__,
        "world_size": trainer.world_size,
        "params": {n: list(p.shape) for n, p in module.named_parameters()},
        "optimizers": [
            {
                "class": type(opt).__name__,
                "param_names": [
                    [names.get(id(p), "<not a module parameter>") for p in g["params"]]
                    for g in opt.param_groups
                ],
            }
            for opt in trainer.optimizers
        ],
    }


def differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences between two fingerprints (empty if the snapshot fits)."""
    if saved.get("strategy") != current.get("strategy"):
        return [f"strategy: snapshot {saved.get('strategy')}, now {current.get('strategy')}"]
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if a == b:
            continue
        if key == "params" and isinstance(a, dict) and isinstance(b, dict):
            missing = sorted(set(b) - set(a))[:5]
            extra = sorted(set(a) - set(b))[:5]
            shapes = [f"{n}: {a[n]} vs {b[n]}" for n in sorted(set(a) & set(b)) if a[n] != b[n]][:5]
            for label, items in (
                ("not in the snapshot", missing),
                ("not in the model", extra),
                ("shapes", shapes),
            ):
                if items:
                    out.append(f"parameters {label}: {items}")
        elif key == "optimizers":
            out.append("optimizers (class or parameter groups) differ")
        else:
            out.append(f"{key}: snapshot {a!r}, now {b!r}")
    return out


def restore(trainer: pl.Trainer, state: dict[str, Any], *, full: bool) -> None:
    """Put ``state`` back into the trainer, this rank's model and optimizers.

    ``full=True`` (resume): everything, including loops, callbacks and datamodule state; the data
    position and RNG follow in :func:`resume_data_and_rng` once the data loader exists.
    ``full=False`` (roll back): model, optimizers, LR schedulers and precision state only; the loop keeps
    going forward.
    """
    module = trainer.lightning_module
    assert module is not None
    connector = trainer._checkpoint_connector
    checkpoint = dict(state["lightning"])
    checkpoint["state_dict"] = state["model"]
    connector._loaded_checkpoint = checkpoint
    try:
        if full:
            connector.restore_datamodule()
            call._call_lightning_module_hook(trainer, "on_load_checkpoint", checkpoint)
        _load_model_and_optimizers(trainer, checkpoint["state_dict"], state["optim"])
        if full:
            connector.restore_callbacks()
            connector.restore_loops()
        connector.restore_precision_plugin_state()
        connector.restore_lr_schedulers()
    finally:
        connector._loaded_checkpoint = {}


def _load_model_and_optimizers(trainer: pl.Trainer, model: dict[str, Any], optim: dict[str, Any]) -> None:
    module = trainer.lightning_module
    assert module is not None
    engine = _engine(trainer)
    if isinstance(engine, ZeroEngine) and optim.get("order"):
        engine.freeze_order(optim["order"])  # the saved bucket layout, before fragments are matched
    if isinstance(engine, Stage3Engine):
        shards = pieces_from_records(optim["shards"])

        def values(name: str, lo: int, hi: int) -> Tensor | None:
            piece = cut(shards.get(name, []), lo, hi)
            return None if piece is None else piece["param"]

        engine.load_fragments(values)
    meta = {n for n, t in itertools.chain(module.named_parameters(), module.named_buffers()) if t.is_meta}
    skip = meta | (_param_names(module) if isinstance(engine, Stage3Engine) else set())
    missing, unexpected = module.load_state_dict(model, strict=False)
    missing = [k for k in missing if k not in skip]
    if missing or unexpected:
        raise KeyError(f"The snapshot's model state lacks {missing[:8]} and has unexpected {unexpected[:8]}.")
    if optim["kind"] == "fragments":
        sharded = engine.sharded_state if engine is not None else None
        if sharded is None:
            raise ValueError(
                "The snapshot holds ZeRO optimizer shards, but the strategy shards no optimizer."
            )
        table = sharded.fragment_table()
        for opt, saved in zip(trainer.optimizers, optim["optimizers"], strict=True):
            pieces = pieces_from_records(saved["records"])
            load_fragments(opt, pieces, saved["param_groups"], table, master_key=sharded.master_key)
        if sharded.master_key is not None and isinstance(sharded, ShardedOptimizer):
            sharded.refresh_params()  # compute copies := restored fp32 masters, on every rank
        return
    for opt, saved_state in zip(trainer.optimizers, optim["optimizers"], strict=True):
        opt.load_state_dict(saved_state)
    _optimizers_to_device(trainer.optimizers, trainer.strategy.root_device)


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
