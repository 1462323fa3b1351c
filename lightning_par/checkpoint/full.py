"""The full (unsharded) model and optimizer state on one rank, from any layout.

Every rank turns what it holds into *records* (``(name, lo, hi, {key: values})`` of flattened elements,
the currency of :mod:`lightning_par.checkpoint.optimizer_state`) in its local tensor-parallel
coordinates, and sends them to the destination rank one rank at a time; the destination assembles them
(:func:`~lightning_par.checkpoint.tp_reshard.globalize`) into full tensors. So the destination holds the
result plus one rank's share, every other rank only its own share: at ZeRO-3 no rank ever holds the
gathered model. What each rank contributes:

* ZeRO-3: its slices of every unit (trainable and frozen parameters);
* ZeRO 0-2: the first data-parallel replica its whole local parameters (tensor-parallel pieces, this
  pipeline stage's layers), and at stages 1/2 every rank its fp32 master fragments, which replace the
  low-precision compute copies of trainable parameters;
* buffers and other non-parameter state (``get_extra_state``): the first data- and tensor-parallel
  replica of each pipeline stage, as they are (buffers are kept equal over the dp group);
* optimizer state: every rank its fragments (ZeRO 1-3), or the first dp replica its whole local state.

The optimizer state comes out in torch's own ``state_dict`` format, parameters numbered in the order of
the user's param groups, so ``optimizer.load_state_dict`` of an unsharded optimizer built by the same
``configure_optimizers()`` accepts it; frozen parameters are numbered and have no state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from lightning_par.checkpoint.optimizer_state import (
    MASTER_KEY,
    Pieces,
    cut,
    fragment_pieces,
    group_hyperparams,
)
from lightning_par.checkpoint.tp_reshard import Record, TPInfo, global_shapes, globalize
from lightning_par.zero.engine_api import Engine, own_state_reads


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def collect(payload: Any, *, dst: int, group: ProcessGroup | None) -> list[Any] | None:
    """Every rank's ``payload`` on global rank ``dst`` (in rank order), sent one rank at a time so the
    destination never holds more than the result plus one payload in transit; None on other ranks."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [payload]
    me = dist.get_rank()
    ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    if me != dst:
        dist.send_object_list([payload], dst=dst, group=group)
        return None
    out = []
    for rank in ranks:
        if rank == dst:
            out.append(payload)
            continue
        box: list[Any] = [None]
        dist.recv_object_list(box, src=rank, group=group)
        out.append(box[0])
    return out


def _cpu(t: Tensor) -> Tensor:
    return t.detach().reshape(-1).cpu().clone()


def unsharded_params(module: nn.Module, engine: Engine) -> list[tuple[str, nn.Parameter]]:
    """At ZeRO-3, the module's parameters no unit holds: attached after setup (an EMA copy made in
    ``on_fit_start``), whole on every rank; other pipeline stages' placeholders are not among them."""
    held = engine.sharded_param_ids
    return [(n, p) for n, p in module.named_parameters() if id(p) not in held and not p.is_meta]


def model_records(module: nn.Module, engine: Engine | None, *, dp_rank: int, tp_rank: int) -> dict[str, Any]:
    """This rank's share of the model (see the module docstring): parameter records, master records and
    non-parameter state."""
    params: list[Record] = []
    masters: list[Record] = []
    if engine is not None and engine.shards_params:
        params = [(n, lo, hi, {"param": _cpu(view)}) for n, lo, hi, view in engine.param_shards()]
        if dp_rank == 0:  # parameters attached after setup (an EMA copy), whole on every rank
            params += [(n, 0, p.numel(), {"param": _cpu(p)}) for n, p in unsharded_params(module, engine)]
    else:
        if dp_rank == 0:
            params = [
                (n, 0, p.numel(), {"param": _cpu(p)}) for n, p in module.named_parameters() if not p.is_meta
            ]
        sharded = engine.sharded_state if engine is not None else None
        if sharded is not None and sharded.master_key is not None:
            masters = [(n, lo, hi, {"param": _cpu(m)}) for n, lo, hi, m in sharded.fragment_table()]
    extras: dict[str, Tensor] = {}
    if dp_rank == 0 and tp_rank == 0:
        names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
        with own_state_reads(module):  # the buffers; the parameters came from the shards above
            entries = module.state_dict(keep_vars=True).items()
        extras = {
            k: v.detach().cpu().clone()
            for k, v in entries
            if k not in names and not (isinstance(v, Tensor) and v.is_meta)
        }
    return {"params": params, "masters": masters, "extras": extras}


def assemble_model(
    shares: Sequence[tuple[TPInfo, Mapping[str, Any]]], module: nn.Module, tp: TPInfo
) -> dict[str, Any]:
    """The full state dict from every rank's :func:`model_records` (keyed by tp coordinates), under every
    name a tied parameter is registered, in the module's ``state_dict()`` order."""
    shapes = global_shapes(module, tp)
    params = globalize([(info, share["params"]) for info, share in shares], shapes)
    masters = globalize([(info, share["masters"]) for info, share in shares], shapes)
    extras: dict[str, Any] = {}
    for _, share in shares:
        for k, v in share["extras"].items():
            extras.setdefault(k, v)
    values: dict[str, Tensor] = {}
    dtypes = {n: p.dtype for n, p in module.named_parameters()}
    for name, shape in shapes.items():
        if _numel(shape) == 0:  # nothing to hold: no rank has a fragment of it
            values[name] = torch.empty(shape, dtype=dtypes[name])
            continue
        source = masters if masters.get(name) else params
        piece = cut(source.get(name, []), 0, _numel(shape))
        if piece is None:
            raise ValueError(f"No rank holds parameter {name!r}; the layout lost it (this is a bug).")
        values[name] = piece["param"].view(shape)
    canonical = {id(p): n for n, p in module.named_parameters()}
    out: dict[str, Any] = {}
    for key in module.state_dict(keep_vars=True):
        if key in extras:
            out[key] = extras[key]
    for alias, p in module.named_parameters(remove_duplicate=False):
        out[alias] = values[canonical[id(p)]]
    order = list(module.state_dict(keep_vars=True))
    return {k: out[k] for k in order if k in out} | {k: v for k, v in out.items() if k not in order}


def optimizer_records(
    optimizer: Optimizer, module: nn.Module, engine: Engine | None, *, dp_rank: int
) -> list[Record]:
    """This rank's share of one optimizer's state, without fp32 masters (those go to the model)."""
    sharded = engine.sharded_state if engine is not None else None
    if sharded is not None:
        return fragment_pieces(optimizer, sharded.fragment_table())
    if dp_rank != 0:
        return []  # replicated: the first dp replica speaks for all
    table = [(n, 0, p.numel(), p) for n, p in module.named_parameters() if not p.is_meta]
    return fragment_pieces(optimizer, table)


def torch_optimizer_state(
    groups: Sequence[Mapping[str, Any]], pieces: Pieces, shapes: Mapping[str, Sequence[int]]
) -> dict[str, Any]:
    """Torch's ``Optimizer.state_dict()`` format from pieces of the full parameters' state; ``groups``
    are the param groups' hyper-parameters with ``param_names`` (the parameters in the user's order)."""
    state: dict[int, dict[str, Any]] = {}
    out_groups = []
    index = 0
    for group in groups:
        ids = []
        for name in group["param_names"]:
            piece = cut(pieces.get(name, []), 0, _numel(shapes[name]))
            if piece is not None:
                state[index] = {
                    k: v.view(tuple(shapes[name])) if isinstance(v, Tensor) and v.dim() > 0 else v
                    for k, v in piece.items()
                    if k != MASTER_KEY
                }
            ids.append(index)
            index += 1
        out_groups.append({**{k: v for k, v in group.items() if k != "param_names"}, "params": ids})
    return {"state": state, "param_groups": out_groups}


def gather_full_state_dict(
    module: nn.Module,
    engine: Engine | None,
    *,
    tp: TPInfo,
    dp_rank: int,
    group: ProcessGroup | None,
    dst: int = 0,
) -> dict[str, Any]:
    """The full model state dict on global rank ``dst`` (``{}`` elsewhere); collective over ``group``."""
    share = model_records(module, engine, dp_rank=dp_rank, tp_rank=int(tp["rank"]))
    shares = collect((dict(tp), share), dst=dst, group=group)
    if shares is None:
        return {}
    with own_state_reads(module):  # the keys and their order
        return assemble_model(shares, module, tp)


def gather_full_optimizer_state(
    optimizer: Optimizer,
    *,
    module: nn.Module,
    engine: Engine | None,
    param_names: Sequence[Sequence[str]],
    tp: TPInfo,
    dp_rank: int,
    group: ProcessGroup | None,
    dst: int = 0,
) -> dict[str, Any]:
    """One optimizer's full state in torch's format on global rank ``dst`` (``{}`` elsewhere);
    ``param_names[g]`` names the parameters of group ``g`` in the user's order."""
    records = optimizer_records(optimizer, module, engine, dp_rank=dp_rank)
    shares = collect((dict(tp), records), dst=dst, group=group)
    if shares is None:
        return {}
    with own_state_reads(module):  # the names of the persistent entries
        shapes = global_shapes(module, tp)
    pieces = globalize(shares, shapes)
    hyper = group_hyperparams(optimizer)
    groups = [{**h, "param_names": list(names)} for h, names in zip(hyper, param_names, strict=True)]
    return torch_optimizer_state(groups, pieces, shapes)
