"""ZeRO-3 units: which modules gather their parameters together, and who owns each parameter.

A *unit* is a module whose parameters are all-gathered together before its forward and freed after it.
The default policy takes every direct child of an ``nn.ModuleList`` (the transformer blocks of almost
every model); a policy may instead name module classes or ``fnmatch`` patterns of module names. What no
unit owns belongs to the root unit (embeddings, final norm, head), which stays gathered for the step.

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
    """Names of the modules a policy selects (default: every direct child of an ``nn.ModuleList``)."""
    if policy is None:
        return [
            f"{parent}.{child}" if parent else child
            for parent, module in root.named_modules()
            if isinstance(module, nn.ModuleList)
            for child, _ in module.named_children()
        ]
    if isinstance(policy, str):
        policy = [policy]
    names = []
    for name, module in root.named_modules():
        if not name:
            continue
        for rule in policy:
            hit = fnmatch.fnmatchcase(name, rule) if isinstance(rule, str) else isinstance(module, rule)
            if hit:
                names.append(name)
                break
    if not names:
        examples = [n for n, _ in root.named_modules() if n][:8]
        rules = [r if isinstance(r, str) else r.__name__ for r in policy]
        raise ValueError(
            f"The module policy {rules} matches no module. Module names look like {examples}; pass class"
            " types (e.g. the transformer block class) or name patterns such as 'model.blocks.*'."
        )
    return names


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
