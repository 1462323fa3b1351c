"""The pipeline's point-to-point transfers as data: which tensors each rank sends and receives, grouped
into the batches it posts with ``torch.distributed.batch_isend_irecv``, in schedule order.

NCCL matches the sends and receives between two ranks by **order** (it ignores tags), runs one batch (an
``ncclGroupStart/End``) at a time per communicator, and a send may wait until its receive is posted. So
a plan is correct when, for every ordered pair of ranks ``(a, b)``, the list of transfers ``a`` sends to
``b`` equals the list ``b`` receives from ``a`` (same transfers, same positions), and the execution in
which every rank posts its batches one after another, each batch completing once every op's partner has
been posted, reaches the end on every rank. :func:`check_plan` verifies both, plus the data flow (a
tensor is sent after the action that computes it, received before the action that needs it).

Planning rule (:func:`plan`): :func:`timing` runs the schedule in unit rounds (each rank runs its next
action as soon as the action's inputs were produced in an earlier round). After round ``t`` every rank
posts one batch holding every transfer produced in round ``t`` that it sends or receives, received early
if it is only needed later. Why this cannot deadlock: a batch after round ``t`` pairs only with the
batches other ranks post after the same round; once all batches of rounds ``< t`` have completed, every
rank can run its actions of rounds ``<= t`` (their inputs arrived in those batches) and post its batch
of round ``t``, whose partners are then all posted, so it completes; by induction every batch does. A
rank runs one action per round, so a batch holds at most one op per peer and direction and no order
inside it has to be agreed. Neighbours that exchange in both directions (1F1B's steady state:
activations down, gradients up) meet in one batch. Transfers between two virtual stages of the same
rank (``p = 1``) are handed over in memory and appear in no batch.

With ``headers=True`` (a step whose activation shapes are not known yet) every round's batch is split
in two: first the shape headers of the round's activations, then the tensors; the receiver reads the
headers in between to size its buffers (the same induction holds per half-round). Gradients never need
a header: they have the shape of the receiver's own output.

Everything here is pure Python: no tensors and no ``torch.distributed`` calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_par.pipeline.schedule import Action

Kind = Literal["act", "grad", "hdr"]


@dataclass(frozen=True)
class Transfer:
    """One tensor from virtual stage ``src`` to ``dst`` for micro-batch ``mb``: an activation
    (``dst = src + 1``), its shape header, or a gradient (``dst = src - 1``)."""

    kind: Kind
    src: int
    dst: int
    mb: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.src}->{self.dst}.{self.mb}"


@dataclass(frozen=True)
class Op:
    """Send ``transfer`` to pipeline rank ``peer`` (``send=True``) or receive it from ``peer``."""

    send: bool
    peer: int
    transfer: Transfer


@dataclass(frozen=True)
class Batch:
    """Ops posted together in one ``batch_isend_irecv``; the rank waits for all of them before its next
    item. ``ops`` keeps the order of same-direction ops to the same peer (that order is the matching)."""

    ops: tuple[Op, ...]


@dataclass(frozen=True)
class Compute:
    """Run ``action`` (its inputs have arrived in earlier batches)."""

    action: Action


Item = Batch | Compute


def stage_of(action: Action, *, rank: int, p: int) -> int:
    """The virtual stage of ``action`` on pipeline rank ``rank``: chunk ``c`` is stage ``c * p + rank``."""
    return action.chunk * p + rank


def inputs_of(action: Action, *, rank: int, p: int, v: int) -> list[Transfer]:
    """What ``action`` must receive before it runs: the activation from ``g - 1`` for a forward, the
    output gradient from ``g + 1`` for a backward (none at the ends of the pipeline)."""
    g, last = stage_of(action, rank=rank, p=p), p * v - 1
    if action.kind == "W":  # weight gradients: local, nothing to receive
        return []
    if action.kind == "F":
        return [Transfer("act", g - 1, g, action.mb)] if g > 0 else []
    return [Transfer("grad", g + 1, g, action.mb)] if g < last else []


def outputs_of(action: Action, *, rank: int, p: int, v: int) -> list[Transfer]:
    """What ``action`` sends once it has run: its output to ``g + 1`` after a forward, the gradient of
    its input to ``g - 1`` after a backward."""
    g, last = stage_of(action, rank=rank, p=p), p * v - 1
    if action.kind == "W":
        return []
    if action.kind == "F":
        return [Transfer("act", g, g + 1, action.mb)] if g < last else []
    return [Transfer("grad", g, g - 1, action.mb)] if g > 0 else []


def forward_only(*, p: int, m: int, v: int) -> list[list[Action]]:
    """The evaluation schedule: every micro-batch through every chunk in order, no backward."""
    return [[Action("F", c, i) for i in range(m) for c in range(v)] for _ in range(p)]


def timing(schedule: Sequence[Sequence[Action]], *, p: int, v: int) -> list[list[int]]:
    """The round at which each action runs when every action takes one round and starts as soon as its
    rank is free and its inputs were produced in an earlier round (``[rank][index]``). Raise
    ``ValueError`` if some rank can never run its next action (the schedule deadlocks)."""
    done: dict[tuple[str, int, int], int] = {}  # (kind, virtual stage, mb) -> round
    rounds: list[list[int]] = [[] for _ in range(p)]
    t = 0
    while any(len(rounds[s]) < len(schedule[s]) for s in range(p)):
        ran = []
        for s in range(p):
            if len(rounds[s]) == len(schedule[s]):
                continue
            action = schedule[s][len(rounds[s])]
            producers = [
                ("F" if x.kind == "act" else "B", x.src, x.mb) for x in inputs_of(action, rank=s, p=p, v=v)
            ]
            if action.kind == "B":  # a backward needs its own forward, earlier on this rank
                producers.append(("F", stage_of(action, rank=s, p=p), action.mb))
            if action.kind == "W":  # and the weight gradients their backward
                producers.append(("B", stage_of(action, rank=s, p=p), action.mb))
            if all(done.get(key, t) < t for key in producers):
                ran.append((s, action))
        if not ran:
            stuck = {s: schedule[s][len(rounds[s])] for s in range(p) if len(rounds[s]) < len(schedule[s])}
            raise ValueError(f"the schedule deadlocks: ranks wait forever at {stuck}.")
        for s, action in ran:  # after the scan: what runs at round t is visible from round t + 1 on
            key = (action.kind, stage_of(action, rank=s, p=p), action.mb)
            if key in done:
                raise ValueError(f"rank {s}: {action} appears twice.")
            done[key] = t
            rounds[s].append(t)
        t += 1
    return rounds


def plan(schedule: Sequence[Sequence[Action]], *, p: int, v: int, headers: bool) -> list[list[Item]]:
    """Every rank's items for ``schedule`` (rule in the module docstring): after round ``t`` each rank
    posts one batch with the transfers produced in round ``t`` that it sends or receives (two batches
    with ``headers``: the headers first)."""
    if len(schedule) != p:
        raise ValueError(f"expected a schedule for {p} ranks, got {len(schedule)}.")
    rounds = timing(schedule, p=p, v=v)
    # the schedules' contract (check_schedule): each link consumes in the order it produces; a plan could
    # carry another order, but a schedule that needs one is a bug to report, not to run
    produced: dict[tuple[str, int, int], list[int]] = {}
    consumed: dict[tuple[str, int, int], list[int]] = {}
    for s, actions in enumerate(schedule):
        for action in actions:
            for x in outputs_of(action, rank=s, p=p, v=v):
                produced.setdefault((x.kind, x.src, x.dst), []).append(x.mb)
            for x in inputs_of(action, rank=s, p=p, v=v):
                consumed.setdefault((x.kind, x.src, x.dst), []).append(x.mb)
    for link, order in produced.items():
        if consumed.get(link) != order:
            raise ValueError(
                f"{link} produces micro-batches in order {order}, consumed in {consumed.get(link)}."
            )
    keyed: list[list[tuple[int, int, Item]]] = [[] for _ in range(p)]  # (round, phase, item) per rank
    boundary: list[dict[tuple[int, int], list[Op]]] = [{} for _ in range(p)]  # (round, phase) -> ops
    for s, actions in enumerate(schedule):
        for action, t in zip(actions, rounds[s], strict=True):
            keyed[s].append((t, 0, Compute(action)))
            for x in outputs_of(action, rank=s, p=p, v=v):
                to = x.dst % p
                if to == s:  # p = 1: handed over in memory
                    continue
                for phase, y in ((1, header_of(x)), (2, x)) if headers and x.kind == "act" else ((2, x),):
                    boundary[s].setdefault((t, phase), []).append(Op(True, to, y))
                    boundary[to].setdefault((t, phase), []).append(Op(False, s, y))
    for s in range(p):
        for (t, phase), ops in boundary[s].items():
            # one action per rank and round: at most one op per peer and direction, so no order to agree on
            keyed[s].append((t, phase, Batch(tuple(sorted(ops, key=lambda o: (o.send, o.peer))))))
    return [[item for _, _, item in sorted(k, key=lambda e: (e[0], e[1]))] for k in keyed]


def check_plan(programs: Sequence[Sequence[Item]], *, p: int, v: int) -> None:
    """Raise ``ValueError`` unless the plans of all ``p`` ranks pair one-to-one in order, respect the data
    flow, and run to the end under NCCL's rules (module docstring). Cost: linear in the number of ops
    times the number of simulation rounds; milliseconds for real sizes."""
    if len(programs) != p:
        raise ValueError(f"expected plans for {p} ranks, got {len(programs)}.")
    _check_data_flow(programs, p=p, v=v)
    batches = [[item for item in items if isinstance(item, Batch)] for items in programs]
    # pairing: the n-th send a -> b is the n-th receive of b from a; streams[(a, b, send)] lists, on rank
    # a, the transfers exchanged with b in one direction, each with the index of its batch
    streams: dict[tuple[int, int, bool], list[tuple[Transfer, int]]] = {}
    for s, mine in enumerate(batches):
        for index, batch in enumerate(mine):
            for op in batch.ops:
                if op.peer == s or not 0 <= op.peer < p:
                    raise ValueError(f"rank {s}: {op} has no remote peer.")
                streams.setdefault((s, op.peer, op.send), []).append((op.transfer, index))
    for sender, receiver in {(a, b) if send else (b, a) for a, b, send in streams}:
        ours = [t for t, _ in streams.get((sender, receiver, True), [])]
        theirs = [t for t, _ in streams.get((receiver, sender, False), [])]
        if ours != theirs:
            raise ValueError(
                f"rank {sender} sends {ours} to rank {receiver}, which receives {theirs}: the streams do"
                " not pair one-to-one in order."
            )
    # deadlock: rank s completes its current batch once every op's partner batch has been posted
    partners: list[list[list[tuple[int, int]]]] = []  # [rank][batch] -> (peer, peer's batch index)
    for s, mine in enumerate(batches):
        partners.append([])
        position: dict[tuple[int, bool], int] = {}
        for batch in mine:
            needs = []
            for op in batch.ops:
                n = position.get((op.peer, op.send), 0)
                position[(op.peer, op.send)] = n + 1
                needs.append((op.peer, streams[(op.peer, s, not op.send)][n][1]))
            partners[s].append(needs)
    cursor = [0] * p
    while True:
        progressed = False
        for s in range(p):
            while cursor[s] < len(batches[s]) and all(cursor[q] >= k for q, k in partners[s][cursor[s]]):
                cursor[s] += 1
                progressed = True
        if all(cursor[s] == len(batches[s]) for s in range(p)):
            return
        if not progressed:
            stuck = {s: batches[s][cursor[s]].ops for s in range(p) if cursor[s] < len(batches[s])}
            raise ValueError(f"the p2p plan deadlocks: ranks wait forever at {stuck}.")


def _check_data_flow(programs: Sequence[Sequence[Item]], *, p: int, v: int) -> None:
    """Every send after the compute that produces it, every needed receive in an earlier batch than its
    compute, a received header in an earlier batch than its activation, and nothing posted twice."""
    for s, items in enumerate(programs):
        headers = {
            o.transfer for b in items if isinstance(b, Batch) for o in b.ops if o.transfer.kind == "hdr"
        }
        computed: set[Transfer] = set()
        arrived: set[Transfer] = set()  # received in a batch that has completed
        posted: set[tuple[bool, Transfer]] = set()
        for item in items:
            if isinstance(item, Compute):
                for t in inputs_of(item.action, rank=s, p=p, v=v):
                    if t.src % p != s and t not in arrived:
                        raise ValueError(f"rank {s}: {item.action} runs before {t} has arrived.")
                outs = outputs_of(item.action, rank=s, p=p, v=v)
                computed |= set(outs) | {header_of(t) for t in outs}
                continue
            for op in item.ops:
                t = op.transfer
                if (op.send, t) in posted:
                    raise ValueError(f"rank {s}: {t} is posted twice.")
                posted.add((op.send, t))
                if op.send and t not in computed:
                    raise ValueError(f"rank {s}: {t} is sent before it is computed.")
                if (
                    not op.send
                    and t.kind == "act"
                    and header_of(t) in headers
                    and header_of(t) not in arrived
                ):
                    raise ValueError(f"rank {s}: {t} is received before its header has been read.")
            arrived |= {op.transfer for op in item.ops if not op.send}


def header_of(t: Transfer) -> Transfer:
    """The header transfer announcing activation transfer ``t``'s shape."""
    return Transfer("hdr", t.src, t.dst, t.mb)
