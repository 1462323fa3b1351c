"""Finding the snapshot to resume from: the newest one that is complete on every rank, agreed by all.

A snapshot is identified by ``(lineage_time, lineage, step)``; a *lineage* is one training run (a fresh
start begins a new one, a resume continues the one it resumes). Each rank lists the snapshots it holds,
in memory (preferred: no disk read) and on disk; one ``all_gather`` gives every rank every list, and
the candidates are the snapshots held by *all* ranks, newest lineage first, then newest step. For the
best candidate each rank loads its part (from memory, else from disk, verifying the checksum) and a
second ``all_gather`` tells whether all succeeded; if any rank failed (a truncated or corrupted file),
the failures are named in a warning and the next older candidate is tried. Snapshots newer than the
chosen one but missing on some ranks (a crash during a persist) are named too; they are never loaded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_par.callbacks import _dist
from lightning_par.callbacks.disk import CorruptSnapshot, DiskStore
from lightning_par.callbacks.memory import MemoryStore

log = logging.getLogger(__name__)

Key = tuple[float, str, int]  # (lineage_time, lineage, step)


@dataclass
class Found:
    """The agreed snapshot: this rank's state and header, and where each rank loaded its part from."""

    state: dict[str, Any]
    header: dict[str, Any]
    sources: list[str]

    @property
    def step(self) -> int:
        return int(self.header["step"])


def _key(header: dict[str, Any]) -> Key:
    return (float(header["lineage_time"]), str(header["lineage"]), int(header["step"]))


def _describe(key: Key) -> str:
    return f"step {key[2]} (lineage {key[1]})"


def find_snapshot(
    *, memories: list[MemoryStore], disk: DiskStore, world_size: int, lineage: str | None = None
) -> Found | None:
    """The newest snapshot complete on all ranks (of ``lineage`` only, if given), loaded. Collective:
    every rank calls it."""

    sources: dict[Key, list[tuple[str, Any]]] = {}
    other_worlds: set[int] = set()

    def add(header: dict[str, Any], source: tuple[str, Any]) -> None:
        if lineage not in (None, header["lineage"]):
            return
        if header.get("world_size") != world_size:
            other_worlds.add(int(header.get("world_size", -1)))
            return
        sources.setdefault(_key(header), []).append(source)

    for memory in memories:
        for header in memory.headers():
            add(header, ("memory", (memory, memory.find(header["lineage"], header["step"]), header)))
    for header in disk.headers():
        add(header, ("disk", header))
    gathered = _dist.gather_objects((sorted(sources), sorted(other_worlds)))
    held = [keys for keys, _ in gathered]
    everywhere = set(held[0]).intersection(*map(set, held[1:]))
    worlds = sorted(set().union(*(set(w) for _, w in gathered)))
    if worlds and not everywhere:
        raise ValueError(
            f"FlashCheckpoint: the snapshots in {disk.dirpath} were written by a job of {worlds} rank(s),"
            f" this one has {world_size}. Nothing was loaded or deleted; run with the original number of"
            " processes,"
            " pass another dirpath, or auto_resume=False (a sharded checkpoint reshards; these do not)."
        )
    anywhere = set().union(*map(set, held))
    order = sorted(everywhere, key=lambda k: (k[0], k[2]), reverse=True)
    best = order[0] if order else None
    incomplete = sorted(k for k in anywhere - everywhere if best is None or (k[0], k[2]) > (best[0], best[2]))
    if incomplete:
        lines = [
            f"{_describe(k)}: missing on rank(s) {[r for r, h in enumerate(held) if k not in h]}"
            for k in incomplete
        ]
        rank_zero_warn(
            "FlashCheckpoint: skipping snapshot(s) not complete on every rank (a crash during a save): "
            + "; ".join(lines)
        )
    for key in order:
        state, source, errors = None, "", []
        for kind, where in sources[key]:
            try:
                if kind == "memory":
                    memory, slot, header = where
                    state, source = memory.load(slot), f"memory ({memory.directory})"
                else:
                    header = where
                    state, source = disk.load(header), f"disk ({header['path']})"
                break
            except CorruptSnapshot as exc:
                errors.append(str(exc))
            except Exception as exc:  # a memory slot that vanished or cannot be read
                errors.append(f"{kind} snapshot: {type(exc).__name__}: {exc}")
        outcome = _dist.gather_objects((state is not None, source, errors, _dist.HOST))
        problems = [
            f"rank {r} ({host}): {err}" for r, (_, _, errs, host) in enumerate(outcome) for err in errs
        ]
        if problems:
            rank_zero_warn(f"FlashCheckpoint: {_describe(key)}: " + "; ".join(problems))
        if all(ok for ok, _, _, _ in outcome):
            assert state is not None
            return Found(state=state, header=header, sources=[src for _, src, _, _ in outcome])
        failed = [r for r, (ok, _, _, _) in enumerate(outcome) if not ok]
        rank_zero_warn(
            f"FlashCheckpoint: skipping {_describe(key)}: rank(s) {failed} could not load their part;"
            " trying an older snapshot."
        )
        del state
    if anywhere:
        rank_zero_warn(
            "FlashCheckpoint: no snapshot is complete and readable on every rank; training starts from"
            " scratch (the snapshots found are left in place)."
        )
    return None
