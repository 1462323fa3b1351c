"""What the pipeline runtime sends between stages, and one step's tensors in transit.

An activation is one tensor or a flat tuple (or list) of tensors: hidden states with a padding mask,
two streams, an integer tensor of positions. Each tensor of it travels as its own point-to-point op, all
of them in the batch of their transfer, in the order of the tuple, so both sides expand a transfer into
the same ops (NCCL pairs by order). Nothing is packed or copied.

A tensor that is not floating point carries no gradient. The gradient transfer that answers an
activation holds one tensor per floating-point part of it, in order (zeros where the part got none), and
nothing for a tuple without floating-point parts: both sides know that count, the receiver of the
gradient from its own output, the sender from the activation it received.

The shape header of an activation (steps that learn shapes only) describes the whole structure in
``HEADER`` int64s: whether it is a tuple, the number of parts, then per part its rank, dtype and sizes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_par.pipeline.p2p import Transfer

DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool,
]  # fmt: skip
MAX_PARTS, MAX_DIMS = 8, 6
_PART = 2 + MAX_DIMS  # rank, dtype index, sizes
HEADER = 2 + MAX_PARTS * _PART  # is-tuple flag, number of parts, the parts


@dataclass(frozen=True)
class Spec:
    """The structure of an activation: a tuple (``True``) or one tensor, and each part's shape and dtype."""

    is_tuple: bool
    parts: tuple[tuple[torch.Size, torch.dtype], ...]

    @classmethod
    def of(cls, value: Any) -> Spec:
        tensors, is_tuple = parts_of(value)
        return cls(is_tuple, tuple((t.shape, t.dtype) for t in tensors))

    def describe(self) -> str:
        shapes = ", ".join(f"{tuple(s)} {d}" for s, d in self.parts)
        return f"({shapes})" if self.is_tuple else shapes


Layout = dict[Transfer, Spec]


def parts_of(value: Any) -> tuple[list[Tensor], bool]:
    """``(tensors, is_tuple)`` of a value passed between stages; anything but a tensor or a flat tuple or
    list of at most ``MAX_PARTS`` tensors is refused."""
    if isinstance(value, Tensor):
        return [value], False
    if (
        isinstance(value, (tuple, list))
        and 0 < len(value) <= MAX_PARTS
        and all(isinstance(t, Tensor) for t in value)
    ):
        return list(value), True
    raise TypeError(
        "A pipeline stage must pass one tensor, or a flat tuple of 1 to"
        f" {MAX_PARTS} tensors, to the next; got {_kind(value)}."
    )


def assemble(tensors: Sequence[Tensor], is_tuple: bool) -> Any:
    """The value the next stage receives: the tuple, or its only tensor."""
    return tuple(tensors) if is_tuple else tensors[0]


def floats(value: Any) -> list[Tensor]:
    """The floating-point parts of an activation: those a gradient transfer answers."""
    return [t for t in parts_of(value)[0] if t.is_floating_point()]


def backward_args(out: Any, grads: Sequence[Tensor] | None) -> tuple[list[Tensor], list[Tensor] | None]:
    """What ``torch.autograd.backward`` takes for a chunk's output: the loss alone on the last stage
    (``grads`` is ``None``), else each floating-point part of ``out`` that requires a gradient, with the
    gradient received for it (parts that require none are skipped: their gradient is zeros)."""
    if grads is None:
        return [out], None
    pairs = [(o, g) for o, g in zip(floats(out), grads, strict=True) if o.requires_grad]
    return [o for o, _ in pairs], [g for _, g in pairs]


def grad_leaves(x: Any) -> list[Tensor]:
    """The tensors of a chunk's input whose gradients the previous stage waits for."""
    if isinstance(x, Tensor):
        return [x] if x.requires_grad else []
    if isinstance(x, (tuple, list)):
        return [t for t in x if isinstance(t, Tensor) and t.requires_grad]
    return []


def encode(spec: Spec, *, device: torch.device) -> Tensor:
    """The shape header of an activation with structure ``spec``."""
    values = [int(spec.is_tuple), len(spec.parts)]
    for shape, dtype in spec.parts:
        if len(shape) > MAX_DIMS or dtype not in DTYPES:
            raise TypeError(f"Cannot send a {len(shape)}-d {dtype} tensor between pipeline stages.")
        part = [len(shape), DTYPES.index(dtype), *shape]
        values += part + [0] * (_PART - len(part))
    return torch.tensor(values + [0] * (HEADER - len(values)), dtype=torch.int64, device=device)


def decode(header: Tensor | list[int]) -> Spec:
    """The structure from a header (a host read: only in steps that learn shapes, and in predict), or
    from its values read already."""
    values = header.tolist() if isinstance(header, Tensor) else header
    parts = []
    for k in range(values[1]):
        ndim, dtype, *sizes = values[2 + k * _PART : 2 + (k + 1) * _PART]
        parts.append((torch.Size(sizes[:ndim]), DTYPES[dtype]))
    return Spec(bool(values[0]), tuple(parts))


@dataclass
class Mail:
    """One step's tensors in transit: ``outbox`` (computed, waiting for their batch), ``inbox`` (received
    or handed over, waiting for their action), each a transfer's list of tensors, and the activation
    structures (``layout``) of this rank's transfers, learnt from headers when ``learn``."""

    layout: Layout
    learn: bool
    inbox: dict[Transfer, list[Tensor]] = field(default_factory=dict)
    outbox: dict[Transfer, list[Tensor]] = field(default_factory=dict)
    # transfers handed over in memory (p = 1) as tuples: no layout entry says so
    tuples: set[Transfer] = field(default_factory=set)
    # (virtual stage, mb) -> (input, output) of a forward awaiting its backward; a received gradient
    # takes its output's shapes
    saved: dict[tuple[int, int], tuple[Any, Any]] = field(default_factory=dict)
    # posted and not waited for: a received transfer's works (waited before its use); sends' works and
    # tensors (waited at the end of the step)
    pending: dict[Transfer, list[Any]] = field(default_factory=dict)
    sending: list[tuple[list[Any], list[Tensor]]] = field(default_factory=list)

    def take(self, t: Transfer) -> list[Tensor]:
        """A received (or handed over) transfer's tensors, after waiting for them."""
        for work in self.pending.pop(t, []):
            work.wait()
        return self.inbox.pop(t)

    def is_tuple(self, t: Transfer) -> bool:
        return t in self.tuples or (t in self.layout and self.layout[t].is_tuple)

    def settle(self) -> None:
        """Wait for every transfer still in flight (the step's end)."""
        for works, _ in self.sending:
            for work in works:
                work.wait()
        for works in self.pending.values():
            for work in works:
                work.wait()
        self.sending, self.pending = [], {}


def signature(value: Any) -> Any:
    """What decides the activation shapes of a micro-batch input: tensor shapes and dtypes, the
    structure around them, and small exact scalars (sequence lengths, flags); not float values."""
    if isinstance(value, Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(signature(x) for x in value))
    if isinstance(value, Mapping):  # dict, or a BatchEncoding (a UserDict) an input function returns
        return ("dict", tuple((repr(k), signature(x)) for k, x in value.items()))
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    return type(value).__qualname__


def _kind(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        inner = ", ".join(type(x).__name__ for x in value[:MAX_PARTS])
        more = ", ..." if len(value) > MAX_PARTS else ""
        return f"a {type(value).__name__} of {len(value)} ({inner}{more})"
    return type(value).__name__
