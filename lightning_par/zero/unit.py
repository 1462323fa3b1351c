"""One ZeRO-3 unit: its flat shards, its gathered buffers, and the gather/free state machine.

A unit's parameters are packed into *parts*, one flat buffer each: the trainable part (the fp32 master
shard, optimizer target, with a gradient shard beside it) and one frozen part per dtype (parameters with
``requires_grad=False``: sharded and gathered like the others, but with no gradient, no master and no
optimizer state; in mixed precision they are kept in the compute dtype). Each part is laid out by a
:class:`FlatLayout` with one bucket padded to a multiple of N; rank ``r`` keeps slice ``r`` (the
*shard*). Gathering all-gathers every part's shards into its ``full`` buffer (whose storage is otherwise
resized to zero) and points each parameter's ``.data`` at its view; freeing points them back at
*placeholders*: tensors of the right shape backed by one NaN element (an integer frozen parameter's
placeholder holds 0), so optimizer grouping by ``p.dim()`` and model summaries see true shapes, writing
to one fails, and reading one outside a forward gives NaN rather than plausible numbers. A replacement of
``.data`` while sharded is caught at the next gather, with the parameter's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_par.collectives import all_gather_flat
from lightning_par.zero.layout import FlatLayout
from lightning_par.zero.quantize import dequantize_blockwise, quantize_blockwise
from lightning_par.zero.unit_writes import UnitWrites

_HUGE = 1 << 62  # one bucket per part


@dataclass(eq=False)
class Part:
    """Parameters of one unit that share a flat buffer (and a dtype)."""

    names: list[str]
    params: list[nn.Parameter]
    layout: FlatLayout
    shard: Tensor
    full: Tensor
    trainable: bool
    placeholders: list[Tensor] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    works: list[Any] = field(default_factory=list)
    # the gather's inputs and low-precision outputs while it is in flight (they must outlive it)
    send: list[Tensor] = field(default_factory=list)
    wire: list[Tensor] = field(default_factory=list)
    # whole parameters in the shard's dtype inside gathered_params(writeback=True) (Unit.gather_stored)
    stored: Tensor | None = None
    # each parameter's version counter when it was last made whole or its writes last absorbed
    gathered_versions: list[int] = field(default_factory=list)

    @property
    def full_bytes(self) -> int:
        return self.full.numel() * self.full.element_size()

    def fragments(self, rank: int) -> list[tuple[str, int, int, Tensor]]:
        """``(name, lo, hi, shard view)`` of every parameter piece in this rank's shard."""
        return [
            (self.names[f.slot], f.param_lo, f.param_hi, self.shard[f.shard_lo : f.shard_lo + f.numel])
            for f in self.layout.fragments(rank)
        ]


@dataclass(eq=False)
class Unit(UnitWrites):
    index: int
    name: str
    module: nn.Module
    parts: list[Part]
    grad_shard: Tensor | None
    state: str = "sharded"  # "sharded" | "gathering" | "gathered"
    grad_buf: Tensor | None = None
    pending: int = 0
    reduced: bool = False
    backward_done: bool = True  # see Stage3Engine: frozen weights may be needed after the last gradient
    needs_backward: bool = True  # its outputs required gradients in the latest forward
    # the dtype the gathers move (None: the compute dtype); fp16/bf16, or int8 blockwise-quantized
    gather_dtype: torch.dtype | None = None
    # gathered since the last optimizer update: its gathered values are the shards' (Unit.absorb_writes)
    fresh: bool = False

    @property
    def train(self) -> Part | None:
        """The trainable part (None for a unit of frozen parameters only)."""
        return self.parts[0] if self.parts and self.parts[0].trainable else None

    @property
    def has_frozen(self) -> bool:
        return any(not part.trainable for part in self.parts)

    @property
    def names(self) -> list[str]:
        """Trainable parameter names, in the order of the trainable layout."""
        return self.train.names if self.train is not None else []

    @property
    def params(self) -> list[nn.Parameter]:
        """Trainable parameters, in the order of the trainable layout."""
        return self.train.params if self.train is not None else []

    @property
    def full_bytes(self) -> int:
        return sum(part.full_bytes for part in self.parts)

    # ------------------------------------------------------------------ state machine
    def check_untouched(self) -> None:
        for part in self.parts:
            for name, p, ph, version in zip(
                part.names, part.params, part.placeholders, part.versions, strict=True
            ):
                if p.data.data_ptr() != ph.data_ptr() or p.data.shape != ph.shape or p._version != version:
                    raise RuntimeError(
                        f"ZeRO-3: parameter {name!r} was replaced or modified outside a forward pass while it"
                        " was sharded, so the change would be lost. Change parameters inside forward, in an"
                        " optimizer step, through load_state_dict / the strategy's checkpoint loading, or"
                        " between steps inside `with trainer.strategy.gathered_params(writeback=True):` on"
                        " every rank (fabric.strategy.gathered_params in Fabric)."
                    )

    def gather(self, group: ProcessGroup) -> None:
        """Start the all-gathers (no-op unless sharded)."""
        if self.state != "sharded":
            return
        self.check_untouched()
        world = dist.get_world_size(group)
        for part in self.parts:
            part.full.untyped_storage().resize_(part.full_bytes)
            part.send, part.wire = self._send_and_wire(part, part.full, world)
            part.works = [
                all_gather_flat(out, src, group=group, async_op=True)
                for out, src in zip(part.wire, part.send, strict=True)
            ]
        self.state = "gathering"

    def _send_and_wire(self, part: Part, full: Tensor, world: int) -> tuple[list[Tensor], list[Tensor]]:
        """What this rank sends of ``part`` and the buffers the all-gathers fill (``full`` itself, or
        low-precision ones that :meth:`wait` casts into it). In a group of one nothing travels, so nothing
        is rounded for the wire (a tensor-parallel run with one data-parallel rank)."""
        wire = self.gather_dtype if self.gather_dtype not in (None, full.dtype) and world > 1 else None
        if wire == torch.int8:  # values and one scale per block, dequantized in wait()
            q, scales = quantize_blockwise(part.shard)
            return [q, scales], [
                torch.empty_like(full, dtype=torch.int8),
                scales.new_empty(world * len(scales)),
            ]
        if wire is not None:  # fp16/bf16, cast up in wait()
            return [part.shard.to(wire)], [torch.empty_like(full, dtype=wire)]
        same = part.shard.dtype == full.dtype
        return [part.shard if same else part.shard.to(full.dtype)], [full]

    def serve(self, group: ProcessGroup) -> None:
        """Take part in the other ranks' all-gathers of this unit, whatever its state here: the same
        collectives as :meth:`gather`, into scratch buffers, the parameters untouched (a join round,
        :mod:`lightning_par.zero.stage3_join`)."""
        world = dist.get_world_size(group)
        for part in self.parts:
            send, wire = self._send_and_wire(part, torch.empty_like(part.full), world)
            for out, src in zip(wire, send, strict=True):
                all_gather_flat(out, src, group=group, async_op=True).wait()

    def wait(self, group: ProcessGroup) -> None:
        """Make the parameters whole (gathering first if needed)."""
        if self.state == "sharded":
            self.gather(group)
        if self.state == "gathering":
            world = dist.get_world_size(group)
            for part in self.parts:
                for work in part.works:
                    work.wait()  # on CUDA: the compute stream waits for the gather, the host does not
                if len(part.wire) == 2:
                    dequantize_blockwise(part.wire[0], part.wire[1], part.full, parts=world)
                elif part.wire[0] is not part.full:
                    part.full.copy_(part.wire[0])
                part.works, part.send, part.wire = [], [], []
                for p, s in zip(part.params, part.layout.slots, strict=True):
                    p.data = part.full[s.offset : s.end].view(s.shape)
                part.gathered_versions = [p._version for p in part.params]
            self.state = "gathered"
            self.fresh = True

    def gather_stored(self, group: ProcessGroup) -> None:
        """Make the parameters whole in their stored precision (each part's shard dtype: the fp32 master,
        fp32 frozen weights), not the compute copy: one blocking all-gather per part into ``stored``,
        which :meth:`free` drops. For writes that :meth:`keep_stored` puts back (an EMA's small steps
        survive, where a 16-bit copy would round them away)."""
        self.free()
        for part in self.parts:
            part.stored = torch.empty(part.layout.numel, dtype=part.shard.dtype, device=part.shard.device)
            all_gather_flat(part.stored, part.shard, group=group)
            for p, s in zip(part.params, part.layout.slots, strict=True):
                p.data = part.stored[s.offset : s.end].view(s.shape)
        self.state = "gathered"

    def free(self, *, force: bool = False) -> None:
        """Point the parameters at their placeholders and release the gathered storage."""
        if self.state == "sharded" and not force:
            return
        for part in self.parts:
            for work in part.works:
                work.wait()
            part.works, part.send, part.wire = [], [], []
            for p, ph in zip(part.params, part.placeholders, strict=True):
                p.data = ph
            part.versions = [p._version for p in part.params]
            part.gathered_versions = []
            part.full.untyped_storage().resize_(0)
            part.stored = None
        self.state = "sharded"


def _build_part(
    named: list[tuple[str, nn.Parameter]],
    *,
    group: ProcessGroup,
    shard_dtype: torch.dtype,
    full_dtype: torch.dtype,
    device: torch.device,
    broadcast: bool,
    trainable: bool,
) -> Part:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    params = [p for _, p in named]
    layout = FlatLayout(
        names=[n for n, _ in named],
        shapes=[tuple(p.shape) for p in params],
        bucket_numel=_HUGE,
        shard_count=world,
    )
    packed = torch.zeros(layout.numel, dtype=shard_dtype, device=device)
    with torch.no_grad():
        for p, s in zip(params, layout.slots, strict=True):
            packed[s.offset : s.end].view(s.shape).copy_(p.detach())
        if world > 1 and broadcast:
            dist.broadcast(packed, src=dist.get_global_rank(group, 0), group=group)
    lo, hi = layout.buckets[0].shard_range(rank, world)
    shard = packed[lo:hi].clone()
    del packed
    part = Part(
        names=[n for n, _ in named],
        params=params,
        layout=layout,
        shard=shard,
        full=torch.zeros(layout.numel, dtype=full_dtype, device=device),
        trainable=trainable,
    )
    fill = float("nan") if full_dtype.is_floating_point or full_dtype.is_complex else 0
    # one element with no dimension: it expands to any shape, a scalar parameter's () too (CLIP's
    # logit_scale; a (1,) element refused to expand to it and the unit's setup failed)
    placeholder = torch.full((), fill, dtype=full_dtype, device=device)
    part.placeholders = [placeholder.clone().expand(p.shape) for p in params]
    return part


def build_unit(
    *,
    index: int,
    name: str,
    module: nn.Module,
    named: list[tuple[str, nn.Parameter]],
    group: ProcessGroup,
    compute_dtype: torch.dtype,
    grad_dtype: torch.dtype,
    device: torch.device,
    broadcast: bool,
    frozen_dtype: torch.dtype | None = None,
    frozen_compute_dtype: torch.dtype | None = None,
) -> Unit:
    """Pack ``named`` (real, materialised parameters) into a sharded unit; with ``broadcast`` every rank
    starts from the values of the group's first rank. The trainable shard keeps the parameters' own dtype
    (the fp32 master in mixed precision), gathers produce ``compute_dtype``, gradients reduce in
    ``grad_dtype``. Frozen floating parameters are gathered in ``frozen_compute_dtype`` (the mixed
    precision's compute dtype; None: their own dtype, so a frozen bf16 base beside fp32 adapters computes
    in bf16 under ``32-true``, as in the user's model) and sharded in ``frozen_dtype`` (None: their own
    dtype, e.g. fp32 under mixed precision, as Lightning keeps them); frozen parameters of other dtypes
    stay in their own."""
    trainable = [(n, p) for n, p in named if p.requires_grad]
    # frozen parts by (shard dtype, gathered dtype)
    frozen: dict[tuple[torch.dtype, torch.dtype], list[tuple[str, nn.Parameter]]] = {}
    for n, p in named:
        if not p.requires_grad:
            floating = p.is_floating_point()
            stored = (frozen_dtype or p.dtype) if floating else p.dtype
            gathered = (frozen_compute_dtype or p.dtype) if floating else p.dtype
            frozen.setdefault((stored, gathered), []).append((n, p))
    parts: list[Part] = []
    groups: list[tuple[list[tuple[str, nn.Parameter]], torch.dtype, torch.dtype, bool]] = []
    if trainable:
        groups.append((trainable, trainable[0][1].dtype, compute_dtype, True))
    groups += [(items, stored, full, False) for (stored, full), items in frozen.items()]
    for items, shard_dtype, full_dtype, is_trainable in groups:
        part = _build_part(
            items,
            group=group,
            shard_dtype=shard_dtype,
            full_dtype=full_dtype,
            device=device,
            broadcast=broadcast,
            trainable=is_trainable,
        )
        parts.append(part)
    grad_shard = None
    if trainable:
        grad_shard = torch.zeros(parts[0].shard.numel(), dtype=grad_dtype, device=device)
    unit = Unit(index=index, name=name, module=module, parts=parts, grad_shard=grad_shard)
    unit.free(force=True)
    return unit
