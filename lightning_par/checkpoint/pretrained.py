"""Lazy, tensor-by-tensor reading of a full (unsharded) state dict, so that a rank can fill its ZeRO shards or
tensor-parallel slices without ever holding the whole model. Free of Lightning and of any process group.

* :meth:`WeightSource.open` takes a ``torch.save`` file (a state dict, or a Lightning checkpoint whose
  ``"state_dict"`` is used), a ``.safetensors`` file, a ``*.safetensors.index.json``, a ``save_pretrained``
  directory (``model.safetensors``, else the index, else ``pytorch_model.bin``), a
  ``torch.distributed.checkpoint`` directory (Lightning's and Fabric's FSDP strategies, torchtitan: each
  tensor read on its own, :class:`~lightning_par.checkpoint.dcp_import.DCPWeights`) or an in-memory
  mapping.
  Only tensor entries are exposed, under the names ``prefix + name_in_file``; :func:`match_names` finds the
  mapping (prefixes, PEFT's ``.base_layer.``) when the caller does not know it.
* Opening reads no tensor data: safetensors headers only (every shard's, so a bad shard fails before any
  weight is copied; shards are mapped on first read), torch files through ``mmap=True``.
* ``get``/``get_slice`` return new contiguous CPU tensors that own their memory: safetensors and mmap'd
  torch files hand out writable views of one shared mapping, so a view would keep the file mapped and let
  an in-place update leak into the next read. A dim-0 slice reads only its rows; other dims page in the
  tensor's extent (page cache, not process memory) but allocate only the slice.
* Validation (paths, shards, headers, ``check_against``) raises before the caller has written anything,
  naming the file and the fix.
"""

from __future__ import annotations

import difflib
import json
import os
import pickle
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import Tensor

from lightning_par.checkpoint.dcp_import import DCPWeights, is_dcp_checkpoint

__all__ = ["WeightSource", "match_names"]

HF_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
_ST_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "U16": torch.uint16, "I16": torch.int16,
    "U32": torch.uint32, "I32": torch.int32, "U64": torch.uint64, "I64": torch.int64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
_LIST = 8  # names shown per category in an error; the counts are always complete


@dataclass(frozen=True)
class _Entry:
    file_name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    shard: Path | None  # the safetensors file holding it; None when it is in ``WeightSource._tensors``


def _safe_open(path: Path) -> Any:
    """safetensors' lazy reader; the package is needed only when a .safetensors file is read (the
    headers are parsed here), so it is imported on first use with a message that says how to get it."""
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise ImportError(
            f"Reading {path} needs the safetensors package: pip install safetensors (it keeps your torch)."
        ) from exc
    return safe_open(str(path), framework="pt")


def _read_safetensors_header(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    # Checked by hand because safetensors' own errors ("MetadataIncompleteBuffer", a failed mmap) do not
    # say which file or what to do, and would only surface at the first read, after weights were copied.
    size = path.stat().st_size
    bad = f"safetensors file {path} ({size} bytes) is truncated or corrupt"
    fix = "re-download or re-save it"
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{bad}: shorter than the 8-byte header length; {fix}")
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > size:
            raise ValueError(f"{bad}: its header length says {n} bytes, more than the file holds; {fix}")
        try:
            header = json.loads(f.read(n))
            entries = {k: v for k, v in header.items() if k != "__metadata__"}
            end = max((int(v["data_offsets"][1]) for v in entries.values()), default=0)
            meta = {k: (tuple(int(d) for d in v["shape"]), str(v["dtype"])) for k, v in entries.items()}
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as err:
            raise ValueError(f"{bad}: its header is not valid ({err!r}); {fix}") from err
    odd = sorted({d for _, d in meta.values() if d not in _ST_DTYPES})
    if odd:
        raise ValueError(f"safetensors file {path} has dtypes this reader does not support: {', '.join(odd)}")
    if 8 + n + end != size:
        what = "truncated" if 8 + n + end > size else "corrupt (trailing bytes)"
        raise ValueError(f"{bad}: the header describes {8 + n + end} bytes, so it is {what}; {fix}")
    return {k: (shape, _ST_DTYPES[d]) for k, (shape, d) in meta.items()}


def _load_torch_file(path: Path) -> Any:
    size = path.stat().st_size
    try:
        try:
            return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except pickle.UnpicklingError:
            # A Lightning checkpoint may pickle hyper-parameters or callback state as arbitrary objects,
            # which the weights-only unpickler refuses. The user named this file explicitly, so it is
            # trusted as much as Lightning's own resume (which also loads with weights_only=False);
            # in-memory sources never take this path.
            return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as err:
        raise ValueError(
            f"torch file {path} ({size} bytes) is truncated, corrupt or not a zip-format torch.save file "
            f"({type(err).__name__}: {err}); re-download it or re-save it with torch.save"
        ) from err


def _tensors_of(obj: Any, description: str) -> dict[str, Tensor]:
    if isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):
        obj = obj["state_dict"]  # a Lightning checkpoint
    if not isinstance(obj, Mapping):
        raise ValueError(f"{description} holds a {type(obj).__name__}, not a state dict (name -> tensor)")
    return {str(k): v for k, v in obj.items() if isinstance(v, Tensor)}


def _owned(t: Tensor) -> Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t)


class WeightSource:
    """Lazy reader of a full state dict; see the module docstring for the contract."""

    def __init__(self, description: str, entries: dict[str, _Entry], tensors: Mapping[str, Tensor]) -> None:
        self.description = description
        self._entries = entries  # model name -> entry
        self._tensors = tensors  # file name -> tensor (torch files and mappings)
        self._handles: dict[Path, Any] = {}
        self._closed = False

    @classmethod
    def open(cls, source: str | os.PathLike[str] | Mapping[str, Tensor], *, prefix: str = "") -> WeightSource:
        """Open ``source`` (see the module docstring); the model's names are ``prefix + name_in_file``."""
        if isinstance(source, Mapping):
            tensors = _tensors_of(source, "the in-memory state dict")
            return cls._from_tensors("<in-memory state dict>", tensors, prefix)
        path = Path(source)
        if is_dcp_checkpoint(path):  # Lightning's / Fabric's FSDP strategies, torchtitan
            weights = DCPWeights(path)
            entries = {
                prefix + n: _Entry(n, shape, dtype, None) for n, (shape, dtype) in weights.meta.items()
            }
            return cls(str(path), entries, weights)
        if path.is_dir():
            found = next((path / f for f in HF_FILES if (path / f).is_file()), None)
            if found is None:
                raise FileNotFoundError(
                    f"{path} is not a save_pretrained directory: looked for {', '.join(HF_FILES)}, "
                    "found none; pass the weight file itself"
                )
            path = found
        elif not path.exists():
            raise FileNotFoundError(
                f"no such file or directory: {path} (expected a torch.save file, a .safetensors file, a "
                f"*.safetensors.index.json or a save_pretrained directory with one of {', '.join(HF_FILES)})"
            )
        if path.name.endswith(".safetensors.index.json"):
            return cls._from_index(path, prefix)
        if path.suffix == ".safetensors":
            meta = _read_safetensors_header(path)
            entries = {prefix + k: _Entry(k, s, d, path) for k, (s, d) in meta.items()}
            return cls(str(path), entries, {})
        return cls._from_tensors(str(path), _tensors_of(_load_torch_file(path), str(path)), prefix)

    @classmethod
    def _from_tensors(cls, description: str, tensors: dict[str, Tensor], prefix: str) -> WeightSource:
        entries = {prefix + k: _Entry(k, tuple(t.shape), t.dtype, None) for k, t in tensors.items()}
        return cls(description, entries, tensors)

    @classmethod
    def _from_index(cls, index: Path, prefix: str) -> WeightSource:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shard_of = {str(k): index.parent / str(v) for k, v in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{index} is not a safetensors index (no valid 'weight_map'): {err!r}") from err
        missing = sorted({str(p.name) for p in shard_of.values() if not p.is_file()})
        if missing:
            raise FileNotFoundError(
                f"{len(missing)} shard file(s) named by {index} do not exist in {index.parent}: "
                f"{', '.join(missing[:_LIST])}; re-download the complete checkpoint"
            )
        headers = {p: _read_safetensors_header(p) for p in sorted(set(shard_of.values()))}
        entries = {}
        for name, shard in shard_of.items():
            if name not in headers[shard]:
                raise ValueError(f"{index} maps {name!r} to {shard}, which does not contain it; re-download")
            entries[prefix + name] = _Entry(name, *headers[shard][name], shard)
        return cls(str(index), entries, {})

    def keys(self) -> list[str]:
        """The names as the model sees them (``prefix`` applied), in file order."""
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return self._entry(name).dtype

    def get(self, name: str) -> Tensor:
        """The whole tensor ``name`` as a new CPU tensor; nothing else is read."""
        e = self._entry(name)
        if e.shard is None:
            return _owned(self._tensors[e.file_name])
        return _owned(self._handle(e.shard).get_tensor(e.file_name))

    def get_slice(self, name: str, *, dim: int, index: int, parts: int) -> Tensor:
        """Chunk ``index`` of ``parts`` equal chunks of ``name`` along ``dim`` (``torch.chunk(t, parts,
        dim)[index]``), reading only that chunk where the format allows."""
        e = self._entry(name)
        ndim = len(e.shape)
        if not -ndim <= dim < ndim:
            raise ValueError(f"dim {dim} is out of range for {name!r} of shape {e.shape}")
        dim %= ndim
        if parts < 1 or not 0 <= index < parts:
            raise ValueError(f"index {index} of {parts} parts is out of range for {name!r}")
        if e.shape[dim] % parts:
            raise ValueError(
                f"{name!r} has size {e.shape[dim]} along dim {dim} (shape {e.shape}), not divisible into "
                f"{parts} equal parts; choose a parallel size that divides it"
            )
        step = e.shape[dim] // parts
        if e.shard is None:
            return _owned(self._tensors[e.file_name].narrow(dim, index * step, step))
        where = (slice(None),) * dim + (slice(index * step, (index + 1) * step),)
        return _owned(self._handle(e.shard).get_slice(e.file_name)[where])

    def check_against(self, expected: Mapping[str, tuple[int, ...]], *, strict: bool = True) -> None:
        """Raise a ``ValueError`` listing names the model expects but the file lacks, names the file has but
        the model does not (only when ``strict``), and names whose shapes differ; return if none."""
        missing = [n for n in expected if n not in self._entries]
        unexpected = [n for n in self._entries if n not in expected] if strict else []
        differ = [
            f"{n}: file {self._entries[n].shape} vs model {tuple(s)}"
            for n, s in expected.items()
            if n in self._entries and self._entries[n].shape != tuple(s)
        ]
        if not (missing or unexpected or differ):
            return
        lines = [f"the weights in {self.description} do not match the model:"]
        for what, items in (("missing from the file", missing), ("unexpected in the file", unexpected),
                            ("with different shapes", differ)):  # fmt: skip
            if items:
                more = f", ... ({len(items) - _LIST} more)" if len(items) > _LIST else ""
                lines.append(f"  {len(items)} {what}: {', '.join(items[:_LIST])}{more}")
        lines.append(
            "Fix: open it with the right prefix= (see match_names), pass strict=False to allow extra file "
            "entries, or load a checkpoint of this model's configuration."
        )
        raise ValueError("\n".join(lines))

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()
        self._tensors = {}  # drops the mmap of a torch file
        self._closed = True

    def __enter__(self) -> WeightSource:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"WeightSource({self.description!r}, {len(self._entries)} tensors)"

    def _entry(self, name: str) -> _Entry:
        if self._closed:
            raise ValueError(f"{self!r} is closed")
        e = self._entries.get(name)
        if e is None:
            close = difflib.get_close_matches(name, self._entries, n=5, cutoff=0.5)
            hint = f"; close names: {', '.join(close)}" if close else ""
            raise KeyError(f"{name!r} is not in {self.description}{hint} (check prefix= or use match_names)")
        return e

    def _handle(self, shard: Path) -> Any:
        if shard not in self._handles:  # lazily, so a sharded checkpoint maps only the shards it reads
            self._handles[shard] = _safe_open(shard).__enter__()
        return self._handles[shard]


# PEFT's wrappers: a LoRA layer's base (``base_layer``), and ``modules_to_save``'s frozen original and its
# trainable copies, which all start from the base model's weight of that name
_PEFT_INFIX = re.compile(r"\.(?:base_layer|original_module|modules_to_save\.[^.]+)\.")


def _norm(name: str) -> str:
    return _PEFT_INFIX.sub(".", name)


def _dot_prefixes(name: str) -> Iterable[str]:
    yield ""
    for i, c in enumerate(name):
        if c == ".":
            yield name[: i + 1]


def match_names(file_keys: Iterable[str], model_keys: Iterable[str]) -> dict[str, str]:
    """Map each model name to the file name holding its weight; unmatched model names are left out.

    1. A model name found verbatim in the file maps to itself.
    2. Otherwise both sides are compared without PEFT's ``.base_layer.`` infix, and with a prefix of whole
       dotted components added to the file name (``model.`` for a LightningModule holding ``self.model``,
       ``base_model.model.`` for PEFT) or stripped from it (loading a wrapper's checkpoint into the bare
       model). Every such (direction, prefix) rule is scored by how many model names it matches; each name
       takes the highest-scoring rule that fits it, ties going to the shorter prefix, then to adding, then
       to the alphabetically first prefix. A file name may serve several model names (e.g. two copies).
    Deterministic: the result depends only on the two sets of names, in ``model_keys`` order.
    """
    files = sorted(set(file_keys))
    model = list(dict.fromkeys(model_keys))
    present = set(files)
    by_norm: dict[str, str] = {}
    for f in sorted(files, key=lambda f: (_norm(f) != f, f)):  # a file name without the infix wins
        by_norm.setdefault(_norm(f), f)
    result = {m: m for m in model if m in present}
    pending: dict[str, list[str]] = {}  # normalised model name -> the model names sharing it
    for m in model:
        if m not in result:
            pending.setdefault(_norm(m), []).append(m)
    # normalised model name -> [(rule, file name)], a rule being (0: add / 1: strip, prefix)
    candidates: dict[str, list[tuple[tuple[int, str], str]]] = {n: [] for n in pending}
    for n in pending:
        candidates[n] += [((0, p), by_norm[n[len(p) :]]) for p in _dot_prefixes(n) if n[len(p) :] in by_norm]
    for g, f in by_norm.items():
        for q in _dot_prefixes(g):
            if q and g[len(q) :] in pending:
                candidates[g[len(q) :]].append(((1, q), f))
    score: dict[tuple[int, str], int] = {}
    for n, cands in candidates.items():
        for rule in {r for r, _ in cands}:
            score[rule] = score.get(rule, 0) + len(pending[n])
    for n, cands in candidates.items():
        if cands:
            _, f = min(cands, key=lambda c: (-score[c[0]], len(c[0][1]), c[0][0], c[0][1]))
            for m in pending[n]:
                result[m] = f
    return {m: result[m] for m in model if m in result}
