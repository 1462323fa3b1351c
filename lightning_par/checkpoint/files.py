"""File integrity for sharded checkpoints: writes that record a file's size and CRC-32, and the checks
that compare a file with that record before anything is unpickled from it.

The CRC-32 (``zlib.crc32``) is computed while ``torch.save`` writes, from the very buffers it hands to
the file (no second pass over the data, no copy); the file is fsync'ed and renamed into place, so a file
under its final name is whole. Reading checks the size first (cheap: truncation, the common damage) and
then the CRC-32 of the bytes; a file that passed is remembered by its ``stat`` identity so the several
readers of one load (meta, optimizer records, model records) check each file once per process.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import torch

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

_CHUNK = 64 << 20  # bytes per read while checking: large enough for throughput, small enough for memory
_WRITE_BUFFER = 1 << 20  # coalesces torch's small header writes; tensor data bypasses it
_VERIFIED_MAX = 4096

DAMAGED_HINT = "The checkpoint is damaged: load an earlier one."


class FileDigest(TypedDict):
    """What a writer recorded about one file: its byte count and the CRC-32 of its bytes."""

    size: int
    crc32: int


class _Crc32Writer(io.RawIOBase):
    """A raw writer onto ``fd`` that folds every byte it writes into a running CRC-32."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd
        self.crc32 = 0
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b: ReadableBuffer) -> int:
        view = memoryview(b).cast("B")
        done = 0
        while done < len(view):
            done += os.write(self.fd, view[done:])
        self.crc32 = zlib.crc32(view, self.crc32)
        self.size += done
        return done


def save_with_digest(obj: Any, path: Path) -> FileDigest:
    """``torch.save(obj)`` to ``path`` atomically and durably (temp file, fsync, rename); return the
    written file's size and CRC-32. A crash leaves at most a ``.tmp`` file, never a partial ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        raw = _Crc32Writer(fd)
        with io.BufferedWriter(raw, buffer_size=_WRITE_BUFFER) as buffered:
            torch.save(obj, buffered)
            buffered.flush()
            os.fsync(fd)  # the bytes are on disk before a marker can claim the file is complete
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return {"size": raw.size, "crc32": raw.crc32}


def file_crc32(path: Path) -> int:
    """The CRC-32 of ``path``'s bytes, read in bounded chunks."""
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            crc = zlib.crc32(view[:n], crc)
    return crc


_verified: set[tuple[Any, ...]] = set()


def verify_file(path: Path, expected: FileDigest, *, checkpoint: Path) -> None:
    """Raise a ``ValueError`` naming ``path`` unless its size and CRC-32 are ``expected``.

    ``checkpoint`` (the directory) only makes the message say which checkpoint the file belongs to.
    """
    st = path.stat()
    if st.st_size != expected["size"]:
        raise ValueError(
            f"Sharded checkpoint {checkpoint}: {path.name} is {st.st_size} bytes, but {expected['size']}"
            f" bytes were written (the file was truncated or altered after the save). {DAMAGED_HINT}"
        )
    # the identity changes whenever the file is rewritten, so a cached pass never hides new damage
    key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, expected["crc32"])
    if key in _verified:
        return
    actual = file_crc32(path)
    if actual != expected["crc32"]:
        raise ValueError(
            f"Sharded checkpoint {checkpoint}: {path.name} fails its checksum (CRC-32 {actual:08x}, but"
            f" {expected['crc32']:08x} was written: its bytes changed after the save). {DAMAGED_HINT}"
        )
    if len(_verified) >= _VERIFIED_MAX:
        _verified.clear()
    _verified.add(key)


def write_text_atomic(path: Path, text: str) -> None:
    """Write a small text file durably under its final name (temp file, fsync, rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_digest(path: Path, digest: FileDigest) -> None:
    """Record ``digest`` of ``path`` next to it, as ``<file>.crc`` (JSON)."""
    write_text_atomic(path.with_name(path.name + ".crc"), json.dumps(dict(digest)) + "\n")


def read_digest(path: Path) -> FileDigest:
    """The digest recorded by :func:`write_digest` for ``path``; ``ValueError`` if it is absent."""
    sidecar = path.with_name(path.name + ".crc")
    try:
        data = json.loads(sidecar.read_text(encoding="utf-8"))
        return {"size": int(data["size"]), "crc32": int(data["crc32"])}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{sidecar} is missing or unreadable ({exc}): the rank that writes {path.name} did not finish."
        ) from exc


def fsync_dir(path: Path) -> None:
    """Make the directory entries of ``path`` (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_path(path: Path) -> None:
    """Delete a file, a symlink (not its target) or a directory tree; nothing if absent."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path)
