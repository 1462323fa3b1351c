"""Pipeline schedules as data: for each pipeline rank, the ordered list of forward/backward actions.

Terms: ``p`` pipeline ranks, ``m`` micro-batches, ``v`` model chunks per rank (``v > 1`` only for the
interleaved schedule). Chunk ``c`` on rank ``s`` is *virtual stage* ``g = c * p + s``: the model is cut
into ``p * v`` consecutive pieces and virtual stage ``g`` feeds ``g + 1``. An action ``F(c, i)`` /
``B(c, i)`` runs the forward / backward of micro-batch ``i`` through chunk ``c``. Communication follows
from the actions: a forward receives its input from virtual stage ``g - 1`` (unless ``g = 0``) and sends
its output to ``g + 1`` (unless last); a backward receives the output gradient from ``g + 1`` and sends the
input gradient to ``g - 1``.

* ``gpipe``: all forwards, then all backwards. Bubble ``(p-1)/(m+p-1)``; activations of all ``m``
  micro-batches alive at once.
* ``1f1b``: ``p - s - 1`` warm-up forwards, then alternate one forward and one backward, then drain.
  Same bubble; at most ``p - s`` micro-batches in flight on rank ``s`` (``p`` on rank 0).
* ``interleaved_1f1b``: the same over ``v`` chunks per rank, in groups of ``p`` micro-batches
  (``m`` must be a multiple of ``p``); the bubble shrinks to ``(p-1)/(v m + p - 1)``, about ``1/v``.
* ``zb`` (zero bubble, ZB-H1 of Qi et al., 2023): the backward is split into ``B`` (the gradient of the
  stage's input, which the previous stage waits for) and ``W`` (the weight gradients, which nobody waits
  for). ``W`` passes are placed where 1F1B idles: the order comes from :func:`_zero_bubble`, list
  scheduling in which every rank prefers ``B``, then ``F``, then ``W``, for assumed action times. Made
  for ``F = B = W`` alone, the order suits only those: in a transformer ``B`` also holds attention's
  backward and the elementwise ops, ``W`` only the linear layers' weight gradients, so ``B > W``, and
  with ``B = 1.2 F``, ``W = 0.9 F`` that order's bubble is 0.076 at ``p = 2``, ``m = 16``, above 1F1B's
  0.059. So one order is made for each of ``ZB_COST_MODELS`` (``B = W = F``; ``1.2 F, 0.9 F``;
  ``1.3 F, 0.8 F``) and the one with the smallest mean makespan over the three is run (there: 0.026 at
  ``1.2 / 0.9``, still 0.020 at equal times). Memory: at most
  ``p - s`` micro-batches between their ``F`` and their ``B`` on rank ``s`` (1F1B's whole activations),
  and at most ``p`` between their ``F`` and their ``W`` (what ``W`` needs, the linear layers' inputs and
  output gradients, for no more micro-batches than 1F1B's peak on rank 0). Bounding the second by
  ``p - s`` as well would make the last stage run ``F B W`` in lockstep, which doubles the bubble. With
  ``F = B = W`` ZB-H1's bubble is ``(p-1)/(3m + p - 1)``, a third of 1F1B's; the chosen order reaches
  it exactly for ``p = 2``, and within 3 unit rounds otherwise (``p <= 6``, ``m <= 16``). It needs
  ``m >= p``.
* ``interleaved_zb``: the same split over ``v`` chunks per rank (as torch's
  ``ScheduleInterleavedZeroBubble``). The same scheduling and choice, with interleaved 1F1B's orders of
  forwards and of backwards on each rank and its bounds: at most interleaved 1F1B's own in-flight count
  on rank ``s`` between ``F`` and ``B`` (so the whole activations never exceed interleaved 1F1B's), and
  at most rank 0's between ``F`` and ``W``. With ``F = B = W`` it reaches ``(p-1)/(3 v m + p - 1)``, a
  third of interleaved 1F1B's, exactly for ``p = 2`` and within one unit round otherwise (``p <= 6``,
  ``v <= 4``, every multiple ``m <= 16`` of ``p``). It needs ``v >= 2`` and ``m`` a multiple of ``p``.

``slack`` (``1f1b`` and ``zb``; default 0): every rank but the last runs ``slack`` more warm-up forwards,
and keeps up to ``slack`` more micro-batches in flight. The bubbles above assume every action takes the
same time. When action times fluctuate (a shared CPU, clocks, other tenants), the steady state of 1F1B
with ``slack = 0`` has no give: a rank's ``F`` needs the forward its neighbour just finished and its
``B`` the gradient its neighbour just computed, so any late action idles the peer, and GPipe, which
buffers every forward, ends up with the smaller bubble. One micro-batch of slack decouples them: the
next activation is there before it is needed, so a peer's slow action is absorbed. Simulated with each
action's time drawn with a 15% coefficient of variation (``benchmarks/pp_sim.py``, p = 2, m = 16), the
bubble drops from 0.104 to 0.063 (1F1B; 0.059 without fluctuations) and from 0.042 to 0.029 (zb; 0.020).
The price is ``slack`` more micro-batches of activations on those ranks (``peak_in_flight``). Interleaved
1F1B's warm-up already holds ``(v - 1) p`` extra forwards, and GPipe all of them, so neither takes it.

:func:`check_schedule` simulates all ranks with blocking receives and reports a deadlock, a backward
before its forward, a missing action, or sends that do not match receives; :func:`peak_in_flight`
measures the activation memory bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b", "zb", "interleaved_zb"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b", "zb", "interleaved_zb")
SPLIT_BACKWARD: tuple[str, ...] = ("zb", "interleaved_zb")  # B is the input gradient, W the weights'
INTERLEAVED: tuple[str, ...] = ("interleaved_1f1b", "interleaved_zb")  # v >= 2 chunks per rank


@dataclass(frozen=True)
class Action:
    kind: Literal["F", "B", "W"]  # W: the weight gradients of a split backward (SPLIT_BACKWARD)
    chunk: int
    mb: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.mb}"


def validate_sizes(name: str, *, p: int, m: int, v: int, slack: int = 0) -> None:
    """Raise a ``ValueError`` naming the problem and a fix for an impossible (schedule, p, m, v, slack)."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline_schedule must be one of {SCHEDULES}, got {name!r}.")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline sizes must be >= 1, got p={p}, m={m}, v={v}.")
    if isinstance(slack, bool) or not isinstance(slack, int) or slack < 0:
        raise ValueError(
            f"pipeline_slack must be an integer >= 0 (extra micro-batches in flight), got {slack!r}."
        )
    if slack and name not in ("1f1b", "zb"):
        raise ValueError(
            f"pipeline_slack={slack} applies to the 1f1b and zb schedules; {name!r} already keeps"
            + (" every micro-batch in flight" if name == "gpipe" else " (v-1)*p extra forwards in flight")
            + ": use pipeline_slack=0 with it."
        )
    if name not in INTERLEAVED and v != 1:
        raise ValueError(
            f"{name!r} runs one chunk per rank; use interleaved_1f1b or interleaved_zb for v={v} chunks."
        )
    if name == "zb" and m < p:
        raise ValueError(
            f"pipeline_schedule='zb' needs num_microbatches >= the pipeline size (m={m}, p={p}): with fewer,"
            f" the weight-gradient passes have no bubble to fill; use m={p} or more."
        )
    if name in INTERLEAVED:
        if v < 2:
            raise ValueError(f"{name} needs at least 2 chunks per rank (virtual_stages >= 2), got {v}.")
        if m < p or m % p != 0:
            raise ValueError(
                f"{name} needs num_microbatches to be a multiple of the pipeline size (so m >= p):"
                f" m={m}, p={p}; use m={max(p, -(-m // p) * p)}."
            )


def build_schedule(name: str, *, p: int, m: int, v: int = 1, slack: int = 0) -> list[list[Action]]:
    """Per-rank action lists of the named schedule (see the module docstring)."""
    validate_sizes(name, p=p, m=m, v=v, slack=slack)
    if name == "gpipe":
        return [
            [Action("F", 0, i) for i in range(m)] + [Action("B", 0, i) for i in range(m)] for _ in range(p)
        ]
    if name == "1f1b":
        return [_one_f_one_b(s, p=p, m=m, slack=slack) for s in range(p)]
    if name == "zb":  # whole activations: 1F1B's p - s; what W needs: rank 0's p (module docstring)
        extra = [slack if s < p - 1 else 0 for s in range(p)]
        return _zero_bubble(
            p=p, m=m, v=1, until_b=[p - s + extra[s] for s in range(p)], until_w=[p + e for e in extra]
        )
    if name == "interleaved_zb":  # interleaved 1F1B's in-flight counts; what W needs: rank 0's
        until_b = [_interleaved_warmup(s, p=p, m=m, v=v) + 1 for s in range(p)]
        return _zero_bubble(p=p, m=m, v=v, until_b=until_b, until_w=[until_b[0]] * p)
    return [_interleaved(s, p=p, m=m, v=v) for s in range(p)]


def _one_f_one_b(s: int, *, p: int, m: int, slack: int = 0) -> list[Action]:
    warmup = min(p - s - 1 + (slack if s < p - 1 else 0), m)
    out = [Action("F", 0, i) for i in range(warmup)]
    f, b = warmup, 0
    while f < m:
        out += [Action("F", 0, f), Action("B", 0, b)]
        f, b = f + 1, b + 1
    out += [Action("B", 0, i) for i in range(b, m)]
    return out


# Cost models (F, B, W) the zero-bubble orders are made for and judged by; B is the input-gradient half
# of a split backward. In a transformer B holds attention's backward and the elementwise ops besides the
# linear layers' input gradients, W only their weight gradients, so B > W is the common case.
ZB_COST_MODELS: tuple[tuple[float, float, float], ...] = ((1.0, 1.0, 1.0), (1.0, 1.2, 0.9), (1.0, 1.3, 0.8))


def _zero_bubble(*, p: int, m: int, v: int, until_b: list[int], until_w: list[int]) -> list[list[Action]]:
    """The order of :func:`_list_schedule` for each of ``ZB_COST_MODELS`` that has the smallest mean
    makespan over those models (module docstring)."""
    orders = [_list_schedule(p=p, m=m, v=v, until_b=until_b, until_w=until_w, cost=c) for c in ZB_COST_MODELS]
    return min(orders, key=lambda o: sum(_makespan(o, p=p, v=v, cost=c) for c in ZB_COST_MODELS))


def _list_schedule(
    *, p: int, m: int, v: int, until_b: list[int], until_w: list[int], cost: tuple[float, float, float]
) -> list[list[Action]]:
    """ZB-H1 by list scheduling with action times ``cost = (F, B, W)`` and free transfers: repeatedly the
    rank that can start an action earliest runs one. A rank ``s`` free at time ``t`` runs the first of
    these it can start at ``t``: its next ``B`` (in interleaved 1F1B's order of backwards, for ``v = 1``
    micro-batch order) once its output gradient is there; its next ``F`` (in that order of forwards) once
    its input is there, while fewer than ``until_b[s]`` forwards wait for their ``B`` and fewer than
    ``until_w[s]`` for their ``W``; its oldest pending ``W``. If it can start none at ``t``, it waits for
    the one it can start first."""
    total, last = m * v, p * v - 1
    duration = dict(zip("FBW", cost, strict=True))
    out: list[list[Action]] = [[] for _ in range(p)]
    end: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, mb) -> finish time
    free = [0.0] * p
    next_f, next_b = [0] * p, [0] * p
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # (chunk, mb) of B without W
    while any(len(a) < 3 * total for a in out):
        best: tuple[float, int, Action] | None = None
        for s in range(p):
            t, f, b = free[s], next_f[s], next_b[s]
            ready: list[tuple[float, int, Action]] = []  # (start, priority, action)
            if b < total:
                c, i = _interleaved_backward(b, p=p, v=v)
                g = c * p + s
                needs = ("F", g, i) if g == last else ("B", g + 1, i)
                if needs in end:
                    ready.append((max(t, end[needs]), 0, Action("B", c, i)))
            if f < total and f - b < until_b[s] and f - (b - len(pending_w[s])) < until_w[s]:
                c, i = _interleaved_forward(f, p=p, v=v)
                g = c * p + s
                if g == 0 or ("F", g - 1, i) in end:
                    ready.append((t if g == 0 else max(t, end[("F", g - 1, i)]), 1, Action("F", c, i)))
            if pending_w[s]:
                ready.append((t, 2, Action("W", *pending_w[s][0])))
            now = [r for r in ready if r[0] <= t]
            pick = min(now, key=lambda r: r[1]) if now else min(ready, default=None)
            if pick is not None and (best is None or pick[0] < best[0]):
                best = (pick[0], s, pick[2])
        if best is None:
            raise AssertionError("zero-bubble list scheduling found no action to run")
        start, s, a = best
        out[s].append(a)
        free[s] = end[(a.kind, a.chunk * p + s, a.mb)] = start + duration[a.kind]
        if a.kind == "F":
            next_f[s] += 1
        elif a.kind == "B":
            next_b[s] += 1
            pending_w[s].append((a.chunk, a.mb))
        else:
            pending_w[s].pop(0)
    return out


def _makespan(schedule: list[list[Action]], *, p: int, v: int, cost: tuple[float, float, float]) -> float:
    """When the last rank finishes ``schedule`` (a valid one) with action times ``cost = (F, B, W)``,
    free transfers and every action started as soon as its rank is free and its input is there."""
    duration, last = dict(zip("FBW", cost, strict=True)), p * v - 1
    end: dict[tuple[str, int, int], float] = {}
    free, pos = [0.0] * p, [0] * p
    while any(pos[s] < len(schedule[s]) for s in range(p)):
        before = sum(pos)
        for s in range(p):
            while pos[s] < len(schedule[s]):
                a = schedule[s][pos[s]]
                g = a.chunk * p + s
                needs = {"F": ("F", g - 1, a.mb), "W": ("B", g, a.mb)}.get(
                    a.kind, ("F", g, a.mb) if g == last else ("B", g + 1, a.mb)
                )
                if a.kind == "F" and g == 0:
                    start = free[s]
                elif needs in end:
                    start = max(free[s], end[needs])
                else:
                    break
                free[s] = end[(a.kind, g, a.mb)] = start + duration[a.kind]
                pos[s] += 1
        if sum(pos) == before:
            raise ValueError("the schedule deadlocks")
    return max(free)


def _interleaved_forward(k: int, *, p: int, v: int) -> tuple[int, int]:
    """(chunk, micro-batch) of a rank's ``k``-th forward in interleaved order: groups of ``p``
    micro-batches go through chunk 0, then chunk 1, ..., then the next group (``v = 1``: micro-batch k)."""
    return (k // p) % v, (k // (p * v)) * p + k % p


def _interleaved_backward(k: int, *, p: int, v: int) -> tuple[int, int]:
    """The ``k``-th backward: the same groups, from the last chunk down."""
    return v - 1 - (k // p) % v, (k // (p * v)) * p + k % p


def _interleaved_warmup(s: int, *, p: int, m: int, v: int) -> int:
    """Forwards rank ``s`` runs before its first backward in interleaved 1F1B."""
    return min((p - s - 1) * 2 + (v - 1) * p, m * v)


def _interleaved(s: int, *, p: int, m: int, v: int) -> list[Action]:
    total = m * v
    warmup = _interleaved_warmup(s, p=p, m=m, v=v)
    out = [Action("F", *_interleaved_forward(k, p=p, v=v)) for k in range(warmup)]
    f, b = warmup, 0
    while f < total:
        out += [
            Action("F", *_interleaved_forward(f, p=p, v=v)),
            Action("B", *_interleaved_backward(b, p=p, v=v)),
        ]
        f, b = f + 1, b + 1
    out += [Action("B", *_interleaved_backward(k, p=p, v=v)) for k in range(b, total)]
    return out


def check_schedule(schedule: list[list[Action]], *, p: int, m: int, v: int) -> None:
    """Simulate every rank (blocking receives, buffered sends); raise ``ValueError`` if the schedule
    deadlocks, runs a backward before its forward, misses or repeats an action, or if the order in which
    a rank sends to a neighbour differs from the order in which that neighbour receives."""
    last = p * v - 1
    split = any(a.kind == "W" for actions in schedule for a in actions)
    kinds = ("F", "B", "W") if split else ("F", "B")
    expected = {(k, c, i) for c in range(v) for i in range(m) for k in kinds}
    for s, actions in enumerate(schedule):
        got = [(a.kind, a.chunk, a.mb) for a in actions]
        if sorted(got) != sorted(expected):
            raise ValueError(
                f"rank {s}: the actions are not each {'F, B and W' if split else 'F and B'} of every (chunk,"
                " micro-batch) once."
            )
    done: set[tuple[str, int, int]] = set()  # (kind, virtual stage, mb)
    pos = [0] * p
    sent: dict[tuple[int, int, str], list[int]] = {}  # (from g, to g, kind) -> mbs in send order
    recv: dict[tuple[int, int, str], list[int]] = {}
    while any(pos[s] < len(schedule[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while pos[s] < len(schedule[s]):
                a = schedule[s][pos[s]]
                g = a.chunk * p + s
                if a.kind == "F":
                    ready = g == 0 or ("F", g - 1, a.mb) in done
                    if ready and g > 0:
                        recv.setdefault((g - 1, g, "act"), []).append(a.mb)
                    if ready and g < last:
                        sent.setdefault((g, g + 1, "act"), []).append(a.mb)
                elif a.kind == "W":  # local: the weight gradients of a backward that ran on this rank
                    if ("B", g, a.mb) not in done:
                        raise ValueError(f"rank {s}: {a} before its backward.")
                    ready = True
                else:
                    if ("F", g, a.mb) not in done:
                        raise ValueError(f"rank {s}: {a} before its forward.")
                    ready = g == last or ("B", g + 1, a.mb) in done
                    if ready and g < last:
                        recv.setdefault((g + 1, g, "grad"), []).append(a.mb)
                    if ready and g > 0:
                        sent.setdefault((g, g - 1, "grad"), []).append(a.mb)
                if not ready:
                    break
                done.add((a.kind, g, a.mb))
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: schedule[s][pos[s]] for s in range(p) if pos[s] < len(schedule[s])}
            raise ValueError(f"the schedule deadlocks: ranks wait forever at {stuck}.")
    for key, order in sent.items():
        if recv.get(key) != order:
            raise ValueError(f"sends {key} in order {order} are received in order {recv.get(key)}.")


def peak_in_flight(actions: list[Action], *, until: Literal["B", "W"] | None = None) -> int:
    """Largest number of (chunk, micro-batch) forwards whose backward has not finished yet (with a split
    backward, ``zb``: whose ``W`` has not run, as the inputs ``W`` needs stay until then; ``until="B"``
    counts up to the ``B`` instead, the whole activations)."""
    done = until or ("W" if any(a.kind == "W" for a in actions) else "B")
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1 if a.kind == done else 0
        peak = max(peak, live)
    return peak
