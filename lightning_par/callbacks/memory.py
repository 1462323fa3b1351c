"""This rank's snapshot slots in shared memory: pre-allocated once, reused, surviving the process.

Layout of ``<directory>/`` (one per rank, e.g. ``/dev/shm/lightning_par_flash/<job key>/rank00001/``)::

    slot0.bin  slot0.meta  slot1.bin  slot1.meta

* ``slotK.bin`` is a flat buffer (see :mod:`.snapshot`) reserved with ``posix_fallocate`` (so a full
  tmpfs is an ``ENOSPC`` error at allocation, never a ``SIGBUS`` at first write) and mapped with
  ``MAP_POPULATE`` (the slow first touch is paid once, when the slot is allocated). A restarted process
  maps the same files again.
* ``slotK.meta`` is the slot's header (step, lineage, rank, world size, index, fingerprint). It is written
  (temp file + rename) only after the data is complete and removed before the slot is overwritten: a
  slot without a meta file is empty or half-written and is never read.

With two slots the newest complete snapshot is never the one being overwritten, so a crash during a copy
leaves the previous snapshot in memory. A slot being persisted to disk is *busy* and is not overwritten.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import pickle
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_par.callbacks import snapshot

_ROUND = 2 << 20  # allocations are whole 2 MiB pages, with 1% headroom for a state that grows a little


class NoRoom(OSError):
    """The snapshot buffers do not fit into the store's file system."""


@dataclass
class _Slot:
    data: Path
    meta: Path
    mm: mmap.mmap | None = None
    buffer: Tensor | None = None
    header: dict[str, Any] | None = None
    busy: bool = False
    pinned: bool = False


def read_header(meta: Path, data: Path, *, check_size: bool = True) -> dict[str, Any] | None:
    """The header of a complete slot or rank file; None if absent or unreadable, or (``check_size``) if
    its data file is shorter than the header says."""
    try:
        header: dict[str, Any] = pickle.loads(meta.read_bytes())
        if header.get("format") != snapshot.FORMAT_VERSION:
            return None
        if check_size and data.stat().st_size < header["nbytes"]:
            return None
        return header
    except (OSError, pickle.UnpicklingError, EOFError, KeyError, TypeError, AttributeError):
        return None


def write_atomic(path: Path, payload: bytes, *, fsync: bool) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(payload)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


class MemoryStore:
    """``slots`` snapshot buffers of this rank in ``directory`` (see the module docstring).

    Thread safety: the owner holds :attr:`lock` while it changes which slot holds what.
    """

    def __init__(self, directory: Path, *, slots: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.lock = threading.Lock()
        self._slots = [_Slot(directory / f"slot{k}.bin", directory / f"slot{k}.meta") for k in range(slots)]
        for s in self._slots:
            s.header = read_header(s.meta, s.data)

    # ------------------------------------------------------------------ what is held
    def headers(self) -> list[dict[str, Any]]:
        """Headers of the complete snapshots held, newest step last."""
        return sorted((s.header for s in self._slots if s.header), key=lambda h: h["step"])

    def header(self, k: int) -> dict[str, Any] | None:
        return self._slots[k].header

    def newest(self) -> int | None:
        """The slot of the newest complete snapshot (None if none)."""
        held = [(s.header["step"], k) for k, s in enumerate(self._slots) if s.header]
        return max(held)[1] if held else None

    def choose(self) -> int | None:
        """The slot to overwrite next: a free one, else the oldest complete one, never a busy one, and
        the newest complete one only when nothing else is free (one slot). None if all are busy."""
        free = [k for k, s in enumerate(self._slots) if not s.busy]
        if not free:
            return None
        empty = [k for k in free if self._slots[k].header is None]
        if empty:
            return empty[0]
        return min(free, key=lambda k: self._slots[k].header["step"])  # type: ignore[index]

    def set_busy(self, k: int, busy: bool) -> None:
        self._slots[k].busy = busy

    # ------------------------------------------------------------------ buffers
    def reserve(self, k: int, nbytes: int, *, pin: bool = False) -> Tensor:
        """Slot ``k``'s buffer with room for ``nbytes`` (allocated or grown now: the slow first touch).

        Raises:
            NoRoom: the file system holding the store lacks the space (checked for every slot at once,
                so the store fails at its first snapshot rather than at its second).
        """
        s = self._slots[k]
        if s.buffer is not None and s.buffer.numel() >= nbytes:
            return s.buffer
        size = max(_ROUND, -(-int(nbytes * 1.01) // _ROUND) * _ROUND)
        self._unmap(s)
        have = sum(x.data.stat().st_size for x in self._slots if x.data.exists())
        want = size * len(self._slots)
        free = shutil.disk_usage(self.directory).free
        if want - have > free:
            raise NoRoom(
                errno.ENOSPC,
                f"{len(self._slots)} x {size / 2**30:.2f} GiB snapshot buffers do not fit into"
                f" {self.directory} ({free / 2**30:.2f} GiB free)",
            )
        fd = os.open(s.data, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise NoRoom(
                        exc.errno, f"cannot reserve {size} bytes in {s.data}: {exc.strerror}"
                    ) from exc
                raise
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            s.mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        s.buffer = torch.frombuffer(s.mm, dtype=torch.uint8)
        if pin:
            s.pinned = _pin(s.buffer)
        return s.buffer

    def buffer(self, k: int) -> Tensor:
        s = self._slots[k]
        assert s.buffer is not None, "reserve() the slot first"
        return s.buffer

    def _unmap(self, s: _Slot) -> None:
        if s.buffer is not None and s.pinned:
            torch.cuda.cudart().cudaHostUnregister(s.buffer.data_ptr())
        s.buffer = None
        s.pinned = False
        if s.mm is not None:
            s.mm.close()
            s.mm = None

    # ------------------------------------------------------------------ commit protocol
    def invalidate(self, k: int) -> None:
        """Forget slot ``k``'s snapshot (meta first), before its buffer is overwritten."""
        s = self._slots[k]
        s.header = None
        s.meta.unlink(missing_ok=True)

    def commit(self, k: int, header: dict[str, Any]) -> None:
        """Mark slot ``k`` complete: its data is in the buffer, ``header`` describes it."""
        s = self._slots[k]
        write_atomic(s.meta, pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL), fsync=False)
        s.header = header

    def find(self, lineage: str, step: int) -> int | None:
        """The slot holding the complete snapshot ``(lineage, step)``, if any."""
        for k, s in enumerate(self._slots):
            if s.header is not None and s.header["lineage"] == lineage and s.header["step"] == step:
                return k
        return None

    def load(self, k: int) -> Any:
        """The state tree held by slot ``k`` (tensors cloned out of shared memory)."""
        header = self._slots[k].header
        if header is None:
            raise LookupError(f"slot {k} of {self.directory} holds no complete snapshot")
        buffer = self.reserve(k, header["nbytes"])  # maps the existing file in a restarted process
        return snapshot.read(buffer, header["index"], clone=True)

    def close(self) -> None:
        for s in self._slots:
            self._unmap(s)

    def remove(self) -> None:
        """Unmap and delete every slot (frees the shared memory)."""
        self.close()
        for s in self._slots:
            s.header = None
            for p in (s.meta, s.data):
                p.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.directory.rmdir()
            # the job's folder too, once its last rank on this node is gone (an empty folder per run
            # piled up in shared memory before)
            self.directory.parent.rmdir()


def _pin(buffer: Tensor) -> bool:
    """Register the buffer with CUDA so device-to-host copies into it run at pinned speed."""
    if not torch.cuda.is_available() or buffer.numel() == 0:
        return False
    portable = 1  # cudaHostRegisterPortable: pinned for every CUDA context, whichever thread registers it
    result = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), portable)
    return int(result) == 0 if not isinstance(result, tuple) else int(result[0]) == 0
