"""Saving and loading a training state under any ZeRO stage, for the strategy (or a plain loop).

* Stage 0 saves Lightning's usual single file (everything is replicated), with layout metadata.
* Stages 1/2 save a sharded directory (:mod:`lightning_par.checkpoint.sharded`): model weights once,
  optimizer state as per-rank records by parameter name and element range.
* Loading accepts either form into either kind of target, so the dp size and stage can change between
  runs without an offline conversion; a checkpoint of other parameters fails with a message naming them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer

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
    read_optimizer_records,
    write_meta,
    write_rank_file,
)
from lightning_par.zero.engine import ZeroEngine


def layout_metadata(
    module: nn.Module,
    *,
    engine: ZeroEngine | None,
    optimizers: Sequence[Optimizer],
    sizes: Mapping[str, int],
) -> dict[str, Any]:
    """What a checkpoint records about the model and the layout it was written with."""
    stage = engine.stage if engine is not None else 0
    names = {p: n for n, p in module.named_parameters()}
    meta: dict[str, Any] = {
        "format": "sharded" if stage > 0 else "full",
        "zero_stage": stage,
        **dict(sizes),
        "params": {n: list(p.shape) for n, p in module.named_parameters()},
        "order": engine.sync.names if engine is not None else [],
        "optimizers": [
            {"class": type(opt).__name__, "param_names": _group_names(opt, engine, names, k)}
            for k, opt in enumerate(optimizers)
        ],
    }
    return meta


def _group_names(
    opt: Optimizer, engine: ZeroEngine | None, names: Mapping[nn.Parameter, str], index: int
) -> list[list[str]]:
    if engine is not None and engine.sharded is not None:
        return [[names[p] for p in group] for group in engine.sharded.group_params(index)]
    return [[names[p] for p in g["params"]] for g in opt.param_groups]


def sharded_optimizer_payload(engine: ZeroEngine, optimizers: Sequence[Optimizer]) -> dict[str, Any]:
    """This rank's optimizer records (stages 1/2)."""
    assert engine.sharded is not None
    names = {p: n for n, p in engine.module.named_parameters()}
    table = engine.sharded.fragment_table()
    master_key = engine.sharded.master_key
    return {
        "optimizers": [
            {
                "param_groups": [
                    {**hyper, "param_names": [names[p] for p in params]}
                    for hyper, params in zip(
                        group_hyperparams(opt), engine.sharded.group_params(k), strict=True
                    )
                ],
                "records": fragment_pieces(opt, table, master_key=master_key),
            }
            for k, opt in enumerate(optimizers)
        ]
    }


def save_sharded(
    checkpoint: dict[str, Any],
    path: Path,
    *,
    engine: ZeroEngine,
    optimizers: Sequence[Optimizer],
    rank: int,
    world_size: int,
    barrier: Callable[[], None],
) -> None:
    """Every rank writes its records; rank 0 writes the rest and, after all are done, the marker."""
    path.mkdir(parents=True, exist_ok=True)
    # "optimizer_states" stays as a list of placeholders (the strategy returns {} per optimizer): Lightning
    # checks for the key before it asks the strategy to restore optimizers.
    write_rank_file(path, rank, sharded_optimizer_payload(engine, optimizers))
    if rank == 0:
        write_meta(path, checkpoint)
    barrier()
    if rank == 0:
        mark_complete(path, world_size)
    barrier()


def check_model(checkpoint: Mapping[str, Any], module: nn.Module) -> None:
    meta = checkpoint.get(METADATA_KEY)
    if meta and "params" in meta:
        check_params_match(meta["params"], {n: tuple(p.shape) for n, p in module.named_parameters()})


def _sources(
    checkpoint: Mapping[str, Any], sharded_path: Path | None, current_names: Sequence[Sequence[Sequence[str]]]
) -> list[tuple[list[dict[str, Any]], Pieces]]:
    """(hyper-parameters, pieces) per optimizer from a checkpoint of either format."""
    if sharded_path is not None:
        return read_optimizer_records(sharded_path)
    meta = checkpoint.get(METADATA_KEY) or {}
    saved_names = [o["param_names"] for o in meta.get("optimizers", [])]
    out = []
    for k, state in enumerate(checkpoint.get("optimizer_states", [])):
        # a checkpoint without our metadata (plain Lightning) was made by the same configure_optimizers()
        names = saved_names[k] if k < len(saved_names) else current_names[k]
        hyper = [{kk: vv for kk, vv in g.items() if kk != "params"} for g in state["param_groups"]]
        out.append((hyper, pieces_from_state_dict(state, names)))
    return out


def load_optimizer_states(
    checkpoint: Mapping[str, Any],
    *,
    module: nn.Module,
    engine: ZeroEngine | None,
    optimizers: Sequence[Optimizer],
    sharded_path: Path | None,
) -> None:
    """Restore ``optimizers`` (sharded or not) from a checkpoint of either format."""
    names = {p: n for n, p in module.named_parameters()}
    current = [_group_names(opt, engine, names, k) for k, opt in enumerate(optimizers)]
    if engine is None or engine.sharded is None:
        if sharded_path is None:
            for opt, state in zip(optimizers, checkpoint.get("optimizer_states", []), strict=False):
                opt.load_state_dict(state)
            return
        for opt, (hyper, pieces) in zip(
            optimizers, _sources(checkpoint, sharded_path, current), strict=False
        ):
            load_unsharded(opt, pieces, hyper, names)
        return
    meta = checkpoint.get(METADATA_KEY) or {}
    order = meta.get("order") or []
    # the optimizer now has state: freeze the bucket order (the checkpoint's, when it is ours)
    engine.sync.set_order(order if sorted(order) == sorted(engine.sync.names) else engine.sync.names)
    sources = _sources(checkpoint, sharded_path, current)
    if len(sources) != len(optimizers):
        raise ValueError(
            f"The checkpoint holds {len(sources)} optimizer(s), the model configures {len(optimizers)}."
        )
    table = engine.sharded.fragment_table()
    for opt, (hyper, pieces) in zip(optimizers, sources, strict=True):
        load_fragments(opt, pieces, hyper, table, master_key=engine.sharded.master_key)
