"""One rank's model and optimizer state for same-layout snapshots: the engine side, without Lightning.

Both front doors snapshot through these functions (the Trainer's ``FlashCheckpoint`` and Fabric's
``FlashSnapshots``); they only use the engine protocol (:class:`lightning_par.zero.engine.Engine`), so the
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
    shards parameters.

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
    cut,
    fragment_pieces,
    group_hyperparams,
    load_fragments,
    pieces_from_records,
)
from lightning_par.zero.engine import Engine


def _param_names(module: nn.Module) -> set[str]:
    return {n for n, _ in module.named_parameters(remove_duplicate=False)}


def capture(
    module: nn.Module, engine: Engine | None, optimizers: Sequence[Optimizer]
) -> tuple[OrderedDict[str, Any], dict[str, Any], list[Tensor]]:
    """``(model, optim, step_tensors)`` of this rank (see the module docstring)."""
    model: OrderedDict[str, Any] = OrderedDict(
        (k, v) for k, v in module.state_dict().items() if not (isinstance(v, Tensor) and v.is_meta)
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
    step_tensors: list[Tensor] = [p for p in module.parameters() if not p.is_meta]
    if engine is not None and engine.shards_params:
        params = _param_names(module)
        model = OrderedDict((k, v) for k, v in model.items() if k not in params)
        shards = engine.param_shards()
        optim["shards"] = [(n, lo, hi, {"param": v.detach()}) for n, lo, hi, v in shards]
        step_tensors += [view for _, _, _, view in shards]
    for opt in optimizers:
        step_tensors += [p for g in opt.param_groups for p in g["params"]]
        step_tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, Tensor)]
    return model, optim, step_tensors


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
    meta = {n for n, t in itertools.chain(module.named_parameters(), module.named_buffers()) if t.is_meta}
    skip = meta | (_param_names(module) if shards_params else set())
    missing, unexpected = module.load_state_dict(model, strict=False)
    missing = [k for k in missing if k not in skip]
    if missing or unexpected:
        raise KeyError(f"The snapshot's model state lacks {missing[:8]} and has unexpected {unexpected[:8]}.")
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
        keys = ("zero_stage", "world_size", "dp", "tp", "pp", "params", "optimizers")
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
