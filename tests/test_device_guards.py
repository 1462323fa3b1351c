"""CPU guards for GPU correctness (issue 15, item 6), on 2 Gloo ranks.

(a) Explicit devices: the ZeRO engines (stages 0-3), the token normaliser, global-norm clipping and the
    fp16 verdict run their hot path under :func:`tests.probes.explicit_devices`, where a tensor created
    without ``device=`` is a meta tensor. Such a tensor handed to a collective fails (or corrupts the
    result); the guarded run must equal the plain run bitwise, and both must equal the unsharded
    single-process reference.
(b) Host syncs per step, counted in the package's own code (``tests.probes.HostSyncs``) through the
    Lightning Trainer: 0 for ``32-true`` and ``bf16-mixed``, 1 (the fp16 verdict) for ``16-mixed``, with
    ``find_unused_parameters=False``; with token-exact normalisation too. Lightning's own calls are
    outside the package and not counted.
(c) Collectives per step equal the analytic count: buckets at stages 0-2, units and parts at stage 3, plus
    one all-reduce each for the token count, the clip norm and the fp16 verdict.
Bad input: ``process_group_backend`` that cannot move the root device's tensors, and ``fused=True``
where no fused kernel exists, are refused at setup.
"""

from __future__ import annotations

import tempfile
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.device_checks import CUDA_DEFAULT_BACKEND, check_optimizer_kernels, resolve_backend
from lightning_par.grad_norm import clip_grad_norm_
from lightning_par.loss import TokenNormalizer, token_loss_sum
from lightning_par.loss_scaler import DynamicLossScaler
from lightning_par.models.gpt import GPT, Block, GPTConfig
from lightning_par.precision import ParallelPrecision
from lightning_par.zero import apply_zero
from lightning_par.zero.stage3 import Stage3Engine
from tests.distributed import run_distributed
from tests.probes import Collectives, HostSyncs, explicit_devices
from tests.test_strategy import Tokens

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)
WORLD, MICRO, ACCUM, STEPS = 2, 4, 2, 3
CPU = torch.device("cpu")


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, CFG.vocab_size, (STEPS, WORLD * MICRO * ACCUM, CFG.block_size + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def _reference() -> dict[str, torch.Tensor]:
    """One process, the global batch's token mean, clipped at 0.5, AdamW."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in _batches():
        opt.zero_grad()
        s, n = token_loss_sum(model(x), y)
        (s / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _engine(model: nn.Module, stage: int) -> Any:
    if stage == 3:
        return Stage3Engine(model, group=dist.group.WORLD, units=[Block], device=CPU)
    return apply_zero(model, group=dist.group.WORLD, stage=stage, bucket_size_mb=0.02)


def _analytic(engine: Any, stage: int) -> int:
    """Collectives of one optimizer step of :func:`_train` after the first (layout) step."""
    extra = 2 + (1 if stage > 0 else 0)  # token count, fp16 verdict, clip norm (whole gradients at 0)
    if stage == 3:
        per_pass = 0
        for unit in engine.units:
            passes = 1 if unit is engine.root or not engine.reshard_after_forward else 2
            per_pass += passes * len(unit.parts) + (1 if unit.train is not None else 0)
        return ACCUM * per_pass + extra
    buckets = len(engine.sync.layout.buckets)
    reduces = buckets * (ACCUM if engine.sync.grad_sync == "every" else 1)
    return reduces + (buckets if stage > 0 else 0) + extra


def _train(rank: int, stage: int, guarded: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(CFG)
    engine = _engine(model, stage)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine.shard_optimizers([opt])
    tokens = TokenNormalizer(group=dist.group.WORLD, device=CPU)
    scaler = DynamicLossScaler(init_scale=1.0)  # unscaling by 1 changes nothing: only the verdict is tested
    norm_groups = [dist.group.WORLD] if stage > 0 else []
    guard = explicit_devices if guarded else _nothing
    syncs, counts = [], []
    with Collectives() as coll, HostSyncs() as host:
        for x, y in _batches():
            coll.reset()
            host.reset()
            per = MICRO * ACCUM
            xs, ys = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
            opt.zero_grad(set_to_none=True)
            with guard():
                for k in range(ACCUM):
                    mx, my = xs[k * MICRO : (k + 1) * MICRO], ys[k * MICRO : (k + 1) * MICRO]
                    s, n = token_loss_sum(model(mx), my)
                    tokens.add(n)
                    if k < ACCUM - 1:
                        with engine.no_sync():
                            s.backward()
                    else:
                        s.backward()
                # the strategy's order (see lightning_par.precision): rescale, unscale and check, clip
                engine.scale_grads(tokens.grad_scale(loss_scale=1.0, dp_size=WORLD))
                grads = [m.grad for g in opt.param_groups for m in g["params"] if m.grad is not None]
                assert not scaler.unscale_and_check(grads, groups=[dist.group.WORLD], device=CPU)
                clip_grad_norm_(grads, 0.5, groups=norm_groups, device=CPU)
            with host.paused():  # torch.optim is not the package (its CPU step counter is read on the host)
                opt.step()
            with guard():
                engine.after_step()
            syncs.append(list(host.calls))
            counts.append(list(coll.calls))
    state = {k: v.detach().clone() for k, v in _gathered_state(model, engine, stage).items()}
    return {"state": state, "syncs": syncs, "collectives": counts, "analytic": _analytic(engine, stage)}


def _gathered_state(model: nn.Module, engine: Any, stage: int) -> dict[str, torch.Tensor]:
    if stage == 3:
        return engine.full_state_dict(to_rank=dist.get_rank())  # type: ignore[no-any-return]
    return dict(model.state_dict())


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _fused_step(rank: int | None) -> dict[str, Any]:
    """One AdamW(fused=True) step at ZeRO-2 (``rank``) or in one process (None)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    engine = None
    if rank is not None:
        engine = apply_zero(model, group=dist.group.WORLD, stage=2, bucket_size_mb=0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    if engine is not None:
        engine.shard_optimizers([opt])
    x, y = _batches()[0]
    if rank is not None:
        per = len(x) // WORLD
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
    s, n = token_loss_sum(model(x), y)
    (s / n).backward()
    opt.step()
    if engine is not None:
        engine.after_step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"fused": [g["fused"] for g in opt.param_groups], "state": state}


def _engine_runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[Any, Any] = {
        (s, guarded): _train(rank, s, guarded) for s in (0, 1, 2, 3) for guarded in (False, True)
    }
    out["fused"] = _fused_step(rank)
    return out


# ---------------------------------------------------------------------------------------------- Trainer
class _TokenModule(pl.LightningModule):
    """A GPT whose training step returns the token-normalised loss sum, logging nothing."""

    def __init__(self, *, token_exact: bool) -> None:
        super().__init__()
        self.token_exact = token_exact
        self.model = GPT(CFG)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        s, n = token_loss_sum(self.model(x), y)
        if self.token_exact:
            return self.trainer.strategy.token_normalized(s, n)  # type: ignore[attr-defined,no-any-return]
        return s / n

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _CountSyncs(pl.Callback):
    """Host syncs made by the package in each training step (forward, backward, optimizer step)."""

    def __init__(self) -> None:
        self.probe = HostSyncs()
        self.per_step: list[list[tuple[str, str]]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.probe.reset()
        self.probe.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.probe.__exit__()
        self.per_step.append(list(self.probe.calls))


def _trainer_runs(rank: int, world: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage, precision, token_exact in [
        (0, "32-true", False),
        (2, "32-true", True),
        (3, "32-true", False),
        (0, "bf16-mixed", True),
        (2, "bf16-mixed", False),
        (3, "bf16-mixed", True),
        (2, "16-mixed", False),
        (3, "16-mixed", True),
    ]:
        pl.seed_everything(0)
        counter = _CountSyncs()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=HybridParallelStrategy(zero_stage=stage, bucket_size_mb=0.02),
            # on CPU, Lightning turns the string "16-mixed" into bf16 autocast: real fp16 needs the plugin
            plugins=[ParallelPrecision(precision)],  # type: ignore[arg-type]
            max_steps=4,
            accumulate_grad_batches=ACCUM,
            gradient_clip_val=0.5,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            default_root_dir=tmp,
            callbacks=[counter],
        )
        trainer.fit(_TokenModule(token_exact=token_exact), DataLoader(Tokens(64), batch_size=MICRO))
        out[(stage, precision, token_exact)] = counter.per_step
    return out


# ---------------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def engine_results() -> list[dict[str, Any]]:
    return run_distributed(_engine_runs, WORLD)


def test_explicit_devices_guarded_equals_plain_and_reference(engine_results: list[dict[str, Any]]) -> None:
    expected = _reference()
    for stage in (0, 1, 2, 3):
        for rank, r in enumerate(engine_results):
            plain, guarded = r[(stage, False)]["state"], r[(stage, True)]["state"]
            for name, value in expected.items():
                torch.testing.assert_close(guarded[name], plain[name], rtol=0, atol=0, msg=f"{stage} {name}")
                torch.testing.assert_close(plain[name], value, msg=f"stage {stage} rank {rank} {name}")


def test_fused_optimizer_passes_through_the_shards(engine_results: list[dict[str, Any]]) -> None:
    expected = _fused_step(None)
    for r in engine_results:
        assert r["fused"]["fused"] == [True]  # the rebuilt optimizer over the shard keeps fused=True
        for name, value in expected["state"].items():
            torch.testing.assert_close(r["fused"]["state"][name], value, msg=name)


def test_no_host_sync_in_the_engines_step(engine_results: list[dict[str, Any]]) -> None:
    for stage in (0, 1, 2, 3):
        for r in engine_results:
            for step, calls in enumerate(r[(stage, True)]["syncs"][1:], start=2):
                # the fp16 verdict is the one read (asked for by the loop through unscale_and_check)
                assert [where.split(":")[0] for _, where in calls] == ["loss_scaler.py"], (stage, step, calls)


def test_collectives_per_step_equal_the_analytic_count(engine_results: list[dict[str, Any]]) -> None:
    for stage in (0, 1, 2, 3):
        for r in engine_results:
            run = r[(stage, False)]
            for calls in run["collectives"][1:]:
                assert len(calls) == run["analytic"], (stage, calls)


def test_trainer_step_host_syncs() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = run_distributed(_trainer_runs, WORLD, tmp, init_group=False, timeout=400)
    for r in results:
        for (stage, precision, token_exact), per_batch in r.items():
            expected = 1 if precision == "16-mixed" else 0
            # fp16 steps skipped on overflow (the first, at the initial scale) do not count towards max_steps
            assert len(per_batch) % ACCUM == 0 and len(per_batch) >= 4 * ACCUM
            windows = range(0, len(per_batch), ACCUM)
            steps = [[c for b in per_batch[i : i + ACCUM] for c in b] for i in windows]
            for step, calls in enumerate(steps[1:], start=2):  # the first window rebuilds the layout
                assert len(calls) == expected, (stage, precision, token_exact, step, calls)


def test_backend_and_kernel_refusals() -> None:
    assert resolve_backend(None, CPU) == "gloo"
    assert resolve_backend(None, torch.device("cuda", 0)) == CUDA_DEFAULT_BACKEND
    with pytest.raises(ValueError, match="cannot move CPU tensors"):
        resolve_backend("mpi", CPU)
    with pytest.raises(ValueError, match="need NCCL"):
        resolve_backend("gloo", torch.device("cuda", 0))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            resolve_backend("nccl", CPU)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=HybridParallelStrategy(process_group_backend="nccl"),
            logger=False,
            enable_progress_bar=False,
            max_steps=1,
        )
        with pytest.raises(ValueError, match="process_group_backend='nccl' needs CUDA"):
            trainer.fit(_TokenModule(token_exact=False), DataLoader(Tokens(8), batch_size=MICRO))
        assert not dist.is_initialized()

    class NoFusedKernel(torch.optim.Optimizer):
        def __init__(self, params: Any) -> None:
            super().__init__(params, {"lr": 0.1, "fused": True})

    params = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="has no fused kernel"):
        check_optimizer_kernels([NoFusedKernel(params)], device=CPU)
    check_optimizer_kernels([torch.optim.AdamW(params, fused=True)], device=CPU)  # CPU has fused AdamW
