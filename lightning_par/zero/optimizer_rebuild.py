"""The user's optimizer rebuilt over this rank's fragments (ZeRO 1-3), and the guards it keeps.

:func:`optimizer_group_params` checks which module parameters each group holds; :func:`rebuild_optimizer`
refills the user's optimizer object, its class, hyper-parameters and group dicts kept, over the master
fragments of those parameters, and returns hooks that guard it: a group added later
(``add_param_group``: its parameters are not in the shards, they would never train), torch's own
``state_dict()`` / ``load_state_dict()`` (this rank's fragments only) and ``optimizer.state`` looked up by a
module parameter (:class:`ShardedState`) are refused, naming the fix.
"""

from __future__ import annotations

import inspect
import warnings
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_par.optimizer_checks import check_shardable

__all__ = [
    "ShardedState",
    "inherit_param_attrs",
    "optimizer_group_params",
    "rebuild_optimizer",
    "refuse_added_groups",
    "refuse_state_dict",
    "stepped_ids",
    "warn_post_hooks",
]


def inherit_param_attrs(fragment: Tensor, param: nn.Parameter) -> None:
    """A master fragment carries its parameter's parallelism marks (e.g. the tensor-parallel dimension),
    so code that sees only the optimizer's tensors (global-norm clipping) can tell sharded from
    replicated pieces."""
    for attr in ("_lp_tp_dim", "_lp_tp_segments", "_lp_norm_skip"):
        if hasattr(param, attr):
            setattr(fragment, attr, getattr(param, attr))


def optimizer_group_params(
    optimizers: Sequence[Optimizer],
    trainable: Sequence[nn.Parameter],
    param_names: dict[nn.Parameter, str],
    *,
    allow_untested: bool = False,
) -> list[list[list[nn.Parameter]]]:
    """The module parameters of each group of each optimizer, checked to be module parameters that
    belong to one optimizer only. Frozen parameters (``requires_grad=False``, not in ``trainable``) are
    allowed, as torch optimizers skip parameters without gradients: they get no fragment and no state."""
    engine_params = set(map(id, trainable))
    module_params = set(map(id, param_names))
    out: list[list[list[nn.Parameter]]] = []
    owner: dict[int, int] = {}
    for k, opt in enumerate(optimizers):
        check_shardable(opt, allow_untested=allow_untested)
        groups = []
        for group in opt.param_groups:
            params = list(group["params"])
            for p in params:
                if id(p) not in module_params:
                    raise ValueError(
                        f"Optimizer {k} holds a tensor of shape {tuple(p.shape)} that is not a parameter of"
                        " the module; ZeRO can only shard module parameters (register it as an"
                        " nn.Parameter of the LightningModule)."
                    )
                if id(p) not in engine_params and p.requires_grad and not p.is_meta:
                    raise ValueError(
                        f"Optimizer {k} holds {param_names[p]!r}, which the ZeRO engine does not manage"
                        " (its requires_grad changed after setup?); set requires_grad before training."
                    )
                if owner.setdefault(id(p), k) != k:
                    raise ValueError(f"Parameter {param_names[p]!r} is in two optimizers.")
            groups.append(params)
        out.append(groups)
    return out


def rebuild_optimizer(
    opt: Optimizer,
    groups: list[list[nn.Parameter]],
    masters: dict[int, list[Tensor]],
    *,
    names: Mapping[int, str],
) -> list[RemovableHandle]:
    """Replace ``opt``'s parameters by the master fragments of its parameters (``masters[id(param)]``),
    keeping the object, its hyper-parameters, its class and its group dicts (refilled in place, so a
    group held from before, ``group = opt.param_groups[0]; group["lr"] = 0.0``, still drives the step);
    the state starts empty. Returns the hooks that guard it, for the caller to remove: a step pre-hook
    that refuses groups added afterwards (:func:`refuse_added_groups`; ``names``: module parameter
    names by id), and ``state_dict`` / ``load_state_dict`` pre-hooks that refuse torch's own format,
    which would hold this rank's fragments only (:func:`refuse_state_dict`)."""
    new_groups: list[dict[str, Any]] = []
    for group, params in zip(opt.param_groups, groups, strict=True):
        hyper = {k: v for k, v in group.items() if k != "params"}
        new_groups.append({**hyper, "params": [m for p in params for m in masters.get(id(p), [])]})
    # A fresh instance runs the class's own state initialisation (Adagrad fills state eagerly from its
    # constructor arguments, so those are passed again, as far as the constructor accepts them).
    accepted = inspect.signature(type(opt).__init__).parameters
    fresh = type(opt)(new_groups, **{k: v for k, v in opt.defaults.items() if k in accepted})
    for group, built in zip(opt.param_groups, fresh.param_groups, strict=True):
        group.clear()
        group.update(built)
    opt.state = ShardedState(fresh.state, names=names)
    expected = len(opt.param_groups)

    def before_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        refuse_added_groups(optimizer, expected=expected, names=names)

    def before_load(optimizer: Optimizer, state_dict: Any) -> None:
        refuse_state_dict(load=True)

    return [
        opt.register_step_pre_hook(before_step),
        opt.register_state_dict_pre_hook(lambda optimizer: refuse_state_dict(load=False)),
        opt.register_load_state_dict_pre_hook(before_load),
    ]


class ShardedState(defaultdict[Any, Any]):
    """``optimizer.state`` of a rebuilt optimizer: keyed by the master fragments, as torch's optimizers
    keep it, and refusing a lookup by one of the module's parameters (``names``: their names by id), which
    has no entry here. Before, ``opt.state[p]`` (a ``defaultdict``) handed back a new empty dict, so a
    user's reset of a layer's moments (a re-initialised head, ReLoRA) changed nothing and a read found
    nothing, without a word; ``p in opt.state`` and ``opt.state.get(p)`` are refused alike."""

    def __init__(self, state: Mapping[Any, Any], *, names: Mapping[int, str]) -> None:
        super().__init__(dict, state)
        self._names = names

    def _refuse(self, key: Any) -> None:
        name = self._names.get(id(key))
        if name is None:
            return
        raise RuntimeError(
            f"optimizer.state[{name!r}] at ZeRO 1-3: the optimizer steps this rank's fragments of the"
            " flattened parameters, and its state is keyed by them, not by the module's parameters, so"
            " nothing there belongs to this parameter (a read would find nothing, a write would change"
            " nothing). To read or reset a parameter's optimizer state, use zero_stage=0; to inspect it,"
            " save a checkpoint (trainer.save_checkpoint / fabric.save), which holds it per parameter."
        )

    def __missing__(self, key: Any) -> Any:
        self._refuse(key)
        return super().__missing__(key)

    def __contains__(self, key: object) -> bool:
        self._refuse(key)
        return super().__contains__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._refuse(key)
        return super().get(key, default)

    # a copy (copy.copy, .copy(), deepcopy, pickle) is torch's plain state mapping, without the guard
    def copy(self) -> defaultdict[Any, Any]:  # type: ignore[override]  # not Self: the plain mapping
        return defaultdict(dict, self)

    __copy__ = copy  # type: ignore[assignment]

    def __reduce__(self) -> Any:
        return (defaultdict, (dict,), None, None, iter(self.items()))


def warn_post_hooks(optimizers: Sequence[Optimizer]) -> None:
    """ZeRO 1/2: the user's step post-hooks (``register_step_post_hook``, and torch's global ones) run
    inside ``optimizer.step()``, before the engine gathers the updated parameters: there every rank's
    parameters hold its own updated slice and the other ranks' values from before the update. An
    element-wise write (a clamp) is exact; one that reads other elements (a renorm, a standardisation,
    an EMA) computes from stale values (a probe: 4e-3 off ``"ddp"`` after 4 steps). Warned at setup."""
    from torch.optim.optimizer import _global_optimizer_post_hooks

    hooked = [type(opt).__name__ for opt in optimizers if opt._optimizer_step_post_hooks]
    if hooked or _global_optimizer_post_hooks:
        warnings.warn(
            f"ZeRO 1/2: step post-hooks on {', '.join(hooked) or 'every optimizer (global)'} run before the"
            " updated parameters are gathered: inside them each rank's parameters hold the other ranks'"
            " slices from before the update, so a write that reads other elements (a renorm, a"
            " standardisation, an EMA) computes from stale values. Do such writes after optimizer.step()"
            " (on_train_batch_end, or an optimizer_step override after super()), or use zero_stage=0.",
            stacklevel=3,
        )


def refuse_state_dict(*, load: bool) -> None:
    """``optimizer.state_dict()`` / ``load_state_dict()`` of an optimizer rebuilt over the shards: torch's
    format would hold this rank's fragments of the flattened parameters (another piece on every rank),
    which ``torch.save`` on one rank cannot resume; before, it was saved without a word and failed at the
    resume with torch's size errors, or, where the ranks' fragments have equal sizes, loaded another
    rank's moments silently. The strategies' checkpoints carry the state at any stage and layout."""
    what = (
        "optimizer.load_state_dict(...) at ZeRO 1-3: the optimizer holds this rank's shards, which a"
        " state dict in torch's format does not fit."
        if load
        else "optimizer.state_dict() at ZeRO 1-3 would hold this rank's shard of the optimizer state only"
        " (fragments of the flattened parameters, another piece on every rank), which no other rank or"
        " layout can load."
    )
    raise RuntimeError(
        what + " Save and load the optimizer with the strategy's checkpoints, on every rank:"
        " fabric.save(path, {'model': model, 'optimizer': optimizer, ...}) and fabric.load(path, state), or"
        " trainer.save_checkpoint(path) and Trainer.fit(ckpt_path=path); they load at any ZeRO stage and"
        " layout, and so does a file Fabric's or Lightning's own strategies wrote. For torch's whole"
        " format, lightning-par-consolidate converts a checkpoint."
    )


def refuse_added_groups(opt: Optimizer, *, expected: int, names: Mapping[int, str]) -> None:
    """Refuse a step of ``opt`` once groups were added after it was rebuilt (``add_param_group``): their
    parameters are the module's, not fragments of the shards, so no gradient would reach them and they
    would never train (before: silently)."""
    if len(opt.param_groups) <= expected:
        return
    added = [
        names.get(id(p), f"a tensor of shape {tuple(p.shape)}")
        for group in opt.param_groups[expected:]
        for p in group["params"]
    ]
    raise RuntimeError(
        f"optimizer.add_param_group after setup at ZeRO 1-3: the optimizer was rebuilt over this rank's"
        f" shards of the parameters it held at setup, so the added group's {added[:4]} would get no"
        " gradient and never train. Give the optimizer every parameter before setup (a param group with"
        " lr=0 until it should train, then set its lr), or use zero_stage=0, where the optimizer keeps"
        " the module's parameters."
    )


def optimizer_of(
    optimizers: Sequence[Optimizer], group_params: Sequence[Sequence[Sequence[nn.Parameter]]]
) -> dict[int, int]:
    """Parameter id -> the id of the optimizer holding it (``group_params``: each optimizer's groups, as
    :func:`optimizer_group_params` returns them)."""
    return {
        id(p): id(opt)
        for opt, groups in zip(optimizers, group_params, strict=True)
        for group in groups
        for p in group
    }


def stepped_ids(optimizer: Optimizer | None, optimizers: Sequence[Optimizer]) -> set[int]:
    """The optimizers (their ids) an optimizer step marks as done with the window's gradients:
    ``optimizer`` (unwrapped from Lightning's ``LightningOptimizer``) when it is one of ``optimizers``;
    otherwise, or without one, all of them, so the window's gradients are dropped whole rather than
    carried into the next window."""
    inner = getattr(optimizer, "_optimizer", optimizer)
    if inner is not None and any(inner is opt for opt in optimizers):
        return {id(inner)}
    return {id(opt) for opt in optimizers}
