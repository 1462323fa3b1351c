"""Persisted snapshots: a directory per (step, lineage), a data file and a meta file per rank.

Layout of ``dirpath/``::

    step-000000120-3f9c2a1b/      one snapshot: step 120 of lineage 3f9c2a1b (one training run)
        rank00000.bin             rank 0's flat buffer (see :mod:`.snapshot`)
        rank00000.meta            rank 0's header: step, lineage, rank, world size, byte count, CRC-32 of
        rank00001.bin             the data, index (pickled tree), fingerprint of model and layout
        rank00001.meta
    step-000000100-3f9c2a1b/ ...

Protocol of one rank's write: ``.bin.tmp`` is written and fsync'ed, then renamed to ``.bin``; then
``.meta.tmp`` likewise to ``.meta`` (the *commit marker*, last); then the directory is fsync'ed. A rank file
without its meta (a write interrupted by a crash or a full disk) is partial and never read; a meta whose
data has another size or checksum is corrupt, named in a warning, and skipped. Every rank writes and
deletes only its own files, so ranks never race; *consistency across ranks* (the same step on all) is
decided when resuming, with collectives (see ``flash.py``).
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import zlib
from pathlib import Path
from typing import Any

import torch

from lightning_par.callbacks import snapshot
from lightning_par.callbacks.memory import read_header

_STEP_DIR = re.compile(r"^step-(\d{9})-([0-9a-f]+)$")
_CHUNK = 64 << 20


class CorruptSnapshot(Exception):
    """A persisted rank file that cannot be trusted; ``path`` names it, the message says why."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def write_bytes(fd: int, data: memoryview) -> None:
    """Write all of ``data`` to ``fd`` (a separate function so tests can inject I/O errors)."""
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DiskStore:
    """This rank's persisted snapshots under ``dirpath`` (see the module docstring)."""

    def __init__(self, dirpath: Path, *, rank: int) -> None:
        self.dirpath = dirpath
        self.rank = rank

    def step_dir(self, lineage: str, step: int) -> Path:
        return self.dirpath / f"step-{step:09d}-{lineage}"

    def _files(self, directory: Path) -> tuple[Path, Path]:
        name = f"rank{self.rank:05d}"
        return directory / f"{name}.bin", directory / f"{name}.meta"

    def check_writable(self) -> None:
        """Create ``dirpath`` and write a probe file there; raise ``OSError`` if that fails."""
        self.dirpath.mkdir(parents=True, exist_ok=True)
        probe = self.dirpath / f".write_probe.rank{self.rank:05d}"
        probe.write_bytes(b"ok")
        probe.unlink()

    def _step_dirs(self) -> list[tuple[Path, str, int]]:
        out = []
        if self.dirpath.is_dir():
            for d in self.dirpath.iterdir():
                m = _STEP_DIR.match(d.name)
                if m and d.is_dir():
                    out.append((d, m.group(2), int(m.group(1))))
        return out

    def cleanup_partial(self) -> list[Path]:
        """Delete this rank's leftovers of interrupted writes (``*.tmp``); return them."""
        removed = []
        for d, _, _ in self._step_dirs():
            for f in d.glob(f"rank{self.rank:05d}.*.tmp"):
                f.unlink(missing_ok=True)
                removed.append(f)
            _rmdir_if_empty(d)
        return removed

    def headers(self) -> list[dict[str, Any]]:
        """Headers of this rank's committed files (their data is verified only when loaded)."""
        return self._headers(f"rank{self.rank:05d}.meta")

    def all_headers(self) -> list[dict[str, Any]]:
        """Headers of every rank's committed files under ``dirpath`` (all of them when it is shared)."""
        return self._headers("rank*.meta")

    def _headers(self, pattern: str) -> list[dict[str, Any]]:
        out = []
        for d, _, _ in self._step_dirs():
            for meta in d.glob(pattern):
                data = meta.with_suffix(".bin")
                header = read_header(meta, data, check_size=False)  # load() checks it, and names it
                if header is not None:
                    header["path"] = str(data)
                    out.append(header)
        return out

    def write(self, header: dict[str, Any], data: memoryview) -> Path:
        """Persist one snapshot of this rank atomically; return its data file.

        Raises:
            OSError: the write failed (e.g. a full disk); the temp files are removed, earlier snapshots
                are untouched.
        """
        directory = self.step_dir(header["lineage"], header["step"])
        path, meta = self._files(directory)
        tmp = path.with_name(path.name + ".tmp")
        try:
            crc = 0
            fd = _create(tmp)
            try:
                for lo in range(0, len(data), _CHUNK):
                    chunk = data[lo : lo + _CHUNK]
                    crc = zlib.crc32(chunk, crc)
                    write_bytes(fd, chunk)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            committed = {**header, "crc32": crc}
            committed.pop("path", None)
            payload = pickle.dumps(committed, protocol=pickle.HIGHEST_PROTOCOL)
            meta_tmp = meta.with_name(meta.name + ".tmp")
            fd = os.open(meta_tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # beside our data: kept
            try:
                write_bytes(fd, memoryview(payload))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(meta_tmp, meta)
            _fsync_dir(directory)
        except OSError:
            for f in (tmp, meta.with_name(meta.name + ".tmp")):
                f.unlink(missing_ok=True)
            if not meta.exists():
                path.unlink(missing_ok=True)
            _rmdir_if_empty(directory)
            raise
        return path

    def load(self, header: dict[str, Any]) -> Any:
        """The state tree of a committed file, after checking its size and CRC-32.

        Raises:
            CorruptSnapshot: the data is shorter, longer or different from what its meta recorded.
        """
        path = Path(header["path"])
        nbytes = header["nbytes"]
        try:
            size = path.stat().st_size
            if size != nbytes:
                raise CorruptSnapshot(path, f"{size} bytes, its meta file recorded {nbytes} (truncated?)")
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            view = memoryview(buffer.numpy())  # type: ignore[arg-type]
            with open(path, "rb", buffering=0) as f:
                got = 0
                while got < nbytes:
                    n = f.readinto(view[got:])
                    if not n:
                        raise CorruptSnapshot(path, f"ended after {got} of {nbytes} bytes")
                    got += n
        except OSError as exc:
            raise CorruptSnapshot(path, f"unreadable ({exc})") from exc
        crc = 0
        for lo in range(0, nbytes, _CHUNK):
            crc = zlib.crc32(view[lo : lo + _CHUNK], crc)
        if crc != header.get("crc32"):
            raise CorruptSnapshot(path, "checksum mismatch (the file was corrupted after it was written)")
        try:
            # own tensors, not views at an offset of one buffer: some consumers (torch.set_rng_state)
            # read a tensor's storage from its start
            return snapshot.read(buffer, header["index"], clone=True)
        except Exception as exc:
            raise CorruptSnapshot(path, f"unreadable index ({exc})") from exc

    def retain(self, *, lineage: str, keep_last: int, safe_step: int) -> list[Path]:
        """Delete this rank's older snapshots of ``lineage``: keep the ``keep_last`` newest and every one
        from the newest at or below ``safe_step`` on (the newest step that all ranks have committed, so
        a snapshot complete on every rank always survives). Other lineages are never touched."""
        steps = sorted(step for _, lin, step in self._step_dirs() if lin == lineage)
        committed = [s for s in steps if self._files(self.step_dir(lineage, s))[1].is_file()]
        keep = set(committed[-keep_last:])
        protected = max((s for s in committed if s <= safe_step), default=None)
        removed = []
        for s in committed:
            if s in keep or (protected is not None and s >= protected):
                continue
            directory = self.step_dir(lineage, s)
            data, meta = self._files(directory)
            meta.unlink(missing_ok=True)  # uncommit first: a crash in between leaves a partial file
            data.unlink(missing_ok=True)
            _rmdir_if_empty(directory)
            removed.append(directory)
        return removed


def _create(path: Path, *, attempts: int = 3) -> int:
    """Open ``path`` for writing, making its directory. Ranks share step directories, and a rank whose
    write failed removes the directory if it is empty: between our ``mkdir`` and our ``open`` it may be
    gone, so make it again (once our file exists the directory is not empty, and no rank removes it). It
    may also go inside ``mkdir``: another rank made it (our ``mkdir`` fails), then removed it before
    ``exist_ok`` could see a directory, which raises ``FileExistsError`` for a path that no longer exists
    (seen once in CI, a full disk on one rank): made again too."""
    for attempt in range(attempts):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except (FileNotFoundError, FileExistsError):
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _rmdir_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
            raise
