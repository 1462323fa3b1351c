"""The pipeline's point-to-point plan and its execution.

(a) Pure: for every schedule and a broad range of (p, m, v), an independent simulation of NCCL's rules
(batches posted one after another per rank, matched by order per pair of ranks, a batch done once all its
partners are posted) pairs every send with the receive of the same transfer and runs to the end; sizes
and schedules that cannot run are refused. (b) Gloo runs on 1, 2 and 4 ranks against the unsharded
model: losses, gradients, evaluation and prediction, with shapes that change between training and
evaluation and with a ragged batch. (c) Every tensor handed to a p2p op or a collective carries the
runtime's device (tensor factories without ``device=`` would land on ``meta`` and fail), no tag is used,
and the host reads at most one value per step once shapes are known, whatever ``m``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_par.pipeline import PipelineRuntime, build_schedule, check_schedule, layer_costs, partition
from lightning_par.pipeline.p2p import Batch, Compute, Item, Op, Transfer, check_plan, forward_only, plan
from lightning_par.pipeline.schedule import Action, validate_sizes
from tests.distributed import run_distributed


def _cases() -> list[tuple[str, int, int, int]]:
    out = []
    for name in ("gpipe", "1f1b", "interleaved_1f1b", "forward"):
        for p in range(1, 7):
            for m in range(1, 13):
                for v in (1,) if name in ("gpipe", "1f1b") else (1, 2, 3):
                    if name == "forward":
                        out.append((name, p, m, v))
                        continue
                    try:
                        validate_sizes(name, p=p, m=m, v=v)
                    except ValueError:
                        with pytest.raises(ValueError):  # refused, never run
                            build_schedule(name, p=p, m=m, v=v)
                        continue
                    out.append((name, p, m, v))
    return out


def _simulate(programs: Sequence[Sequence[Item]], *, p: int, v: int) -> int:
    """Run the programs under NCCL's rules, independently of check_plan; return the number of transfers.
    Asserts the pairing (same transfer at the same position of each pair's stream), the data flow, and
    that no rank waits forever."""
    posted: dict[tuple[int, int, bool], list[Transfer]] = {}  # (rank, peer, send) -> posted transfers
    pos = [0] * p
    active: list[list[tuple[Op, int]] | None] = [None] * p  # the posted batch: (op, position in stream)
    arrived: list[set[Transfer]] = [set() for _ in range(p)]
    last = p * v - 1
    while any(pos[s] < len(programs[s]) or active[s] is not None for s in range(p)):
        progressed = False
        for s in range(p):
            while active[s] is None and pos[s] < len(programs[s]):
                item = programs[s][pos[s]]
                pos[s] += 1
                progressed = True
                if isinstance(item, Compute):
                    a, g = item.action, item.action.chunk * p + s
                    needed = None
                    if a.kind == "F" and g > 0:
                        needed = Transfer("act", g - 1, g, a.mb)
                    elif a.kind == "B" and g < last:
                        needed = Transfer("grad", g + 1, g, a.mb)
                    if needed is not None and needed.src % p != s:  # from another rank: arrived before
                        assert needed in arrived[s], (s, a)
                    continue
                mine = []
                for op in item.ops:
                    stream = posted.setdefault((s, op.peer, op.send), [])
                    mine.append((op, len(stream)))
                    stream.append(op.transfer)
                active[s] = mine
            batch = active[s]
            if batch is not None and all(
                len(posted.get((op.peer, s, not op.send), [])) > n for op, n in batch
            ):
                for op, n in batch:  # the partner at the same position carries the same transfer
                    assert posted[(op.peer, s, not op.send)][n] == op.transfer, (s, op)
                    if not op.send:
                        arrived[s].add(op.transfer)
                active[s] = None
                progressed = True
        assert progressed, f"deadlock at {[(pos[s], active[s]) for s in range(p)]}"
    sends = sum(len(t) for (_, _, send), t in posted.items() if send)
    assert sends == sum(len(t) for (_, _, send), t in posted.items() if not send)
    return sends


def test_every_schedule_pairs_in_order_and_never_blocks() -> None:
    checked = 0
    for name, p, m, v in _cases():
        schedule = forward_only(p=p, m=m, v=v) if name == "forward" else build_schedule(name, p=p, m=m, v=v)
        for headers in (False, True):
            programs = plan(schedule, p=p, v=v, headers=headers)
            check_plan(programs, p=p, v=v)
            transfers = _simulate(programs, p=p, v=v)
            # every boundary between virtual stages on different ranks carries m activations (+ m headers)
            # and, when training, m gradients
            remote = (p * v - 1) if p > 1 else 0
            per_link = (2 if headers else 1) + (name != "forward")
            assert transfers == remote * m * per_link, (name, p, m, v, headers)
            for items in programs:  # one op per peer and direction in a batch: no order to agree on
                for b in (i for i in items if isinstance(i, Batch)):
                    keys = [(op.peer, op.send) for op in b.ops]
                    assert len(keys) == len(set(keys))
            checked += 1
    assert checked > 700


def test_one_f_one_b_meets_in_fused_batches() -> None:
    # p=2, m=4: in the steady state rank 0 sends activation i+2 and receives gradient i+1 in the batch
    # where rank 1 sends that gradient and receives that activation: neither waits for the other
    programs = plan(build_schedule("1f1b", p=2, m=4), p=2, v=1, headers=False)

    def act(i: int, send: bool) -> Op:
        return Op(send, 1 if send else 0, Transfer("act", 0, 1, i))

    def grad(i: int, send: bool) -> Op:
        return Op(send, 0 if send else 1, Transfer("grad", 1, 0, i))

    batches = [[item.ops for item in items if isinstance(item, Batch)] for items in programs]
    assert batches[0] == [
        (act(0, True),), (act(1, True),), (grad(0, False),), (grad(1, False), act(2, True)),
        (grad(2, False), act(3, True)), (grad(3, False),),
    ]  # fmt: skip
    assert batches[1] == [
        (act(0, False),), (act(1, False),), (grad(0, True),), (act(2, False), grad(1, True)),
        (act(3, False), grad(2, True)), (grad(3, True),),
    ]  # fmt: skip
    assert [i.action for i in programs[1] if isinstance(i, Compute)] == build_schedule("1f1b", p=2, m=4)[1]


def test_bad_schedules_and_plans_are_refused() -> None:
    good = build_schedule("1f1b", p=2, m=2)
    cyclic = [
        [Action("F", 0, 1), Action("F", 0, 0), Action("B", 0, 0), Action("B", 0, 1)],
        [Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)],
    ]
    backward_first = [good[0], [good[1][1], good[1][0], *good[1][2:]]]
    twice = [good[0], [*good[1], good[1][0]]]
    for bad in (cyclic, backward_first, twice):
        with pytest.raises(ValueError):
            check_schedule(bad, p=2, m=2, v=1)
        with pytest.raises(ValueError, match=r"deadlocks|twice|order"):
            plan(bad, p=2, v=1, headers=False)
    x0, x1, y0, y1 = (Transfer(k, s, d, i) for k, s, d in (("act", 0, 1), ("grad", 1, 0)) for i in (0, 1))
    f0, f1, b0, b1 = (Compute(Action(k, 0, i)) for k in "FB" for i in (0, 1))
    # 1F1B with every send in a batch of its own: rank 0's second send waits for rank 1's receive, which
    # comes after rank 1's send of gradient 0, which waits for rank 0's receive behind that second send
    separate = [
        [f0, Batch((Op(True, 1, x0),)), f1, Batch((Op(True, 1, x1),)), Batch((Op(False, 1, y0),)), b0,
         Batch((Op(False, 1, y1),)), b1],
        [Batch((Op(False, 0, x0),)), f0, b0, Batch((Op(True, 0, y0),)), Batch((Op(False, 0, x1),)), f1, b1,
         Batch((Op(True, 0, y1),))],
    ]  # fmt: skip
    with pytest.raises(ValueError, match="deadlocks"):
        check_plan(separate, p=2, v=1)
    swapped = [[f0, f1, Batch((Op(True, 1, x0),)), Batch((Op(True, 1, x1),))],
               [Batch((Op(False, 0, x1),)), Batch((Op(False, 0, x0),)), f0, f1]]  # fmt: skip
    with pytest.raises(ValueError, match="one-to-one in order"):
        check_plan(swapped, p=2, v=1)
    early = [[Batch((Op(True, 1, x0),)), f0], [Batch((Op(False, 0, x0),)), f0]]
    with pytest.raises(ValueError, match="before it is computed"):
        check_plan(early, p=2, v=1)


# ---------------------------------------------------------------------------------------------- Gloo runs
WIDTHS = [6, 10, 7, 9, 5, 8, 6, 4, 3]  # every boundary between layers has its own width
M = 4
READS = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy"}


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(nn.Linear(a, b, dtype=torch.float64), nn.Tanh()) for a, b in itertools.pairwise(WIDTHS)
    ]


def _steps() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Training at 8 samples, evaluation at 12, training again (known shapes), prediction at 12, a
    ragged training batch of 4, evaluation again: every change of shape goes through a header step."""
    g = torch.Generator().manual_seed(1)
    plan_ = [("train", 8), ("eval", 12), ("train", 8), ("predict", 12), ("train", 4), ("eval", 12)]
    return [
        (kind, torch.randn(n, WIDTHS[0], generator=g, dtype=torch.float64),
         torch.randn(n, WIDTHS[-1], generator=g, dtype=torch.float64))
        for kind, n in plan_
    ]  # fmt: skip


def _names(layers: Sequence[nn.Module]) -> dict[int, str]:
    return {id(p): f"{i}.{n}" for i, layer in enumerate(layers) for n, p in layer.named_parameters()}


def _reference() -> list[dict[str, Any]]:
    layers = _layers()
    model, names = nn.Sequential(*layers), _names(layers)
    out = []
    for kind, x, y in _steps():
        model.zero_grad(set_to_none=True)
        if kind == "train":
            loss = sum(F.mse_loss(model(a), b) for a, b in zip(x.chunk(M), y.chunk(M), strict=True)) / M
            loss.backward()  # type: ignore[union-attr]
            grads = {names[id(p)]: p.grad.clone() for p in model.parameters() if p.grad is not None}
            out.append({"value": loss.detach().float(), "grads": grads})  # losses come back in fp32
        else:
            with torch.no_grad():
                outs = [model(a) for a in x.chunk(M)]
            losses = [F.mse_loss(o, b) for o, b in zip(outs, y.chunk(M), strict=True)]
            mean = (sum(losses) / M).float()  # type: ignore[union-attr]
            out.append({"value": torch.cat(outs) if kind == "predict" else mean, "grads": {}})
    return out


class _HostReads(TorchFunctionMode):
    """Counts the tensor methods that copy a value to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += getattr(func, "__name__", "") in READS
        return func(*args, **(kwargs or {}))


def _pipeline(rank: int, world: int, runs: list[tuple[str, int, int]]) -> dict[str, Any]:
    seen: list[tuple[torch.device, int]] = []  # (device, tag) of every tensor given to communication
    real_batch, real_broadcast = dist.batch_isend_irecv, dist.broadcast

    def batch(ops: list[dist.P2POp]) -> Any:
        seen.extend((op.tensor.device, op.tag) for op in ops)
        return real_batch(ops)

    def broadcast(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen.append((tensor.device, 0))
        return real_broadcast(tensor, *args, **kwargs)

    dist.batch_isend_irecv, dist.broadcast = batch, broadcast  # type: ignore[assignment]
    results: dict[str, Any] = {}
    for schedule, v, slack in runs:
        layers = _layers()
        pieces = partition(layer_costs(layers, "uniform"), world * v)
        chunks = [nn.Sequential(*layers[slice(*pieces[c * world + rank])]) for c in range(v)]
        runtime = PipelineRuntime(
            chunks=chunks, group=dist.group.WORLD, schedule=schedule, num_microbatches=M, slack=slack
        )
        names = _names(layers)
        local = [p for c in chunks for p in c.parameters()]
        steps = []
        for kind, x, y in _steps():
            for p in local:
                p.grad = None
            xs = list(x.chunk(M)) if rank == 0 else None  # only the first stage gets the inputs
            ys = y.chunk(M)
            # tensor factories without an explicit device= would make meta tensors, which Gloo refuses
            with torch.device("meta"), _HostReads() as reads:
                if kind == "train":
                    value = runtime.train_step(inputs=xs, loss_fn=lambda o, i, ys=ys: F.mse_loss(o, ys[i]))
                elif kind == "eval":
                    value = runtime.forward_step(inputs=xs, loss_fn=lambda o, i, ys=ys: F.mse_loss(o, ys[i]))
                else:
                    value = runtime.predict_step(inputs=xs)
            grads = {names[id(p)]: p.grad.clone() for p in local if p.grad is not None}
            steps.append({"value": value.clone(), "grads": grads, "reads": reads.count})
        assert seen and all(device == runtime.device for device, _ in seen), set(seen)
        assert all(tag == 0 for _, tag in seen)
        results[f"{schedule}/{v}/{slack}"] = {"steps": steps, "device": str(runtime.device), "ops": len(seen)}
        seen.clear()
    return results


def _expected_reads(rank: int, world: int, v: int) -> list[int]:
    """Host reads per step: the shape id on ranks > 0; in a step with new shapes one per activation
    header received; prediction reads its result's header once on ranks other than the last."""
    shape_id = int(world > 1 and rank > 0)
    headers = M * sum(1 for c in range(v) if c * world + rank > 0) if world > 1 else 0
    new = [True, True, False, False, True, False]  # train 8, eval 12, train 8, predict 12, train 4, eval 12
    reads = [shape_id + (headers if n else 0) for n in new]
    reads[3] += int(world > 1 and rank != world - 1)
    return reads


def assert_steps_match(
    per_rank: list[list[dict[str, Any]]], reference: list[dict[str, Any]], key: str
) -> None:
    """Every rank's step values equal the reference's; the gradients of all ranks, merged, equal its."""
    merged: list[dict[str, torch.Tensor]] = [{} for _ in reference]
    for rank, steps in enumerate(per_rank):
        for i, (step, ref) in enumerate(zip(steps, reference, strict=True)):
            torch.testing.assert_close(step["value"], ref["value"], msg=f"{key} step {i} rank {rank}")
            merged[i].update(step["grads"])
    for i, ref in enumerate(reference):
        assert set(merged[i]) == set(ref["grads"]), (key, i)
        for name, grad in ref["grads"].items():
            torch.testing.assert_close(merged[i][name], grad, msg=f"{key} step {i} {name}")


def _compare(results: list[dict[str, Any]], world: int) -> None:
    reference = _reference()
    for key, _ in results[0].items():
        v = int(key.split("/")[1])
        for rank, r in enumerate(results):
            run = r[key]
            assert run["device"] == "cpu" and run["ops"] > 0
            assert [s["reads"] for s in run["steps"]] == _expected_reads(rank, world, v), (key, rank)
        assert_steps_match([r[key]["steps"] for r in results], reference, key)


def test_two_ranks_match_the_unsharded_model() -> None:
    runs = [("gpipe", 1, 0), ("1f1b", 1, 0), ("interleaved_1f1b", 2, 0), ("interleaved_1f1b", 4, 0)]
    runs += [("1f1b", 1, 1), ("zb", 1, 1)]  # slack: one more micro-batch in flight on rank 0
    runs += [("interleaved_zb", 2, 0), ("interleaved_zb", 3, 0)]
    _compare(run_distributed(_pipeline, 2, runs), 2)


def test_four_ranks_and_one_rank_match_the_unsharded_model() -> None:
    runs = [
        ("1f1b", 1, 0),
        ("interleaved_1f1b", 2, 0),
        ("1f1b", 1, 2),
        ("zb", 1, 1),
        ("interleaved_zb", 2, 0),
    ]
    _compare(run_distributed(_pipeline, 4, runs), 4)
    # one rank: interleaved chunks hand their tensors over in memory
    one = [("gpipe", 1, 0), ("interleaved_1f1b", 2, 0), ("interleaved_zb", 2, 0)]
    _compare(run_distributed(_pipeline, 1, one), 1)
