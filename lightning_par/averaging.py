"""Weight averages (EMA, SWA) kept where the weights are kept: each rank averages the fp32 values it owns.

Lightning's ``WeightAveraging`` deep-copies the whole module and averages ``module.parameters()``: under
ZeRO-3 those are placeholders, under tensor parallelism slices, under pipeline parallelism meta tensors,
and with low-precision parameters rounded copies of the fp32 masters. :class:`WeightAverages` averages
the values the optimizer updates instead, the *targets*:

* ZeRO 1-3: this rank's fragments of the trainable parameters (``sharded_state.fragment_table()``: the
  fp32 masters, or the fp32 parameters' own slices), so the average costs ``1/dp`` of the model per rank
  and no communication per update;
* stage 0 (or no engine): the whole local parameters (this rank's tensor-parallel slice, this stage's
  layers), trainable and frozen, as Lightning does.

With ``use_buffers`` the floating-point buffers (whole on every rank) are averaged by the same rule; other
buffers (``num_batches_tracked``) are left as they are. For an average ``a`` of a target ``w`` after
``n`` updates, an update is ``a := w`` when ``n = 0``, else ``a := rule(a, w, n)``: EMA
``decay * a + (1 - decay) * w``, SWA ``a + (w - a) / (n + 1)``, or a torch-style ``avg_fn``.
:meth:`swap` exchanges averages and targets (evaluation with the averaged weights, and back) and
:meth:`copy_to_targets` writes the averages into the model; after either, the engine's whole parameters
follow (``masters_changed``: a cast and all-gather at ZeRO 1/2, regathered units at ZeRO-3).

A target's identity is ``(name, lo, hi)``. ZeRO 1/2 move fragments when their bucket order is rebuilt
(first backward, checkpoint load); the averages then move with them, one all-reduce per parameter over
the dp ``group`` (each rank contributes the elements it held, which are disjoint). Averages read from a
checkpoint arrive as pieces of the full parameters and are cut to this rank's targets when first needed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_par.checkpoint.optimizer_state import Pieces, cut, whole_pieces
from lightning_par.zero.engine_api import Engine

AvgFn = Callable[[Tensor, Tensor, Tensor], Tensor]  # torch's avg_fn: (average, current, n) -> new average
Key = tuple[str, int, int]


def ema_rule(decay: float) -> Callable[[list[Tensor], list[Tensor], int], None]:
    """``a := decay * a + (1 - decay) * w`` on lists, rounded as torch's ``get_ema_avg_fn`` rounds it (each
    product, then their sum) so a run equals Lightning's ``EMAWeightAveraging`` on the same values."""
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"EMA decay must lie in [0, 1], got {decay}.")

    def update(averages: list[Tensor], currents: list[Tensor], n: int) -> None:
        scaled = torch._foreach_mul(currents, 1.0 - decay)
        torch._foreach_mul_(averages, decay)
        torch._foreach_add_(averages, scaled)

    return update


def swa_rule(averages: list[Tensor], currents: list[Tensor], n: int) -> None:
    """``a := a + (w - a) / (n + 1)``: the equal-weight mean of the ``n + 1`` models seen."""
    torch._foreach_lerp_(averages, currents, 1.0 / (n + 1))


def avg_fn_rule(avg_fn: AvgFn) -> Callable[[list[Tensor], list[Tensor], int], None]:
    """A torch-style per-tensor ``avg_fn(average, current, n_averaged)`` (``torch.optim.swa_utils``)."""

    def update(averages: list[Tensor], currents: list[Tensor], n: int) -> None:
        counts: dict[torch.device, Tensor] = {}  # n on each device, made once per update
        for a, w in zip(averages, currents, strict=True):
            if a.device not in counts:  # filled on the device: torch.tensor(n) would copy from the host
                counts[a.device] = torch.full((), n, dtype=torch.int64, device=a.device)
            count = counts[a.device]
            a.copy_(avg_fn(a, w, count))

    return update


MultiAvgFn = Callable[[list[Tensor], list[Tensor], Tensor], None]  # torch's multi_avg_fn, in place


def multi_avg_fn_rule(multi_avg_fn: MultiAvgFn) -> Callable[[list[Tensor], list[Tensor], int], None]:
    """A torch-style ``multi_avg_fn(averages, currents, n_averaged)`` (``get_ema_multi_avg_fn()``), which
    updates the averages in place: called once per (device, dtype) group, with ``n`` as a tensor on that
    device, as torch's ``AveragedModel`` calls it."""

    def update(averages: list[Tensor], currents: list[Tensor], n: int) -> None:
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {}
        for a, w in zip(averages, currents, strict=True):
            pair = groups.setdefault((a.device, a.dtype), ([], []))
            pair[0].append(a)
            pair[1].append(w)
        for (device, _), (avgs, ws) in groups.items():
            multi_avg_fn(avgs, ws, torch.full((), n, dtype=torch.int64, device=device))

    return update


def averaging_rule(
    *, decay: float | None = None, avg_fn: AvgFn | None = None, multi_avg_fn: MultiAvgFn | None = None
) -> Callable[[list[Tensor], list[Tensor], int], None]:
    """The update of at most one of: an EMA with ``decay``, torch's per-tensor ``avg_fn``, its in-place
    list form ``multi_avg_fn``; none gives the equal-weight mean (SWA)."""
    options = (("decay", decay), ("avg_fn", avg_fn), ("multi_avg_fn", multi_avg_fn))
    given = [name for name, value in options if value is not None]
    if len(given) > 1:
        raise ValueError(f"Give one of decay, avg_fn and multi_avg_fn, not {' and '.join(given)}.")
    if decay is not None:
        return ema_rule(decay)
    if avg_fn is not None:
        return avg_fn_rule(avg_fn)
    if multi_avg_fn is not None:
        return multi_avg_fn_rule(multi_avg_fn)
    return swa_rule


class WeightAverages:
    """The averages of one module's weights under one engine (see the module docstring). Every method is
    called by every rank of the dp ``group`` at the same point (a relayout's move is collective)."""

    def __init__(
        self,
        module: nn.Module,
        engine: Engine | None,
        *,
        group: ProcessGroup | None,
        rule: Callable[[list[Tensor], list[Tensor], int], None],
        use_buffers: bool = True,
        before_write: Callable[[], None] | None = None,
    ) -> None:
        self.module = module
        # a snapshot copy in flight (FlashCheckpoint, FlashSnapshots with snapshot_copy="overlap") reads
        # the targets and the averages off the training thread: it must finish before they are written
        self.before_write = before_write
        self.engine = engine
        self.group = group
        self.rule = rule
        self.use_buffers = use_buffers
        self.n_averaged = 0
        self._averages: dict[Key, Tensor] | None = None  # built at first use
        self._buffers: dict[str, Tensor] = {}
        self._moved = False
        self._pending: tuple[Pieces, Mapping[str, Tensor]] | None = None
        if engine is not None:
            engine.on_relayout(self._mark_moved)

    def _mark_moved(self) -> None:
        self._moved = True

    # ------------------------------------------------------------------ targets
    def targets(self) -> list[tuple[str, int, int, Tensor]]:
        """``(name, lo, hi, values)`` of what this rank averages (module docstring); ``values`` is the live
        tensor, flat for fragments, in the parameter's shape for whole parameters."""
        sharded = self.engine.sharded_state if self.engine is not None else None
        if sharded is not None:
            return sharded.fragment_table()
        return [(n, 0, p.numel(), p.detach()) for n, p in self.module.named_parameters() if not p.is_meta]

    def buffer_targets(self) -> list[tuple[str, Tensor]]:
        if not self.use_buffers:
            return []
        return [(n, b) for n, b in self.module.named_buffers() if not b.is_meta and b.is_floating_point()]

    def _pairs(self) -> tuple[list[Tensor], list[Tensor]]:
        """(averages, targets) in one order, parameters then buffers; the averages built or moved first."""
        table = self.targets()
        averages = self._current_averages(table)
        buffers = self.buffer_targets()
        if set(self._buffers) != {n for n, _ in buffers}:
            pending = self._pending[1] if self._pending is not None else {}
            self._buffers = {
                n: (pending[n].to(b.device, b.dtype) if n in pending else b.detach().clone())
                for n, b in buffers
            }
        self._pending = None  # the checkpoint's values are in place now
        avgs = [averages[(n, lo, hi)] for n, lo, hi, _ in table] + [self._buffers[n] for n, _ in buffers]
        currents = [t for *_, t in table] + [b.detach() for _, b in buffers]
        return avgs, currents

    def _current_averages(self, table: Sequence[tuple[str, int, int, Tensor]]) -> dict[Key, Tensor]:
        keys = [(n, lo, hi) for n, lo, hi, _ in table]
        if self._averages is None:
            self._averages = self._first_averages(table)
        elif self._moved and self.engine is not None and self.engine.sharded_state is not None:
            self._averages = self._move(table)  # (stage 0 averages whole parameters: nothing moves)
        self._moved = False
        missing = [k for k in keys if k not in self._averages]
        if missing:
            raise RuntimeError(
                f"The weight averages lost track of {missing[0][0]!r} (elements {missing[0][1]}-"
                f"{missing[0][2]}): the model's parameters changed after averaging started (this is a bug"
                " unless the model was rebuilt)."
            )
        return self._averages

    def _first_averages(self, table: Sequence[tuple[str, int, int, Tensor]]) -> dict[Key, Tensor]:
        """A copy of the targets, or the checkpoint's averages cut to them."""
        out: dict[Key, Tensor] = {}
        pieces = self._pending[0] if self._pending is not None else {}
        for name, lo, hi, t in table:
            piece = cut(pieces.get(name, []), lo, hi) if pieces else None
            if pieces and piece is None:
                raise ValueError(
                    f"The checkpoint's weight averages lack {name!r}: it was saved for another model."
                )
            value = t.detach().clone() if piece is None else piece["param"].reshape(t.shape)
            out[(name, lo, hi)] = value.to(device=t.device, dtype=t.dtype)
        return out

    @torch.no_grad()
    def _move(self, table: Sequence[tuple[str, int, int, Tensor]]) -> dict[Key, Tensor]:
        """The averages for this rank's new fragments: per trainable parameter, every rank's old pieces
        summed into the whole (disjoint, so the sum is the values) and the new pieces cut out."""
        old = self._averages or {}
        wanted: dict[str, list[tuple[int, int, Tensor]]] = {}
        for name, lo, hi, t in table:
            wanted.setdefault(name, []).append((lo, hi, t))
        out: dict[Key, Tensor] = {}
        sharded = self.engine.sharded_state if self.engine is not None else None
        masters = torch.float32 if sharded is not None and sharded.master_key is not None else None
        for name, p in self.module.named_parameters():
            if p.is_meta or not p.requires_grad:
                continue
            held = [(lo, hi, a) for (n, lo, hi), a in old.items() if n == name]
            # the fragments' dtype, the same on every rank (one owning no element of p must agree with
            # the others in the all-reduce): the fp32 masters, or the parameters themselves
            whole = torch.zeros(p.numel(), dtype=masters or p.dtype, device=p.device)
            for lo, hi, a in held:
                whole[lo:hi] = a.reshape(-1)
            if self.group is not None and dist.get_world_size(self.group) > 1:
                dist.all_reduce(whole, group=self.group)
            for lo, hi, t in wanted.get(name, []):
                out[(name, lo, hi)] = whole[lo:hi].clone().reshape(t.shape)
        return out

    # ------------------------------------------------------------------ the operations
    def _writing(self) -> None:
        if self.before_write is not None:
            self.before_write()

    @torch.no_grad()
    def update(self) -> None:
        """One averaging step from the targets' current values."""
        self._writing()
        avgs, currents = self._pairs()
        if self.n_averaged == 0:
            torch._foreach_copy_(avgs, currents)
        elif avgs:
            self.rule(avgs, currents, self.n_averaged)
        self.n_averaged += 1

    @torch.no_grad()
    def swap(self) -> None:
        """Exchange averages and targets; a second call undoes the first."""
        self._writing()
        avgs, currents = self._pairs()
        for a, w in zip(avgs, currents, strict=True):
            held = w.clone()
            w.copy_(a)
            a.copy_(held)
        self._weights_written()

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """The model holds the averaged weights inside (evaluation, sampling); its own come back at the
        exit, also after an exception. Entered by every rank of the dp group."""
        self.swap()
        try:
            yield
        finally:
            self.swap()

    @torch.no_grad()
    def copy_to_targets(self) -> None:
        """The model takes the averaged weights (the end of training)."""
        self._writing()
        avgs, currents = self._pairs()
        if currents:
            torch._foreach_copy_(currents, avgs)
        self._weights_written()

    def _weights_written(self) -> None:
        if self.engine is not None:
            self.engine.masters_changed()

    # ------------------------------------------------------------------ checkpoints
    def records(self, *, dp_rank: int) -> list[tuple[str, int, int, dict[str, Tensor]]]:
        """This rank's averages as checkpoint records ``(name, lo, hi, {"param": values})`` (CPU copies);
        whole parameters (stage 0) only from dp rank 0, the others hold the same."""
        self._pairs()  # built, or moved to the current fragments
        sharded = self.engine is not None and self.engine.sharded_state is not None
        if not sharded and dp_rank != 0:
            return []
        assert self._averages is not None
        return [
            (n, lo, hi, {"param": a.detach().reshape(-1).cpu().clone()})
            for (n, lo, hi), a in self._averages.items()
        ]

    def buffer_values(self) -> dict[str, Tensor]:
        """The averaged buffers (CPU copies), by name."""
        self._pairs()
        return {n: b.detach().cpu().clone() for n, b in self._buffers.items()}

    def state_dict(self, *, clone: bool = True) -> dict[str, Any]:
        """This rank's averages for a snapshot (Fabric's ``FlashSnapshots`` stores it as any stateful
        entry): the update count, the averages by ``(name, lo, hi)`` (this rank's local elements) and the
        averaged buffers; copies, or with ``clone=False`` the live tensors, for a snapshot writer that
        copies them before the next write (``before_write`` fences it). Checkpoints use ``records``."""
        self._pairs()
        assert self._averages is not None
        own = (lambda t: t.detach().clone()) if clone else (lambda t: t.detach())
        params = [(n, lo, hi, own(a)) for (n, lo, hi), a in self._averages.items()]
        buffers = {n: own(b) for n, b in self._buffers.items()}
        return {"n_averaged": self.n_averaged, "params": params, "buffers": buffers}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take :meth:`state_dict`'s output, saved by this rank under the same layout."""
        self.load(snapshot_pieces(state["params"]), state["buffers"], n_averaged=int(state["n_averaged"]))

    def load(self, pieces: Pieces, buffers: Mapping[str, Tensor], *, n_averaged: int) -> None:
        """Take a checkpoint's averages: ``pieces`` of this rank's local parameters (tensor-parallel slices
        already cut), applied when the targets are next read."""
        self._pending = (pieces, dict(buffers))
        self._averages, self._buffers, self._moved = None, {}, False
        self.n_averaged = n_averaged


def snapshot_pieces(params: Sequence[tuple[str, int, int, Tensor]]) -> Pieces:
    """Pieces of :meth:`WeightAverages.state_dict`'s ``params``, of one rank or of several (every writer of
    a snapshot resharded to another dp size or stage: their fragments together cover each parameter)."""
    pieces: Pieces = {}
    for name, lo, hi, value in params:
        pieces.setdefault(name, []).append((lo, hi, {"param": value.reshape(-1)}))
    return pieces


def full_pieces(state: Mapping[str, Any], module: nn.Module) -> tuple[Pieces, dict[str, Tensor]]:
    """Pieces and buffers from a whole state dict of ``module``'s names (a Lightning checkpoint)."""
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    pieces = whole_pieces({n: v for n, v in state.items() if n in params})
    buffers = {n: v for n, v in state.items() if n not in params and isinstance(v, Tensor)}
    return pieces, buffers
