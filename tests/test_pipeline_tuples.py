"""Tuples between pipeline stages: hidden states with a boolean mask, integer positions, a second float
stream and a float constant that needs no gradient, cut at tuple and at single-tensor boundaries, against
the unsharded model on 1, 2 and 4 ranks for every schedule: per-step losses (training with a new and a
known shape, evaluation), gradients and predictions. Plus the structure's unit rules (headers, refusals)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_par.pipeline import PipelineRuntime, layer_costs, partition
from lightning_par.pipeline.mail import HEADER, MAX_PARTS, Spec, backward_args, decode, encode, parts_of
from tests.distributed import run_distributed
from tests.test_pipeline_p2p import assert_steps_match

W, M = 6, 4
F64 = torch.float64


class _Embed(nn.Module):
    """x -> (h, mask, side, positions, const): bool and int64 parts, a float constant without gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.h, self.side = nn.Linear(W, W, dtype=F64), nn.Linear(W, W, dtype=F64)

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        positions = torch.arange(x.shape[0], device=x.device)
        return self.h(x), x[:, :1] > 0, torch.tanh(self.side(x)), positions, torch.full_like(x, 0.5)


class _Mix(nn.Module):
    """Every part used: the mask gates the update, positions and the constant shift it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W, dtype=F64)

    def forward(self, x: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        h, mask, side, positions, const = x
        h = h + torch.where(mask, torch.tanh(self.lin(h + side)), const) + 0.01 * positions[:, None]
        return h, mask, side * 0.9, positions, const


class _Squash(nn.Module):
    """Tuple -> one tensor."""

    def forward(self, x: tuple[Tensor, ...]) -> Tensor:
        h, mask, side, _, const = x
        return h + side * mask + const


class _Fork(nn.Module):
    """One tensor -> (h, side), two float streams."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W, dtype=F64)

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        return torch.tanh(self.lin(h)), h


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(W, W, dtype=F64), nn.Linear(W, W, dtype=F64)

    def forward(self, x: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        h, side = x
        return torch.tanh(self.a(h)) + side, torch.tanh(self.b(side))


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(W, 2, dtype=F64)

    def forward(self, x: tuple[Tensor, Tensor]) -> Tensor:
        h, side = x
        return self.lin(h * side)


def _layers() -> list[nn.Module]:
    """Eight layers cut uniformly into ``p * v`` chunks: 2 chunks cross at (h, side) after layer 3; 4 at the
    5-tuple after layer 1 and at (h, side) after 3 and 5; 8 after every layer, _Squash's single tensor
    after layer 2 included."""
    torch.manual_seed(0)
    return [_Embed(), _Mix(), _Squash(), _Fork(), _Pair(), _Pair(), _Pair(), _Head()]


def _batches() -> list[tuple[str, Tensor, Tensor]]:
    """Training at 8 samples, training again (known shapes), evaluation at 12, prediction at 12."""
    g = torch.Generator().manual_seed(1)
    plan = [("train", 8), ("train", 8), ("eval", 12), ("predict", 12)]
    return [
        (k, torch.randn(n, W, generator=g, dtype=F64), torch.randn(n, 2, generator=g, dtype=F64))
        for k, n in plan
    ]


def _names(layers: list[nn.Module]) -> dict[int, str]:
    return {id(p): f"{i}.{n}" for i, layer in enumerate(layers) for n, p in layer.named_parameters()}


def _reference() -> list[dict[str, Any]]:
    layers = _layers()
    model, names, out = nn.Sequential(*layers), _names(layers), []
    for kind, x, y in _batches():
        model.zero_grad(set_to_none=True)
        pairs = list(zip(x.chunk(M), y.chunk(M), strict=True))
        if kind == "train":
            loss = sum(F.mse_loss(model(a), b) for a, b in pairs) / M
            loss.backward()  # type: ignore[union-attr]
            grads = {names[id(p)]: p.grad.clone() for p in model.parameters() if p.grad is not None}
            out.append({"value": loss.detach().float(), "grads": grads})
            continue
        with torch.no_grad():
            outs = [model(a) for a, _ in pairs]
        mean = (sum(F.mse_loss(o, b) for o, (_, b) in zip(outs, pairs, strict=True)) / M).float()  # type: ignore[union-attr]
        out.append({"value": torch.cat(outs) if kind == "predict" else mean, "grads": {}})
    return out


def _pipeline(rank: int, world: int, runs: list[tuple[str, int]]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for schedule, v in runs:
        layers = _layers()
        pieces = partition(layer_costs(layers, "uniform"), world * v)
        chunks = [nn.Sequential(*layers[slice(*pieces[c * world + rank])]) for c in range(v)]
        runtime = PipelineRuntime(
            chunks=chunks, group=dist.group.WORLD, schedule=schedule, num_microbatches=M
        )
        names, local = _names(layers), [p for c in chunks for p in c.parameters()]
        steps = []
        for kind, x, y in _batches():
            for p in local:
                p.grad = None
            xs, ys = (list(x.chunk(M)) if rank == 0 else None), y.chunk(M)
            loss_fn = lambda o, i, ys=ys: F.mse_loss(o, ys[i])  # noqa: E731
            if kind == "train":
                value = runtime.train_step(inputs=xs, loss_fn=loss_fn)
            elif kind == "eval":
                value = runtime.forward_step(inputs=xs, loss_fn=loss_fn)
            else:
                value = runtime.predict_step(inputs=xs)
            grads = {names[id(p)]: p.grad.clone() for p in local if p.grad is not None}
            steps.append({"value": value.clone(), "grads": grads})
        results[f"{schedule}/{v}"] = steps
    return results


def _compare(results: list[dict[str, Any]]) -> None:
    reference = _reference()
    for key in results[0]:
        assert_steps_match([r[key] for r in results], reference, key)


def test_tuples_between_stages_match_the_unsharded_model() -> None:
    runs = [("gpipe", 1), ("1f1b", 1), ("zb", 1), ("interleaved_1f1b", 2), ("interleaved_zb", 2)]
    runs += [("interleaved_1f1b", 4)]  # 8 chunks: every boundary, the single tensor's among them
    _compare(run_distributed(_pipeline, 2, runs))
    _compare(run_distributed(_pipeline, 4, [("1f1b", 1), ("interleaved_1f1b", 2)]))
    _compare(run_distributed(_pipeline, 1, [("interleaved_1f1b", 2), ("interleaved_zb", 4)]))  # in memory


def test_structure_headers_and_refusals() -> None:
    value = (torch.zeros(2, 3), torch.ones(4, dtype=torch.bool), torch.arange(5))
    spec = Spec.of(value)
    header = encode(spec, device=torch.device("cpu"))
    assert header.shape == (HEADER,) and decode(header) == spec and spec.is_tuple
    single = Spec.of(torch.zeros(7, 1, dtype=torch.bfloat16))
    assert decode(encode(single, device=torch.device("cpu"))) == single and not single.is_tuple
    assert spec.describe() == "((2, 3) torch.float32, (4,) torch.bool, (5,) torch.int64)"
    with pytest.raises(TypeError, match=r"one tensor, or a flat tuple of 1 to 8 tensors.*got dict"):
        parts_of({"h": torch.zeros(1)})
    with pytest.raises(TypeError, match=r"got a tuple of 2 \(Tensor, tuple\)"):
        parts_of((torch.zeros(1), (torch.zeros(1),)))
    with pytest.raises(TypeError, match=rf"got a list of {MAX_PARTS + 1} "):
        parts_of([torch.zeros(1)] * (MAX_PARTS + 1))
    with pytest.raises(TypeError, match="Cannot send a 7-d"):
        encode(Spec.of(torch.zeros([1] * 7)), device=torch.device("cpu"))
    # a gradient per floating-point part that requires one; the others are skipped
    h = torch.zeros(2, requires_grad=True) * 2
    outs, grads = backward_args((h, torch.ones(2), torch.arange(2)), [torch.ones(2), torch.ones(2)])
    assert outs == [h] and grads is not None and len(grads) == 1
