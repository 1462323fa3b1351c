"""Evaluation with uneven batch counts over the data-parallel ranks, for a ZeRO-3 engine (a "join").

Why
---
Every ZeRO-3 forward all-gathers each unit over the dp group, so every dp rank must run as many forwards
as the others. Lightning's ``trainer.predict`` does not pad its distributed sampler (each sample is
predicted once), so 9 samples on 2 ranks give one rank a batch more than the other; an iterable
evaluation dataset may do the same. The rank that runs out first moved on to the epoch's end while the
others waited in their next all-gather: a hang, where ``"ddp"`` (no collective in evaluation) runs.

Protocol (only while :attr:`Stage3Join.joining` is on; the strategy turns it on for an evaluation loop
whose ranks' batch counts differ)
-------------------------------------------------------------------------------------------------
* Before a rank launches the all-gather of unit ``u`` (a prefetch, or a use of a sharded unit), it
  announces ``u``: an all-reduce (``MAX``) of ``index(u) + 1`` over the dp group. No host read.
* A rank whose batches are over calls :meth:`Stage3Join.serve_gathers`: it frees what it holds, then
  contributes ``0`` to the announcements; each round's maximum names the unit the ranks still evaluating
  gather next, and this rank joins that all-gather with its shard (one host read per round: this rank
  has nothing else to do). A round whose maximum is ``0`` means every rank is serving: all leave.

The ranks still evaluating run the same model code, so they gather the same units in the same order
(announcing the same index); serving ranks issue exactly the collectives they do, in that order. Every
rank calls :meth:`serve_gathers` at the end of each of its dataloaders, so a dataloader's gathers never
mix with the next one's. Evaluation changes no parameter, so which forward an all-gather belongs to
does not matter, only that every rank takes part in it.

Within one step the ranks must also run equally many forwards. Hugging Face's ``generate()`` stops when
its sequences end, sooner on one rank than another, unless it knows the model is sharded: then
(``synced_gpus``) every rank keeps running forwards until all are done. It knows FSDP's models by the
attribute :data:`HF_SHARDED_ATTR`, which :func:`mark_hf_models` sets on the Hugging Face models of a
ZeRO-3 module for the engine's lifetime (:func:`unmark_hf_models` removes it). Before, a validation step
whose ``generate()`` met the end-of-sequence token on one rank only broke the next gathers.

Code that runs forwards on one rank only (sampling on rank 0 in a callback) cannot gather: the other ranks
are not there. :meth:`Stage3Join.gathered`, entered by every rank, gathers the whole model first and keeps
it whole until every rank leaves; the Hugging Face mark is lifted meanwhile, so a ``generate()`` there
runs alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from lightning_par.zero.unit import Unit


class Stage3Join:
    """The join protocol of a ZeRO-3 engine (see the module docstring)."""

    group: ProcessGroup
    device: torch.device
    units: list[Unit]
    # on: every all-gather is announced (the strategy sets it for an evaluation loop whose ranks' batch
    # counts differ, and clears it at the loop's end)
    joining: bool = False
    _holding: bool = False  # inside gathered(): every unit stays whole
    _hf_marked: list[nn.Module]  # Hugging Face models marked as sharded (mark_hf_models)
    _codes: torch.Tensor | None = None  # unit index + 1 per unit, on the device (the announcements)

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every rank enters together: each unit is gathered once and stays whole until the exit, where
        it is freed. Inside, a rank may run forwards on its own (sampling on rank 0 only): no gather is
        needed, so no rank waits for another. The whole model is in memory on each rank meanwhile; for
        forwards only (the shards do not change inside)."""
        if self._holding:
            raise RuntimeError("gathered_params() is already active: leave it before entering it again.")
        for unit in self.units:  # whatever this rank holds now, every rank gathers the same units below
            unit.free()
        for unit in self.units:
            unit.wait(self.group)
        self._holding = True
        # no synced generate() inside: a rank generating alone must not wait for the others' forwards
        unmark_hf_models(self._hf_marked)
        try:
            yield
        finally:
            self._holding = False
            mark_hf_models_again(self._hf_marked)
            for unit in self.units:
                unit.free()

    def _announce(self, unit: Unit) -> None:
        """Tell ranks that serve which unit this rank gathers next (only if it will gather)."""
        if self.joining and unit.state == "sharded":
            if self._codes is None:  # made once on the device: a tensor from a list would be a host copy
                self._codes = torch.arange(1, len(self.units) + 1, dtype=torch.int64, device=self.device)
            flag = self._codes[unit.index : unit.index + 1].clone()  # the all-reduce writes into it
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)

    def serve_gathers(self) -> None:
        """Take part in the other ranks' all-gathers until every rank serves (module docstring)."""
        for unit in self.units:
            unit.free()  # a gather below must send this rank's shard, not find the unit whole
        flag = torch.zeros(1, dtype=torch.int64, device=self.device)
        while True:
            flag.zero_()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            index = int(flag.item()) - 1  # the one host read per round (module docstring)
            if index < 0:
                return
            unit = self.units[index]
            unit.wait(self.group)
            unit.free()


# transformers' mark of a module whose parameters are sharded over the ranks (set by its FSDP2 helper)
HF_SHARDED_ATTR = "_is_fsdp_managed_module"


def _is_hf_model(module: nn.Module) -> bool:
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
        for c in type(module).__mro__
    )


def mark_hf_models(module: nn.Module) -> list[nn.Module]:
    """Mark the Hugging Face models inside ``module`` as sharded (module docstring); the ones marked."""
    marked = []
    for m in module.modules():
        if _is_hf_model(m) and not getattr(m, HF_SHARDED_ATTR, False):
            setattr(m, HF_SHARDED_ATTR, True)
            marked.append(m)
    return marked


def unmark_hf_models(marked: list[nn.Module]) -> None:
    for m in marked:
        if HF_SHARDED_ATTR in m.__dict__:
            delattr(m, HF_SHARDED_ATTR)


def mark_hf_models_again(marked: list[nn.Module]) -> None:
    for m in marked:
        setattr(m, HF_SHARDED_ATTR, True)
