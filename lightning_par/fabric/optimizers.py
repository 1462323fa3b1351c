"""The optimizer side of lightning_par's Fabric strategy: ``fabric.setup_optimizers`` hands the optimizers
over one call each; they are checked at once (no module set up, meta parameters, the layout's optimizer
rules, pointed at what tensor or pipeline parallelism replaced) and sharded together, over one layout of
every optimizer's parameters, at their first use (the module's first forward, a pipeline call, a
checkpoint, a read of ``strategy.optimizers``).
"""

from __future__ import annotations

from lightning.fabric.utilities.optimizer import _optimizers_to_device
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_par.build import set_precision_groups
from lightning_par.device_checks import check_optimizer_kernels
from lightning_par.fabric.mixin import FabricMixin
from lightning_par.fabric.setup import Replaced, complete_stage_groups, follow_replaced
from lightning_par.optimizer_checks import check_layout_optimizers
from lightning_par.owned_hooks import for_owner
from lightning_par.peft_checks import refuse_grad_reading_adapters


class FabricOptimizers(FabricMixin):
    """Mixin of :class:`lightning_par.fabric.HybridParallelStrategy`, before Fabric's ``Strategy`` in its
    bases so ``setup_optimizer`` overrides Fabric's (see the module docstring)."""

    zero_stage: int
    allow_untested_optimizer: bool
    _optimizers: list[Optimizer]
    _pending: list[Optimizer]  # handed over by setup_optimizer, sharded at their first use
    _pending_hook: RemovableHandle | None  # the module's pre-hook that shards them at its first forward
    _before_optimizers: RemovableHandle | None  # refuse_forward_before_optimizers
    _replaced: Replaced  # parameters tensor / pipeline parallelism replaced, by their old identity

    @property
    def optimizers(self) -> list[Optimizer]:
        """The set-up optimizers, rebuilt over this rank's shards (those handed over by
        ``setup_optimizers`` are sharded now if they were not yet)."""
        self.flush_optimizers()
        return self._optimizers

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """``fabric.setup_optimizers(opt_a, opt_b)`` calls this once per optimizer, so each is only
        recorded here: ZeRO 1-3 shard all of them together (one layout over every optimizer's parameters)
        at their first use, :meth:`flush_optimizers` (before, the second call was refused)."""
        self._check_optimizers([optimizer])
        self._pending.append(optimizer)
        if self._before_optimizers is not None:  # the first forward sets them up: nothing to refuse
            self._before_optimizers.remove()
            self._before_optimizers = None
        if self._pending_hook is None and self.module is not None:
            # eager inside a compiled model (Fabric compiles the set-up module again): traced, the
            # sharding of the optimizers switched AdamW to capturable=True, whose step fails on a CPU
            flush = for_owner(self.module, lambda *_: self.flush_optimizers(), eager=True)
            self._pending_hook = self.module.register_forward_pre_hook(flush, prepend=True)
        return optimizer

    def flush_optimizers(self) -> None:
        """Set up the optimizers ``setup_optimizers`` handed over, if any (every rank, at the same point
        of the loop: the first forward, pipeline call, checkpoint or read of :attr:`optimizers`)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        if self._pending_hook is not None:
            self._pending_hook.remove()
            self._pending_hook = None
        self._setup_optimizers(pending, checked=True)

    def _check_optimizers(self, optimizers: list[Optimizer]) -> None:
        """What can be refused before the optimizers are sharded (at once, also for those
        ``setup_optimizers`` hands over one by one): no module set up, optimizers set up already, meta
        parameters; then, pointed at what tensor or pipeline parallelism replaced (under a pipeline, their
        groups completed with the other stages' placeholders), the layout's optimizer rules."""
        if self.engine is None:
            raise RuntimeError("Set up the module first: fabric.setup(model, optimizer) or setup_module().")
        if self.module is not None:  # training: the optimizers come
            refuse_grad_reading_adapters(self.module, zero_stage=self.zero_stage)
        if self._optimizers:
            raise ValueError(
                "The optimizers of this module are already set up (and sharded at their first use): pass"
                " all of them in one fabric.setup(model, *optimizers) or setup_optimizers(*optimizers)"
                " call, or several setup_optimizers calls before the model's first forward."
            )
        if any(p.is_meta for opt in optimizers for g in opt.param_groups for p in g["params"]):
            raise ValueError(
                "An optimizer holds meta-device parameters: with fabric.init_module(empty_init=True) the"
                " ZeRO-3 engine replaces them by their materialised shards, so create the optimizer after"
                " model = fabric.setup_module(model), from model.parameters(), then call"
                " fabric.setup_optimizers(optimizer)."
            )
        names = {id(p): n for n, p in self.module.named_parameters()} if self.module is not None else None
        follow_replaced(self._replaced, optimizers)
        # the parameters to be trained, named after what tensor parallelism put in the module
        held = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
        self.precision.check_trainable(((names or {}).get(id(p), "<not in the module>"), p) for p in held)
        if self._pipeline is not None:  # collective over the stages: every rank, one optimizer at a time
            assert self.module is not None
            complete_stage_groups(optimizers, self.module, pp_group=self.mesh.pp_group)
        check_layout_optimizers(
            optimizers,
            pipeline=self._pipeline is not None,
            allow_untested=self.allow_untested_optimizer,
            names=names,
        )
        check_optimizer_kernels(optimizers, device=self.root_device)

    def _setup_optimizers(self, optimizers: list[Optimizer], *, checked: bool = False) -> None:
        """Shard ``optimizers`` (``checked``: :meth:`_check_optimizers` passed them already, and pointed
        them at the placeholders of other stages, which it would now take for meta parameters)."""
        if not checked:
            self._check_optimizers(optimizers)
        self._replaced = {}
        assert self.engine is not None  # _check_optimizers
        self.engine.shard_optimizers(optimizers)
        if self._before_optimizers is not None:
            self._before_optimizers.remove()
            self._before_optimizers = None
        _optimizers_to_device(optimizers, self.root_device)
        self._optimizers = list(optimizers)
        set_precision_groups(self.precision, self.mesh, zero_stage=self.zero_stage)
