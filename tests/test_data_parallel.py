"""ZeRO stage 0 (GradSync) against the unsharded single-process reference, without a Trainer."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_par.models.gpt import GPT, GPTConfig
from lightning_par.zero import FlatLayout, UnusedParametersError, apply_data_parallel
from tests.distributed import run_distributed
from tests.reference import data_parallel_backward

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)
GLOBAL_BATCH = 8
STEPS = 4


def _batches(steps: int, batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, CFG.vocab_size, (steps, batch, CFG.block_size + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _reference(
    batches: list[tuple[torch.Tensor, torch.Tensor]], *, micro: int = 1
) -> tuple[list[float], GPT]:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        # unsharded, one process; gradients summed in the ranks' order (see tests/reference.py)
        losses.append(sum(data_parallel_backward(model, _loss, x, y, world=2, micro=micro)) / 2)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return losses, model


def _train_dp(
    rank: int, world: int, *, micro: int, bucket_mb: float
) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(100 + rank)  # deliberately different init per rank: the engine must broadcast rank 0's
    model = GPT(CFG)
    if rank == 0:
        torch.manual_seed(0)
        model = GPT(CFG)
    sync = apply_data_parallel(model, group=dist.group.WORLD, bucket_size_mb=bucket_mb)
    assert len(sync.layout.buckets) > 1 or bucket_mb > 1
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    per_rank = GLOBAL_BATCH // world
    for x, y in _batches(STEPS, GLOBAL_BATCH):
        opt.zero_grad()
        xs, ys = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        total = torch.zeros(())
        for k, (mx, my) in enumerate(zip(xs.chunk(micro), ys.chunk(micro), strict=True)):
            loss = _loss(model, mx, my) / micro
            if k < micro - 1:
                with sync.no_sync():
                    loss.backward()
            else:
                loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append(total.item())
    sync.remove()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _dp_cases(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {}
    out["plain"] = _train_dp(rank, world, micro=1, bucket_mb=0.02)
    out["accum4"] = _train_dp(rank, world, micro=4, bucket_mb=0.02)
    out["one_bucket"] = _train_dp(rank, world, micro=2, bucket_mb=64)
    out["order"] = _ready_order(rank)
    out["unused"] = _unused(rank)
    return out


def _ready_order(rank: int) -> list[str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    # register the parameters in an order unlike their use, the rebuild must fix the bucket order
    sync = apply_data_parallel(model, group=dist.group.WORLD, bucket_size_mb=1e-5)
    before = [s.name for s in sync.layout.slots]
    model(torch.ones(2, 4)).sum().backward()
    after = [s.name for s in sync.layout.slots]
    sync.remove()
    assert before == ["2.bias", "2.weight", "0.bias", "0.weight"]
    return after


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 3)
        self.head_a = nn.Linear(3, 1)
        self.head_b = nn.Linear(3, 1)  # rank 0 only
        self.never = nn.Linear(3, 1)  # no rank

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.body(x)
        out = self.head_a(h)
        return out + self.head_b(h) if use_b else out


def _unused(rank: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = _TwoHeads()
    strict = apply_data_parallel(model, group=dist.group.WORLD)
    with pytest.raises(UnusedParametersError, match=r"never\.weight"):
        model(torch.ones(2, 3), use_b=rank == 0).sum().backward()
    strict.remove()
    model.zero_grad(set_to_none=True)
    ref = copy.deepcopy(model)
    ref(torch.ones(2, 3), use_b=True).sum().backward()  # rank 0's contribution to head_b
    lenient = apply_data_parallel(model, group=dist.group.WORLD, find_unused_parameters=True)
    model(torch.ones(2, 3), use_b=rank == 0).sum().backward()
    lenient.remove()
    assert model.never.weight.grad is None
    assert model.head_b.weight.grad is not None and ref.head_b.weight.grad is not None
    torch.testing.assert_close(model.head_b.weight.grad, ref.head_b.weight.grad / 2)
    torch.testing.assert_close(model.head_a.weight.grad, ref.head_a.weight.grad)
    return {"ok": True}


def test_data_parallel_matches_single_process() -> None:
    results = run_distributed(_dp_cases, 2)
    batches = _batches(STEPS, GLOBAL_BATCH)
    refs = {micro: _reference(batches, micro=micro) for micro in (1, 4, 2)}
    for case, micro in (("plain", 1), ("accum4", 4), ("one_bucket", 2)):
        ref_losses, ref_model = refs[micro]
        ref_state = ref_model.state_dict()
        for rank, res in enumerate(results):
            losses, state = res[case]  # type: ignore[index]
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(ref_losses), msg=f"{case} rank {rank}"
            )
            for k, v in ref_state.items():
                torch.testing.assert_close(state[k], v, msg=f"{case} rank {rank} {k}")
    # gradients became ready last layer first: the rebuilt order puts it in the first bucket
    assert results[0]["order"][:2] == ["2.bias", "2.weight"] or results[0]["order"][:2] == [
        "2.weight",
        "2.bias",
    ]
    assert results[0]["order"] == results[1]["order"]
    assert all(r["unused"] == {"ok": True} for r in results)


def test_flat_layout_buckets_and_shards() -> None:
    layout = FlatLayout(
        names=["a", "b", "c", "d"], shapes=[(3, 2), (5,), (7,), (1,)], bucket_numel=11, shard_count=2
    )
    # a+b = 11 fit one bucket; c+d = 8 the next; buckets padded to a multiple of 2
    assert [(b.start, b.numel, b.slots) for b in layout.buckets] == [(0, 12, (0, 1)), (12, 8, (2, 3))]
    assert layout.numel == 20 and layout.shard_numel == 10
    cover: dict[int, int] = {}
    for rank in range(2):
        frags = layout.fragments(rank)
        assert sum(f.numel for f in frags) <= layout.shard_numel
        for f in frags:
            cover[f.slot] = cover.get(f.slot, 0) + f.numel
    assert cover == {0: 6, 1: 5, 2: 7, 3: 1}
    with pytest.raises(ValueError, match="bucket_numel must be >= 1"):
        FlatLayout(names=["a"], shapes=[(1,)], bucket_numel=0)


def test_bucket_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bucket_size_mb must be > 0"):
        apply_data_parallel(nn.Linear(2, 2), group=None, bucket_size_mb=0)  # type: ignore[arg-type]
