"""ZeRO stages 1/2 (apply_zero + ShardedOptimizer) against the unsharded single-process reference."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_par.grad_norm import clip_grad_norm_
from lightning_par.models.gpt import GPT, GPTConfig
from lightning_par.models.lit_gpt import warmup_cosine
from lightning_par.zero import apply_zero, check_shardable
from tests.distributed import run_distributed
from tests.reference import data_parallel_backward

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)
GLOBAL_BATCH = 16
STEPS = 5


def _batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, CFG.vocab_size, (STEPS, GLOBAL_BATCH, CFG.block_size + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def _optimizer(model: nn.Module, kind: str) -> tuple[torch.optim.Optimizer, Any]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    opt: torch.optim.Optimizer
    if kind == "adamw":
        opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95))
    elif kind == "sgd":
        opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.Adagrad(groups, lr=0.05, initial_accumulator_value=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, partial(warmup_cosine, warmup_steps=2, total_steps=STEPS, min_ratio=0.1)
    )
    return opt, sched


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _reference(
    kind: str, micro: int, world: int, every: bool = False
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Unsharded, one process; gradients summed in the ranks' order (see tests/reference.py)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt, sched = _optimizer(model, kind)
    losses = []
    for x, y in _batches():
        opt.zero_grad()
        total = (
            sum(
                data_parallel_backward(
                    model, _loss, x, y, world=world, micro=micro, reduce_every_micro_batch=every
                )
            )
            / world
        )
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(total)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _train_zero(
    rank: int,
    world: int,
    *,
    stage: int,
    kind: str,
    micro: int,
    grad_sync: str | None,
    reduce_op: str = "auto",
) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(CFG)
    engine = apply_zero(
        model,
        group=dist.group.WORLD,
        stage=stage,
        bucket_size_mb=0.02,
        grad_sync=grad_sync,
        reduce_op=reduce_op,
    )  # type: ignore[arg-type]
    opt, sched = _optimizer(model, kind)
    engine.shard_optimizers([opt])
    losses = []
    per_rank = GLOBAL_BATCH // world
    lrs = []
    for x, y in _batches():
        opt.zero_grad()
        xs, ys = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        total = torch.zeros(())
        for k, (mx, my) in enumerate(zip(xs.chunk(micro), ys.chunk(micro), strict=True)):
            loss = _loss(model, mx, my) / micro
            if k < micro - 1:
                with engine.no_sync():
                    loss.backward()
            else:
                loss.backward()
            total += loss.detach()
        grads = [m.grad for g in opt.param_groups for m in g["params"] if m.grad is not None]
        clip_grad_norm_(grads, 1.0, groups=[dist.group.WORLD])
        opt.step()
        engine.after_step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append(total.item())
    state_numel = sum(
        v.numel() for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0
    )
    engine.remove()
    return {
        "losses": losses,
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "state_numel": state_numel,
        "grad_bytes": engine.sync.grad_bytes(),
        "lrs": lrs,
    }


CASES: list[tuple[str, dict[str, Any]]] = [
    ("s1_adamw_acc4", dict(stage=1, kind="adamw", micro=4, grad_sync=None)),
    ("s2_adamw_acc4", dict(stage=2, kind="adamw", micro=4, grad_sync=None)),
    ("s1_every_rs", dict(stage=1, kind="adamw", micro=2, grad_sync="every", reduce_op="reduce_scatter")),
    ("s2_boundary", dict(stage=2, kind="adamw", micro=2, grad_sync="boundary")),
    ("s2_rs_sgd", dict(stage=2, kind="sgd", micro=1, grad_sync=None, reduce_op="reduce_scatter")),
    ("s1_adagrad", dict(stage=1, kind="adagrad", micro=1, grad_sync=None)),
]


# 4 ranks: Gloo adds the ranks' gradients in its own order, so SGD (see tests/reference.py)
CASES_FOUR: list[tuple[str, dict[str, Any]]] = [
    ("s1_sgd_acc2", dict(stage=1, kind="sgd", micro=2, grad_sync=None)),
    ("s2_sgd_acc2", dict(stage=2, kind="sgd", micro=2, grad_sync=None, reduce_op="reduce_scatter")),
]


def _all_cases(rank: int, world: int, cases: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    return {name: _train_zero(rank, world, **kw) for name, kw in cases}


def _check(results: list[dict[str, Any]], world: int, cases: list[tuple[str, dict[str, Any]]]) -> None:
    refs: dict[tuple[str, int, bool], tuple[list[float], dict[str, torch.Tensor]]] = {}
    full_numel = sum(p.numel() for p in GPT(CFG).parameters())
    for name, kw in cases:
        every = (kw["grad_sync"] or ("every" if kw["stage"] == 2 else "boundary")) == "every"
        key = (kw["kind"], kw["micro"], every)
        if key not in refs:
            refs[key] = _reference(kw["kind"], kw["micro"], world, every)
        ref_losses, ref_state = refs[key]
        for rank, res in enumerate(results):
            got = res[name]
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), msg=name)
            for k, v in ref_state.items():
                torch.testing.assert_close(got["state"][k], v, msg=f"{name} rank {rank} {k}")
        # optimizer state is sharded: AdamW keeps 2 tensors per element, split over the ranks
        per_elem = {"adamw": 2, "sgd": 1, "adagrad": 1}[kw["kind"]]
        total = sum(r[name]["state_numel"] for r in results)
        assert total == per_elem * full_numel, name
        assert all(r[name]["state_numel"] <= per_elem * (full_numel // world + 4096) for r in results)
        if kw["stage"] == 2 and kw["grad_sync"] is None:
            gb = results[0][name]["grad_bytes"]
            assert gb["full"] == 0 and gb["shard"] <= 4 * (full_numel // world + 8192)


def test_zero12_match_single_process_two_ranks() -> None:
    _check(run_distributed(_all_cases, 2, CASES), 2, CASES)


def test_zero12_match_single_process_four_ranks() -> None:
    _check(run_distributed(_all_cases, 4, CASES_FOUR), 4, CASES_FOUR)


def test_unshardable_optimizer_is_named() -> None:
    p = nn.Parameter(torch.zeros(2))
    with pytest.raises(TypeError, match=r"cannot shard torch\.optim\.lbfgs\.LBFGS.*whole flattened"):
        check_shardable(torch.optim.LBFGS([p]))
    # LBFGS needs whole gradients: refused even on the user's word
    with pytest.raises(TypeError, match=r"LBFGS.*allow_untested_optimizer does not change that"):
        check_shardable(torch.optim.LBFGS([p]), allow_untested=True)
    # an element-wise optimizer outside the tested list: refused, unless the user vouches for it
    with pytest.raises(TypeError, match=r"cannot shard torch\.optim\.rprop\.Rprop.*AdamW.*allow_untested"):
        check_shardable(torch.optim.Rprop([p]))
    check_shardable(torch.optim.Rprop([p]), allow_untested=True)
    # other packages' optimizers that need whole tensors, known by their class names: refused on the
    # user's word too (before, transformers' Adafactor trained 2.7e-2 off "ddp" at ZeRO-1, silently)
    from transformers.optimization import Adafactor

    class FusedLAMB(torch.optim.SGD):
        """The shape of apex's / timm's: a whole-tensor update on an element-wise base class's name."""

    class LambdaLion(torch.optim.SGD):
        """A name that only looks like one: element-wise, accepted."""

    class Scalars(torch.optim.SGD):
        """Another ("lars" inside a word): accepted."""

    class Prodigy(torch.optim.SGD):
        """Its step size comes from dot products over every parameter: refused."""

    for opt, reason in (
        (Adafactor([p], lr=1e-3, relative_step=False), "row and column statistics"),
        (FusedLAMB([p], lr=0.1), "trust ratio"),
        (Prodigy([p], lr=0.1), "dot products"),
    ):
        with pytest.raises(TypeError, match=f"{type(opt).__name__}: .*{reason}.*does not change that"):
            check_shardable(opt, allow_untested=True)
    check_shardable(LambdaLion([p], lr=0.1), allow_untested=True)
    check_shardable(Scalars([p], lr=0.1), allow_untested=True)
    with pytest.raises(ValueError, match="handles stages 0, 1 and 2, got 5"):
        apply_zero(nn.Linear(2, 2), group=None, stage=5)  # type: ignore[arg-type]
