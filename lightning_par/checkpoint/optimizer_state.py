"""Optimizer state by parameter name and element range: the common currency of resharding.

Any optimizer state we can read (a torch ``state_dict`` of an unsharded optimizer, or the fragments of a
ZeRO shard) is turned into *pieces*: ``(lo, hi, {key: value})`` for the flattened elements ``[lo, hi)``
of a named parameter, where tensor values with ``dim() > 0`` are 1-D slices and 0-dim values (Adam's
``step``) are per-parameter scalars. Any target layout (an unsharded optimizer, or this rank's fragments
under another dp size or stage) is filled by cutting the pieces it overlaps. Names, not positions, tie
state to parameters, so a checkpoint survives a different bucket order or data-parallel size.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_par.zero.sharded_optimizer import MASTER_KEY as MASTER_KEY  # re-exported for the format

Piece = tuple[int, int, dict[str, Any]]
Pieces = dict[str, list[Piece]]


def _flat(value: Any) -> Any:
    return value.detach().reshape(-1) if isinstance(value, Tensor) and value.dim() > 0 else value


# per-parameter states that torch's optimizers keep as one number whatever the parameter's shape
_SCALAR_STATES = frozenset({"step", "eta", "mu", "mu_product"})


def _flat_state(state: Mapping[str, Any], *, scalar_param: bool) -> dict[str, Any]:
    """A torch optimizer's state of one parameter with its per-element tensors flat. A 0-dim parameter's
    per-element states are 0-dim too, like its step (CLIP's ``logit_scale``: Adam's ``exp_avg`` of shape
    ``()``): for one (``scalar_param``) the floating states outside :data:`_SCALAR_STATES` are its
    elements. Before, they were taken for step-like scalars and the piece had no elements, so a resume
    from a torch-format checkpoint into ZeRO 1-3 dropped that parameter's optimizer state."""
    flat = {k: _flat(v) for k, v in state.items()}
    if not scalar_param:
        return flat
    return {
        k: v.reshape(1)
        if isinstance(v, Tensor) and v.dim() == 0 and v.is_floating_point() and k not in _SCALAR_STATES
        else v
        for k, v in flat.items()
    }


def pieces_from_state_dict(
    state_dict: Mapping[str, Any], param_names: Sequence[Sequence[str]], *, scalars: Collection[str] = ()
) -> Pieces:
    """Pieces of an unsharded torch optimizer ``state_dict``; ``param_names[g][i]`` names the i-th
    parameter of group ``g`` (the order in which the optimizer was given its parameters); ``scalars``:
    the names of 0-dim parameters (see :func:`_flat_state`)."""
    groups = state_dict["param_groups"]
    if len(groups) != len(param_names):
        raise ValueError(
            f"The checkpoint's optimizer has {len(groups)} param groups, the model's {len(param_names)}."
        )
    out: Pieces = {}
    for group, names in zip(groups, param_names, strict=True):
        if len(group["params"]) != len(names):
            raise ValueError(
                f"An optimizer param group holds {len(group['params'])} parameters in the checkpoint and"
                f" {len(names)} in the model."
            )
        for index, name in zip(group["params"], names, strict=True):
            state = state_dict["state"].get(index)
            if state:
                flat = _flat_state(state, scalar_param=name in scalars)
                numel = next((v.numel() for v in flat.values() if isinstance(v, Tensor) and v.dim() > 0), 0)
                out.setdefault(name, []).append((0, numel, flat))
    return out


def whole_pieces(state: Mapping[str, Any]) -> Pieces:
    """``{"param": values}`` pieces of a state dict's tensors, each whole (non-tensor entries skipped)."""
    return {
        name: [(0, value.numel(), {"param": value.detach().reshape(-1)})]
        for name, value in state.items()
        if isinstance(value, Tensor)
    }


def cut(pieces: Sequence[Piece], lo: int, hi: int) -> dict[str, Any] | None:
    """State for elements ``[lo, hi)`` assembled from the ``pieces`` of one parameter (None if absent)."""
    parts = sorted((p for p in pieces if p[0] < hi and p[1] > lo), key=lambda p: p[0])
    if not parts:
        return None
    covered = lo
    for a, b, _ in parts:
        if a > covered:
            break
        covered = max(covered, b)
    if covered < hi:
        raise ValueError(f"The checkpoint holds optimizer state for only part of the range [{lo}, {hi}).")
    out: dict[str, Any] = {}
    for key, value in parts[0][2].items():
        if isinstance(value, Tensor) and value.dim() > 0:
            chunks = []
            pos = lo
            for a, b, state in parts:
                if b <= pos:
                    continue
                start = max(a, pos)
                chunks.append(state[key][start - a : min(b, hi) - a])
                pos = min(b, hi)
                if pos >= hi:
                    break
            out[key] = torch.cat(chunks) if len(chunks) > 1 else chunks[0].clone()
        else:
            out[key] = value.clone() if isinstance(value, Tensor) else value
    return out


def group_hyperparams(optimizer: Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def restore_hyperparams(optimizer: Optimizer, saved: Sequence[Mapping[str, Any]]) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(
            f"The checkpoint's optimizer has {len(saved)} param groups, the model's optimizer"
            f" {len(optimizer.param_groups)}; configure_optimizers() must build the same groups."
        )
    own = {"params", "param_names", *optimizer.defaults}
    for group, hyper in zip(optimizer.param_groups, saved, strict=True):
        # keys the saved groups lack and the optimizer does not define (a scheduler's initial_lr, set by
        # Lightning's learning-rate finder after the save) go, as torch's load_state_dict replaces groups
        for key in [k for k in group if k not in own and k not in hyper]:
            del group[key]
        group.update({k: v for k, v in hyper.items() if k not in ("params", "param_names")})


def load_unsharded(
    optimizer: Optimizer, pieces: Pieces, hyper: Sequence[Mapping[str, Any]], names: dict[nn.Parameter, str]
) -> None:
    """Fill an ordinary (unsharded) optimizer from pieces. Meta placeholders (another pipeline stage's
    parameters, held by the optimizer of a pipeline at stage 0) get no state: they never get a gradient
    here, so the optimizer never steps them, and a state on the meta device could not move."""
    restore_hyperparams(optimizer, hyper)
    optimizer.state.clear()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.is_meta:
                continue
            state = cut(pieces.get(names[p], []), 0, p.numel())
            if state is not None:
                optimizer.state[p] = {
                    k: _like(v.view(p.shape), p) if isinstance(v, Tensor) and v.dim() > 0 else v
                    for k, v in state.items()
                }


def load_fragments(
    optimizer: Optimizer,
    pieces: Pieces,
    hyper: Sequence[Mapping[str, Any]],
    fragments: Iterable[tuple[str, int, int, Tensor]],
    *,
    master_key: str | None = None,
) -> None:
    """Fill a sharded optimizer whose parameters are the given ``(name, lo, hi, master)`` fragments.

    With ``master_key``, a saved fp32 master value under that key overwrites the fragment itself. The
    state is replaced, as by torch's ``load_state_dict``: a fragment without saved state (saved before its
    first step) starts empty, not with what the optimizer held before the load (Lightning's learning-rate
    finder restores a checkpoint taken before its trial steps, inside the same fit).
    """
    restore_hyperparams(optimizer, hyper)
    optimizer.state.clear()
    owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for name, lo, hi, master in fragments:
        if id(master) not in owned:
            continue
        state = cut(pieces.get(name, []), lo, hi)
        if state is None:
            continue
        if master_key is not None and master_key in state:
            with torch.no_grad():
                master.copy_(state.pop(master_key))
        optimizer.state[master] = {
            k: (_like(v, master) if v.dim() > 0 else v.to(master.device)) if isinstance(v, Tensor) else v
            for k, v in state.items()
        }


def _like(value: Tensor, param: Tensor) -> Tensor:
    """A saved state tensor on ``param``'s device, and in its dtype where both are floating point, as
    torch's ``Optimizer.load_state_dict`` casts them (a checkpoint of a ``32-true`` run resumed in
    ``64-true``; before, the first step failed on the mixed dtypes at ZeRO 1-3)."""
    if value.is_floating_point() and param.is_floating_point():
        return value.to(device=param.device, dtype=param.dtype)
    return value.to(param.device)


def fragment_pieces(
    optimizer: Optimizer,
    fragments: Iterable[tuple[str, int, int, Tensor]],
    *,
    master_key: str | None = None,
    copy: bool = True,
) -> list[tuple[str, int, int, dict[str, Any]]]:
    """This rank's state as ``(name, lo, hi, {key: value})`` records: CPU copies ready to save, or with
    ``copy=False`` flat views of the live tensors (a snapshot copies them later, off the training
    thread)."""

    def out_of(t: Tensor) -> Tensor:
        return t.cpu().clone() if copy else t

    out = []
    owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for name, lo, hi, master in fragments:
        if id(master) not in owned:
            continue
        saved = optimizer.state.get(master, {})
        state = {k: out_of(_flat(v)) if isinstance(v, Tensor) else v for k, v in saved.items()}
        if master_key is not None:
            state[master_key] = out_of(master.detach().float().reshape(-1))
        if state:
            out.append((name, lo, hi, state))
    return out


def pieces_from_records(records: Iterable[tuple[str, int, int, dict[str, Any]]]) -> Pieces:
    out: Pieces = {}
    for name, lo, hi, state in records:
        out.setdefault(name, []).append((lo, hi, state))
    return out


def param_names_by_group(optimizer: Optimizer, names: Callable[[nn.Parameter], str]) -> list[list[str]]:
    return [[names(p) for p in g["params"]] for g in optimizer.param_groups]
