"""Pipeline schedules as per-rank action orders, and the bubble those orders leave under modelled costs.

An order lists per rank the compute actions ``(kind, g, mb)`` it runs, in sequence: ``F`` forward, ``B``
full backward, or the two halves of a split backward, ``I`` (input gradient) and ``W`` (weight gradient),
of virtual stage ``g`` and micro-batch ``mb``. Transfers are free. An action starts when its rank is free
and its input is there: for ``F`` the forward of ``(g-1, mb)`` (none for ``g = 0``); for ``B`` / ``I``
the input gradient from ``B`` / ``I`` of ``(g+1, mb)``, or on the last stage its own forward; for ``W``
its own ``I``. Rank ``r``'s bubble is ``1 - busy_r / T``: ``busy_r`` the sum of its actions' costs,
``T`` the makespan (the last rank's end; bench_pp_torch's measured ``1 - m c / T`` in model form).

* ``unit_bubble``: every action costs ``UNIT_COST[kind]`` (``F = 1``, ``B = 2``, ``I = W = 1``), the mean
  over ranks: the order's own bubble, equal to the analytic formula where the order is ideal.
* ``jitter_bubble``: each action costs ``UNIT_COST[kind] * X``, ``X`` drawn independently per action,
  lognormal with ``E X = 1`` and coefficient of variation ``cv[rank]`` (``sigma^2 = ln(1 + cv^2)``, ``mu =
  -sigma^2 / 2``); the Monte Carlo mean of the mean-over-ranks bubble. Why: in a static order a rank that
  waits on another inherits that rank's lateness as idle time. ``T`` is the longest dependency path and
  ``E max >= max E``: random costs lengthen the expected makespan while the expected busy time stays that
  of unit costs, so the bubble grows, and more where more paths come close to the longest (1F1B's steady
  state waits on the other rank every micro-batch, GPipe's queued forwards absorb lateness: at ``p = 2``,
  ``cv = 0.15`` 1F1B 0.104 vs GPipe 0.087 at ``m = 16``, but 0.218 vs 0.228 at ``m = 4``).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from lightning_par.pipeline import build_schedule
from lightning_par.pipeline.schedule import SPLIT_BACKWARD

UNIT_COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}  # I / W: the two halves of a split backward
Order = list[list[tuple[str, int, int]]]  # per rank: (kind, virtual stage, micro-batch)
Plan = list[tuple[int, str, int, int]]  # (rank, kind, input slot or -1, output slot), see _plan


def _plan(orders: Order, *, last: int) -> tuple[Plan, int]:
    """Every action of ``orders`` once, in an order that runs each after its input (rank by rank, as far
    as the inputs allow), with the result slots it reads and writes; and the number of slots.

    Which inputs exist never depends on the costs, so one plan serves every draw of them: a draw is then
    one pass over a flat list instead of a re-run of this search. Raises ``ValueError`` on a deadlock."""
    slots: dict[tuple[str, int, int], int] = {}  # ("F" | "G": input gradient | "W", g, mb) -> slot
    plan: Plan = []
    pos = [0] * len(orders)
    while any(pos[r] < len(o) for r, o in enumerate(orders)):
        moved = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                kind, g, mb = order[pos[r]]
                backward = ("F", g, mb) if g == last else ("G", g + 1, mb)
                dep = {"F": ("F", g - 1, mb) if g > 0 else None, "W": ("G", g, mb)}.get(kind, backward)
                if dep is not None and dep not in slots:
                    break
                out = slots.setdefault(("G" if kind in "BI" else kind, g, mb), len(slots))
                plan.append((r, kind, -1 if dep is None else slots[dep], out))
                pos[r], moved = pos[r] + 1, True
        if not moved:
            raise ValueError("the action orders deadlock")
    return plan, len(slots)


def _bubbles(plan: Plan, slots: int, ranks: int, costs: Sequence[float]) -> list[float]:
    """Per-rank bubble ``1 - busy_r / T`` of ``plan`` run with ``costs[i]`` for its ``i``-th action."""
    finish, free, busy = [0.0] * slots, [0.0] * ranks, [0.0] * ranks
    for (r, _, dep, out), c in zip(plan, costs, strict=True):
        start = free[r] if dep < 0 else max(free[r], finish[dep])
        free[r] = finish[out] = start + c
        busy[r] += c
    span = max(free)
    return [1 - b / span for b in busy]


def simulate(orders: Order, *, last: int, cost: Callable[[str, int], float]) -> list[float]:
    """Per-rank bubble of ``orders`` (last virtual stage ``last``) with free transfers, an action of kind
    ``kind`` on rank ``rank`` taking ``cost(kind, rank)`` (module docstring). ``cost`` is called once per
    action, in an order that respects the dependencies (the same for every call of ``simulate``)."""
    plan, slots = _plan(orders, last=last)
    return _bubbles(plan, slots, len(orders), [cost(kind, r) for r, kind, _, _ in plan])


def unit_bubble(orders: Order, *, last: int) -> float:
    """Mean over ranks of ``simulate`` with ``UNIT_COST``."""
    return statistics.fmean(simulate(orders, last=last, cost=lambda kind, _: UNIT_COST[kind]))


def jitter_bubble(
    orders: Order, *, last: int, cv: Sequence[float], samples: int = 400, seed: int = 0
) -> float:
    """Mean over ``samples`` draws of the mean-over-ranks bubble, each action's cost ``UNIT_COST[kind]``
    times an independent lognormal factor of mean 1 and coefficient of variation ``cv[rank]`` (module
    docstring), drawn from ``random.Random(seed)``: deterministic for a fixed seed. With every ``cv`` 0
    the costs are fixed and one run is every draw, so the result is ``unit_bubble`` exactly."""
    if len(cv) != len(orders) or min(cv) < 0 or samples < 1:
        raise ValueError(f"need one cv >= 0 per rank ({len(orders)}) and samples >= 1, got {cv}, {samples}")
    plan, slots = _plan(orders, last=last)
    units = [UNIT_COST[kind] for _, kind, _, _ in plan]
    if not any(cv):
        return statistics.fmean(_bubbles(plan, slots, len(orders), units))
    sigma = [math.sqrt(math.log1p(c * c)) for c in cv]
    ln_factor = [(-s * s / 2, s) for s in sigma]  # (mu, sigma) of ln X per rank
    per_action = [(u, *ln_factor[r]) for u, (r, *_) in zip(units, plan, strict=True)]
    gauss = random.Random(seed).gauss
    total = 0.0
    for _ in range(samples):
        costs = [u * math.exp(mu + s * gauss(0.0, 1.0)) for u, mu, s in per_action]
        total += statistics.fmean(_bubbles(plan, slots, len(orders), costs))
    return total / samples


def ours_orders(schedule: str, *, p: int, m: int, v: int, slack: int = 0) -> Order:
    """Our schedule's actions; a ``zb`` / ``interleaved_zb`` backward ``B`` is the input half (``I``) of a
    split backward."""
    kinds = {"B": "I"} if schedule in SPLIT_BACKWARD else {}
    acts = build_schedule(schedule, p=p, m=m, v=v, slack=slack)
    return [[(kinds.get(a.kind, a.kind), a.chunk * p + r, a.mb) for a in rank] for r, rank in enumerate(acts)]


def torch_orders(schedule: Any) -> Order:
    """The compute actions (F, B, I, W) of a multi-stage torch schedule's ``pipeline_order``."""
    out: Order = []
    for _, acts in sorted(schedule.pipeline_order.items()):
        kept = [a for a in acts if a is not None and a.computation_type.value in UNIT_COST]
        out.append([(a.computation_type.value, a.stage_index, a.microbatch_index) for a in kept])
    return out
