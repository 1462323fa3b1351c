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
Every all-gather becomes a *round*, and the ranks' rounds match one to one, in order:

* A rank about to gather unit ``u`` (a prefetch, or a use of a sharded unit) says so: an all-gather over
  the dp group of ``index(u) + 1``; a rank whose batches are over (:meth:`Stage3Join.serve_gathers`)
  says ``0``. Every rank reads the table (one host read per round).
* Each unit someone asked for is then all-gathered by every rank, in index order: the rank that asked
  gathers it for use (asynchronously, as before), the others take part into scratch buffers
  (:meth:`~lightning_par.zero.unit.Unit.serve`) and leave their own copy as it is.
* A round where every rank says ``0`` ends the serving: all leave.

So the ranks need not run the same forwards at all: the one still evaluating, ranks whose forwards
differ in number (a ``generate()`` that ends sooner on one of them), a rank that serves. Every rank
calls :meth:`serve_gathers` at the end of each of its dataloaders, so a dataloader's gathers never mix
with the next one's. Evaluation changes no parameter, so which forward an all-gather belongs to does not
matter, only that every rank takes part in it. Nothing else may communicate between the gathers (a
per-step ``all_gather`` in the user's step would meet a round), so while joining, the Hugging Face
models are not marked as sharded (below): their ``generate()`` would all-reduce every token.

Within one step the ranks must also run equally many forwards. Hugging Face's ``generate()`` stops when
its sequences end, sooner on one rank than another, unless it knows the model is sharded: then
(``synced_gpus``) every rank keeps running forwards until all are done. It knows FSDP's models by the
attribute :data:`HF_SHARDED_ATTR`, which :func:`mark_hf_models` sets on the Hugging Face models of a
ZeRO-3 module for the engine's lifetime (:func:`unmark_hf_models` removes it; lifted while joining, where
rounds match the forwards instead). Before, a validation step whose ``generate()`` met the
end-of-sequence token on one rank only broke the next gathers.

Code that runs forwards on one rank only (sampling on rank 0 in a callback) cannot gather: the other ranks
are not there. :meth:`Stage3Join.gathered`, entered by every rank, gathers the whole model first and keeps
it whole until every rank leaves; the Hugging Face mark is lifted meanwhile, so a ``generate()`` there
runs alone.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from lightning_par.grad_norm import by_device_dtype
from lightning_par.zero.unit import Unit
from lightning_par.zero.writeback import refuse_unequal_writes


class Stage3Join:
    """The join protocol of a ZeRO-3 engine (see the module docstring)."""

    group: ProcessGroup
    device: torch.device
    module: nn.Module
    rank: int
    world: int
    units: list[Unit]
    _joining: bool = False  # see the joining property
    _holding: bool = False  # inside gathered(): every unit stays whole
    _whole: bool = False  # the model is whole since unshard_all() (after fit; stage3_state)
    _hf_marked: list[nn.Module]  # Hugging Face models marked as sharded (mark_hf_models)
    _codes: torch.Tensor | None = None  # 0, 1, ..., len(units) on the device (what a round says)

    @contextmanager
    def gathered(self, *, writeback: bool = False) -> Iterator[None]:
        """Every rank enters together: each unit is gathered once and stays whole until the exit, where
        it is freed. Inside, a rank may run forwards on its own (sampling on rank 0 only): no gather is
        needed, so no rank waits for another. The whole model is in memory on each rank meanwhile.

        Without ``writeback`` the parameters are the compute copies and writes to them are dropped at
        the exit. With it they are gathered in their stored precision (fp32 masters and frozen shards:
        the whole model in fp32 meanwhile) and in-place writes reach the shards at a normal exit; every
        rank must write the same (:mod:`lightning_par.zero.writeback` checks)."""
        if self._holding:
            raise RuntimeError("gathered_params() is already active: leave it before entering it again.")
        if self._whole:  # after fit: whole already; writes stay in the model, which exports read then
            yield
            return
        for unit in self.units:  # a forward's writes to a unit gathered now (inside a step)
            unit.absorb_writes(self.rank, self.world)
        # units held now (inside a step: the root until its gradients exist) are gathered again at a normal
        # exit: the step's graph holds views of their storage (MoCo's momentum update between the query
        # forward and the backward; before, the backward failed: "setStorage: ... storage of size 0").
        # Those any rank holds, agreed (a gather is collective; a data-dependent forward may differ).
        flags = [int(unit.state != "sharded") for unit in self.units]
        holding = torch.tensor(flags, dtype=torch.int32, device=self.device)
        dist.all_reduce(holding, op=dist.ReduceOp.MAX, group=self.group)
        in_step = [unit for unit, h in zip(self.units, holding.tolist(), strict=True) if h]  # a host read
        for unit in self.units:  # whatever this rank holds now, every rank gathers the same units below
            unit.free()
        for unit in self.units:
            if writeback:
                unit.gather_stored(self.group)
            else:
                unit.wait(self.group)
        self._holding = True
        # no synced generate() inside: a rank generating alone must not wait for the others' forwards
        unmark_hf_models(self._hf_marked)
        params = list(self.module.parameters())
        before = {id(p) for p in params}
        held = None if writeback else _fingerprint(params)
        try:
            yield
            if writeback:
                self._keep_writes()
            elif before - {id(p) for p in self.module.parameters()}:
                # (a module added inside, as an EMA copy assigned to the model, loses nothing)
                raise RuntimeError(
                    "The model's parameters changed inside gathered_params() (modules replaced or removed,"
                    " as PEFT's merge_and_unload() does), whose writes are dropped at the exit without"
                    " writeback: the merged weights are gone while the adapters are too. Enter"
                    " gathered_params(writeback=True) (every rank) to keep what is written inside."
                )
            elif held is not None and not _same(held, _fingerprint(params)):
                # the parameters there at the entry (a module added inside, an EMA copy, is its own); a
                # local verdict (a write on one rank only is one too): a warning, so no rank waits
                warnings.warn(
                    "Parameters were written inside gathered_params() without writeback=True (a clamp,"
                    " an EMA or a re-initialisation of the weights): those writes are dropped at its exit,"
                    " the shards keep the values from before. Enter gathered_params(writeback=True) on every"
                    " rank to keep them.",
                    stacklevel=3,
                )
        finally:
            self._holding = False
            if not self._joining:  # while joining the mark stays lifted (joining's setter)
                mark_hf_models_again(self._hf_marked)
            for unit in self.units:
                unit.free()
        for unit in in_step:  # every rank held the same units (the same step); the values written inside
            unit.wait(self.group)

    def _keep_writes(self) -> None:
        """Inside ``gathered(writeback=True)``, at the exit: refuse writes that differ between the ranks,
        then put each rank's slice back into its shards."""
        with torch.no_grad():
            for unit in self.units:
                unit.take_back_stored()
        stored = [(unit.name or "<root>", part.stored) for unit in self.units for part in unit.parts]
        refuse_unequal_writes([(n, b) for n, b in stored if b is not None], group=self.group)
        with torch.no_grad():
            for unit in self.units:
                unit.keep_stored(self.group)

    @property
    def joining(self) -> bool:
        """On: every all-gather is a join round (the strategy sets it for an evaluation loop whose ranks'
        batch counts differ, and clears it at the loop's end)."""
        return self._joining

    @joining.setter
    def joining(self, on: bool) -> None:
        if on != self._joining:
            self._joining = on
            if on:
                unmark_hf_models(self._hf_marked)
            else:
                mark_hf_models_again(self._hf_marked)

    def _announce(self, unit: Unit) -> None:
        """Before this rank gathers ``unit``: its join round (a no-op unless joining and sharded)."""
        if self._joining and unit.state == "sharded":
            self._round(unit.index + 1)

    def _round(self, want: int) -> bool:
        """One join round (module docstring); ``want``: the unit index + 1 this rank gathers, or 0. True
        if some rank wanted a unit."""
        if self._codes is None:  # made once on the device: a tensor from a list would be a host copy
            self._codes = torch.arange(len(self.units) + 1, dtype=torch.int64, device=self.device)
        mine = self._codes[want : want + 1].clone()
        table = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(table, mine, group=self.group)
        wanted = sorted({int(code) for code in torch.cat(table).tolist() if code})  # the host read
        for code in wanted:
            unit = self.units[code - 1]
            if code == want:
                unit.gather(self.group)  # for use: the caller waits for it as before
            else:
                unit.serve(self.group)
        return bool(wanted)

    def serve_gathers(self) -> None:
        """This rank's batches are over: take part in the others' gathers until every rank is done."""
        for unit in self.units:
            unit.free()  # nothing more to compute here
        busy = True
        while busy:  # until a round in which no rank wants a unit
            busy = self._round(0)


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


def _fingerprint(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """Per parameter (gathered), its 2-norm in at least fp32, one fused kernel per dtype and device: what
    an in-place write inside :meth:`Stage3Join.gathered` changes (a clamp, a renorm, an EMA step, a
    re-initialisation); the engine's own read, which no watch of the user's reads sees."""
    groups = by_device_dtype(p for p in params if not p.is_meta)
    with torch._C.DisableTorchFunction(), torch.no_grad():
        return [
            torch.stack(torch._foreach_norm(ts, 2.0, dtype=torch.promote_types(dtype, torch.float32)))
            for (_, dtype), ts in groups.items()
        ]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """The fingerprints agree (host reads: a verdict for the user's code outside any step); NaN norms
    (a model already NaN) tell nothing and pass."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape or not (torch.equal(x, y) or bool(torch.isnan(x).any())):
            return False
    return True
