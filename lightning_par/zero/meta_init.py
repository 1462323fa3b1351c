"""Large-model initialisation for ZeRO-3: meta-device parameters materialised one unit at a time.

A model built on the meta device has shapes but no storage. Each unit in turn gets real storage, is
initialised by its modules' own ``reset_parameters()`` under a seed derived from the unit's index (the
same on every rank and for any world size), is sliced into shards, and is released, so no rank ever
holds more than one unit in full. :func:`materialize_model` does the same for the whole model in one
process: the unsharded twin used to check that a sharded init equals the full init sliced.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_par.zero.units import UnitPolicy, plan_units


def target_device(module: nn.Module) -> torch.device:
    """The device of the first real parameter or buffer (CPU if everything is on the meta device)."""
    for t in (*module.parameters(), *module.buffers()):
        if not t.is_meta:
            return t.device
    return torch.device("cpu")


def materialize_unit(
    root: nn.Module, params: Sequence[nn.Parameter], *, seed: int, device: torch.device
) -> list[nn.Parameter]:
    """Replace meta ``params`` by real ones on ``device`` (everywhere they are registered, so ties hold)
    and initialise them with their modules' own ``reset_parameters()`` under ``torch.manual_seed(seed)``:
    the same values on every rank and for any world size, so a sharded init equals the full init sliced
    (see :func:`materialize_model`). Returns the new parameters in the order of ``params``."""
    wanted = {id(p): p for p in params if p.is_meta}
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    owners: list[nn.Module] = []
    for _, m in root.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            if p is not None and id(p) in wanted:
                places.setdefault(id(p), []).append((m, attr))
                if all(m is not o for o in owners):
                    owners.append(m)
    fresh: dict[int, nn.Parameter] = {}
    for pid, old in wanted.items():
        new = nn.Parameter(
            torch.empty(old.shape, dtype=old.dtype, device=device), requires_grad=old.requires_grad
        )
        for m, attr in places[pid]:
            m._parameters[attr] = new
        fresh[pid] = new
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for m in owners:
            reset = getattr(m, "reset_parameters", None)
            if reset is None:
                raise ValueError(
                    f"{type(m).__name__} holds meta-device parameters but has no reset_parameters(), so"
                    " ZeRO-3 cannot initialise its shard; give it one or create the model on a real device."
                )
            reset()
    return [fresh.get(id(p), p) for p in params]


def materialize_model(root: nn.Module, *, units: UnitPolicy = None, seed: int, device: torch.device) -> None:
    """Unsharded twin of stage-3 initialisation: unit by unit, the same seeds, the whole model."""
    plan = [entry for entry in plan_units(root, units).units if entry[2]]
    for index, (_, _, named) in enumerate(plan):
        params = [p for _, p in named]
        if any(p.is_meta for p in params):
            materialize_unit(root, params, seed=seed + index, device=device)
