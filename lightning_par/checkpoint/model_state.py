"""A checkpoint's model state read back: whole (``full_state_dict_of``, from one file or a sharded
directory, with the fp32 masters of a mixed-precision run in place of its low-precision weights) or
into a model as an engine holds it (``load_module_state``: ZeRO-3 shards filled directly, otherwise the
full state cut to this rank's tensor-parallel slices and pipeline stage)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_par.checkpoint.full import unsharded_params
from lightning_par.checkpoint.hook_edits import StateEdits
from lightning_par.checkpoint.optimizer_state import MASTER_KEY, Pieces, cut, whole_pieces
from lightning_par.checkpoint.rank_state import meta_names
from lightning_par.checkpoint.sharded import (
    METADATA_KEY,
    _payloads,
    assemble_state_dict,
    read_model_records,
    read_optimizer_records,
)
from lightning_par.checkpoint.tp_reshard import TPInfo, global_shapes, localize, localize_state_dict
from lightning_par.zero.engine_api import Engine


def read_buffers(path: Path) -> dict[str, Any]:
    """The buffers (and other non-parameter entries) the ranks of a sharded checkpoint wrote."""
    out: dict[str, Any] = {}
    for payload in _payloads(path):
        for k, v in payload.get("buffers", {}).items():
            out.setdefault(k, v)
    return out


def full_state_dict_of(
    checkpoint: dict[str, Any], sharded_path: Path | None, edits: StateEdits | None = None
) -> dict[str, Any]:
    """The checkpoint's full ``state_dict``: assembled from ZeRO-3 records if that is how it was saved, and
    with the fp32 masters of a mixed-precision run in place of its low-precision parameters; the records
    go through ``edits`` (default: the save hooks' recorded in the metadata), and what the hooks wrote in
    ``state_dict`` stays over them."""
    state: dict[str, Any] = dict(checkpoint.get("state_dict", {}))
    if sharded_path is None:
        return state
    meta = checkpoint[METADATA_KEY]
    edits = edits if edits is not None else StateEdits.from_meta(meta)
    records = read_buffers(sharded_path)
    model = read_model_records(sharded_path)
    if model is not None:
        records.update(assemble_state_dict(model, meta))
    masters: Pieces = {}
    for _, pieces in read_optimizer_records(sharded_path):
        for name, parts in pieces.items():
            masters.setdefault(name, []).extend(
                (lo, hi, {"param": s[MASTER_KEY]}) for lo, hi, s in parts if MASTER_KEY in s
            )
    if any(masters.values()):
        records.update(assemble_state_dict(masters, meta, require_all=False))
    return edits.over(records, state)


def load_stage3_params(
    checkpoint: Mapping[str, Any], engine: Engine, sharded_path: Path | None, tp: TPInfo, edits: StateEdits
) -> dict[str, Any]:
    """Fill this rank's parameter shards from a checkpoint of any stage and layout; return the
    non-parameter entries of its state_dict (buffers), for ``load_state_dict`` of the rest. The records
    go through ``edits``, and the entries the hooks wrote stay over them."""
    pieces = read_model_records(sharded_path) if sharded_path is not None else None
    hook_state = dict(checkpoint.get("state_dict", {}))
    state = edits.over(read_buffers(sharded_path), hook_state) if sharded_path is not None else hook_state
    if pieces is None:
        pieces = whole_pieces(state)
    else:
        pieces = edits.records(pieces)
        pieces.update(whole_pieces({k: hook_state[k] for k in edits.written}))
    pieces = localize(pieces, global_shapes(engine.module, tp), tp)

    def values(name: str, lo: int, hi: int) -> Tensor | None:
        piece = cut(pieces.get(name, []), lo, hi)
        return None if piece is None else piece["param"]

    engine.load_param_shards(values)
    params = {n for n, _ in engine.module.named_parameters(remove_duplicate=False)}
    rest = {k: v for k, v in state.items() if k not in params}
    for name, p in unsharded_params(engine.module, engine):  # attached after setup: loaded whole
        piece = cut(pieces.get(name, []), 0, p.numel())
        if piece is not None:
            rest[name] = piece["param"].reshape(p.shape)
    return rest


def load_module_state(
    checkpoint: Mapping[str, Any],
    module: nn.Module,
    engine: Engine | None,
    *,
    sharded_path: Path | None,
    tp: TPInfo,
    strict: bool,
    edits: StateEdits | None = None,
) -> None:
    """Load a checkpoint's model state (either format, any layout) into ``module`` as ``engine`` holds it:
    ZeRO-3 shards are filled directly; otherwise the full state dict is cut to this rank's tensor-parallel
    pieces (other pipeline stages' layers skipped), loaded, and, where ZeRO 1/2 keeps separate fp32
    masters, copied into them at full precision (the compute copy alone would be rounded). ``edits``:
    the checkpoint hooks' changes to its ``state_dict`` (default: the save hooks' alone)."""
    if edits is None:
        edits = StateEdits.from_meta(checkpoint.get(METADATA_KEY))
    remote = meta_names(module)  # other pipeline stages' layers: skipped, their owners load them
    if engine is not None and engine.shards_params:
        rest = load_stage3_params(checkpoint, engine, sharded_path, tp, edits)
        rest = {k: v for k, v in rest.items() if k not in remote}
        missing, unexpected = module.load_state_dict(rest, strict=False)
        # buffers, and parameters no unit holds (attached after setup), come through load_state_dict
        whole = {n for n, b in module.named_buffers() if not b.is_meta}
        whole |= {n for n, _ in unsharded_params(module, engine)}
        if strict and (set(missing) & whole or unexpected):
            raise KeyError(
                f"Buffers or whole parameters missing from the checkpoint: {sorted(set(missing) & whole)};"
                f" unexpected keys: {sorted(unexpected)}."
            )
        return
    state = full_state_dict_of(dict(checkpoint), sharded_path, edits)
    # a model already made tensor-parallel (a second fit in the same process) takes its slices
    state = localize_state_dict(state, module, tp)
    state = {k: v for k, v in state.items() if k not in remote}
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in remote]
    if strict and (missing or unexpected):
        raise KeyError(
            f"The checkpoint's state_dict lacks {missing[:8]} and has unexpected {unexpected[:8]}."
        )
    sharded = engine.sharded_state if engine is not None else None
    if engine is not None and sharded is not None and sharded.master_key is not None:
        with torch.no_grad():
            for name, lo, hi, master in sharded.fragment_table():
                if isinstance(state.get(name), Tensor):
                    master.copy_(state[name].detach().reshape(-1)[lo:hi])
        engine.masters_changed()  # the compute copy follows the masters on every rank
