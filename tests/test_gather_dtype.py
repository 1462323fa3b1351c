"""ZeRO-3's parameter all-gather in low precision (``gather_dtype="bf16"|"fp16"|"int8"``), 2 Gloo ranks.

The fp32 masters stay exact in the shards; forward and backward see the gathered weights rounded. The
unsharded twin is one process that rounds its weights the same way before every forward and applies the
gradient to the exact fp32 weights: bf16 must equal it to round-off. int8 is blockwise-quantized over each
rank's shard (a scale per 256 values), so its twin is the bound: every gathered weight within half a
step (``max|block| / 254``) of its master, the gathers a quarter of the fp32 bytes plus the scales.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_par import HybridParallelStrategy
from lightning_par.zero import unit as unit_module
from lightning_par.zero.quantize import BLOCK, dequantize_blockwise, quantize_blockwise
from lightning_par.zero.stage3 import Stage3Engine
from tests.distributed import run_distributed

STEPS = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 300), nn.Tanh(), nn.Linear(300, 20), nn.Tanh(), nn.Linear(20, 4))


def _batches(part: int, parts: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g)) for _ in range(STEPS)]
    return [(x.chunk(parts)[part], y.chunk(parts)[part]) for x, y in data]


def _ours(rank: int, world: int, dtype: torch.dtype | None) -> dict[str, Any]:
    model = _model()
    engine = Stage3Engine(model, group=dist.group.WORLD, gather_dtype=dtype)  # type: ignore[arg-type]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine.shard_optimizers([opt])
    seen: list[torch.Tensor] = []
    hook = model[0].register_forward_pre_hook(lambda m, a: seen.append(m.weight.detach().clone()))
    sent = [0]
    real = unit_module.all_gather_flat

    def counting(out: torch.Tensor, src: torch.Tensor, **kw: Any) -> Any:
        sent[0] += src.numel() * src.element_size()
        return real(out, src, **kw)

    unit_module.all_gather_flat = counting  # type: ignore[assignment]
    masters: list[torch.Tensor] = []
    try:
        for x, y in _batches(rank, world):
            opt.zero_grad()
            with engine.forward_context():
                loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            engine.after_step()
            full = engine.full_state_dict(to_rank=rank)
            masters.append(full["0.weight"].clone())
    finally:
        unit_module.all_gather_flat = real  # type: ignore[assignment]
        hook.remove()
    engine.unshard_all()
    engine.remove()
    return {
        "state": {n: p.detach().clone() for n, p in model.named_parameters()},
        "seen": seen,
        "masters": masters,
        "gather_bytes": sent[0],
    }


def _twin(dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """One process, whole batches, weights rounded to ``dtype`` for forward and backward only."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in _batches(0, 1):
        opt.zero_grad()
        exact = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(dtype).float() if dtype is not None else p)
        nn.functional.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p, e in zip(model.parameters(), exact, strict=True):
                p.copy_(e)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _runs(rank: int, world: int) -> dict[str, Any]:
    return {str(d): _ours(rank, world, d) for d in (None, torch.bfloat16, torch.float16, torch.int8)}


def test_low_precision_parameter_gathers_equal_their_twins() -> None:
    r = run_distributed(_runs, 2)[0]
    for dtype in (None, torch.bfloat16, torch.float16):
        twin = _twin(dtype)
        for n, v in twin.items():
            torch.testing.assert_close(
                r[str(dtype)]["state"][n], v, rtol=1e-5, atol=1e-6, msg=f"{dtype}: {n}"
            )
    exact, bf16 = r["None"], r[str(torch.bfloat16)]
    assert bf16["gather_bytes"] * 2 == exact["gather_bytes"]
    assert max((bf16["state"][n] - exact["state"][n]).abs().max().item() for n in exact["state"]) > 1e-6
    # int8: the weights forward saw (from the second step on) are the masters of the step before, each
    # within half a quantization step of its block's scale; and visibly rounded
    int8 = r[str(torch.int8)]
    for seen, master in zip(int8["seen"][1:], int8["masters"][:-1], strict=True):
        err = (seen - master).abs()
        assert err.max().item() <= master.abs().max().item() / 254 + 1e-7
        assert err.max().item() > 0
    scales = exact["gather_bytes"] / 4 / BLOCK * 4  # at most one fp32 scale per block (plus padding)
    assert exact["gather_bytes"] / 4 <= int8["gather_bytes"] <= exact["gather_bytes"] / 4 + 2 * scales + 64


def _alone(rank: int, world: int) -> dict[str, Any]:
    return {str(d): _ours(rank, world, d)["state"] for d in (None, torch.bfloat16, torch.int8)}


def test_a_group_of_one_gathers_without_rounding() -> None:
    """One data-parallel rank (a tensor-parallel run on as many ranks as its tp size): nothing travels,
    so a low-precision gather must not round the weights (before: 4.4e-3 on a tp2 loss with int8)."""
    r = run_distributed(_alone, 1)[0]
    for dtype in (torch.bfloat16, torch.int8):
        torch.testing.assert_close(r[str(dtype)], r["None"], rtol=0, atol=0, msg=str(dtype))


def test_quantizer_round_trip_and_padding() -> None:
    g = torch.Generator().manual_seed(0)
    shards = [torch.randn(BLOCK + 37, generator=g) * 10**k for k in range(3)]
    shards[1][:BLOCK] = 0  # an all-zero block
    pieces = [quantize_blockwise(s) for s in shards]
    q = torch.cat([p[0] for p in pieces])
    scales = torch.cat([p[1] for p in pieces])
    out = torch.empty(sum(s.numel() for s in shards))
    dequantize_blockwise(q, scales, out, parts=len(shards))
    for k, (s, got) in enumerate(zip(shards, out.split(BLOCK + 37), strict=True)):
        for lo in (0, BLOCK):
            block = s[lo : lo + BLOCK]
            bound = block.abs().max().item() / 254 + 1e-6 * 10**k
            assert (got[lo : lo + BLOCK] - block).abs().max().item() <= bound, (k, lo)
    assert torch.equal(out[BLOCK + 37 : 2 * BLOCK + 37], torch.zeros(BLOCK))


def test_gather_dtype_is_checked_at_construction() -> None:
    with pytest.raises(ValueError, match="applies at zero_stage=3 only"):
        HybridParallelStrategy(zero_stage=2, gather_dtype="bf16")
    with pytest.raises(ValueError, match="gather_dtype must be one of"):
        HybridParallelStrategy(zero_stage=3, gather_dtype="int4")  # type: ignore[arg-type]
    assert HybridParallelStrategy(zero_stage=3, gather_dtype="int8").gather_dtype == "int8"
