"""Saving and loading a training state under any ZeRO stage, for the strategy (or a plain loop).

* Stage 0 saves Lightning's usual single file (everything is replicated), with layout metadata.
* Stages 1/2 save a sharded directory (:mod:`lightning_par.checkpoint.sharded`): model weights once,
  optimizer state as per-rank records by parameter name and element range.
* Loading accepts either form into either kind of target, so the dp size and stage can change between
  runs without an offline conversion; a checkpoint of other parameters fails with a message naming them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_par.checkpoint.full import model_records
from lightning_par.checkpoint.hook_edits import StateEdits
from lightning_par.checkpoint.optimizer_state import (
    Pieces,
    fragment_pieces,
    group_hyperparams,
    load_fragments,
    load_unsharded,
    pieces_from_state_dict,
)
from lightning_par.checkpoint.sharded import (
    METADATA_KEY,
    check_params_match,
    mark_complete,
    prepare_staging,
    read_optimizer_records,
    staging_dir,
    swap_into_place,
    write_meta,
    write_rank_file,
)
from lightning_par.checkpoint.tp_reshard import (
    TPInfo,
    global_shapes,
    localize,
)
from lightning_par.compose import COMPOSITION_ATTR
from lightning_par.zero.engine_api import Engine


def layout_metadata(
    module: nn.Module,
    *,
    engine: Engine | None,
    optimizers: Sequence[Optimizer],
    sizes: Mapping[str, int],
    tp: TPInfo,
) -> dict[str, Any]:
    """What a checkpoint records about the model (full parameter shapes) and the layout it was written
    with."""
    stage = engine.stage if engine is not None else 0
    names = {p: n for n, p in module.named_parameters()}
    aliases: dict[str, list[str]] = {}
    for alias, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(names[p], []).append(alias)
    meta: dict[str, Any] = {
        "format": "sharded" if stage > 0 or tp["size"] > 1 else "full",
        "zero_stage": stage,
        **dict(sizes),
        "params": global_shapes(module, tp),
        "tp_dims": dict(tp["dims"]),
        "aliases": {n: a for n, a in aliases.items() if len(a) > 1},
        "order": engine.bucket_order() if engine is not None else [],
        "optimizers": [
            {"class": type(opt).__name__, "param_names": _group_names(opt, engine, names, k)}
            for k, opt in enumerate(optimizers)
        ],
    }
    if stage > 0:
        # ZeRO 1-3 hold optimizer state (and at 3 the parameters) in flat fragments laid out over the
        # trainable parameters, so a same-layout snapshot fits only the same trainable set
        meta["frozen"] = sorted(n for n, p in module.named_parameters() if not p.requires_grad)
    composition = getattr(module, COMPOSITION_ATTR, None)
    if composition is not None and composition.pipeline is not None:
        # which layers each pipeline piece holds: a same-layout snapshot is only valid for the same cut
        meta["pipeline_cut"] = [[start, end] for start, end in composition.pipeline.pieces]
    return meta


COMM_KEY = "comm_state"  # in the layout metadata: the gradient compressor's state (PowerSGD)


def record_comm_state(meta: dict[str, Any], engine: Engine | None) -> None:
    """Add the gradient compressor's state to a checkpoint's layout metadata ``meta``: PowerSGD's ``Q``
    and its residuals averaged over the dp group, which any dp size resumes from. Collective over the dp
    group when there is such a state; a no-op without one."""
    state = engine.comm_state(average=True) if engine is not None else None
    if state is not None:
        meta[COMM_KEY] = state


def named_params(params: Iterable[nn.Parameter], names: Mapping[nn.Parameter, str]) -> list[str]:
    """The model's names of an optimizer's ``params`` (its state is saved by name); a parameter the model
    no longer holds (a module replaced after fit) is refused, naming the ways to save."""
    params = list(params)
    gone = [tuple(p.shape) for p in params if p not in names]
    if gone:
        raise RuntimeError(
            f"The optimizer holds {len(gone)} parameter(s) the model no longer has (shapes {gone[:4]}): a"
            " module was replaced after the optimizer was built (PEFT's merge_and_unload() after fit, say)."
            " Optimizer state is saved by parameter name, so it cannot be saved with this model: save the"
            " weights alone (Trainer: trainer.save_checkpoint(path, weights_only=True); Fabric:"
            " fabric.save(path, {'model': model}); either: the strategy's consolidated_state_dict()), or"
            " build an optimizer over the new modules (a new fit or setup)."
        )
    return [names[p] for p in params]


def _group_names(
    opt: Optimizer, engine: Engine | None, names: Mapping[nn.Parameter, str], index: int
) -> list[list[str]]:
    sharded = engine.sharded_state if engine is not None else None
    if sharded is not None:
        return [named_params(group, names) for group in sharded.group_params(index)]
    return [named_params(g["params"], names) for g in opt.param_groups]


def rank_payload(
    module: nn.Module,
    engine: Engine | None,
    optimizers: Sequence[Optimizer],
    tp: TPInfo,
    *,
    with_model: bool,
    dp_rank: int = 0,
) -> dict[str, Any]:
    """This rank's records in its local coordinates: optimizer state and, where no single rank holds the
    whole model (ZeRO-3, tensor or pipeline parallelism), its share of the parameters, trainable and
    frozen, and of the buffers (see :func:`lightning_par.checkpoint.full.model_records`); plus its
    tensor-parallel coordinates."""
    sharded = engine.sharded_state if engine is not None else None
    names = {p: n for n, p in module.named_parameters()}
    if sharded is not None:
        table = sharded.fragment_table()
        master_key = sharded.master_key
        group_params = [sharded.group_params(k) for k in range(len(optimizers))]
    else:  # whole local parameters (stage 0 with tensor parallelism)
        table = [(n, 0, p.numel(), p) for n, p in module.named_parameters() if not p.is_meta]
        master_key = None
        group_params = [[list(g["params"]) for g in opt.param_groups] for opt in optimizers]
    payload: dict[str, Any] = {
        "optimizers": [
            {
                "param_groups": [
                    {**hyper, "param_names": named_params(params, names)}
                    for hyper, params in zip(group_hyperparams(opt), group_params[k], strict=True)
                ],
                "records": fragment_pieces(opt, table, master_key=master_key),
            }
            for k, opt in enumerate(optimizers)
        ],
        "tp": dict(tp),
    }
    if with_model:
        share = model_records(module, engine, dp_rank=dp_rank, tp_rank=int(tp["rank"]))
        payload["model"] = share["params"]
        payload["buffers"] = share["extras"]
    return payload


def save_sharded(
    checkpoint: dict[str, Any],
    path: Path,
    *,
    payload: dict[str, Any],
    rank: int,
    world_size: int,
    barrier: Callable[[], None],
) -> None:
    """Save a sharded checkpoint to ``path`` atomically (see :mod:`lightning_par.checkpoint.sharded`).

    Every rank writes its records, rank 0 ``meta.pt``, all into a staging directory that every rank
    derives from ``path`` (the same broadcast path on all ranks) and the global step; after a barrier rank
    0 writes the ``COMPLETE`` manifest and swaps the staging directory in for whatever is at ``path``. A
    crash at any point leaves ``path`` (or its ``.previous`` fallback) holding a complete checkpoint, the
    old one or the new one. A checkpoint without ``"optimizer_states"`` (Lightning's ``save_weights_only``)
    gets no optimizer records in the rank files. Collective: every rank calls it with the same ``path``.
    """
    step = checkpoint.get("global_step", 0)
    staging = staging_dir(path, step=step if isinstance(step, int) else 0)
    if "optimizer_states" not in checkpoint:
        payload = {**payload, "optimizers": []}  # weights only: the optimizer state must not leak in
    # "optimizer_states", when present, stays as a list of placeholders (the strategy returns {} per
    # optimizer): Lightning checks for the key before it asks the strategy to restore optimizers.
    if rank == 0:
        prepare_staging(path, staging=staging)
    barrier()  # the staging directory exists, empty, before any rank writes into it
    write_rank_file(staging, rank, payload)
    if rank == 0:
        write_meta(staging, checkpoint)
    barrier()
    if rank == 0:
        mark_complete(staging, world_size)
        swap_into_place(staging, path=path)
    barrier()  # nobody reads path (or saves it again) before the swap is done


def check_model(
    checkpoint: Mapping[str, Any],
    module: nn.Module,
    tp: TPInfo,
    *,
    strict: bool = True,
    edits: StateEdits | None = None,
    hint: str = "",
) -> None:
    """Refuse a checkpoint whose recorded parameters are not the model's, before anything loads (with
    ``strict=False``, only those of another shape, or none in common); ``edits``: what the checkpoint
    hooks changed in its ``state_dict`` (:mod:`~lightning_par.checkpoint.hook_edits`), applied to the
    recorded names first; ``hint`` ends a refusal's message."""
    meta = checkpoint.get(METADATA_KEY)
    current = {n: tuple(s) for n, s in global_shapes(module, tp).items()}
    state = checkpoint.get("state_dict")
    if meta and "params" in meta:
        recorded = (edits or StateEdits()).shapes(meta["params"], state or {})
        check_params_match(recorded, current, strict=strict, hint=hint)
        return
    if isinstance(state, Mapping):
        # a plain Lightning checkpoint ("ddp", a consolidated file): its parameters by their names in the
        # state dict, beside which buffers and extra state live, so only the model's missing parameters
        # and shapes are compared here (before, a model of another size failed later with a bare KeyError,
        # or at ZeRO-3 with a message about the optimizer's param groups)
        saved = {n: tuple(v.shape) for n, v in state.items() if n in current and isinstance(v, Tensor)}
        check_params_match(saved, current, strict=strict, hint=hint)


def _sources(
    checkpoint: Mapping[str, Any],
    sharded_path: Path | None,
    current_names: Sequence[Sequence[Sequence[str]]],
    scalars: Collection[str] = (),
) -> list[tuple[list[dict[str, Any]], Pieces]]:
    """(hyper-parameters, pieces) per optimizer from a checkpoint of either format; ``scalars``: the
    names of 0-dim parameters."""
    if sharded_path is not None:
        return read_optimizer_records(sharded_path)
    meta = checkpoint.get(METADATA_KEY) or {}
    saved_names = [o["param_names"] for o in meta.get("optimizers", [])]
    out = []
    for k, state in enumerate(checkpoint.get("optimizer_states", [])):
        # a checkpoint without our metadata (plain Lightning) was made by the same configure_optimizers()
        names = saved_names[k] if k < len(saved_names) else current_names[k]
        hyper = [{kk: vv for kk, vv in g.items() if kk != "params"} for g in state["param_groups"]]
        out.append((hyper, pieces_from_state_dict(state, names, scalars=scalars)))
    return out


def load_optimizer_states(
    checkpoint: Mapping[str, Any],
    *,
    module: nn.Module,
    engine: Engine | None,
    optimizers: Sequence[Optimizer],
    sharded_path: Path | None,
    tp: TPInfo,
    saved_index: Sequence[int] | None = None,
    edits: StateEdits | None = None,
) -> None:
    """Restore ``optimizers`` (sharded or not) from a checkpoint of either format and any layout, and the
    gradient compressor's state recorded beside them. ``saved_index[i]``: which of the checkpoint's
    optimizers ``optimizers[i]`` restores (Fabric's state keys; default: the ``i``-th, all of them).
    ``edits``: the checkpoint hooks' changes to its ``state_dict`` (renamed parameters keep their state,
    written ones their moments but not their fp32 masters: :meth:`StateEdits.optimizer_pieces`)."""
    edits = edits or StateEdits()
    if engine is not None:
        engine.load_comm_state((checkpoint.get(METADATA_KEY) or {}).get(COMM_KEY))
    names = {p: n for n, p in module.named_parameters()}
    current = [_group_names(opt, engine, names, k) for k, opt in enumerate(optimizers)]
    index = list(saved_index) if saved_index is not None else list(range(len(optimizers)))
    by_saved = dict(zip(index, current, strict=True))
    sharded = engine.sharded_state if engine is not None else None
    shapes = global_shapes(module, tp)
    scalars = {n for n, shape in shapes.items() if len(shape) == 0}
    saved = [o["param_names"] for o in (checkpoint.get(METADATA_KEY) or {}).get("optimizers", [])]
    states = checkpoint.get("optimizer_states", [])
    # a checkpoint without our metadata (plain Lightning) was made by the same configure_optimizers()
    current_of_saved = [by_saved.get(k, []) for k in range(len(states))]
    if engine is None or sharded is None:
        # torch's own load ties state to parameters by position: only when the names, where the
        # checkpoint records them, are in the same order (else by name, below), and no parameter is
        # another pipeline stage's meta placeholder (torch would move its saved state onto meta)
        placeholders = any(p.is_meta for opt in optimizers for g in opt.param_groups for p in g["params"])
        if (
            sharded_path is None
            and tp["size"] == 1
            and not placeholders
            and not edits
            and (saved == [] or [saved[j] for j in index if j < len(saved)] == current)
        ):
            for opt, j in zip(optimizers, index, strict=True):
                if j < len(states):
                    opt.load_state_dict(states[j])
            return
        sources = [
            (hyper, edits.optimizer_pieces(pieces))
            for hyper, pieces in _sources(checkpoint, sharded_path, current_of_saved, scalars)
        ]
        for opt, j in zip(optimizers, index, strict=True):
            if j < len(sources):
                hyper, pieces = sources[j]
                load_unsharded(opt, localize(pieces, shapes, tp), hyper, names)
        return
    meta = checkpoint.get(METADATA_KEY) or {}
    # the optimizer now has state: freeze the bucket order (the checkpoint's, when it is ours)
    engine.freeze_order(meta.get("order") or [])
    sources = [
        (hyper, edits.optimizer_pieces(pieces))
        for hyper, pieces in _sources(checkpoint, sharded_path, current_of_saved, scalars)
    ]
    if (saved_index is None and len(sources) != len(optimizers)) or any(j >= len(sources) for j in index):
        raise ValueError(
            f"The checkpoint holds {len(sources)} optimizer(s), the model configures {len(optimizers)}."
        )
    table = sharded.fragment_table()
    for opt, j in zip(optimizers, index, strict=True):
        hyper, pieces = sources[j]
        load_fragments(opt, localize(pieces, shapes, tp), hyper, table, master_key=sharded.master_key)
    engine.masters_changed()  # the compute copy follows the restored fp32 masters
