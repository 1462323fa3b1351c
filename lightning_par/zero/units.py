"""ZeRO-3 units: which modules gather their parameters together, and who owns each parameter.

A *unit* is a module whose parameters are all-gathered together before its forward and freed after it.
The default policy takes the children of the outermost ``nn.ModuleList`` s (the transformer blocks of almost
every model; a list held directly in such a list, as a U-Net's ``ModuleList`` of ``ModuleList`` s, is looked
into, having no forward of its own). A list inside a block stays in the block's unit: the experts of a
mixture of experts run on the ranks whose tokens chose them, and as units of their own their all-gathers
would pair up differently on different ranks (a collective mismatch, a hang on NCCL), where the block, as
FSDP users wrap it, runs on every rank. A policy may instead name module classes, or strings: ``fnmatch``
patterns of module names or a class's name, bare or dotted (``"LlamaDecoderLayer"``, ``"transformers.models
.llama.modeling_llama.LlamaDecoderLayer"``), so a YAML file or command line can name the block class as it
names a layer. A name pattern's ``*`` crosses dots, so ``"model.blocks.*"`` also matches every module
inside a block: a pattern selects the outermost modules it matches, not those inside one it already
selected. What no unit owns belongs to the root unit (embeddings, final norm, head), which stays gathered
for the step.

Every parameter takes part, trainable or frozen (``requires_grad=False``: sharded and gathered the same
way, without gradient or optimizer state), except the meta placeholders that stand for layers of other
pipeline stages (marked ``_lp_remote``), which this rank does not hold.

Ownership: a parameter belongs to the deepest unit whose subtree holds *every* place it is registered,
so a weight tied across two units (an embedding and an LM head) has one owner, the common ancestor, and
is gathered, reduced and counted once.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

UnitPolicy = Sequence[str | type[nn.Module]] | None
REMOTE_ATTR = "_lp_remote"  # a meta placeholder for a parameter that lives on another pipeline stage


@dataclass
class UnitPlan:
    """``(unit name, module, [(canonical param name, param)])``, root (name ``""``) last; units without
    parameters are left out, except the root."""

    units: list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]]


def match_modules(root: nn.Module, policy: UnitPolicy) -> list[str]:
    """Names of the modules a policy selects (default: the children of the outermost ``nn.ModuleList`` s;
    see the module docstring)."""
    if policy is None:
        return _outermost_blocks(root)
    if isinstance(policy, str):
        policy = [policy]
    names: list[str] = []
    by_name: dict[str, list[str]] = {}  # a name pattern -> the modules it selected by name
    for name, module in root.named_modules():
        if not name:
            continue
        chosen = False
        for rule in policy:
            if isinstance(rule, str) and fnmatch.fnmatchcase(name, rule):
                inside = by_name.setdefault(rule, [])
                if not any(name.startswith(f"{outer}.") for outer in inside):
                    inside.append(name)
                    chosen = True
            elif _selects(rule, name, module):
                chosen = True
        if chosen:
            names.append(name)
    if not names:
        examples = [n for n, _ in root.named_modules() if n][:8]
        # the model's own classes first (a ModuleList's children: its blocks), torch's building blocks last
        blocks = {id(c) for m in root.modules() if isinstance(m, nn.ModuleList) for c in m.children()}
        rank: dict[str, int] = {}
        for n, m in root.named_modules():
            if n:
                kind = 0 if id(m) in blocks else 2 if type(m).__module__.startswith("torch.") else 1
                rank[type(m).__name__] = min(kind, rank.get(type(m).__name__, kind))
        classes = sorted(rank, key=lambda c: (rank[c], c))[:8]
        rules = [r if isinstance(r, str) else r.__name__ for r in policy]
        raise ValueError(
            f"The module policy {rules} matches no module. Module names look like {examples} and module"
            f" classes are {classes}; pass class types or class names (e.g. the transformer block's) or name"
            " patterns such as 'model.blocks.*' (the outermost modules a pattern matches)."
        )
    return names


def _outermost_blocks(root: nn.Module) -> list[str]:
    """The children of every ``nn.ModuleList`` that lies inside no such child, in module order."""
    modules: dict[str, nn.Module] = {}
    names: list[str] = []
    for name, module in root.named_modules():
        modules[name] = module
        parent = modules.get(name.rpartition(".")[0]) if name else None
        if (
            isinstance(parent, nn.ModuleList)
            and not isinstance(module, nn.ModuleList)
            and not any(name.startswith(f"{outer}.") for outer in names)
        ):
            names.append(name)
    return names


def _selects(rule: str | type[nn.Module], name: str, module: nn.Module) -> bool:
    """A class selects its instances (subclasses included); a string selects the modules whose class is
    named so, bare or with its module's path (name patterns: ``match_modules``)."""
    if not isinstance(rule, str):
        return isinstance(module, rule)
    cls = type(module)
    return rule in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def plan_units(root: nn.Module, policy: UnitPolicy = None) -> UnitPlan:
    """Split the parameters of ``root`` into units (see the module docstring)."""
    picks = match_modules(root, policy)
    modules = dict(root.named_modules())
    places: dict[int, list[str]] = {}
    canonical: dict[int, tuple[str, nn.Parameter]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        if getattr(param, REMOTE_ATTR, False):
            continue
        places.setdefault(id(param), []).append(name)
        canonical.setdefault(id(param), (name, param))
    owned: dict[str, list[tuple[str, nn.Parameter]]] = {p: [] for p in picks}
    owned[""] = []
    for pid, names in places.items():
        candidates = [p for p in picks if all(n.startswith(p + ".") for n in names)]
        owner = max(candidates, key=len) if candidates else ""
        owned[owner].append(canonical[pid])
    units = [(p, modules[p], owned[p]) for p in picks if owned[p]]
    units.append(("", root, owned[""]))
    return UnitPlan(units=units)


def check_pipeline_units(
    root: nn.Module,
    policy: UnitPolicy,
    *,
    layers: Sequence[nn.Module],
    pieces: Sequence[tuple[int, int]],
    pp_size: int,
) -> None:
    """Refuse a unit policy that a pipeline cannot serve: every unit must be one of the pipeline ``layers``
    or lie inside one. A pipeline calls its layers, never their parents, so a unit above them would never
    be gathered by its own forward, and one spanning layers of several stages (``pieces``: each virtual
    stage's layer range, virtual stage ``g`` on rank ``g % pp_size``) would hold parameters that live on
    other ranks. Depends only on the model's structure, so every rank raises alike."""
    modules = dict(root.named_modules())
    names = {id(m): n for n, m in modules.items()}
    inside: dict[int, int] = {}  # module id -> index of the layer that holds it
    for index, layer in enumerate(layers):
        for module in layer.modules():
            inside.setdefault(id(module), index)
    stage_of = {i: g % pp_size for g, (lo, hi) in enumerate(pieces) for i in range(lo, hi)}
    for name in match_modules(root, policy):
        if id(modules[name]) in inside or next(modules[name].parameters(), None) is None:
            continue  # inside a layer, or no unit at all (e.g. metrics in an nn.ModuleList)
        held = sorted({i for m in modules[name].modules() if (i := inside.get(id(m))) is not None})
        stages = sorted({stage_of[i] for i in held if i in stage_of})
        where = (
            f"it holds pipeline layers {held[0]}..{held[-1]} on stages {stages}, so its parameters cross a"
            " stage boundary"
            if len(stages) > 1
            else "it is not a pipeline layer nor inside one, so the pipeline (which calls the layers) would"
            " never gather it"
        )
        layer_names = [names.get(id(layer), type(layer).__name__) for layer in layers[:3]]
        if not held:  # no layer in it: a module beside the pipeline (an EMA or teacher copy on the module)
            raise ValueError(
                f"ZeRO-3 under pipeline parallelism found {name!r} (selected as a unit by zero3_units or"
                f" its default) outside the pipeline's layers (e.g. {layer_names}): each stage holds and"
                " runs its own layers only, so a module beside them (a copy of the model for an EMA or a"
                " teacher) would never be gathered. Keep it off the LightningModule (for an EMA:"
                " lightning_par.callbacks.ShardedEMA, which averages each stage's own weights)."
            )
        raise ValueError(
            f"zero3_units selects {name!r} as a ZeRO-3 unit, but {where}. Under pipeline parallelism every"
            f" unit must be a pipeline layer (e.g. {layer_names}) or lie inside one: pass the block class,"
            " name patterns of modules inside the layers, or leave zero3_units unset (every child of an"
            " nn.ModuleList)."
        )
