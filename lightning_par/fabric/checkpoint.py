"""``fabric.save`` / ``fabric.load`` / ``fabric.load_raw`` under lightning_par's Fabric strategy.

Two formats, both read back into any ZeRO stage and any data-parallel size:

* a **sharded directory** (stages 1-3 or tensor parallel, ``save_distributed_checkpoint=True``): the
  package's directory format (:mod:`lightning_par.checkpoint.sharded`: rank files, ``meta.pt``, a CRC
  manifest, written into staging and swapped in atomically). ``meta.pt`` holds the entries of ``state``
  that are neither the module nor its optimizers (``"extras"``), the module's non-parameter entries
  (its whole state dict at stages 1/2, where every rank holds the parameters) and the layout; each
  rank file holds its optimizer fragments and, at stage 3 or under tensor parallelism, its share of
  the parameters.
* **one torch file** (stage 0 without tensor parallelism, ``save_distributed_checkpoint=False``, or a
  state without optimizers and weight averages of a model every rank holds whole: ZeRO 1/2 without
  tensor or pipeline parallelism, as litgpt saves its result),
  written by global rank 0: ``{module key: full state dict, optimizer key: full state in torch's
  format, ...extras}`` plus the layout, as Fabric's FSDP writes with ``state_dict_type="full"``; the
  full state is gathered one rank at a time (:mod:`lightning_par.checkpoint.full`).

``fabric.load_raw(path, model)`` reads a plain state dict (a ``torch.save`` of ``model.state_dict()``)
into the shards: each rank copies only its slices, from a memory-mapped file.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_par.averaging import WeightAverages, full_pieces
from lightning_par.checkpoint.averages import gather_averaged_state, pieces_from_entries, rank_entry
from lightning_par.checkpoint.dcp_import import is_dcp_checkpoint, read_dcp_entries, torch_optimizer_states
from lightning_par.checkpoint.export import consolidate
from lightning_par.checkpoint.full import gather_full_optimizer_state, gather_full_state_dict
from lightning_par.checkpoint.io import (
    _group_names,
    check_model,
    layout_metadata,
    load_optimizer_states,
    rank_payload,
    record_comm_state,
    save_sharded,
)
from lightning_par.checkpoint.model_state import load_module_state
from lightning_par.checkpoint.sharded import (
    FABRIC_KEYS,
    METADATA_KEY,
    is_sharded_checkpoint,
    read_meta,
    read_rank_entries,
)
from lightning_par.checkpoint.single_file import FABRIC_DIRECTORY_NOTE, read_torch_file, write_over_directory
from lightning_par.checkpoint.tp_reshard import TPInfo, global_shapes, localize, tp_info
from lightning_par.tensor_parallel.layers import TP_DIM_ATTR

if TYPE_CHECKING:
    from lightning_par.fabric.strategy import HybridParallelStrategy

KEYS = FABRIC_KEYS  # which entries of the saved state were the module and its optimizers


def split_state(strategy: HybridParallelStrategy, state: Mapping[str, Any]) -> tuple[str | None, list[str]]:
    """The key of the module and the keys of its optimizers in ``state`` (checked to be the ones this
    strategy set up). Other modules (an EMA copy, a teacher, a torchmetrics metric) are entries like a
    scheduler: their ``state_dict()`` is saved and loaded whole, as Fabric's own strategies do; one that
    holds this rank's pieces only (a copy of a tensor-parallel model's slices, or of a pipeline stage
    with placeholders for the others) is refused by key. Before, every other module was refused under
    tensor or pipeline parallelism, a metric included."""
    modules = [k for k, v in state.items() if isinstance(v, nn.Module)]
    mine = [k for k in modules if state[k] is strategy.module]
    if len(mine) > 1:
        raise ValueError(f"The state holds the set-up module under several keys {mine}: keep one.")
    pieces = [k for k in modules if k not in mine and _holds_pieces(state[k])]
    if pieces:
        raise ValueError(
            f"state[{pieces[0]!r}] is a module this strategy did not set up, and it holds this rank's"
            " tensor-parallel slices or pipeline placeholders (a copy of the model), which one whole entry"
            f" cannot keep: save state[{pieces[0]!r}].state_dict() on every rank to a file of its own, or"
            " keep its weights in the set-up module."
        )
    optimizers = [k for k, v in state.items() if isinstance(v, Optimizer)]
    for k in optimizers:
        if not any(state[k] is opt for opt in strategy.optimizers):
            raise ValueError(f"state[{k!r}] is not an optimizer set up by fabric.setup() with this module.")
    return (mine[0] if mine else None), optimizers


def _holds_pieces(module: nn.Module) -> bool:
    """Whether ``module`` has tensors that are this rank's part only: a tensor-parallel slice (marked by
    the plan) or a meta placeholder (another stage's layers, or ZeRO-3's shards)."""
    tensors = [*module.parameters(), *module.buffers()]
    return any(hasattr(t, TP_DIM_ATTR) or t.is_meta for t in tensors)


def _tp(strategy: HybridParallelStrategy) -> TPInfo:
    assert strategy.module is not None
    mesh = strategy.mesh
    return tp_info(strategy.module, rank=mesh.tp_rank, size=mesh.tp_size)


def is_stateful(value: Any) -> bool:
    """Whether a state entry is saved as its ``state_dict()`` and restored by ``load_state_dict`` (LR
    schedulers and the like; Fabric's own rule), rather than stored as it is."""
    has = callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))
    return has and not isinstance(value, Tensor | dict)


def layout(strategy: HybridParallelStrategy, optimizers: list[Optimizer]) -> dict[str, Any]:
    """What a checkpoint or snapshot records of the strategy's module and layout (collective-free)."""
    assert strategy.module is not None
    mesh = strategy.mesh
    sizes = {"world_size": strategy.world_size, "dp": mesh.dp_size, "tp": mesh.tp_size, "pp": mesh.pp_size}
    return layout_metadata(
        strategy.module, engine=strategy.engine, optimizers=optimizers, sizes=sizes, tp=_tp(strategy)
    )


def consolidated(strategy: HybridParallelStrategy) -> dict[str, Any]:
    """The full model state dict on global rank 0, ``{}`` elsewhere (collective)."""
    if strategy.module is None:
        raise RuntimeError("consolidated_state_dict() needs the module set up first (fabric.setup).")
    dp_rank = strategy.mesh.dp_rank
    return gather_full_state_dict(
        strategy.module, strategy.engine, tp=_tp(strategy), dp_rank=dp_rank, group=None
    )


def _extras(state: Mapping[str, Any], skip: set[str]) -> dict[str, Any]:
    return {k: v.state_dict() if is_stateful(v) else v for k, v in state.items() if k not in skip}


def save(strategy: HybridParallelStrategy, path: Path, state: Mapping[str, Any]) -> None:
    """Write ``state`` to ``path`` (collective; see the module docstring for the format)."""
    module_key, opt_keys = split_state(strategy, state)
    module, engine = strategy.module, strategy.engine
    if module is None or engine is None:
        raise RuntimeError("fabric.save needs the module set up first (fabric.setup).")
    optimizers = [state[k] for k in opt_keys]
    tp, rank, world, mesh = _tp(strategy), strategy.global_rank, strategy.world_size, strategy.mesh
    meta = layout(strategy, optimizers)
    if optimizers:
        record_comm_state(meta, engine)  # PowerSGD's state, beside the optimizer state (collective)
    keys = {"module": module_key, "optimizers": opt_keys}
    # weight averages (strategy.weight_averages()): each rank's share, like the optimizer state
    averages = {k: v for k, v in state.items() if isinstance(v, WeightAverages)}
    extras = _extras(state, {*opt_keys, *averages, *([module_key] if module_key else [])})
    # no rank holds the whole model at stage 3 or under tensor or pipeline parallelism: the parameters go
    # in pieces (other stages' layers are meta placeholders here, held by their own stage's file)
    in_pieces = engine.shards_params or mesh.tp_size > 1 or mesh.pp_size > 1
    # the whole model alone (litgpt's final save): one file, as Fabric's "ddp" writes it, with the fp32
    # masters where they are apart (ZeRO 1/2 in mixed precision)
    model_only = not optimizers and not averages and not in_pieces
    if (engine.stage > 0 or in_pieces) and strategy.save_distributed_checkpoint and not model_only:
        params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
        model_state = {
            k: v
            for k, v in module.state_dict().items()
            if not (in_pieces and k in params) and not (isinstance(v, Tensor) and v.is_meta)
        }
        checkpoint = {
            "state_dict": model_state,
            "optimizer_states": [{} for _ in optimizers],
            KEYS: keys,
            "extras": extras,
            METADATA_KEY: meta,
        }
        payload = rank_payload(module, engine, optimizers, tp, with_model=in_pieces, dp_rank=mesh.dp_rank)
        payload["entries"] = {
            k: rank_entry(a, dp_rank=mesh.dp_rank, tp_rank=mesh.tp_rank) for k, a in averages.items()
        }
        save_sharded(checkpoint, path, payload=payload, rank=rank, world_size=world, barrier=strategy.barrier)
        rank_zero_warn(FABRIC_DIRECTORY_NOTE)  # once per process: the same message at every save
        return
    meta["format"] = "full"
    if engine.stage == 0 and not in_pieces:
        full_model: dict[str, Any] = module.state_dict()
        full_optimizers = [opt.state_dict() for opt in optimizers]
    else:
        names = {p: n for n, p in module.named_parameters()}
        full_model = gather_full_state_dict(module, engine, tp=tp, dp_rank=mesh.dp_rank, group=None)
        full_optimizers = [
            gather_full_optimizer_state(
                opt,
                module=module,
                engine=engine,
                param_names=_group_names(opt, engine, names, k),
                tp=tp,
                dp_rank=mesh.dp_rank,
                group=None,
            )
            for k, opt in enumerate(optimizers)
        ]
    averaged = {  # the averaged model as a whole state dict, on rank 0 (collective)
        k: gather_averaged_state(a, full_model, module, tp=tp, dp_rank=mesh.dp_rank, gather=True)
        for k, a in averages.items()
    }
    if strategy.is_global_zero:
        content = {
            **{k: {"state_dict": averaged[k], "n_averaged": a.n_averaged} for k, a in averages.items()},
            **extras,
            **dict(zip(opt_keys, full_optimizers, strict=True)),
            KEYS: keys,
            METADATA_KEY: meta,
        }
        if module_key is not None:
            content[module_key] = full_model
        path.parent.mkdir(parents=True, exist_ok=True)
        write_over_directory(path, lambda to: torch.save(content, to))  # an earlier directory: swapped
    strategy.barrier()


def load(
    strategy: HybridParallelStrategy,
    path: Path,
    state: nn.Module | Optimizer | dict[str, Any] | None,
    *,
    strict: bool,
) -> dict[str, Any]:
    """Restore ``state`` in place from ``path`` (either format, any stage and dp size); return what the
    checkpoint holds beyond ``state`` (Fabric's contract)."""
    if not path.exists():
        raise FileNotFoundError(f"No checkpoint at {str(path)!r}.")
    if isinstance(state, nn.Module):
        _load_raw(strategy, path, state, strict=strict)
        return {}
    if isinstance(state, Optimizer):
        raise TypeError(
            "fabric.load_raw of an optimizer state is not supported under ZeRO (its state lives in shards):"
            " save and load it with fabric.save / fabric.load."
        )
    state = {} if state is None else state
    source: Path | None = path if is_sharded_checkpoint(path) else None
    raw: Mapping[str, Any] = {}  # a single file's or a DCP directory's entries
    if source is not None:
        checkpoint = read_meta(path)
        keys, extras = checkpoint.get(KEYS, {}), dict(checkpoint.get("extras", {}))
        saved_optimizers = list(keys.get("optimizers") or [])
    else:
        dcp = is_dcp_checkpoint(path)  # Fabric's FSDPStrategy / ModelParallelStrategy wrote it
        raw = read_dcp_entries(path) if dcp else read_torch_file(path, weights_only=False)
        keys = raw.get(KEYS) or {
            "module": next((k for k, v in state.items() if isinstance(v, nn.Module)), None),
            "optimizers": [k for k, v in state.items() if isinstance(v, Optimizer)],
        }
        saved = {*([keys["module"]] if keys["module"] else []), *keys["optimizers"]}
        saved_optimizers = [k for k in keys["optimizers"] if k in raw]
        trainer_file = "state_dict" in raw and "pytorch-lightning_version" in raw
        if keys["module"] and keys["module"] not in raw and trainer_file:
            # before: "The checkpoint's state_dict lacks [every name]", as if the model differed
            raise ValueError(
                f"{str(path)!r} is a Lightning Trainer checkpoint: its weights are under 'state_dict', named"
                " as the LightningModule holds them (e.g. 'model.'), not under"
                f" {keys['module']!r} as fabric.save writes them. Load the weights with"
                " fabric.load_raw(path, model), from a file of the model's own names (the 'state_dict'"
                " entries with the LightningModule's attribute prefix removed, saved with torch.save)."
            )
        checkpoint = {
            "state_dict": raw.get(keys["module"], {}) if keys["module"] else {},
            "optimizer_states": [raw[k] for k in saved_optimizers],
            METADATA_KEY: raw.get(METADATA_KEY),
        }
        extras = {k: v for k, v in raw.items() if k not in saved and k not in (KEYS, METADATA_KEY)}
        if dcp:  # optimizer state keyed by parameter name: torch's format, the names kept beside it
            present = [k for k in keys["optimizers"] if k in raw]
            checkpoint["optimizer_states"], checkpoint[METADATA_KEY] = torch_optimizer_states(raw, present)
    module_key, opt_keys = split_state(strategy, state)
    module = strategy.module
    # each optimizer restores the saved one of its key, as Fabric's own strategies do (before: by
    # position, so two optimizers listed in another order swapped their state, silently); checked
    # before anything is loaded
    index = _saved_index(opt_keys, saved_optimizers, path, strict=strict)
    if module_key is not None:
        assert module is not None
        check_model(checkpoint, module, _tp(strategy), strict=strict)
        _load_module(strategy, checkpoint, source, strict=strict)
    if opt_keys:
        assert module is not None
        optimizers = [state[k] for k in opt_keys if k in index]
        load_optimizer_states(
            checkpoint, module=module, engine=strategy.engine, optimizers=optimizers, sharded_path=source,
            tp=_tp(strategy), saved_index=[index[k] for k in opt_keys if k in index],
        )  # fmt: skip
        _optimizers_to_device(optimizers, strategy.root_device)
    for k in [k for k in state if isinstance(state[k], WeightAverages)]:
        _load_averages(strategy, state[k], k, source, raw_entry=extras.pop(k, None), strict=strict)
    for k in [k for k in state if k != module_key and k not in opt_keys]:
        if isinstance(state[k], WeightAverages):
            continue
        if k not in extras:
            if strict:
                raise KeyError(f"state[{k!r}] is not in the checkpoint {str(path)!r} (pass strict=False).")
            continue
        target = state[k]
        if is_stateful(target):
            target.load_state_dict(extras[k])
        else:
            state[k] = extras[k]
    rest = {k: v for k, v in extras.items() if k not in state}
    # Fabric's contract: what the checkpoint holds beyond ``state``, the model's and the optimizers'
    # states included (before: left out, so fabric.load(path)["model"] was a KeyError), whole. From a
    # sharded directory that means assembling every rank's pieces on each rank: done when the model was
    # not asked for (fabric.load(path) to look inside), not for the optimizers an evaluation load skips
    unloaded = [k for k in [keys.get("module"), *saved_optimizers] if k is not None and k not in state]
    if source is not None and module_key is not None:
        unloaded = []
    if unloaded:
        # a directory consolidates into fabric.save's own layout: the entries under their keys
        whole = consolidate(path) if source is not None else raw
        for k in unloaded:
            rest[k] = whole[k]
    return rest


def _saved_index(opt_keys: list[str], saved: list[str], path: Path, *, strict: bool) -> dict[str, int]:
    """Which saved optimizer each of ``opt_keys`` restores: the one saved under its key; a checkpoint that
    names none (written before keys were recorded) by position. A key the checkpoint lacks is refused,
    or skipped with ``strict=False``."""
    if not saved:
        return {k: i for i, k in enumerate(opt_keys)}
    missing = [k for k in opt_keys if k not in saved]
    if missing and strict:
        raise KeyError(
            f"state[{missing[0]!r}] (an optimizer) is not in the checkpoint {str(path)!r}, which holds the"
            f" optimizers {saved}: load with the keys they were saved under, or pass strict=False."
        )
    return {k: saved.index(k) for k in opt_keys if k in saved}


def _load_averages(
    strategy: HybridParallelStrategy,
    averages: WeightAverages,
    key: str,
    source: Path | None,
    *,
    raw_entry: Mapping[str, Any] | None,
    strict: bool,
) -> None:
    """Restore ``averages`` from the checkpoint's entry ``key``: every rank's share of a sharded one, or
    the averaged state dict of one file; cut to this rank's fragments when next used."""
    assert strategy.module is not None
    tp = _tp(strategy)
    shapes = global_shapes(strategy.module, tp)
    entries = read_rank_entries(source, key) if source is not None else []
    if entries:
        pieces, buffers = pieces_from_entries(entries, shapes)
        n_averaged = int(entries[0][1]["n_averaged"])
    elif raw_entry is not None:
        pieces, buffers = full_pieces(raw_entry["state_dict"], strategy.module)
        n_averaged = int(raw_entry["n_averaged"])
    else:
        if strict:
            raise KeyError(f"state[{key!r}] (weight averages) is not in the checkpoint (pass strict=False).")
        return
    averages.load(localize(pieces, shapes, tp), buffers, n_averaged=n_averaged)


def _load_module(
    strategy: HybridParallelStrategy, checkpoint: Mapping[str, Any], source: Path | None, *, strict: bool
) -> None:
    assert strategy.module is not None
    load_module_state(
        checkpoint,
        strategy.module,
        strategy.engine,
        sharded_path=source,
        tp=_tp(strategy),
        strict=strict,
    )


def _load_raw(strategy: HybridParallelStrategy, path: Path, module: nn.Module, *, strict: bool) -> None:
    if module is not strategy.module:
        raise ValueError("fabric.load_raw: pass the module returned by fabric.setup().")
    if is_sharded_checkpoint(path):
        raise ValueError(f"{str(path)!r} is a sharded checkpoint directory: read it with fabric.load.")
    raw = read_torch_file(path, weights_only=True)
    state = raw.get("state_dict", raw) if isinstance(raw, dict) else raw
    _load_module(strategy, {"state_dict": state}, None, strict=strict)
