"""A training state as one flat byte buffer plus a small pickled index.

:func:`plan` walks a state tree (dicts, lists, tuples, anything picklable) and replaces every tensor by a
:class:`TensorRef`; the tensors get aligned, non-overlapping byte ranges of one buffer (tensors that are
the same view, e.g. tied weights, share one range). The tree itself, without tensor data, is pickled into
the *index*. Copying a state is then ``copy_into`` (one ``copy_`` per tensor into a pre-allocated buffer)
and reading it back is :func:`read` (views or clones of the buffer, put back into the tree).

Nothing here knows about Lightning, shared memory or files: see ``memory.py`` and ``disk.py``.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

ALIGN = 64  # bytes; every tensor starts on a cache line (and on any dtype's alignment)
FORMAT_VERSION = 1


@dataclass(frozen=True)
class TensorRef:
    """Placeholder for the ``index``-th tensor of a snapshot inside its pickled tree."""

    index: int


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in the flat buffer (its bytes, contiguous, in C order)."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class Plan:
    """A state split into live source tensors and their places in a flat buffer of ``nbytes`` bytes."""

    sources: list[Tensor]
    slots: list[Slot]
    tree: Any
    nbytes: int

    def index(self) -> bytes:
        """The pickled tree (tensors replaced by :class:`TensorRef`) and the slot table."""
        return pickle.dumps({"tree": self.tree, "slots": self.slots}, protocol=pickle.HIGHEST_PROTOCOL)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _key(t: Tensor) -> tuple[Any, ...]:
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


def plan(state: Any) -> Plan:
    """Lay out every tensor of ``state`` in one buffer; raise ``TypeError`` naming an unsupported one.

    Plain tensors and ``nn.Parameter`` are supported on any device and dtype; tensor subclasses (DTensor,
    sparse, quantized, nested) are refused, since their bytes are not one dense block.
    """
    sources: list[Tensor] = []
    slots: list[Slot] = []
    seen: dict[tuple[Any, ...], int] = {}
    offset = 0

    def visit(obj: Any, path: str) -> Any:
        nonlocal offset
        if isinstance(obj, Tensor):
            if type(obj) not in (Tensor, nn.Parameter) or obj.layout != torch.strided or obj.is_quantized:
                raise TypeError(
                    f"FlashCheckpoint cannot snapshot {path} ({type(obj).__name__}, layout {obj.layout}):"
                    " only dense torch tensors are supported."
                )
            key = _key(obj)
            if key not in seen:
                nbytes = obj.numel() * obj.element_size()
                seen[key] = len(sources)
                sources.append(obj.detach())
                slots.append(Slot(offset, nbytes, obj.dtype, tuple(obj.shape)))
                offset += _aligned(nbytes)
            return TensorRef(seen[key])
        return _map_children(obj, path, visit)

    tree = visit(state, "state")
    return Plan(sources=sources, slots=slots, tree=tree, nbytes=offset)


def _map_children(obj: Any, path: str, fn: Callable[[Any, str], Any]) -> Any:
    """``obj`` with ``fn`` applied to each child of a dict/list/tuple (others are leaves, kept as-is)."""
    if isinstance(obj, dict | OrderedDict):
        out = type(obj)() if type(obj) in (dict, OrderedDict) else {}
        for k, v in obj.items():
            out[k] = fn(v, f"{path}[{k!r}]")
        if hasattr(obj, "_metadata"):  # nn.Module.state_dict() carries per-module versions here
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(obj, Mapping):
        return {k: fn(v, f"{path}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, list):
        return [fn(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        items = [fn(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    return obj


def view(buffer: Tensor, slot: Slot) -> Tensor:
    """The tensor of ``slot`` as a view of ``buffer`` (a 1-D ``uint8`` tensor)."""
    raw = buffer[slot.offset : slot.offset + slot.nbytes]
    if slot.dtype == torch.bool:
        return raw.view(torch.bool).view(slot.shape)
    return raw.view(slot.dtype).view(slot.shape)


@torch.no_grad()
def copy_into(buffer: Tensor, p: Plan, which: Iterable[int]) -> None:
    """Copy the source tensors ``which`` into their slots of ``buffer``."""
    for i in which:
        src = p.sources[i]
        dst = view(buffer, p.slots[i])
        if src.device.type == "cpu":
            dst.copy_(src)
        else:  # device-to-host: asynchronous into pinned memory; the caller synchronizes
            dst.copy_(src, non_blocking=True)


def read(buffer: Tensor, index: bytes, *, clone: bool) -> Any:
    """The state tree of a snapshot, tensors taken from ``buffer``: cloned, or as views of it (only for a
    caller that copies them out: views sit at an offset of one storage, which some consumers ignore)."""
    content = pickle.loads(index)
    slots: list[Slot] = content["slots"]
    end = max((s.offset + s.nbytes for s in slots), default=0)
    if buffer.numel() < end:
        raise ValueError(f"the data holds {buffer.numel()} bytes, the index needs {end}")
    tensors = [view(buffer, s).clone() if clone else view(buffer, s) for s in slots]

    def fill(obj: Any, path: str) -> Any:
        if isinstance(obj, TensorRef):
            return tensors[obj.index]
        return _map_children(obj, path, fill)

    return fill(content["tree"], "state")
