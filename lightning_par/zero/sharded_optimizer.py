"""ZeRO stages 1/2: the user's optimizer, rebuilt over this rank's shard of the parameters.

Contract
--------
The parameters of the module are moved into one flat buffer laid out like the gradients (same buckets,
see :class:`~lightning_par.zero.layout.FlatLayout`). Rank ``r`` owns slice ``r`` of every bucket: the
*fragments* of parameters in that slice. The user's optimizer object is kept (LR schedulers, ``lr_monitor``
and ``optimizer.param_groups[i]["lr"]`` keep working, its group dicts too) but its groups' contents and
``state`` are those of a fresh optimizer of the same class and hyper-parameters over the fragments
(:mod:`lightning_par.zero.optimizer_rebuild`, which also guards it), so each rank keeps optimizer state
for 1/N of the elements. This is exact for element-wise optimizers (every update of
element ``i`` depends only on element ``i`` of the parameter, gradient and state), which is why only
those are accepted.

After the step, each bucket is all-gathered so every rank holds the updated full parameters again.
The fp32 master weights are the fragments themselves when the parameters are fp32; a low-precision
model keeps separate fp32 master fragments (see ``master_dtype``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_par.collectives import all_gather_flat
from lightning_par.zero.grad_sync import GradSync
from lightning_par.zero.grad_window import GradWindow
from lightning_par.zero.grad_writes import refuse_written_grads
from lightning_par.zero.layout import FlatLayout, Fragment
from lightning_par.zero.optimizer_rebuild import (
    inherit_param_attrs,
    optimizer_group_params,
    optimizer_of,
    rebuild_optimizer,
    stepped_ids,
    warn_post_hooks,
)
from lightning_par.zero.param_writes import ParamWrites
from lightning_par.zero.writeback import refuse_unequal_writes

# Checkpoint key of fp32 master weights saved beside the optimizer state of low-precision models (the
# engine names it, so the checkpoint code depends on the engine and not the other way round).
MASTER_KEY = "master"


class ShardedOptimizer(GradWindow, ParamWrites):
    """Owns the flat parameter buffer, the fragments and the rebuilt optimizers of one module; which
    gradients they see over a window is :class:`~lightning_par.zero.grad_window.GradWindow`."""

    def __init__(
        self,
        *,
        sync: GradSync,
        optimizers: Sequence[Optimizer],
        param_names: dict[nn.Parameter, str],
        master_dtype: torch.dtype | None = None,
        compute_dtype: torch.dtype | None = None,
        allow_untested_optimizer: bool = False,
        marks_passes: bool = True,
    ) -> None:
        if not sync.shard:
            raise ValueError("ShardedOptimizer needs a sharded GradSync (shard=True).")
        self.sync = sync
        self.optimizers = list(optimizers)
        first = sync.params[0].dtype
        self.compute_dtype = compute_dtype or first
        self.master_dtype = master_dtype or first
        self._group_params = optimizer_group_params(
            self.optimizers, sync.params, param_names, allow_untested=allow_untested_optimizer
        )
        self._names = {id(p): n for p, n in param_names.items()}
        self._group_guards: list[RemovableHandle] = []  # rebuild_optimizer's guards of the optimizers
        self._stepped_in_window: set[int] = set()  # ids of the optimizers that stepped in this window
        self._window_params: set[int] = set()  # ids of the parameters with gradients in this window
        sync.on_relayout(self._relayout)
        sync.on_reduced(self._attach_grads)
        sync.on_pass_start(self._before_pass)
        if marks_passes:  # see ZeroEngine.marks_passes
            sync.on_pass_end(self._mark_window)
            sync.before_accumulate(self._drop_zeroed)
        self._relayout()
        # the compute parameters equal the masters (cast) but for the user's writes since the last
        # refresh; False between an update of the masters and the refresh that follows it
        self._params_current = True
        warn_post_hooks(self.optimizers)
        self._step_hooks = [opt.register_step_pre_hook(self._before_update) for opt in self.optimizers]
        # after the update, not before: Lightning runs the closure (forward, backward, the first
        # backward's relayout) inside optimizer.step()
        self._step_hooks += [opt.register_step_post_hook(self._after_update) for opt in self.optimizers]

    # ------------------------------------------------------------------ layout
    def holds_state(self) -> bool:
        """Whether the rebuilt optimizers hold state over the current fragments that a relayout would
        strand: they stepped, or state was loaded into them. What their constructor made (Adagrad fills
        its accumulators eagerly) does not count: a relayout builds it again over the new fragments."""
        if not hasattr(self, "_masters"):
            return False
        return any(
            _state_ids(opt) != built or (self._stepped and opt.state)
            for opt, built in zip(self.optimizers, self._built_state, strict=True)
        )

    def _relayout(self) -> None:
        sync, layout = self.sync, self.sync.layout
        if self.holds_state():
            raise RuntimeError("The ZeRO layout changed after the optimizer took a step; this is a bug.")
        params = sync.params
        old_layout, old_masters = getattr(self, "_layout", None), getattr(self, "master_flat", None)
        self.fragments = layout.fragments(sync.rank)
        self.master_flat: Tensor | None = None
        # leave_whole_masters() ran (after fit): the parameters are whole fp32 copies the user may change
        self._left_whole = False
        self._whole_views: list[Tensor] | None = None  # the parameters' places while whole_masters() runs
        if self.master_dtype != self.compute_dtype:
            self.master_flat = torch.zeros(layout.shard_numel, dtype=self.master_dtype, device=sync.device)
            if old_layout is not None and old_masters is not None:
                # a new bucket order (after the first backward): the parameters are low-precision copies
                # now, the exact values are the old masters, spread over the ranks
                self._carry_masters(old_layout, old_masters)
            else:
                # at construction the parameters are still fp32: a low-precision run starts from exact
                # fp32 values, not from their rounded copies
                with torch.no_grad():
                    for f in self.fragments:
                        value = params[f.slot].detach().reshape(-1)[f.param_lo : f.param_hi]
                        self.master_flat[f.shard_lo : f.shard_lo + f.numel].copy_(value)
        self._layout = layout
        # per bucket (start, end, lo, hi, at): the bucket in the flat layout, this rank's slice [lo, hi) of
        # it, and where that slice's masters start in master_flat (this rank's shard of every bucket, in
        # bucket order: FlatLayout.fragments)
        self._own: list[tuple[int, int, int, int, int]] = []
        at = 0
        for bucket in layout.buckets:
            lo, hi = bucket.shard_range(sync.rank, sync.world)
            self._own.append((bucket.start, bucket.end, lo, hi, at))
            at += hi - lo
        self._grad_copy: Tensor | None = None  # the gradient shard cast to the masters' dtype, this step
        with torch.no_grad():
            self.param_flat = torch.zeros(layout.numel, dtype=self.compute_dtype, device=sync.device)
            self._views: list[Tensor] = []
            for p, s in zip(params, layout.slots, strict=True):
                view = self.param_flat[s.offset : s.end].view(s.shape)
                view.copy_(p.detach())
                p.data = view  # the Parameter object (and autograd hooks on it) stays the same
                self._views.append(view)
        masters: dict[int, list[Tensor]] = {}
        self._master_slots: list[tuple[Tensor, Tensor, int]] = []
        for f in self.fragments:
            slot = layout.slots[f.slot]
            compute = self.param_flat[slot.offset + f.param_lo : slot.offset + f.param_hi]
            if self.master_flat is not None:
                master = self.master_flat[f.shard_lo : f.shard_lo + f.numel]
            else:
                master = compute
            inherit_param_attrs(master, params[f.slot])
            masters.setdefault(id(params[f.slot]), []).append(master)
            self._master_slots.append((master, compute, f.slot))
        self._masters = masters
        # each fragment's view of the gradient shard, which lives as long as the layout: made here, not
        # sliced every step (host time a GPU waits for); unused when the shard's dtype is not the masters'
        grad_shard = sync.grad_shard
        assert grad_shard is not None
        self._grad_views = [grad_shard[f.shard_lo : f.shard_lo + f.numel] for f in self.fragments]
        for handle in self._group_guards:  # a new layout: the groups are rebuilt again
            handle.remove()
        self._group_guards = [
            hook
            for opt, groups in zip(self.optimizers, self._group_params, strict=True)
            for hook in rebuild_optimizer(opt, groups, masters, names=self._names)
        ]
        self._built_state = [_state_ids(opt) for opt in self.optimizers]
        self._stepped = False
        # the optimizer (its id) each fragment's parameter belongs to, for open_window
        owner_of = optimizer_of(self.optimizers, self._group_params)
        self._owners = [owner_of.get(id(params[f.slot]), 0) for f in self.fragments]
        self._slot_owners = [owner_of.get(id(p), -1) for p in params]
        self._seen_everywhere = {id(opt) for opt in self.optimizers}
        for rank in range(sync.world):
            self._seen_everywhere &= {owner_of.get(id(params[f.slot]), -1) for f in layout.fragments(rank)}

    @torch.no_grad()
    def _carry_masters(self, old: FlatLayout, old_masters: Tensor) -> None:
        """Fill this rank's new master fragments from the old layout's masters, one old bucket at a time
        (one all-gather each: no rank ever holds more than a bucket of fp32 values beyond its shard)."""
        assert self.master_flat is not None
        sync, layout = self.sync, self.sync.layout
        wanted: dict[str, list[Fragment]] = {}
        for f in self.fragments:
            wanted.setdefault(layout.slots[f.slot].name, []).append(f)
        offset = 0
        for bucket in old.buckets:
            size = bucket.numel // sync.world
            full = torch.empty(bucket.numel, dtype=old_masters.dtype, device=old_masters.device)
            all_gather_flat(full, old_masters[offset : offset + size].contiguous(), group=sync.group)
            offset += size
            for i in bucket.slots:
                slot = old.slots[i]
                start = slot.offset - bucket.start
                for f in wanted.get(slot.name, []):
                    piece = full[start + f.param_lo : start + f.param_hi]
                    self.master_flat[f.shard_lo : f.shard_lo + f.numel].copy_(piece)

    # ------------------------------------------------------------------ step
    def _before_update(self, optimizer: Optimizer, args: Any, kwargs: Any) -> Any:
        """torch's step pre-hook of every rebuilt optimizer: :meth:`_ready_for_update` now, or, for a step
        given a closure (Lightning's automatic optimization runs ``training_step``, the backward and
        ``on_before_optimizer_step`` in it, inside ``step``), right after the closure: a write made there
        (a clamp, ``p.data = ...``) was lost or undid the update, 0.2 off ``"ddp"`` in a probe."""
        # torch hands the hook step's positional arguments with the optimizer first
        closure = kwargs["closure"] if "closure" in kwargs else args[1] if len(args) > 1 else None
        if closure is None:
            self._ready_for_update()
            return None

        def then_ready() -> Any:
            result = closure()
            self._ready_for_update()
            return result

        if "closure" in kwargs:
            return args, {**kwargs, "closure": then_ready}
        return (args[0], then_ready, *args[2:]), kwargs

    def _ready_for_update(self) -> None:
        """Gradients written into ``param.grad`` are refused (:mod:`lightning_par.zero.grad_writes`); the
        masters take the user's writes to the parameters first."""
        refuse_written_grads(self.sync.params, names=self._names, engine_buffer=self.sync.buffer)
        self.absorb_param_writes()
        self._params_current = False

    def _after_update(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """torch's step post-hook: the state now follows the current fragments."""
        self._stepped = True

    @torch.no_grad()
    def after_step(self, *, open_window: bool = True, optimizer: Optimizer | None = None) -> None:
        """Copy masters into the compute parameters, all-gather every bucket, and (``open_window``)
        open a new window; without it the window stays until :meth:`open_window`. ``optimizer``: the one
        that stepped (or skipped its step: an fp16 overflow), whose gradients the window drops; None for
        all of them."""
        self._stepped_in_window |= stepped_ids(optimizer, self.optimizers)
        self.absorb_param_writes()  # a skipped step (fp16 overflow) did not run the pre-hook
        self.refresh_params()
        self._window_done = True
        if open_window:
            self.open_window()

    @torch.no_grad()
    def refresh_params(self) -> None:
        """Compute parameters := masters (cast), on every rank (one all-gather per bucket). This rank's
        masters are its shard of every bucket, in bucket order (:meth:`FlatLayout.fragments`), so one
        cast copy per bucket refreshes them (the padding at a bucket's end is zero on both sides)."""
        if self.master_flat is not None:
            for _, _, lo, hi, at in self._own:
                self.param_flat[lo:hi].copy_(self.master_flat[at : at + hi - lo])
        works = []
        for start, end, lo, hi, _ in self._own:
            full = self.param_flat[start:end]
            # in place: this rank's input is its own slice of the output (NCCL's in-place all-gather;
            # Gloo stages through its own buffer), so no per-step copy of the shard is made
            work = all_gather_flat(full, self.param_flat[lo:hi], group=self.sync.group, async_op=True)
            works.append(work)
        for work in works:
            assert work is not None
            work.wait()
        self._params_current = True

    @contextmanager
    def whole_masters(self) -> Iterator[None]:
        """Inside, the trainable parameters are whole copies of the fp32 masters, not the compute copy
        (``gathered_params(writeback=True)``): an EMA's small steps or a clamp are made in fp32, and at a
        normal exit each rank's slice goes back into its masters, after the ranks agreed they wrote the
        same (:mod:`lightning_par.zero.writeback`). A no-op where the parameters are the masters. One
        all-gather per bucket in, one refresh of the compute copy out; the whole model in fp32 inside."""
        if self.master_flat is None or self._left_whole:  # after fit: the parameters are the fp32 values
            yield
            return
        sync, masters = self.sync, self.master_flat
        # entered while the masters are ahead of the parameters (between an update and its refresh), the
        # flag stays cleared after the refresh below
        current = self._params_current
        stored = self._whole_masters_in_params()
        try:
            yield
            self.take_back_replaced()  # torch's prune.remove inside: into the whole copy
            refuse_unequal_writes([("the trainable parameters", stored)], group=sync.group)
            with torch.no_grad():
                for _, _, lo, hi, at in self._own:
                    masters[at : at + hi - lo].copy_(stored[lo:hi])
        finally:
            self._whole_views = None
            for p, view in zip(sync.params, self._views, strict=True):
                p.data = view
            self.refresh_params()
            self._params_current = current

    @torch.no_grad()
    def _whole_masters_in_params(self) -> Tensor:
        """The trainable parameters become views of one whole copy of the masters (returned), gathered
        over the dp group (one all-gather per bucket), after this rank's writes reached its masters."""
        sync, masters = self.sync, self.master_flat
        assert masters is not None
        self.absorb_param_writes()
        stored = torch.empty(sync.layout.numel, dtype=masters.dtype, device=masters.device)
        for start, end, lo, hi, at in self._own:
            all_gather_flat(stored[start:end], masters[at : at + hi - lo], group=sync.group)
        self._whole_views = [stored[s.offset : s.end].view(s.shape) for s in sync.layout.slots]
        for p, view in zip(sync.params, self._whole_views, strict=True):
            p.data = view
        return stored

    def leave_whole_masters(self) -> None:
        """After training: the trainable parameters are left as whole copies of the fp32 masters in
        storage of their own, as they were before setup, so the module the user keeps computes and saves
        at master precision (Lightning's mixed precision keeps parameters in fp32 too); before, they
        stayed the 16-bit compute copies, and ``torch.save(model.state_dict())`` after ``fit`` wrote
        rounded weights. A no-op where the parameters are the masters. The flat buffers stay with the
        engine, but from then on the parameters are what counts: exports and checkpoints read them (no
        separate master records, :attr:`master_key` is None), so edits made after ``fit`` (in place, a
        ``load_state_dict``) are saved, as under DDP, and ``whole_masters()`` changes nothing."""
        if self.master_flat is not None and not self._left_whole:  # once (a second teardown kept edits)
            self._whole_masters_in_params()
            self._left_whole = True

    # ------------------------------------------------------------------ introspection

    def group_params(self, index: int) -> list[list[nn.Parameter]]:
        """The module parameters of each param group of optimizer ``index``, as the user gave them."""
        return self._group_params[index]

    @property
    def master_key(self) -> str | None:
        """Checkpoint key of separate fp32 master values (None when the parameters are the masters, or
        hold their values whole since :meth:`leave_whole_masters`)."""
        return MASTER_KEY if self.master_flat is not None and not self._left_whole else None

    def fragment_table(self) -> list[tuple[str, int, int, Tensor]]:
        """``(param name, lo, hi, master fragment)`` for every fragment this rank owns (the user's writes
        to the parameters absorbed first)."""
        self.absorb_param_writes()
        names = self.sync.names
        return [
            (names[f.slot], f.param_lo, f.param_hi, master)
            for f, (master, _, _) in zip(self.fragments, self._master_slots, strict=True)
        ]

    def stepped_tensors(self) -> list[Tensor]:
        """The tensors the rebuilt optimizers step (this rank's master fragments), as they are."""
        return [master for master, _, _ in getattr(self, "_master_slots", [])]

    def remove(self) -> None:
        """Detach the optimizers' step pre-hooks (the rebuilt groups stay)."""
        for handle in self._step_hooks + self._group_guards:
            handle.remove()
        self._step_hooks, self._group_guards = [], []

    def grad_copy_bytes(self) -> int:
        """The masters' dtype copy of the gradient shard (a reduction dtype other than theirs), held until
        the next step attaches a new one."""
        copy = self._grad_copy
        return copy.numel() * copy.element_size() if copy is not None else 0

    def optimizer_state_bytes(self) -> int:
        total = 0
        for opt in self.optimizers:
            for state in opt.state.values():
                total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, Tensor))
        if self.master_flat is not None:
            total += self.master_flat.numel() * self.master_flat.element_size()
        return total


def _state_ids(opt: Optimizer) -> dict[int, dict[str, int]]:
    """Which objects ``opt``'s state holds: a load replaces them, a step updates them in place."""
    return {id(p): {k: id(v) for k, v in state.items()} for p, state in opt.state.items()}
