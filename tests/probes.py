"""Instruments for the device-correctness guards (tests/test_device_guards.py).

* :func:`explicit_devices`: inside it, a tensor created without ``device=`` lands on the meta device, so
  only explicitly placed tensors are real: a mechanism that hands a collective such a tensor fails (Gloo
  refuses meta tensors) or computes garbage, which the guard's comparison with a plain run catches.
  Under NCCL the same tensor would have been a CPU tensor, which NCCL refuses.
* :class:`HostSyncs`: counts the calls that read a tensor's value on the host (``item``, ``tolist``,
  ``cpu``, ``numpy``, and Python's ``bool``/``int``/``float``/``index`` of a tensor) made directly by
  code under a given package. On a GPU each is a device synchronisation. Not seen: calls inside torch
  functions (a CPU step counter in ``torch.optim``, which is no device sync), and ``.to(device)``, which
  on these CPU runs cannot be told apart from a placement on the communication device (the CPU).
* :class:`SlowSnapshotCopies`: the flash-snapshot copy thread starts each copy ``delay_s`` late, so that
  work right after a snapshot (a validation swap, an evaluation) runs while the copy still reads the
  live tensors: what writes them then must wait for the copy.
* :class:`Collectives`: records every collective and point-to-point call (name and element count).
* :func:`counting_backend`: a ``torch.compile`` backend (dynamo's ``aot_eager``: AOTAutograd, no C++
  compiler) counting, in :data:`COMPILED_CALLS`, every call of a graph it compiled, so that a test shows
  its model ran compiled.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

import lightning_par.collectives as lp_collectives


@contextmanager
def explicit_devices() -> Iterator[None]:
    """Tensors created without an explicit device inside go to the meta device."""
    with torch.device("meta"):
        yield


_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class HostSyncs:
    """Counts host reads of tensor values made directly by files under ``package`` (see the module
    docstring). ``calls`` holds ``(method, "file:line")`` of each; reset it with :meth:`reset`."""

    def __init__(self, package: str = "lightning_par") -> None:
        self.package = f"/{package}/"
        self.calls: list[tuple[str, str]] = []
        self._saved: dict[str, Any] = {}
        self._active = False

    def reset(self) -> None:
        self.calls = []

    def _record(self, name: str) -> None:
        if not self._active:
            return
        frame = sys._getframe(2)  # the caller of the patched method
        where = frame.f_code.co_filename
        if self.package in where:
            self.calls.append((name, f"{where.split(self.package)[-1]}:{frame.f_lineno}"))

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        probe = self

        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            probe._record(name)
            return original(self, *args, **kwargs)

        return read

    def __enter__(self) -> HostSyncs:
        for name in _READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._wrap(name, original))
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._active = False
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved = {}

    @contextmanager
    def paused(self) -> Iterator[None]:
        previous, self._active = self._active, False
        try:
            yield
        finally:
            self._active = previous


_DIST_OPS = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "batch_isend_irecv",
    "isend",
    "irecv",
    "send",
    "recv",
    "barrier",
    "broadcast_object_list",
)


class Collectives:
    """Records ``(name, numel)`` of every collective/p2p call (``torch.distributed`` functions and the
    package's flat wrappers) inside the context."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self._saved: list[tuple[Any, str, Any]] = []

    def reset(self) -> None:
        self.calls = []

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        probe = self

        def op(*args: Any, **kwargs: Any) -> Any:
            first = args[0] if args else None
            probe.calls.append((name, first.numel() if isinstance(first, torch.Tensor) else 0))
            return original(*args, **kwargs)

        return op

    def __enter__(self) -> Collectives:
        for name in _DIST_OPS:
            if hasattr(dist, name):
                self._patch(dist, name)
        for name in ("_all_gather", "_reduce_scatter"):
            self._patch(lp_collectives, name)
        return self

    def _patch(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, original))
        setattr(owner, name, self._wrap(name.lstrip("_"), original))

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved = []


COMPILED_CALLS = [0]  # calls of graphs compiled by counting_backend, in this process


def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
    """Dynamo's ``aot_eager`` backend, counting every call of the graph it compiled."""
    compiled = torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    def run(*args: Any) -> Any:
        COMPILED_CALLS[0] += 1
        return compiled(*args)

    return run


class SlowSnapshotCopies:
    """Inside it, every flash-snapshot copy (``SnapshotWriter``'s copy-thread job) starts ``delay_s`` late
    (see the module docstring); the writer's method is restored at the exit."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __enter__(self) -> None:
        from lightning_par.callbacks.writer import SnapshotWriter

        self.original = original = SnapshotWriter._complete
        delay = self.delay_s

        def late(writer: SnapshotWriter, *args: Any, **kwargs: Any) -> None:
            time.sleep(delay)
            original(writer, *args, **kwargs)

        SnapshotWriter._complete = late  # type: ignore[method-assign]

    def __exit__(self, *exc: object) -> None:
        from lightning_par.callbacks.writer import SnapshotWriter

        SnapshotWriter._complete = self.original  # type: ignore[method-assign]
