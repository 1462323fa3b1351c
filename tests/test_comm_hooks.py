"""DDP communication hooks on our buckets (``HybridParallelStrategy(comm_hook=...)``), 2 Gloo ranks.

The model (an MLP of 1,288 parameters) fits one bucket in both engines, so our bucket holds the same
gradients as DDP's; its order is the order gradients become ready in both (each rebuilds its bucket in
that order after the first backward). Compared:

* torch's ``allreduce_hook`` (a hook that only averages) gives bitwise the result without a hook, at
  stages 0 and 1, with accumulation 2 (x/2 + y/2 = (x + y)/2 exactly for two ranks); every hook runs
  once per optimizer step;
* torch's ``fp16_compress_hook`` and ``powerSGD_hook`` (rank 1, error feedback, warm start, compressing
  from step 2) give bitwise the weights of torch DDP with the same hook on the same model and data, at
  stage 0 and stage 1, SGD with momentum, 6 steps, without and with accumulation 2 (each micro-batch
  but the last inside ``no_sync``, its forward included: DDP reads the flag in its forward; before,
  this test ran DDP's forward outside it, so DDP reduced every micro-batch and differed in the last bit);
* bad input is refused when the strategy is constructed (our own PowerSGD and the ``"fp16"``/``"bf16"``
  names are tested in ``tests/test_powersgd.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from lightning_par import HybridParallelStrategy
from lightning_par.fabric import HybridParallelStrategy as FabricStrategy
from lightning_par.zero.engine import apply_zero
from tests.distributed import run_distributed

STEPS, MICRO = 6, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 20), nn.Tanh(), nn.Linear(20, 4))


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(STEPS)]


def _state(kind: str) -> tuple[Any, Any]:
    if kind == "allreduce":
        return default_hooks.allreduce_hook, dist.group.WORLD
    if kind == "fp16":
        return default_hooks.fp16_compress_hook, dist.group.WORLD
    state = powerSGD_hook.PowerSGDState(
        process_group=dist.group.WORLD, matrix_approximation_rank=1, start_powerSGD_iter=2, random_seed=5
    )
    return powerSGD_hook.powerSGD_hook, state


def _train(
    rank: int, engine_kind: str, stage: int, hook_kind: str | None, micro: int = 1
) -> dict[str, torch.Tensor]:
    model = _model()
    hook, state = _state(hook_kind) if hook_kind else (None, None)
    calls = [0]
    if hook is not None and engine_kind != "ddp":  # DDP insists on its own bucket annotation
        inner = hook

        def hook(s: Any, bucket: Any) -> Any:
            calls[0] += 1
            return inner(s, bucket)

    if engine_kind == "ddp":
        net = DistributedDataParallel(model)
        if hook is not None:
            net.register_comm_hook(state, hook)
        sync = net.no_sync
    else:
        net = model
        engine = apply_zero(
            model,
            group=dist.group.WORLD,
            stage=stage,
            reduce_op="all_reduce",
            comm_hook=hook,
            comm_hook_state=state,
        )  # type: ignore[arg-type]
        sync = engine.no_sync
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if engine_kind != "ddp":
        engine.shard_optimizers([opt])
    for x, y in _batches(rank):
        opt.zero_grad()
        for k, (mx, my) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
            # DDP reads no_sync in its forward: the whole micro-batch runs inside it
            with sync() if k < micro - 1 else contextlib.nullcontext():
                (nn.functional.mse_loss(net(mx), my) / micro).backward()
        opt.step()
        if engine_kind != "ddp":
            engine.after_step()
    if engine_kind != "ddp":
        engine.remove()
    if engine_kind != "ddp":
        assert calls[0] == (STEPS if hook is not None else 0)  # once per optimizer step, whatever micro
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _all(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage in (0, 1):
        out[f"none{stage}"] = _train(rank, "ours", stage, None, micro=MICRO)
        out[f"allreduce{stage}"] = _train(rank, "ours", stage, "allreduce", micro=MICRO)
        for kind in ("fp16", "powersgd"):
            out[f"{kind}{stage}"] = _train(rank, "ours", stage, kind)
            out[f"{kind}{stage}_acc"] = _train(rank, "ours", stage, kind, micro=MICRO)
    for kind in ("fp16", "powersgd"):
        out[f"ddp_{kind}"] = _train(rank, "ddp", 0, kind)
        out[f"ddp_{kind}_acc"] = _train(rank, "ddp", 0, kind, micro=MICRO)
    out["ddp_none"] = _train(rank, "ddp", 0, None)
    return out


def test_torch_hooks_run_unchanged_on_our_buckets() -> None:
    results = run_distributed(_all, 2)
    r = results[0]
    for stage in (0, 1):
        for name, value in r[f"none{stage}"].items():
            assert torch.equal(r[f"allreduce{stage}"][name], value), f"allreduce hook, stage {stage}: {name}"
        for kind in ("fp16", "powersgd"):
            for acc in ("", "_acc"):
                for name, value in r[f"ddp_{kind}{acc}"].items():
                    got = r[f"{kind}{stage}{acc}"][name]
                    assert torch.equal(got, value), f"{kind}{acc}, stage {stage}: {name}"
    # the hooks change something: compressed runs differ from the uncompressed one
    for kind in ("fp16", "powersgd"):
        diff = max((r[f"{kind}0"][n] - r["none0"][n]).abs().max().item() for n in r["none0"])
        assert diff > 1e-6, (kind, diff)
    assert all(torch.equal(results[1]["powersgd1"][n], v) for n, v in r["powersgd1"].items())


@pytest.mark.parametrize("cls", [HybridParallelStrategy, FabricStrategy])
def test_bad_hooks_are_refused_at_construction(cls: type) -> None:
    with pytest.raises(ValueError, match="comm_hook must be one of"):
        cls(comm_hook="int4")
    with pytest.raises(ValueError, match="powersgd_rank must be a positive integer"):
        cls(comm_hook="powersgd", powersgd_rank=0)
    with pytest.raises(ValueError, match="cannot apply at zero_stage=3"):
        cls(zero_stage=3, comm_hook="powersgd")
    with pytest.raises(ValueError, match="needs reduce_op 'auto' or 'all_reduce'"):
        cls(zero_stage=2, comm_hook="powersgd", reduce_op="reduce_scatter")
    with pytest.raises(ValueError, match="grad_sync 'boundary'"):
        cls(zero_stage=2, comm_hook=default_hooks.fp16_compress_hook, grad_sync="every")
    with pytest.raises(ValueError, match="unknown field"):
        cls(comm_hook="powersgd", comm_hook_state={"rank": 4})
    # PowerSGD's fields at construction, not in each rank's first backward (before: an AttributeError
    # there for torch's PowerSGDState, torch's own error for a string seed, a negative size accepted)
    torch_state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1)
    with pytest.raises(ValueError, match=r"is a mapping of its fields .* comm_hook=powerSGD_hook"):
        cls(comm_hook="powersgd", comm_hook_state=torch_state)
    for field, value, message in (
        ("start_iter", -1, "start_iter must be an integer >= 0, got -1"),
        ("start_iter", 2.5, "start_iter must be an integer >= 0, got 2.5"),
        ("min_compression_rate", 0.5, "min_compression_rate must be a number >= 1, got 0.5"),
        ("seed", "x", "seed must be an integer, got 'x'"),
        ("min_bucket_numel", -5, "min_bucket_numel must be an integer >= 0, got -5"),
        ("warm_start", "yes", "warm_start must be True or False, got 'yes'"),
    ):
        with pytest.raises(ValueError, match=f"PowerSGD {message}"):
            cls(comm_hook="powersgd", comm_hook_state={field: value})
    # options PowerSGD alone reads, without it: said (a sweep over comm_hook keeps them)
    with pytest.warns(UserWarning, match="comm_hook=None uses neither comm_hook_state nor powersgd_rank"):
        cls(comm_hook_state={"start_iter": 5})
    with pytest.warns(UserWarning, match="comm_hook='fp16' uses neither"):
        cls(comm_hook="fp16", powersgd_rank=4)
    cls(zero_stage=3, comm_hook="fp16")  # a low-precision reduction applies at every stage
