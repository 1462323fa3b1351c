"""One rank's model and optimizer state for same-layout snapshots: the engine side, without Lightning.

Both front doors snapshot through these functions (the Trainer's ``FlashCheckpoint`` and Fabric's
``FlashSnapshots``); they only use the engine protocol (:class:`lightning_par.zero.engine_api.Engine`), so the
same code serves stages 0-3 and no engine class is named here.

A rank's share is two trees:

``model``
    ``module.state_dict()`` without meta entries (other pipeline stages): replicated weights at stages
    0-2, this rank's tensor-parallel pieces; when the engine shards parameters (stage 3) only the
    buffers, the parameters being in ``optim["shards"]``.
``optim``
    ``{"kind": "torch", "optimizers": [opt.state_dict(), ...]}`` for unsharded optimizers, or
    ``{"kind": "fragments", "order": bucket order, "optimizers": [{"param_groups", "records"}]}`` where a
    record ``(name, lo, hi, {state})`` is a fragment this rank owns (the format of
    :mod:`lightning_par.checkpoint.optimizer_state`, fp32 masters included when separate); plus
    ``"shards": [(name, lo, hi, {"param": view})]``, every parameter piece this rank holds, when the engine
    shards parameters; ``"comm"``: the gradient compressor's state (PowerSGD), when there is one.

:func:`capture` returns *live* tensors (views, no copies) and the tensors only an optimizer step changes
(parameters, shards, masters, optimizer state): a caller may copy those after the training thread moved
on, until the next optimizer step. :func:`load` is the exact inverse on the same layout.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_par.checkpoint.optimizer_state import (
    MASTER_KEY,
    cut,
    fragment_pieces,
    group_hyperparams,
    load_fragments,
    load_unsharded,
    pieces_from_records,
    pieces_from_state_dict,
)
from lightning_par.zero.compressor_state import merge_states
from lightning_par.zero.engine_api import Engine, own_state_reads


def meta_names(module: nn.Module) -> set[str]:
    """The names (every alias) of ``module``'s meta parameters and buffers: placeholders of other
    pipeline stages' layers, loaded by their owners."""
    held = itertools.chain(
        module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)
    )
    return {n for n, t in held if t.is_meta}


def _param_names(module: nn.Module) -> set[str]:
    return {n for n, _ in module.named_parameters(remove_duplicate=False)}


def capture(
    module: nn.Module, engine: Engine | None, optimizers: Sequence[Optimizer]
) -> tuple[OrderedDict[str, Any], dict[str, Any], list[Tensor]]:
    """``(model, optim, step_tensors)`` of this rank (see the module docstring)."""
    with own_state_reads(module):
        entries = module.state_dict().items()
    model: OrderedDict[str, Any] = OrderedDict(
        (k, v) for k, v in entries if not (isinstance(v, Tensor) and v.is_meta)
    )
    sharded = engine.sharded_state if engine is not None else None
    optim: dict[str, Any]
    if engine is not None and sharded is not None:
        table = sharded.fragment_table()
        optim = {
            "kind": "fragments",
            "order": engine.bucket_order(),
            "optimizers": [
                {
                    "param_groups": group_hyperparams(opt),
                    "records": fragment_pieces(opt, table, master_key=sharded.master_key, copy=False),
                }
                for opt in optimizers
            ],
        }
    else:
        optim = {"kind": "torch", "optimizers": [opt.state_dict() for opt in optimizers]}
    comm = engine.comm_state() if engine is not None else None
    if comm is not None:
        # this rank's PowerSGD residuals and Q: changed by the next backward, so not step tensors
        optim["comm"] = comm
    step_tensors: list[Tensor] = [p for p in module.parameters() if not p.is_meta]
    if engine is not None and engine.shards_params:
        # the units' parameters go as shards; one attached after setup (an EMA copy) stays in `model`
        held = engine.sharded_param_ids
        params = {n for n, p in module.named_parameters(remove_duplicate=False) if id(p) in held}
        model = OrderedDict((k, v) for k, v in model.items() if k not in params)
        shards = engine.param_shards()
        optim["shards"] = [(n, lo, hi, {"param": v.detach()}) for n, lo, hi, v in shards]
        step_tensors += [view for _, _, _, view in shards]
    for opt in optimizers:
        step_tensors += [p for g in opt.param_groups for p in g["params"]]
        step_tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, Tensor)]
    return model, optim, step_tensors


def _load_model(module: nn.Module, model: dict[str, Any], *, skip: set[str]) -> None:
    """``module.load_state_dict(model)``, where only the names in ``skip`` may be missing (held elsewhere:
    shards, other pipeline stages)."""
    missing, unexpected = module.load_state_dict(model, strict=False)
    missing = [k for k in missing if k not in skip]
    if missing or unexpected:
        raise KeyError(f"The snapshot's model state lacks {missing[:8]} and has unexpected {unexpected[:8]}.")


def storages(tensors: Sequence[Tensor]) -> set[int]:
    """The storage addresses of ``tensors`` (what the snapshot writer may copy late)."""
    return {t.untyped_storage().data_ptr() for t in tensors if t.numel() and not t.is_meta}


def load(
    module: nn.Module,
    engine: Engine | None,
    optimizers: Sequence[Optimizer],
    model: dict[str, Any],
    optim: dict[str, Any],
) -> None:
    """Put :func:`capture`'s trees back on the same layout (positions and fragments match)."""
    if engine is not None and optim.get("order"):
        engine.freeze_order(optim["order"])  # the saved bucket layout, before fragments are matched
        if engine.bucket_order() != list(optim["order"]):  # kept: its optimizers hold state in it
            raise ValueError(
                "This snapshot's fragments follow another bucket order than the one this run's optimizers"
                " hold state in, so its positions would land on other parameters. Restore it before the"
                " first optimizer step (at the start of the run), where its order is adopted."
            )
    if engine is not None:
        engine.load_comm_state(optim.get("comm"))  # the same rank's residuals: exact
    shards_params = engine is not None and engine.shards_params
    if shards_params:
        assert engine is not None
        if "shards" not in optim:
            raise ValueError("The snapshot holds no parameter shards, but the engine shards parameters.")
        shards = pieces_from_records(optim["shards"])

        def values(name: str, lo: int, hi: int) -> Tensor | None:
            piece = cut(shards.get(name, []), lo, hi)
            return None if piece is None else piece["param"]

        engine.load_param_shards(values)
    skip = meta_names(module) | (_param_names(module) if shards_params else set())
    _load_model(module, model, skip=skip)
    if optim["kind"] == "fragments":
        sharded = engine.sharded_state if engine is not None else None
        if engine is None or sharded is None:
            raise ValueError(
                "The snapshot holds ZeRO optimizer shards, but the strategy shards no optimizer."
            )
        table = sharded.fragment_table()
        for opt, saved in zip(optimizers, optim["optimizers"], strict=True):
            pieces = pieces_from_records(saved["records"])
            load_fragments(opt, pieces, saved["param_groups"], table, master_key=sharded.master_key)
        engine.masters_changed()  # compute copies := restored fp32 masters, on every rank
        return
    for opt, saved_state in zip(optimizers, optim["optimizers"], strict=True):
        # torch casts the state onto each parameter's device and keeps step counters where the optimizer
        # wants them (on the host unless capturable/fused): nothing to move here
        opt.load_state_dict(saved_state)


def load_resharded(
    module: nn.Module,
    engine: Engine | None,
    optimizers: Sequence[Optimizer],
    parts: Sequence[tuple[dict[str, Any], dict[str, Any]]],
    *,
    param_names: Sequence[Sequence[Sequence[str]]],
) -> None:
    """Put the ``(model, optim)`` trees of *every* rank of a snapshot written at another data-parallel size
    or ZeRO stage onto this rank's layout (no tensor or pipeline parallelism on either side).

    Parameters and optimizer state are turned into the name/range *pieces* of
    :mod:`lightning_par.checkpoint.optimizer_state` (the union of all writers' records, or an unsharded
    optimizer's ``state_dict`` read with ``param_names``, the saved optimizers' parameter names by group),
    and this rank's layout takes what it owns: its fragments at stages 1-3, everything at stage 0.
    Parameters come whole from a writer's model tree (stages 0-2) or are assembled from the writers'
    shards (stage 3); buffers come from writer 0.
    """
    models = [m for m, _ in parts]
    optims = [o for _, o in parts]
    kinds = {o["kind"] for o in optims}
    if len(kinds) != 1:
        raise ValueError(f"The snapshot's ranks saved different optimizer formats {sorted(kinds)}.")
    shapes = {n: p.shape for n, p in module.named_parameters()}
    shard_pieces = pieces_from_records(r for o in optims for r in o.get("shards", []))

    def full(name: str) -> Tensor:
        if name in models[0]:
            return models[0][name].detach().reshape(-1)
        whole = cut(shard_pieces.get(name, []), 0, shapes[name].numel())
        if whole is None:
            raise KeyError(f"The snapshot holds neither the parameter {name!r} nor its shards.")
        return whole["param"]

    if engine is not None and engine.shards_params:
        engine.load_param_shards(lambda name, lo, hi: full(name)[lo:hi] if name in shapes else None)
    comms = [o["comm"] for o in optims if "comm" in o]
    if engine is not None:  # every new rank takes the writers' mean residual (lightning_par.zero.powersgd)
        engine.load_comm_state(merge_states(comms) if comms else None)
    skip = _param_names(module) if engine is not None and engine.shards_params else set()
    model = OrderedDict((k, v) for k, v in models[0].items() if k not in skip)  # shards hold those
    canonical = {id(p): n for n, p in module.named_parameters()}
    for alias, param in module.named_parameters(remove_duplicate=False):  # tied weights: every name
        if alias not in skip and alias not in model:
            model[alias] = full(canonical[id(param)]).view(param.shape)
    _load_model(module, model, skip=skip)
    names = {p: n for n, p in module.named_parameters()}
    sharded = engine.sharded_state if engine is not None else None
    if engine is not None:  # the optimizer gets state now: fix the bucket layout first (a writer's, if
        engine.freeze_order(optims[0].get("order") or [])  # it names the same parameters), as load() does
    for k, opt in enumerate(optimizers):
        if kinds == {"fragments"}:
            pieces = pieces_from_records(r for o in optims for r in o["optimizers"][k]["records"])
            hyper = optims[0]["optimizers"][k]["param_groups"]
        else:
            saved = optims[0]["optimizers"][k]
            scalars = {n for n, shape in shapes.items() if len(shape) == 0}
            pieces = pieces_from_state_dict(saved, param_names[k], scalars=scalars)
            hyper = [{n: v for n, v in g.items() if n != "params"} for g in saved["param_groups"]]
            if sharded is not None and sharded.master_key is not None:
                # an unsharded optimizer keeps no fp32 master: the saved parameter is the master
                for name in {n for group in param_names[k] for n in group}:
                    master = full(name).float()
                    states = pieces.setdefault(name, [(0, master.numel(), {})])
                    states[0][2][sharded.master_key] = master
        if sharded is not None:
            load_fragments(opt, pieces, hyper, sharded.fragment_table(), master_key=sharded.master_key)
        else:
            for states in pieces.values():  # a separate fp32 master is the parameter itself here
                for _, _, state in states:
                    state.pop(MASTER_KEY, None)
            load_unsharded(opt, pieces, hyper, names)
    if sharded is not None and engine is not None:
        engine.masters_changed()


def fingerprint(
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    *,
    strategy: str,
    world_size: int,
    layout: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What must be equal for a snapshot to load: strategy, world size, parameters, optimizers and, for
    our strategies, the layout metadata a checkpoint records (``layout``, which then replaces the rest)."""
    if layout is not None:
        keys = (
            "zero_stage",
            "world_size",
            "dp",
            "tp",
            "pp",
            "pipeline_cut",
            "params",
            "frozen",
            "optimizers",
        )
        return {"strategy": strategy, **{k: layout[k] for k in keys if k in layout}}
    names = {id(p): n for n, p in module.named_parameters()}
    return {
        "strategy": strategy,
        "world_size": world_size,
        "params": {n: list(p.shape) for n, p in module.named_parameters()},
        "optimizers": [
            {
                "class": type(opt).__name__,
                "param_names": [
                    [names.get(id(p), "<not a module parameter>") for p in g["params"]]
                    for g in opt.param_groups
                ],
            }
            for opt in optimizers
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
        if key == "frozen":
            out.extend(_frozen_differences(a, b))
        elif key == "params" and isinstance(a, dict) and isinstance(b, dict):
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
            out.extend(_optimizer_differences(a or [], b or []))
        elif key == "pipeline_cut" and isinstance(a, list) and isinstance(b, list):
            was, now = [e - s for s, e in a], [e - s for s, e in b]
            out.append(
                f"pipeline cut: the snapshot's stages held {was} layers per piece, now {now}; resume with"
                f" partition_method={was}"
            )
        elif key == "zero_stage":
            out.append(
                f"ZeRO stage: snapshot {a!r}, now {b!r} (a snapshot changes stage only together with the"
                " data-parallel size; at this size resume at its stage, or from a checkpoint of"
                " trainer.save_checkpoint or fabric.save, which loads at any stage)"
            )
        else:
            out.append(f"{key}: snapshot {a!r}, now {b!r}")
    return out


def _frozen_differences(saved: list[str] | None, current: list[str] | None) -> list[str]:
    """The frozen-set change between a snapshot and this run, with the way to make it (nothing when
    either side does not record the set: snapshots of ZeRO-0, or written before it was recorded)."""
    if saved is None or current is None:
        return []
    now_frozen = sorted(set(current) - set(saved))
    now_trainable = sorted(set(saved) - set(current))
    out = [
        f"parameters {label}: {names[:5]}{' ...' if len(names) > 5 else ''}"
        for label, names in (
            ("trained in the snapshot, frozen now", now_frozen),
            ("frozen in the snapshot, trainable now", now_trainable),
        )
        if names
    ]
    out.append(
        "ZeRO 1-3 lay their optimizer state out over the trainable parameters only, so a snapshot loads"
        " into the same frozen set; to change it, resume from a checkpoint of trainer.save_checkpoint or"
        " fabric.save, which loads by name"
    )
    return out


def _optimizer_differences(saved: list[dict[str, Any]], current: list[dict[str, Any]]) -> list[str]:
    """The optimizers' differences by name: count, class, and which parameters joined or left each (an
    optimizer built over the trainable parameters follows the frozen set)."""
    if len(saved) != len(current):
        return [f"optimizers: the snapshot has {len(saved)}, this run {len(current)}"]
    out = []
    for k, (a, b) in enumerate(zip(saved, current, strict=True)):
        if a.get("class") != b.get("class"):
            out.append(f"optimizer {k}: snapshot {a.get('class')}, now {b.get('class')}")
            continue
        was = {n for group in a.get("param_names", []) for n in group}
        now = {n for group in b.get("param_names", []) for n in group}
        left, joined = sorted(was - now), sorted(now - was)
        if not left and not joined:
            out.append(f"optimizer {k}: its parameter groups are split otherwise")
            continue
        listed = [
            f"{label} {names[:5]}" for label, names in (("left it:", left), ("joined it:", joined)) if names
        ]
        out.append(
            f"optimizer {k}: parameters {'; '.join(listed)} (frozen otherwise? resume with the same"
            " parameters trainable, or from a checkpoint of trainer.save_checkpoint or fabric.save, which"
            " loads by name)"
        )
    return out
