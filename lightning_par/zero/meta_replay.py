"""Replaying the writes :mod:`lightning_par.zero.meta_writes` recorded, when ZeRO-3 materialises a unit.

:func:`pending_writes` says, for the unit's meta parameters, which recorded writes each needs
(:meth:`~lightning_par.zero.meta_writes.Writes.to_replay`; none for a parameter ``pretrained=`` fills) and
refuses, before anything is replaced, a write that read another meta tensor. :func:`replay_writes` runs
them on the real parameters under the seed it is given: each recorded call again, its views taken again
from the parameter (``.data[0]``, ``chunk(3)[1]``), its tensors moved to the parameter's device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_par.zero.meta_copies import COPY_ATTR
from lightning_par.zero.meta_writes import WRITES_ATTR, WRITTEN, Write, Writes

BUILT_ATTR = "_lightning_par_built_version"  # a meta parameter's in-place version when its block ended


def stamp_built(params: Iterable[Tensor]) -> None:
    """At the end of the block that built them: each meta parameter's in-place version, so a write made
    after the block (lost: nothing records it) is found at materialisation."""
    for p in params:
        if p.is_meta:
            p.__dict__[BUILT_ATTR] = p._version


def refuse_writes_after_build(root: nn.Module) -> None:
    """Refuse, naming them, meta parameters of ``root`` written in place after their block ended; called
    before the first is materialised (materialisation itself writes into meta parameters of later units,
    harmlessly: an initialiser of a module spanning units)."""
    late = [
        name
        for name, p in root.named_parameters(remove_duplicate=False)
        if p.is_meta and p.__dict__.get(BUILT_ATTR, p._version) != p._version
    ]
    if late:
        raise RuntimeError(
            f"ZeRO-3 meta init: {late[:6]}{' ...' if len(late) > 6 else ''} were written after the block"
            " that built the model (between fabric.init_module(empty_init=True) / configure_model() and"
            " setup, e.g. model.apply(model._init_weights)), while they were meta placeholders: those writes"
            " would be lost. Make them inside the block (writes there are replayed on the shards at setup),"
            " or set an initialiser as a module's reset_parameters without calling it (as litgpt's pretrain"
            " does for FSDP: each shard is initialised by its module's reset_parameters()), or pass"
            " meta_init=False to build the model whole on every rank first."
        )


def writes_after_load(param: Tensor | None) -> bool:
    """Whether ``param`` was loaded while built and written into after the load."""
    held = param.__dict__.get(WRITES_ATTR) if param is not None else None
    return isinstance(held, Writes) and held.after_load and bool(held.ops)


def _bind(value: Any, target: Tensor, device: torch.device) -> Any:
    if value is WRITTEN:
        return target
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, tuple | list):
        return type(value)(_bind(v, target, device) for v in value)
    return value


def _run(write: Write, param: Tensor) -> None:
    target = param
    for step in write.path:
        view = step.func(
            target, *_bind(step.args, target, param.device), **_bind(step.kwargs, target, param.device)
        )
        target = view[step.index] if step.index is not None else view
    args = _bind(write.args, target, param.device)
    kwargs = {k: _bind(v, target, param.device) for k, v in write.kwargs.items()}
    write.func(*args, **kwargs)


def pending_writes(
    params: Sequence[tuple[str, nn.Parameter]], *, loaded: set[int]
) -> list[tuple[str, nn.Parameter, list[Write]]]:
    """For meta ``params`` (name, parameter) about to be materialised, the writes each needs replayed
    (``loaded``: ids of those filled from weights; see :meth:`Writes.to_replay`): a parameter loaded from
    ``pretrained=`` (no load recorded) needs none, its file supersedes what was built. Writes that cannot
    be replayed are refused here, before anything is replaced."""
    out: list[tuple[str, nn.Parameter, list[Write]]] = []
    refused: list[str] = []
    for name, param in params:
        writes = param.__dict__.get(WRITES_ATTR)
        if not isinstance(writes, Writes) or (id(param) in loaded and not writes.after_load):
            continue
        todo = writes.to_replay()
        refused += [f"{name} ({w.name}: {w.unreplayable})" for w in todo if w.unreplayable is not None]
        if todo:
            out.append((name, param, todo))
    if refused:
        raise ValueError(
            f"The model's construction wrote into meta-device parameters in ways ZeRO-3 cannot replay when it"
            f" materialises them: {refused}. Move that initialisation into the module's reset_parameters()"
            " (run on each unit as it gets storage), pass the weights as pretrained=..., or set"
            " meta_init=False (the model is built on a real device first)."
        )
    return out


def replay_writes(
    pending: Sequence[tuple[str, nn.Parameter, list[Write]]],
    fresh: dict[int, nn.Parameter],
    *,
    reseed: Callable[[str], None],
) -> None:
    """Run each parameter's pending writes on its real replacement ``fresh[id(meta)]`` (under no_grad,
    after ``reseed(name)``)."""
    with torch.no_grad():
        for name, param, todo in pending:
            real = fresh.get(id(param))
            if real is None:
                continue
            reseed(f"{name}#writes")
            for write in todo:
                _run(write, real)


def forget_writes(params: Sequence[Tensor]) -> None:
    """Drop records copied onto real parameters (materialisation copies a meta parameter's attributes)."""
    for p in params:
        p.__dict__.pop(WRITES_ATTR, None)
        p.__dict__.pop(BUILT_ATTR, None)
        p.__dict__.pop(COPY_ATTR, None)
