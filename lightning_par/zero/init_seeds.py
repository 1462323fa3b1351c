"""The seeds ZeRO-3's meta init draws initial values from, and the random state it draws them in.

Each module's initialisers run under :func:`module_seed` of the run's seed and the module's path, so a
module's initial values depend on nothing else (not the unit it falls in, the stage that holds it or the
world size); :func:`agree_seed` makes the run's seed one across the mesh, and :func:`own_rng` draws
without moving the user's random streams."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from lightning_par.zero.units import REMOTE_ATTR


def module_seed(seed: int, path: str) -> int:
    """The seed the initialisers of the module at ``path`` (its name in the model) run under: a 32-bit
    hash of the run's ``seed`` and the path (see the module docstring). 32 bits, because torch's CPU
    generator keeps only the low 32 bits of a seed: a seed with the run's part above them would give
    every run the same model. ``torch.compile``'s ``_orig_mod`` steps are left out of the path: compiling a
    submodule (in ``configure_model``) does not change the model drawn."""
    path = ".".join(part for part in path.split(".") if part != "_orig_mod")
    digest = hashlib.blake2b(f"{seed}:{path}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def warn_drawn_init(params: Sequence[nn.Parameter], *, seed: int, group: ProcessGroup) -> None:
    """Say once (on the group's first rank) that ZeRO-3 draws the initial values of meta ``params`` from
    ``seed`` by module path, so they differ from what a non-sharded run draws from the caller's generator
    (the same for every stage-3 layout with that seed); nothing is said when none is drawn."""
    drawn = [p for p in params if p.is_meta and not getattr(p, REMOTE_ATTR, False)]
    if not drawn or dist.get_rank(group) != 0:
        return
    warnings.warn(
        f"ZeRO-3 meta init draws the initial values of {len(drawn)} parameters from seed {seed}, per module"
        " path (every stage-3 layout with this seed gets the same model), not from your global random"
        ' generator: they differ from the model a non-sharded run ("ddp", ZeRO 0-2, meta_init=False)'
        " draws after the same seed_everything(). For the same initial weights pass meta_init=False, or load"
        " them (pretrained=..., fabric.load_raw).",
        stacklevel=2,
    )


def agree_seed(value: int, *, groups: Sequence[ProcessGroup], device: torch.device) -> int:
    """``value`` of the first rank of the mesh, on every rank: broadcast from the first rank of each of
    ``groups`` in turn (groups spanning the mesh's dimensions: data, tensor and pipeline parallel). The
    seed meta parameters are drawn from must be one: tensor-parallel peers draw the same full matrices and
    replicated parameters, pipeline stages the same copies of tied ones. One host read, at setup."""
    seed = torch.tensor([value], device=device)
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.broadcast(seed, src=dist.get_global_rank(group, 0), group=group)
    return int(seed.item())


@contextmanager
def own_rng(device: torch.device) -> Iterator[Callable[[int], None]]:
    """Within: a function that seeds the CPU's random state and ``device``'s; both states are restored
    after, so the user's random streams (dropout, data order) go on as if nothing had been drawn."""
    backend = torch.get_device_module(device.type) if device.type not in ("cpu", "meta") else None
    index = 0
    if backend is not None:
        index = device.index if device.index is not None else backend.current_device()

    def seed(value: int) -> None:
        torch.random.default_generator.manual_seed(value)
        if backend is not None:
            with backend.device(index):
                backend.manual_seed(value)

    if backend is None:
        with torch.random.fork_rng(devices=[]):
            yield seed
    else:
        with torch.random.fork_rng(devices=[index], device_type=device.type):
            yield seed
