"""Deep copies of modules made on the meta device start equal to their source, as on a real device.

Why
---
ZeRO-3's meta init draws each module's initial values under a seed of the run's seed and the module's
path (:mod:`lightning_par.zero.init_seeds`). A module deep-copied from another while the model is built
(a DPO reference or a distillation teacher copied from the policy in ``configure_model()``, an EMA copy,
``nn.TransformerEncoder``'s cloned layers) has another path, so it drew other values: a DPO run's policy
and reference started 0.11 apart and its first loss was not ln 2, silently, where on a real device the
copy holds its source's values.

Contract
--------
:func:`mark_copy` (called from the meta build's ``nn.Parameter.__deepcopy__``) keeps, on a copied meta
parameter, its source and the source's write record as it was copied. :func:`copy_seed_paths` then maps
the path of every module of the model whose parameters are all such copies, none written since, of the
parameters under one other module at the same relative names, to that module's path. Materialisation
draws a mapped module (its ``reset_parameters()``, a Hugging Face ``_init_weights``, PEFT's adapter init,
the writes it inherited) under its source's seed (:func:`seed_path`), so it gets its source's initial
values, the writes made to the source after the copy excepted, as on a real device. A copy written after
it was made (``nn.Transformer`` re-initialises its cloned layers) keeps its own path: its values were
meant to differ. Copies of a source outside the model (the layer ``nn.TransformerEncoder`` clones) take
the first copy's path: equal to one another, as torch's clones are. A tensor-parallel layer counts as
the full-size layer it replaced (its kept meta source, whose parameters the copy marks are on, and as
which its slices are drawn).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from lightning_par.zero.meta_writes import WRITES_ATTR
from lightning_par.zero.tp_init import parallel_layers, sources_in_place

__all__ = [
    "COPY_ATTR",
    "copy_owner",
    "copy_seed_paths",
    "creators_last",
    "mark_copy",
    "mark_owner",
    "seed_path",
]

COPY_ATTR = "_lp_meta_copy_of"  # (source parameter, its record's op list when copied, that list's length)
OWNER_ATTR = "_lp_meta_owner"  # a callable giving the module that created the parameter (None: unknown)


def mark_copy(source: Tensor, copy: Tensor) -> None:
    """``copy`` is a deep copy of the meta parameter ``source`` made while the model is built."""
    held = copy.__dict__.get(WRITES_ATTR)
    ops = getattr(held, "ops", None)
    copy.__dict__[COPY_ATTR] = (source, ops, len(ops) if ops is not None else 0)


def mark_owner(param: Tensor, module: nn.Module) -> None:
    """``module`` registers the meta ``param``: its creator, if it is the first to (a tie such as
    ``head.weight = emb.weight`` registers it again, in another module)."""
    if OWNER_ATTR not in param.__dict__:
        param.__dict__[OWNER_ATTR] = weakref.ref(module)


def copy_owner(source: Tensor, copy: Tensor, memo: dict[int, Any]) -> None:
    """The creator of ``copy`` (a deep copy of ``source``) is the copy of ``source``'s creator made by the
    same deep copy (looked up when asked: the creator may be copied after the parameter)."""
    owner = _owner(source)
    if owner is not None:
        key = id(owner)
        copy.__dict__[OWNER_ATTR] = lambda: memo.get(key)


def _owner(param: Tensor) -> Any:
    found = param.__dict__.get(OWNER_ATTR)
    return found() if found is not None else None


def creators_last(modules: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """``modules`` (to initialise, each under its own seed, so their order changes no value) with those
    holding a parameter another module created first: the creator's initialiser, run after, leaves a tied
    parameter its values, as on a real device, where the tie hands the creator's parameter to the other
    module (before, the later module in the model's order won: ``head.weight = emb.weight`` got the
    head's uniform draw where the embedding's normal one was due)."""

    def foreign(module: nn.Module) -> bool:
        return any(
            (owner := _owner(p)) is not None and owner is not module
            for p in module._parameters.values()
            if p is not None
        )

    return sorted(modules, key=lambda item: not foreign(item[1]))


def _unwritten_source(param: Tensor) -> Tensor | None:
    """The source ``param`` was copied from, if nothing was written into ``param`` since."""
    mark: Any = param.__dict__.get(COPY_ATTR)
    if mark is None:
        return None
    source, ops, count = mark
    now = getattr(param.__dict__.get(WRITES_ATTR), "ops", None)
    if now is not ops or (now is not None and len(now) != count):
        return None
    return source


def copy_seed_paths(root: nn.Module) -> dict[str, str]:
    """Module path -> the path of the module it is an unwritten deep copy of (module docstring)."""
    # a tensor-parallel layer's parameters as those of the full-size layer it replaced (its source, kept
    # on the meta device): the copies were made of those, before the conversion, and its slices drawn so
    with sources_in_place(parallel_layers(root, {id(p) for p in root.parameters()})):
        named: list[tuple[str, Tensor]] = list(root.named_parameters(remove_duplicate=False))
    if not any(COPY_ATTR in p.__dict__ for _, p in named):
        return {}
    names: dict[int, set[str]] = {}
    under: dict[str, list[tuple[str, Tensor]]] = {}  # module path -> its parameters by relative name
    for name, p in named:
        names.setdefault(id(p), set()).add(name)
        parts = name.split(".")
        for k in range(1, len(parts)):
            under.setdefault(".".join(parts[:k]), []).append((".".join(parts[k:]), p))
    # each parameter's source in the model, once; a source outside it (the layer nn.TransformerEncoder
    # clones) stands for its first copy, which the later ones follow
    resolved: dict[int, Tensor | None] = {}
    first: dict[int, Tensor] = {}
    for _, p in named:
        source = _unwritten_source(p)
        if source is not None and id(source) not in names:
            held = first.setdefault(id(source), p)
            source = held if held is not p else None
        resolved[id(p)] = source
    out: dict[str, str] = {}
    for path, params in under.items():
        candidates: set[str] | None = None
        for rel, p in params:
            source = resolved[id(p)]
            found = {n[: -len(rel) - 1] for n in names.get(id(source), ()) if n.endswith("." + rel)}
            candidates = found if candidates is None else candidates & found
            if not candidates:
                break
        if candidates is not None and len(candidates) == 1:
            (origin,) = candidates
            if origin != path and not origin.startswith(path + ".") and not path.startswith(origin + "."):
                out[path] = origin
    return out


def seed_path(paths: Mapping[str, str], name: str) -> str:
    """``name`` (a module path, or a parameter's name with a suffix) with the longest mapped module path
    that prefixes it replaced by its source's path, again until none does: a copy of a copy draws as the
    first source, and a copy of ``nn.TransformerEncoder`` has its clone layers drawn as the first layer."""
    for _ in range(len(paths) + 1):  # each step moves to a source made earlier: no cycle
        parts = name.split(".")
        for k in range(len(parts), 0, -1):
            origin = paths.get(".".join(parts[:k]))
            if origin is not None:
                name = ".".join([origin, *parts[k:]])
                break
        else:
            return name
    return name
