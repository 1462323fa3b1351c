"""LightningModule hooks the Trainer strategy adapts for one run, and the loop bookkeeping it corrects.

Each ``guard_*`` function sets an instance attribute on the user's LightningModule (or callback),
shadowing the class's method, through :func:`install`, and returns the names it set; the strategy removes
them at teardown (:func:`restore`), so the class's own methods, or an instance attribute of the user's
that a wrapper shadowed, show through again and nothing outlives the run.

* :func:`guard_schedulers`: with fp16 loss scaling a skipped step is not a step, so per-step LR
  schedulers must not advance on it (Lightning steps them through ``lr_scheduler_step``).
* :func:`guard_toggling`: manual optimization at ZeRO 1-3. Lightning's ``toggle_optimizer`` freezes the
  other optimizers' parameters by walking ``optimizer.param_groups``, which the engine has replaced by
  this rank's fragments; the guarded version freezes the module's parameters, as with ``"ddp"``.
* :func:`guard_module_zero_grad`: at ZeRO 1-3 the LightningModule's ``zero_grad()`` (the user's, and
  Lightning's before a validation loop) reaches the optimizers' windows too, as ``param.grad`` under DDP
  (under pipeline parallelism too).
* :func:`lend_no_sync`: ``trainer.model.no_sync()`` (DDP's wrapper method) on the LightningModule.
* :func:`guard_placeholder_reads`: at ZeRO-3 the module's and user callbacks' ``on_save_checkpoint`` and
  fit-, epoch- and batch-level hooks run while the parameters are placeholders (NaN); a read of them
  there is refused with the fix instead of computing or saving NaN.
* :func:`guard_grad_reads`: at ZeRO 1-3 the module's and user callbacks' ``on_before_optimizer_step`` and
  ``configure_gradient_clipping`` refuse ``param.grad`` reads that find None, at every step.
* :func:`explain_zero_views`: with whole-file checkpoints a rank other than 0 hands the save hooks
  expanded zeros in place of rank 0's gathered state; an in-place write into one is explained.
* :func:`lightning_par.summaries.guard_summaries` sets such attributes on Lightning's model summary
  callbacks and graph-logging loggers.
* :func:`uncount_step`: takes a skipped step off Lightning's optimizer-step count (``global_step``).
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from lightning_par.module_dtypes import explained_dtype_errors
from lightning_par.precision import ParallelPrecision
from lightning_par.zero.engine_api import Engine, ShardedState
from lightning_par.zero.stage3 import Stage3Engine

GUARDED = "_lightning_par_guarded"  # marks a hook set here or in summaries.py


def guard_schedulers(
    module: pl.LightningModule, *, skipped: Callable[[], bool], step_schedulers: Callable[[Any], bool]
) -> list[str]:
    """Wrap ``module.lr_scheduler_step`` so that a scheduler for which ``step_schedulers(scheduler)``
    (its interval is ``"step"``) does not advance when ``skipped()``."""
    inner = module.lr_scheduler_step
    if getattr(inner, GUARDED, False):
        return []

    def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
        if not (step_schedulers(scheduler) and skipped()):
            inner(scheduler, metric)

    setattr(lr_scheduler_step, GUARDED, True)
    install(module, "lr_scheduler_step", lr_scheduler_step)
    return ["lr_scheduler_step"]


def guard_toggling(
    module: pl.LightningModule, *, sharded: ShardedState, optimizers: Sequence[Optimizer]
) -> list[str]:
    """Make ``toggle_optimizer``/``untoggle_optimizer`` act on the module parameters each optimizer was
    given (``sharded.group_params``), not on the fragments it now holds. A module's own override of either
    is not called (Lightning's base version, which an override calls through ``super()``, would walk the
    fragments): warned, naming what to do instead."""
    overridden = [
        name
        for name in ("toggle_optimizer", "untoggle_optimizer")
        if name in vars(module) or is_overridden(name, module, pl.LightningModule)
    ]
    if overridden:
        rank_zero_warn(
            f"ZeRO stages 1-3 replace {' and '.join(overridden)} for this run: the optimizers hold shards of"
            " the parameters, so lightning_par toggles the module's parameters each optimizer was given, and"
            " your override is not called. Do what it adds (logging, freezing other modules) in"
            " training_step around the toggle, or use zero_stage=0."
        )
    owned: dict[int, list[nn.Parameter]] = {
        id(opt): [p for group in sharded.group_params(k) for p in group] for k, opt in enumerate(optimizers)
    }

    def toggle_optimizer(optimizer: Any) -> None:
        inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps ours
        state: dict[Any, bool] = {}  # Lightning's own attribute, keyed by parameter
        for params in owned.values():
            for p in params:
                state.setdefault(p, p.requires_grad)
                p.requires_grad = False
        for p in owned.get(id(inner), []):
            p.requires_grad = state[p]
        module._param_requires_grad_state = state

    def untoggle_optimizer(optimizer: Any) -> None:
        saved: dict[Any, bool] = module._param_requires_grad_state
        for p, requires_grad in saved.items():
            p.requires_grad = requires_grad
        module._param_requires_grad_state = {}

    install(module, "toggle_optimizer", toggle_optimizer)
    install(module, "untoggle_optimizer", untoggle_optimizer)
    return ["toggle_optimizer", "untoggle_optimizer"]


def guard_module_zero_grad(module: pl.LightningModule, *, optimizers: Sequence[Optimizer]) -> list[str]:
    """``module.zero_grad()`` also zeroes ``optimizers`` for the run (with the same ``set_to_none``). Under
    DDP it drops what an open accumulation window holds; at ZeRO 1-3 those gradients live in the engine's
    shards, which the module's ``param.grad`` do not reach, so they went into the next step: a batch
    skipped with ``self.zero_grad()`` after its backward, and Lightning's own default
    ``on_validation_model_zero_grad`` (``self.zero_grad()`` before a validation loop, in manual
    optimization before every one: a window accumulated by hand across a mid-window validation was 0.016-
    0.05 off ``"ddp"`` in a probe). The optimizers' dropped fragments leave the window at the next pass.
    The module's own walk over its ``param.grad`` (None at ZeRO 1-3) is not a read the first step's
    watch should refuse. A copy of ``module`` made during the run (``copy.deepcopy``, pickling) has the
    class's ``zero_grad`` (:class:`_RunAttribute`). A submodule's ``zero_grad()`` is not seen."""
    if "zero_grad" in vars(module):
        return []

    def zero_grad(*args: Any, **kwargs: Any) -> None:
        with torch._C.DisableTorchFunction():
            type(module).zero_grad(module, *args, **kwargs)
        set_to_none = bool(kwargs.get("set_to_none", args[0] if args else True))
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    install(module, "zero_grad", zero_grad)
    return ["zero_grad"]


def lend_no_sync(
    module: pl.LightningModule, *, no_sync: Callable[[], AbstractContextManager[None]]
) -> list[str]:
    """``trainer.model.no_sync()``, DDP's idiom for accumulating by hand in manual optimization, where
    ``trainer.model`` is the LightningModule itself under this strategy (before: ``AttributeError``):
    ``module.no_sync`` for the run is the strategy's ``block_backward_sync``. Not where the module has a
    ``no_sync`` of its own."""
    if hasattr(module, "no_sync") and not isinstance(module.no_sync, _NothingToSync):
        return []

    def module_no_sync() -> AbstractContextManager[None]:
        return no_sync()

    install(module, "no_sync", module_no_sync)
    return ["no_sync"]


# hooks Lightning runs outside any forward while ZeRO-3's parameters are placeholders: per run, per epoch
# and per batch (before, the per-batch ones were watched between the first two steps only, and a weight
# norm logged in on_train_batch_end from step 3 on, or in any on_validation_batch_end, logged NaN); the
# same names on the LightningModule and on callbacks
PLACEHOLDER_HOOKS = (
    "on_fit_start",
    "on_train_start",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "on_train_epoch_end",
    "on_validation_start",
    "on_validation_epoch_start",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_validation_epoch_end",
    "on_validation_end",
    "on_test_start",
    "on_test_epoch_start",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_test_epoch_end",
    "on_test_end",
    "on_predict_start",
    "on_predict_epoch_start",
    "on_predict_batch_start",
    "on_predict_batch_end",
    "on_predict_epoch_end",
    "on_predict_end",
    "on_train_end",
    "on_save_checkpoint",
)
# callbacks of these packages read no weights in those hooks (checkpoints read through the strategy)
_TRUSTED_CALLBACKS = ("lightning.", "pytorch_lightning.", "lightning_par.")


# hooks Lightning runs between a window's reduction and the optimizer's update, where code written for DDP
# reads param.grad (gradient histograms, hand-made clipping)
GRAD_HOOKS = ("on_before_optimizer_step", "configure_gradient_clipping")
_GRAD_GUARDED = "_lightning_par_grad_guarded"


def _users_hook(obj: pl.LightningModule | Callback, hook: str) -> bool:
    """Whether ``hook`` is the user's own: overridden by a LightningModule, or by a callback from outside
    Lightning and this package."""
    base = pl.LightningModule if isinstance(obj, pl.LightningModule) else Callback
    if base is Callback and type(obj).__module__.startswith(_TRUSTED_CALLBACKS):
        return False
    return hasattr(base, hook) and is_overridden(hook, obj, base)


def overridden_anywhere(module: pl.LightningModule, hook: str) -> bool:
    """Whether ``hook`` is the user's own on ``module`` or on one of its Trainer's callbacks from outside
    Lightning and this package."""
    trainer = getattr(module, "_trainer", None)
    callbacks = getattr(trainer, "callbacks", None) or []
    return any(_users_hook(obj, hook) for obj in (module, *callbacks))


def guard_placeholder_reads(
    obj: pl.LightningModule | Callback, *, refused: Callable[[str], AbstractContextManager[None]]
) -> list[str]:
    """Run each of ``obj``'s :data:`PLACEHOLDER_HOOKS` it overrides (a LightningModule, or a callback
    from outside Lightning and this package) inside ``refused(hook name)`` (ZeRO-3: a read of a
    placeholder parameter raises there instead of computing or saving NaN); the names set, for
    :func:`restore`."""
    return _run_inside(obj, PLACEHOLDER_HOOKS, GUARDED, refused)


def hook_context(engine: Engine | None, plugin: Any) -> Callable[[str], AbstractContextManager[None]] | None:
    """The context :func:`guard_placeholder_reads` runs the user's hooks in, given the hook's name; None
    where there is nothing to guard: at ZeRO-3, where the parameters are placeholders outside the steps,
    reads of them are refused; in a mixed precision whose fp32 masters are apart, where the module holds
    16-bit copies and no autocast runs in hooks, a dtype clash gets a note naming the ways out
    (``module_dtypes.explained_dtype_errors``)."""
    mixed = isinstance(plugin, ParallelPrecision) and plugin.uses_masters and plugin.mixed
    stage3 = engine if isinstance(engine, Stage3Engine) else None
    if engine is None or not (stage3 or mixed):
        return None

    @contextmanager
    def context(where: str) -> Iterator[None]:
        refused = stage3.reads_refused(f"in {where}") if stage3 else nullcontext()
        notes = explained_dtype_errors(
            enabled=mixed, dtype=plugin.compute_dtype, precision=plugin.precision, hook=where
        )
        with notes, refused:
            yield

    return context


def guard_grad_reads(
    obj: pl.LightningModule | Callback, *, refused: Callable[[str], AbstractContextManager[None]]
) -> list[str]:
    """Run each of ``obj``'s :data:`GRAD_HOOKS` it overrides inside ``refused(hook name)`` (ZeRO 1-3: a
    read of ``param.grad`` that finds None there raises at every step, where the first step's watch
    ends; before, a gradient histogram started after the first step logged nothing, silently); the
    names set, for :func:`restore`."""
    return _run_inside(obj, GRAD_HOOKS, _GRAD_GUARDED, refused)


def _run_inside(
    obj: pl.LightningModule | Callback,
    hooks: Sequence[str],
    mark: str,
    context: Callable[[str], AbstractContextManager[None]],
) -> list[str]:
    """Each of ``hooks`` the user overrides on ``obj``, wrapped (once: ``mark``) to run inside
    ``context(where)``, ``where`` the hook's name (``"a callback's <name>"`` on a callback) for the
    messages; the names set."""
    names = []
    owner = "" if isinstance(obj, pl.LightningModule) else "a callback's "
    for hook in hooks:
        if not _users_hook(obj, hook) or getattr(getattr(obj, hook), mark, False):
            continue
        inner = getattr(obj, hook)

        def guarded(
            *args: Any, _inner: Callable[..., Any] = inner, _hook: str = owner + hook, **kwargs: Any
        ) -> Any:
            with context(_hook):
                return _inner(*args, **kwargs)

        setattr(guarded, mark, True)
        install(obj, hook, guarded)
        names.append(hook)
    return names


def explain_zero_views(obj: pl.LightningModule | Callback, *, why: str) -> list[str]:
    """Wrap ``obj``'s own ``on_save_checkpoint`` (a LightningModule's, or a callback's from outside
    Lightning and this package) so that torch's "single memory location" error, an in-place write into
    one of the expanded zeros a rank other than 0 gets with whole-file checkpoints
    (:func:`lightning_par.checkpoint.hook_edits.rank_zero_view`), is raised again with ``why``."""
    if not _users_hook(obj, "on_save_checkpoint"):
        return []
    inner = obj.on_save_checkpoint

    def on_save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        try:
            return inner(*args, **kwargs)
        except RuntimeError as error:
            if "single memory location" not in str(error):
                raise
            raise RuntimeError(f"{why} (torch: {error})") from error

    install(obj, "on_save_checkpoint", on_save_checkpoint)
    return ["on_save_checkpoint"]


def uncount_step(module: pl.LightningModule) -> None:
    """A skipped step is not a step: undo the optimizer-step count Lightning is about to complete
    (``trainer.global_step``, which drives ``max_steps`` and step-based checkpointing)."""
    if not module.automatic_optimization:
        return
    step = module.trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step
    # Lightning increments "completed" right after this hook returns; take one off first
    step.total.completed -= 1
    step.current.completed -= 1


class _RunAttribute:
    """An instance attribute :func:`install` set for one run: called, it is ``wrapper``. Pickled with its
    object (``torch.save(module)`` in a callback during the run) or deep-copied with it (an EMA copy), it
    becomes what the object shows outside the run (:func:`_outside_run`); before, pickling failed on the
    wrappers, local functions. Attribute reads (the marks set on a wrapper) reach ``wrapper``; Lightning's
    ``is_overridden`` and ``inspect.signature`` look through ``__wrapped__`` to it."""

    def __init__(self, obj: Any, name: str, wrapper: Callable[..., Any]) -> None:
        self.__wrapped__ = wrapper
        self.owner, self.name = weakref.ref(obj), name
        self.previous = vars(obj).get(name, _ABSENT)  # the user's own instance attribute, if any

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__wrapped__(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "__wrapped__":  # not set yet (never, outside __init__)
            raise AttributeError(name)
        return getattr(self.__wrapped__, name)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        owner = self.owner()
        if self.previous is _ABSENT:
            return _outside_run, (owner, self.name)
        return _outside_run, (owner, self.name, self.previous)


class _NothingToSync:
    """What a pickled or copied LightningModule holds for ``no_sync``, the one method the run lends that
    its class lacks (DDP's idiom): a context doing nothing, as ``no_sync()`` of one process (code that
    calls it when present runs as under ``"ddp"``; before, it raised)."""

    def __call__(self) -> AbstractContextManager[None]:
        return nullcontext()


def _outside_run(obj: Any, name: str, *previous: Any) -> Any:
    """The attribute ``name`` of ``obj`` (a copy, being rebuilt) without the run's wrapper: the user's own
    instance attribute it shadowed, else the class's method bound to ``obj``, else (``no_sync``)
    :class:`_NothingToSync`."""
    if previous:
        return previous[0]
    attr = getattr(type(obj), name, None)
    if isinstance(attr, types.FunctionType):
        return types.MethodType(attr, obj)
    return attr if attr is not None else _NothingToSync()


_ABSENT = object()


def install(obj: Any, name: str, wrapper: Callable[..., Any]) -> None:
    """Set ``wrapper`` as ``obj``'s instance attribute ``name`` for one run (a :class:`_RunAttribute`),
    remembering the instance attribute it shadows (the user's own, set on the object), which
    :func:`restore` puts back."""
    setattr(obj, name, _RunAttribute(obj, name, wrapper))


def restore(obj: Any, names: Sequence[str]) -> None:
    """Undo the ``guard_*`` functions: each instance attribute they set goes, and one of the user's it
    shadowed comes back (before, it was deleted with the wrapper)."""
    for name in names:
        current = vars(obj).get(name)
        if not isinstance(current, _RunAttribute):  # the user replaced the wrapper: theirs stays
            continue
        previous = current.previous
        if previous is _ABSENT:
            delattr(obj, name)
        else:
            setattr(obj, name, previous)
