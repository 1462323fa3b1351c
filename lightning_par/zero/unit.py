"""One ZeRO-3 unit: its flat shard, its gathered buffer, and the gather/free state machine.

A unit's parameters are packed by a :class:`FlatLayout` with one bucket padded to a multiple of N; rank
``r`` keeps slice ``r`` (the *shard*, fp32 master and optimizer target). Gathering all-gathers the shards
into ``full`` (whose storage is otherwise resized to zero) and points each parameter's ``.data`` at its
view; freeing points them back at *placeholders*: tensors of the right shape backed by one NaN element,
so optimizer grouping by ``p.dim()`` and model summaries see true shapes, writing to one fails, and
reading one outside a forward gives NaN rather than plausible numbers. A replacement of ``.data`` while
sharded is caught at the next gather, with the parameter's name.
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

_HUGE = 1 << 62  # one bucket per unit


@dataclass(eq=False)
class Unit:
    index: int
    name: str
    module: nn.Module
    names: list[str]
    params: list[nn.Parameter]
    layout: FlatLayout
    shard: Tensor
    full: Tensor
    grad_shard: Tensor
    placeholders: list[Tensor] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    state: str = "sharded"  # "sharded" | "gathering" | "gathered"
    work: Any = None
    grad_buf: Tensor | None = None
    pending: int = 0
    reduced: bool = False

    @property
    def full_bytes(self) -> int:
        return self.full.numel() * self.full.element_size()

    # ------------------------------------------------------------------ state machine
    def check_untouched(self) -> None:
        for name, p, ph, version in zip(
            self.names, self.params, self.placeholders, self.versions, strict=True
        ):
            if p.data.data_ptr() != ph.data_ptr() or p.data.shape != ph.shape or p._version != version:
                raise RuntimeError(
                    f"ZeRO-3: parameter {name!r} was replaced or modified outside a forward pass while it was"
                    " sharded, so the change would be lost. Change parameters inside forward, in an optimizer"
                    " step, or through load_state_dict / the strategy's checkpoint loading."
                )

    def gather(self, group: ProcessGroup) -> None:
        """Start the all-gather (no-op unless sharded)."""
        if self.state != "sharded":
            return
        self.check_untouched()
        self.full.untyped_storage().resize_(self.full_bytes)
        source = self.shard if self.shard.dtype == self.full.dtype else self.shard.to(self.full.dtype)
        self.work = all_gather_flat(self.full, source, group=group, async_op=True)
        self.state = "gathering"

    def wait(self, group: ProcessGroup) -> None:
        """Make the parameters whole (gathering first if needed)."""
        if self.state == "sharded":
            self.gather(group)
        if self.state == "gathering":
            self.work.wait()
            self.work = None
            for p, s in zip(self.params, self.layout.slots, strict=True):
                p.data = self.full[s.offset : s.end].view(s.shape)
            self.state = "gathered"

    def free(self, *, force: bool = False) -> None:
        """Point the parameters at their placeholders and release the gathered storage."""
        if self.state == "sharded" and not force:
            return
        if self.state == "gathering":
            self.work.wait()
            self.work = None
        for p, ph in zip(self.params, self.placeholders, strict=True):
            p.data = ph
        self.versions = [p._version for p in self.params]
        self.full.untyped_storage().resize_(0)
        self.state = "sharded"


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
) -> Unit:
    """Pack ``named`` (real, materialised parameters) into a sharded unit; with ``broadcast`` every rank
    starts from the values of the group's first rank. The shard keeps the parameters' own dtype (the
    fp32 master in mixed precision), gathers produce ``compute_dtype``, gradients reduce in
    ``grad_dtype``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    params = [p for _, p in named]
    layout = FlatLayout(
        names=[n for n, _ in named],
        shapes=[tuple(p.shape) for p in params],
        bucket_numel=_HUGE,
        shard_count=world,
    )
    packed = torch.zeros(layout.numel, dtype=params[0].dtype, device=device)
    with torch.no_grad():
        for p, s in zip(params, layout.slots, strict=True):
            packed[s.offset : s.end].view(s.shape).copy_(p.detach())
        if world > 1 and broadcast:
            dist.broadcast(packed, src=dist.get_global_rank(group, 0), group=group)
    lo, hi = layout.buckets[0].shard_range(rank, world)
    shard = packed[lo:hi].clone()
    del packed
    full = torch.zeros(layout.numel, dtype=compute_dtype, device=device)
    unit = Unit(
        index=index,
        name=name,
        module=module,
        names=[n for n, _ in named],
        params=params,
        layout=layout,
        shard=shard,
        full=full,
        grad_shard=torch.zeros(shard.numel(), dtype=grad_dtype, device=device),
    )
    nan = torch.full((1,), float("nan"), dtype=compute_dtype, device=device)
    unit.placeholders = [nan.clone().expand(p.shape) for p in params]
    unit.free(force=True)
    return unit
