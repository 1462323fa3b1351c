"""The step side of lightning_par's Fabric strategy: ``fabric.backward``, ``fabric.clip_gradients`` and
``optimizer.step()`` mapped onto the engine and ``ParallelPrecision``; ``strategy.join()`` for evaluation
loops whose ranks run different numbers of batches at ZeRO-3.

One fp16 rule holds at every stage: each optimizer's gradients are unscaled once per backward, and the
overflow verdict is agreed over every rank (``precision.step_groups``), at the first of ``clip_gradients`` or
``optimizer.step()``; a skipped step is skipped on every rank, and the loss scale moves the same way
everywhere. The clip norm is the global one: the sum over the groups that hold disjoint gradient
pieces (``precision.grad_norm_groups``: dp from stage 1 on, tp under tensor parallelism).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_par.averaging import AvgFn, MultiAvgFn, WeightAverages, averaging_rule
from lightning_par.checkpoint.tp_reshard import tp_info
from lightning_par.fabric.mixin import FabricMixin
from lightning_par.fabric.pipeline import refuse_backward
from lightning_par.grad_reads import GradReads
from lightning_par.layout_norms import layout_grad_norms
from lightning_par.tensor_parallel.replicas import mismatch_message, replicated_grad_mismatch
from lightning_par.zero.stage3 import Stage3Engine
from lightning_par.zero.stage3_join import Stage3Join


class FabricSteps(FabricMixin):
    """Mixin of :class:`lightning_par.fabric.HybridParallelStrategy`, first in its bases so these methods
    override Fabric's ``Strategy`` ones (see the module docstring)."""

    # called first in every optimizer step: e.g. FlashSnapshots' fence, so a snapshot copy still reading
    # the weights finishes before they change (registered and removed by their owners)
    before_optimizer_step: list[Callable[[], None]]
    _found_inf: dict[int, bool]  # this window's fp16 verdict per optimizer, once its gradients are unscaled
    _grad_reads: GradReads | None = None  # the first optimizer step's param.grad watch (grad_reads.py)

    def open_window(self) -> None:
        """A backward (or a pipeline step) begins a new gradient window once an optimizer has stepped:
        the last window's gradients are dropped only now, so every optimizer stepped after one backward
        (a model split over two optimizers) finds its gradients (before, the first step dropped them)."""
        if self.engine is not None:
            self.engine.open_window()

    _check_tp_replicas = False  # the first optimizer step compares the tp replicas' gradients (stage 0)

    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        if self._pipeline is not None:
            refuse_backward()
        self.open_window()
        if self.engine is not None:  # its reductions end with this pass, past reentrant checkpoints'
            self.engine.watch_backward(tensor)
        if self._grad_reads is not None:
            self._grad_reads.arm()
        scaler = self.precision.scaler
        if scaler is not None:
            tensor = scaler.scale_loss(tensor)
        self._found_inf.clear()  # new gradients: the next clip or step unscales them
        tensor.backward(*args, **kwargs)

    def _unscaled(self, optimizer: Optimizer) -> bool:
        """fp16: unscale ``optimizer``'s gradients once per window and agree on overflow over every rank;
        True if its step must be skipped. Per optimizer, as torch's GradScaler: two optimizers clipped
        after one backward each unscale their own gradients (before, the second one's verdict was the
        first's, and it clipped its gradients still scaled)."""
        scaler = self.precision.scaler
        if scaler is None:
            return False
        key = id(optimizer)
        if key not in self._found_inf:
            grads = [p.grad for p in self.precision.main_params(optimizer) if p.grad is not None]
            self._found_inf[key] = scaler.unscale_and_check(
                grads, groups=self.precision.step_groups, device=self.root_device
            )
        return self._found_inf[key]

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the global norm over every rank's shard; returns that norm (on the device)."""
        if self._unscaled(optimizer):
            # the step will be skipped
            return torch.full((), float("inf"), dtype=torch.float32, device=self.root_device)
        # the plugin's clip: the global norm, tp-replicated parameters counted once (as under the Trainer)
        self.precision.clip_grad_by_norm(optimizer, max_norm, norm_type=float(norm_type))
        norm = self.precision.last_grad_norm
        assert norm is not None
        if error_if_nonfinite and not bool(torch.isfinite(norm)):  # asked for: one host read
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} of the gradients is non-finite; pass"
                " error_if_nonfinite=False to clip anyway."
            )
        return norm

    def grad_norm(
        self, module: nn.Module | None = None, norm_type: float | str = 2.0, group_separator: str = "/"
    ) -> dict[str, Tensor | float]:
        """Lightning's ``grad_norm(module, norm_type)`` for this layout, between ``fabric.backward`` and
        ``optimizer.step()``: each parameter's gradient norm under Lightning's keys, for the gradients the
        optimizers are about to apply, equal on every rank (:mod:`lightning_par.layout_norms`: every rank
        must call it). Under ``"16-mixed"`` the optimizers' gradients are unscaled first (once per
        window, as ``fabric.clip_gradients`` does). ``module``: the set-up model (default) or one of its
        submodules, Fabric's wrapper or the module itself; names are relative to it."""
        root = self.module
        if root is None:
            raise RuntimeError("grad_norm() needs a model set up: call fabric.setup(model, ...) first.")
        target = getattr(module, "_forward_module", module)  # Fabric's wrapper: the module inside
        for optimizer in self.optimizers:
            self._unscaled(optimizer)
        return layout_grad_norms(
            root,
            target,
            engine=self.engine,
            mesh=self.mesh,
            device=self.root_device,
            norm_type=norm_type,
            group_separator=group_separator,
        )

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """Clip every gradient element to ``[-clip_val, clip_val]`` after this step's fp16 unscale (the
        same once-per-step verdict as the norm clip; nothing to clip on a step that will be skipped)."""
        if self._unscaled(optimizer):
            return
        params = [p for p in self.precision.main_params(optimizer) if p.grad is not None]
        torch.nn.utils.clip_grad_value_(params, clip_value=clip_val)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        # optimizer.step(closure): the closure's forward and backward first, then the step's work as
        # without one (before, the hooks, unscaling and checks below ran ahead of the backward: at ZeRO
        # 1/2 in bf16-mixed a loop stepping with a closure trained 0.22 off Fabric's "ddp", silently)
        closure = kwargs.pop("closure", None)
        loss = closure() if closure is not None else None
        if self._grad_reads is not None:  # the first step: a refused param.grad read is raised here
            reads, self._grad_reads = self._grad_reads, None
            reads.end()
        for hook in self.before_optimizer_step:
            hook()
        if self._check_tp_replicas and not self._unscaled(optimizer):
            self._verify_tp_replicas()
        output = None
        scaler = self.precision.scaler
        if self._unscaled(optimizer):
            assert scaler is not None
            scaler.update(True)  # skipped on every rank (the verdict is agreed)
            optimizer.zero_grad(set_to_none=True)
            if self.engine is not None:  # a stateful compressor drops the non-finite gradient it took
                self.engine.step_skipped()
        else:
            output = optimizer.step(**kwargs)
            if scaler is not None:
                scaler.update(False)
        if self.engine is not None:  # the gradients stay for another optimizer until the next backward
            self.engine.after_step(open_window=False, optimizer=optimizer)
        if isinstance(self.engine, Stage3Engine):  # until the next forward, its placeholders are refused
            self.engine.refuse_reads_between_steps(
                "between optimizer.step() and the model's next forward (a merge of adapters, an EMA"
                " update or a weight read in the loop)"
            )
        return output if closure is None else loss

    @contextmanager
    def join(self) -> Iterator[None]:
        """An evaluation loop whose ranks may run different numbers of batches, at ZeRO-3: every rank
        enters, runs its own batches (forwards only, no backward), and on leaving takes part in the
        other ranks' parameter gathers until all are done (:mod:`lightning_par.zero.stage3_join`). At
        other stages, or with one dp rank, nothing communicates in evaluation and this does nothing.

        ``with fabric.strategy.join(), torch.no_grad(): for batch in my_batches: model(batch)``"""
        engine = self.engine
        if not isinstance(engine, Stage3Join) or dist.get_world_size(engine.group) == 1:
            yield
            return
        if engine.joining:
            raise RuntimeError("strategy.join() is already active: leave it before entering it again.")
        engine.joining = True
        try:
            yield
            engine.serve_gathers()
        finally:
            engine.joining = False

    def gathered_params(self, *, writeback: bool = False) -> AbstractContextManager[None]:
        """The Trainer strategy's ``gathered_params`` for Fabric loops (every rank enters): at ZeRO-3 the
        model is whole inside, so one rank may sample alone (``if fabric.global_rank == 0:
        sample(model)``); ``writeback=True`` keeps in-place writes made inside (an EMA teacher, a clamp),
        made in the fp32 masters at ZeRO 1-3 and refused if the ranks' writes differ; a ``FlashSnapshots``
        copy still reading the weights finishes first."""
        if writeback:
            self._before_weight_writes()
        engine = self.engine
        return engine.gathered(writeback=writeback) if engine is not None else nullcontext()

    def weight_averages(
        self,
        *,
        decay: float | None = None,
        avg_fn: AvgFn | None = None,
        multi_avg_fn: MultiAvgFn | None = None,
        use_buffers: bool = True,
    ) -> WeightAverages:
        """An average of the set-up model's weights kept as this strategy keeps them (each rank its fp32
        master fragments at ZeRO 1-3, its slices and stage under TP / PP: see
        :mod:`lightning_par.averaging`): an EMA with ``decay``, or torch's ``avg_fn(average, current,
        n_averaged)`` or its in-place list form ``multi_avg_fn``, else the equal-weight mean (SWA). In
        the loop, on every rank: ``averages.update()`` after ``optimizer.step()``, ``with
        averages.swapped():`` to evaluate on the averaged weights, ``averages.copy_to_targets()`` to keep
        them. Call after ``fabric.setup(model, optimizer)``."""
        engine = self.engine
        if engine is None:
            raise RuntimeError("weight_averages(): call it after fabric.setup(model, optimizer).")
        rule = averaging_rule(decay=decay, avg_fn=avg_fn, multi_avg_fn=multi_avg_fn)
        return WeightAverages(
            engine.module,
            engine,
            group=self.mesh.dp_group,
            rule=rule,
            use_buffers=use_buffers,
            before_write=self._before_weight_writes,  # FlashSnapshots' copy in flight finishes first
        )

    def _verify_tp_replicas(self) -> None:
        """Once, before the first optimizer step with gradients: the tensor-parallel replicas' gradients
        agree (:mod:`lightning_par.tensor_parallel.replicas`); raised before the step changes anything."""
        module = self.module
        assert module is not None
        if not any(p.grad is not None for p in module.parameters()):
            return
        self._check_tp_replicas = False
        mesh = self.mesh
        mismatch = replicated_grad_mismatch(
            module,
            sharded=tp_info(module, rank=mesh.tp_rank, size=mesh.tp_size)["dims"],
            group=mesh.tp_group,
            device=self.root_device,
        )
        if mismatch:
            raise RuntimeError(mismatch_message(mismatch, fabric=True))

    def _before_weight_writes(self) -> None:
        for hook in self.before_optimizer_step:
            hook()
