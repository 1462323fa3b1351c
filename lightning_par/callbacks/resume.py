"""Finding the snapshot to resume from: the newest one whose every rank's part can be read, agreed by all.

A snapshot is identified by ``(lineage_time, lineage, step, world size)``; a *lineage* is one training run
(a fresh start begins a new one, a resume continues the one it resumes). A snapshot written by ``W``
ranks consists of ``W`` *parts*, one per writing rank. Each rank lists the parts it can read locally:
its own memory slots, the other memory folders of its node (another rank's slots, or *replicas* of a
rank on another node), and the disk files under ``dirpath`` (every rank's, when ``dirpath`` is shared).
One ``all_gather`` gives every rank every list; a snapshot is a candidate when the parts held anywhere
cover all ``W`` writers (newest lineage first, then newest step). Snapshots of another world size are
candidates only with ``reshard=True``.

What each rank needs of the candidate: its own part when the world size is the same (``W`` ranks
continue as ``W``), every part when it is not (the state is resharded, :mod:`lightning_par.checkpoint.
rank_state`). A needed part is read locally, memory before disk; a part this rank cannot read (a lost
node's, held only as a replica on a survivor) is sent by the rank holding it, preferring a holder that has
it in memory. A second ``all_gather`` tells whether every load succeeded; if any failed (a truncated or
corrupt file), the failures are named in a warning and the next older candidate is tried. Newer snapshots
that lack some writer's part everywhere (a crash during a persist, a lost node without replica or disk
copy) are named with the missing ranks; they are never loaded and nothing is deleted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_par.callbacks import _dist
from lightning_par.callbacks.disk import CorruptSnapshot, DiskStore
from lightning_par.callbacks.memory import MemoryStore
from lightning_par.checkpoint.rank_state import differences

log = logging.getLogger(__name__)

Key = tuple[float, str, int, int]  # (lineage_time, lineage, step, world size of the writers)


@dataclass
class Found:
    """The agreed snapshot: the parts this rank loaded (by writing rank), the header of its own part (or
    of part 0 when resharding), and where each writing rank's part came from."""

    parts: dict[int, dict[str, Any]]
    header: dict[str, Any]
    sources: list[str]
    rank: int = 0
    resharded: bool = field(default=False)

    @property
    def step(self) -> int:
        return int(self.header["step"])

    @property
    def world_size(self) -> int:
        """The number of ranks that wrote the snapshot."""
        return int(self.header["world_size"])

    @property
    def state(self) -> dict[str, Any]:
        """This rank's own part (same world size only)."""
        return self.parts[self.rank]


def _key(header: dict[str, Any]) -> Key:
    world = int(header.get("world_size", -1))
    return (float(header["lineage_time"]), str(header["lineage"]), int(header["step"]), world)


def describe(key: Key) -> str:
    return f"step {key[2]} (lineage {key[1]}, {key[3]} rank(s))"


Source = tuple[str, Any]  # ("memory", (store, slot)) or ("disk", header)


def _load(source: Source, disk: DiskStore) -> tuple[dict[str, Any], str]:
    kind, where = source
    if kind == "memory":
        memory, slot = where
        return memory.load(slot), f"memory ({memory.directory})"
    return disk.load(where), f"disk ({where['path']})"


def find_snapshot(
    *,
    memories: list[MemoryStore],
    node_root: Path,
    slots: int,
    disk: DiskStore,
    rank: int,
    world_size: int,
    lineage: str | None = None,
    reshard: bool = False,
) -> Found | None:
    """The newest snapshot whose parts can all be read (of ``lineage`` only, if given), this rank's
    needed parts loaded (see the module docstring). ``memories``: this rank's stores; ``node_root``: the
    job's folder in shared memory, whose other folders (other ranks' slots, replicas) are read too.
    Collective: every rank calls it."""
    mine = {m.directory for m in memories}
    others = [
        MemoryStore(d, slots=slots)
        for d in sorted(node_root.iterdir() if node_root.is_dir() else [])
        if d.is_dir() and d not in mine
    ]
    try:
        return _find(
            memories=[*memories, *others],
            disk=disk,
            rank=rank,
            world_size=world_size,
            lineage=lineage,
            reshard=reshard,
        )
    finally:
        for memory in others:
            memory.close()  # unmapped; the parts loaded are copies


def _find(
    *,
    memories: list[MemoryStore],
    disk: DiskStore,
    rank: int,
    world_size: int,
    lineage: str | None,
    reshard: bool,
) -> Found | None:
    held: dict[Key, dict[int, list[Source]]] = {}
    headers: dict[tuple[Key, int], dict[str, Any]] = {}

    def add(header: dict[str, Any], source: Source) -> None:
        if lineage not in (None, header["lineage"]):
            return
        key, writer = _key(header), int(header["rank"])
        held.setdefault(key, {}).setdefault(writer, []).append(source)
        headers.setdefault((key, writer), header)

    for memory in memories:
        for header in memory.headers():
            slot = memory.find(header["lineage"], header["step"])
            add(header, ("memory", (memory, slot)))
    for header in disk.all_headers():
        add(header, ("disk", header))
    listed = {key: {w: srcs[0][0] for w, srcs in parts.items()} for key, parts in held.items()}
    every = _dist.gather_objects(listed)  # per rank: {key: {writer: "memory" | "disk"}}
    keys = set().union(*every)
    covered = {k for k in keys if set().union(*(e.get(k, {}) for e in every)) >= set(range(k[3]))}
    usable = {k for k in covered if k[3] == world_size or reshard}
    other_worlds = sorted({k[3] for k in covered - usable})
    if other_worlds and not usable:
        raise ValueError(
            f"The flash snapshots in {disk.dirpath} were written by a job of {other_worlds} rank(s), this one"
            f" has {world_size}. Nothing was loaded or deleted; run with the original number of processes,"
            " or pass another dirpath (FlashCheckpoint: or auto_resume=False)."
        )
    order = sorted(usable, key=lambda k: (k[0], k[2]), reverse=True)
    best = order[0] if order else None
    newer = sorted(k for k in keys - covered if best is None or (k[0], k[2]) > (best[0], best[2]))
    if newer:
        lines = []
        for k in newer:
            somewhere = set().union(*(e.get(k, {}) for e in every))
            lost = sorted(set(range(k[3])) - somewhere)
            lines.append(f"{describe(k)}: no copy of rank(s) {lost} in any memory, replica or disk")
        rank_zero_warn(
            "FlashCheckpoint: skipping snapshot(s) not complete on every rank (a crash during a save, or a"
            " lost node without replica or disk copy); resuming from an older one, nothing deleted: "
            + "; ".join(lines)
        )
    for key in order:
        found = _load_candidate(key, held.get(key, {}), every, headers, disk, rank, world_size)
        if found is not None:
            return found
    if keys:
        rank_zero_warn(
            "FlashCheckpoint: no snapshot is complete and readable on every rank; training starts from"
            " scratch (the snapshots found are left in place)."
        )
    return None


def _plan(
    key: Key, every: list[dict[Key, dict[int, str]]], world_size: int
) -> tuple[list[set[int]], list[tuple[int, int, int]]]:
    """``(needs, transfers)``: the writers' parts each rank needs, and ``(writer, holder, needer)`` for
    each part a rank needs but cannot read (the same on every rank: computed from gathered lists)."""
    writers = key[3]
    needs = [{r} if writers == world_size else set(range(writers)) for r in range(world_size)]
    transfers = []
    for writer in range(writers):
        holders = [r for r, e in enumerate(every) if writer in e.get(key, {})]
        in_memory = [r for r in holders if every[r][key][writer] == "memory"]
        sender = (in_memory or holders)[0]
        for needer in range(world_size):
            if writer in needs[needer] and writer not in every[needer].get(key, {}):
                transfers.append((writer, sender, needer))
    return needs, transfers


def _load_candidate(
    key: Key,
    mine: dict[int, list[Source]],
    every: list[dict[Key, dict[int, str]]],
    headers: dict[tuple[Key, int], dict[str, Any]],
    disk: DiskStore,
    rank: int,
    world_size: int,
) -> Found | None:
    needs, transfers = _plan(key, every, world_size)
    wanted = (needs[rank] & set(mine)) | {w for w, sender, _ in transfers if sender == rank}
    parts: dict[int, dict[str, Any]] = {}
    sources: dict[int, str] = {}
    errors: list[str] = []
    for writer in sorted(wanted):
        for source in mine[writer]:
            try:
                parts[writer], sources[writer] = _load(source, disk)
                break
            except CorruptSnapshot as exc:
                errors.append(str(exc))
            except Exception as exc:  # a memory slot that vanished or cannot be read
                errors.append(f"{source[0]} part of rank {writer}: {type(exc).__name__}: {exc}")
    ok = set(parts) == wanted
    # one gather: the verdict, the failures and where this rank read the parts it needs itself
    local = {w: sources[w] for w in needs[rank] if w in sources}
    outcome = _dist.gather_objects((ok, errors, _dist.HOST, local))
    problems = [f"rank {r} ({host}): {err}" for r, (_, errs, host, _) in enumerate(outcome) for err in errs]
    if problems:
        rank_zero_warn(f"FlashCheckpoint: {describe(key)}: " + "; ".join(problems))
    if not all(good for good, _, _, _ in outcome):
        failed = [r for r, (good, _, _, _) in enumerate(outcome) if not good]
        rank_zero_warn(
            f"FlashCheckpoint: skipping {describe(key)}: rank(s) {failed} could not load their part;"
            " trying an older snapshot."
        )
        return None
    for writer, sender, needer in transfers:  # the same order on every rank: matched sends and receives
        if rank == sender:
            dist.send_object_list([parts[writer], headers[(key, writer)]], dst=needer)
        elif rank == needer:
            box: list[Any] = [None, None]
            dist.recv_object_list(box, src=sender)
            parts[writer], headers[(key, writer)] = box
    for writer in set(parts) - needs[rank]:
        del parts[writer]  # loaded only to be sent
    own = rank if key[3] == world_size else 0
    by_writer = {w: src for _, _, _, read in outcome for w, src in read.items()}
    for writer, sender, _ in transfers:  # derivable on every rank from the gathered lists
        by_writer.setdefault(writer, f"rank {sender}'s {every[sender][key][writer]}")
    return Found(
        parts=parts,
        header=headers[(key, own)],  # a needed part: loaded here or received with its header
        sources=[by_writer[w] for w in range(key[3])],
        rank=rank,
        resharded=key[3] != world_size,
    )


RESHARDABLE = ("world_size", "dp", "zero_stage", "frozen")  # what a resharded resume may change


def check_fingerprint(
    found: Found, fingerprint: dict[str, Any], *, owner: str, dirpath: Path, remedy: str
) -> None:
    """Raise a ``ValueError`` naming the differences if ``found`` was written by another model or layout
    on any rank (``remedy`` says what to do instead); a resharded snapshot may differ in
    :data:`RESHARDABLE`. Collective; changes nothing."""
    saved = dict(found.header["fingerprint"])
    if found.resharded:
        saved = {k: v for k, v in saved.items() if k not in RESHARDABLE}
        fingerprint = {k: v for k, v in fingerprint.items() if k not in RESHARDABLE}
    every = [d for d in _dist.gather_objects(differences(saved, fingerprint)) if d]
    if every:
        raise ValueError(
            f"{owner}: the snapshot of step {found.step} in {dirpath} (and in shared memory) was written by"
            f" another model or layout: {'; '.join(every[0])}. Nothing was loaded, changed or deleted;"
            f" {remedy}."
        )
