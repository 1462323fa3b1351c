"""Our gradient compression (``comm_hook="powersgd"``, ``"fp16"``, ``"bf16"``) against unsharded references.

PowerSGD's update depends on the ranks' gradients and residuals only through their means (see
:mod:`lightning_par.zero.powersgd`), so its unsharded twin is one process compressing the gradient of the
whole batch: 2 ranks (stages 0 and 1, accumulation 2) must equal it to round-off. The same property makes
checkpoints portable, which the tests check through every path: a snapshot on the same layout (bitwise),
the snapshot of 2 ranks resumed by one process (each new rank takes the mean residual), and Lightning
checkpoints through the Trainer (stage 1 -> stage 0, with accumulation and clipping).

``"fp16"``/``"bf16"`` reduce in that dtype, pre-divided by N: at stage 0 bitwise torch DDP with
``fp16_compress_hook``; at stage 2 (a reduce-scatter every micro-batch) and stage 3 the same sums, so
equal to the stage-0 run.
"""

from __future__ import annotations

import io
import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState as TorchPowerSGDState
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy, ParallelPrecision
from lightning_par.checkpoint import rank_state
from lightning_par.fabric import HybridParallelStrategy as FabricStrategy
from lightning_par.zero.comm_hooks import resolve_comm_hook
from lightning_par.zero.engine import apply_zero
from lightning_par.zero.stage3 import Stage3Engine
from tests import test_fabric as fabric_tests
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state
from tests.test_strategy import N_SAMPLES, WORLD, LossRecorder, Tokens, _module, _trainer
from tests.third_party import LoraLlama
from tests.third_party import Tokens as LlamaTokens

STEPS, MICRO = 8, 2
Batches = list[tuple[torch.Tensor, torch.Tensor]]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 20), nn.Tanh(), nn.Linear(20, 4))


def _batches(part: int, parts: int) -> Batches:
    """Every step's global batch of 16 samples, ``part`` of ``parts`` of it."""
    g = torch.Generator().manual_seed(7)
    data = [(torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g)) for _ in range(STEPS)]
    return [(x.chunk(parts)[part], y.chunk(parts)[part]) for x, y in data]


def _engine(
    model: nn.Module, group: Any, stage: int, hook: str | None, *, warm_start: bool = True, **kw: Any
) -> Any:
    fields = {"start_iter": 2, "warm_start": warm_start} if hook == "powersgd" else None
    c = resolve_comm_hook(hook, fields, group=group, powersgd_rank=2)  # type: ignore[arg-type]
    if stage == 3:
        return Stage3Engine(model, group=group, comm_dtype=c.dtype, **kw)
    return apply_zero(
        model, group=group, stage=stage, comm_hook=c.hook, comm_hook_state=c.state, comm_dtype=c.dtype, **kw
    )


def _steps(model: nn.Module, engine: Any, opt: torch.optim.Optimizer, data: Batches, micro: int = 1) -> None:
    for x, y in data:
        opt.zero_grad()
        for k, (mx, my) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
            with engine.forward_context():
                loss = nn.functional.mse_loss(model(mx), my) / micro
            if k < micro - 1:
                with engine.no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
        engine.after_step()


def _run(group: Any, part: int, parts: int, stage: int, hook: str | None, micro: int = 1, **kw: Any) -> Any:
    model = _model()
    engine = _engine(model, group, stage, hook, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine.shard_optimizers([opt])
    _steps(model, engine, opt, _batches(part, parts), micro)
    engine.unshard_all()
    engine.remove()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _copy(tree: Any) -> Any:
    buf = io.BytesIO()
    torch.save(tree, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _snapshots(rank: int, world: int, single: Any, *, warm_start: bool = True) -> dict[str, Any]:
    """Three steps, a snapshot, three more; the snapshot resumed on the same layout, and by one process.
    Without ``warm_start`` every step draws ``Q`` afresh: the generator's state is in the snapshot."""
    out: dict[str, Any] = {}
    data = _batches(rank, world)

    def fresh(group: Any) -> tuple[nn.Module, Any, torch.optim.Optimizer]:
        model = _model()
        engine = _engine(model, group, 1, "powersgd", warm_start=warm_start)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        engine.shard_optimizers([opt])
        return model, engine, opt

    model, engine, opt = fresh(dist.group.WORLD)
    _steps(model, engine, opt, data[:4])
    model_tree, optim_tree, _ = rank_state.capture(model, engine, [opt])
    saved = _copy((model_tree, optim_tree))
    assert "comm" in saved[1] and saved[1]["comm"]["error"], "the residuals are in the snapshot"
    _steps(model, engine, opt, data[4:])
    out["uninterrupted"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.remove()

    model, engine, opt = fresh(dist.group.WORLD)
    rank_state.load(model, engine, [opt], *saved)
    _steps(model, engine, opt, data[4:])
    out["same_layout"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.remove()

    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, saved)
    model, engine, opt = fresh(single)  # one process takes both writers' parts, and the whole batch
    names = [[n for n, _ in _model().named_parameters()]]
    rank_state.load_resharded(model, engine, [opt], parts, param_names=[names])
    _steps(model, engine, opt, _batches(0, 1)[4:])
    out["one_process"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.remove()
    return out


def _engine_runs(rank: int, world: int) -> dict[str, Any]:
    singles = [dist.new_group([r]) for r in range(world)]
    one = singles[rank]
    out: dict[str, Any] = {
        "reference": _run(one, 0, 1, 0, "powersgd"),
        "uncompressed": _run(one, 0, 1, 0, None),
        "s0": _run(dist.group.WORLD, rank, world, 0, "powersgd", micro=MICRO),
        "s1": _run(dist.group.WORLD, rank, world, 1, "powersgd", micro=MICRO),
    }
    # low-precision reductions
    for name in ("fp16", "bf16"):
        out[f"{name}_s0"] = _run(dist.group.WORLD, rank, world, 0, name)
    rs = {"reduce_op": "reduce_scatter", "grad_sync": "every"}
    out["bf16_s2"] = _run(dist.group.WORLD, rank, world, 2, "bf16", **rs)
    out["bf16_s3"] = _run(dist.group.WORLD, rank, world, 3, "bf16")
    out["fp32_s0"] = _run(dist.group.WORLD, rank, world, 0, None)
    model = _model()
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in _batches(rank, world):
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    out["ddp_fp16"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out.update(_snapshots(rank, world, one))
    out["cold"] = _snapshots(rank, world, one, warm_start=False)
    out["embedding_plan"] = _embedding_plan(dist.group.WORLD)
    return out


def _embedding_plan(group: Any) -> dict[str, list[str]]:
    """Which matrices PowerSGD compresses in a model with an embedding table, by default and with
    ``compress_embeddings``."""
    out = {}
    for compress in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 32), nn.Linear(32, 64))
        c = resolve_comm_hook(
            "powersgd", {"start_iter": 0, "compress_embeddings": compress}, group=group, powersgd_rank=2
        )
        engine = apply_zero(model, group=group, stage=0, comm_hook=c.hook, comm_hook_state=c.state)
        tokens = torch.randint(0, 64, (4, 8))
        nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        names = {id(p): n for n, p in model.named_parameters()}
        out[str(compress)] = sorted(
            names[id(m.param)] for plan in c.state._plans.values() for m in plan.matrices
        )
        engine.remove()
    return out


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


def test_compression_equals_its_unsharded_twin_and_resumes_from_snapshots() -> None:
    results = run_distributed(_engine_runs, 2)
    r = results[0]
    for key in ("s0", "s1"):  # 2 ranks with accumulation 2 == one process on the whole batch
        for n, v in r["reference"].items():
            torch.testing.assert_close(r[key][n], v, rtol=1e-5, atol=1e-6, msg=f"powersgd {key}: {n}")
    assert _max_diff(r["reference"], r["uncompressed"]) > 1e-3  # and PowerSGD did change the update
    for n, v in r["ddp_fp16"].items():
        assert torch.equal(r["fp16_s0"][n], v), f"fp16 vs DDP fp16_compress_hook: {n}"
    for key in ("bf16_s2", "bf16_s3"):
        for n, v in r["bf16_s0"].items():
            torch.testing.assert_close(r[key][n], v, rtol=1e-6, atol=1e-7, msg=f"{key}: {n}")
    assert _max_diff(r["bf16_s0"], r["fp32_s0"]) > 1e-5  # bf16 rounding is visible
    for n, v in r["uninterrupted"].items():
        assert torch.equal(r["same_layout"][n], v), f"snapshot, same layout: {n}"
        torch.testing.assert_close(r["one_process"][n], v, rtol=1e-5, atol=1e-6, msg=f"dp 2 -> 1: {n}")
    for n, v in r["cold"]["uninterrupted"].items():  # warm_start=False: Q drawn every step
        assert torch.equal(r["cold"]["same_layout"][n], v), f"snapshot without warm start: {n}"
    assert _max_diff(r["cold"]["uninterrupted"], r["uninterrupted"]) > 1e-5
    for n, v in r["s1"].items():
        assert torch.equal(results[1]["s1"][n], v), "ranks hold the same weights"
    # embedding tables (row-sparse gradients) go uncompressed unless asked for
    assert r["embedding_plan"] == {
        "False": ["1.weight", "2.weight"],
        "True": ["0.weight", "1.weight", "2.weight"],
    }


def _trainer_runs(rank: int, world: int, tmp: str) -> dict[str, Any]:
    def fit(strategy: Any, epochs: int, *, ckpt: str | None = None, resume: str | None = None) -> Any:
        module = _module()
        callbacks: list[Any] = [LossRecorder()]
        if ckpt is not None:
            callbacks.append(ModelCheckpoint(dirpath=ckpt, save_last=True))
        trainer = _trainer(strategy, epochs, tmp, callbacks, world)
        loader = DataLoader(Tokens(N_SAMPLES), batch_size=2, shuffle=True)
        trainer.fit(module, loader, ckpt_path=resume)
        return {k: v.clone() for k, v in module.state_dict().items()}

    def psgd(stage: int) -> HybridParallelStrategy:
        return HybridParallelStrategy(
            zero_stage=stage, comm_hook="powersgd", powersgd_rank=2, comm_hook_state={"start_iter": 1}
        )

    out: dict[str, Any] = {"full": fit(psgd(1), 2), "uncompressed": fit("zero1", 2)}
    ckpt = os.path.join(tmp, "ckpt")
    fit(psgd(1), 1, ckpt=ckpt)
    last = os.path.join(ckpt, "last.ckpt")
    out["resumed_s0"] = fit(psgd(0), 2, resume=last)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit("zero1", 2, resume=last)
    out["warnings"] = [str(w.message) for w in caught if "PowerSGD" in str(w.message)]
    return out


def test_trainer_checkpoints_carry_the_powersgd_state(tmp_path: Any) -> None:
    r = run_distributed(_trainer_runs, WORLD, str(tmp_path))[0]
    for k, v in r["full"].items():  # stage 1 -> stage 0 through a Lightning checkpoint, mid-training
        torch.testing.assert_close(r["resumed_s0"][k], v, msg=f"resumed: {k}")
    assert _max_diff(r["full"], r["uncompressed"]) > 1e-4
    assert any("residuals are dropped" in m for m in r["warnings"]), r["warnings"]


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_low_precision_names_apply_to_reduce_scatter_stages(zero_stage: int) -> None:
    strategy = HybridParallelStrategy(zero_stage=zero_stage, comm_hook="bf16", reduce_op="reduce_scatter")
    assert strategy.comm_hook == "bf16"
    with pytest.raises(ValueError, match=r"cannot apply at zero_stage=3|needs reduce_op"):
        HybridParallelStrategy(zero_stage=zero_stage, comm_hook="powersgd", reduce_op="reduce_scatter")
    with pytest.raises(ValueError, match="unknown field"):
        HybridParallelStrategy(comm_hook="powersgd", comm_hook_state={"start_iteration": 3})


def _fabric_psgd(stage: int) -> FabricStrategy:
    return FabricStrategy(
        zero_stage=stage, comm_hook="powersgd", powersgd_rank=2, comm_hook_state={"start_iter": 1}
    )


def _fabric_run(rank: int, world: int, strategy: Any, save: str) -> dict[str, Any]:
    return fabric_tests._run(rank, world, strategy, save=save)


def _fabric_resume(rank: int, world: int, path: str) -> dict[str, Any]:
    """ZeRO-1 PowerSGD in one process from the ZeRO-2 checkpoint of 2 ranks, for the last steps."""
    fabric = fabric_tests._fabric(_fabric_psgd(1), 1)
    with fabric.init_module():
        model = fabric_tests.litgpt_model.GPT(fabric_tests._config())
    model, optimizer = fabric.setup(model, fabric_tests._adamw(model))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(path, state)
    strategy = fabric.strategy
    assert isinstance(strategy, FabricStrategy) and strategy.engine is not None
    comm = strategy.engine.comm_state()
    assert comm is not None and comm["iteration"] == 2 and comm["error"], "the PowerSGD state was restored"
    steps = range(2, fabric_tests.STEPS)
    losses = fabric_tests._loop(fabric, model, optimizer, rank=0, world=1, steps=steps)
    return {"losses": losses, "state": fabric_tests._state(model)}


def test_fabric_litgpt_powersgd_equals_one_process_and_resumes_at_dp1(tmp_path: Any) -> None:
    """litgpt's GPT in a Fabric loop (accumulation 2, clipping): PowerSGD at ZeRO-2 on 2 ranks equals
    PowerSGD in one process on the whole batch; its checkpoint of step 2 continues at ZeRO-1 in one
    process (the residuals' mean) as if uninterrupted."""
    path = str(tmp_path / "psgd")
    ref = run_distributed(fabric_tests._run, 1, _fabric_psgd(0), init_group=False)[0]
    plain = run_distributed(fabric_tests._run, 1, "zero0", init_group=False)[0]
    two = run_distributed(_fabric_run, 2, _fabric_psgd(2), path, init_group=False)
    resumed = run_distributed(_fabric_resume, 1, path, init_group=False)[0]
    for rank, r in enumerate(two):
        fabric_tests._assert_equal(r, ref, f"rank {rank}, PowerSGD zero2")
    tail = {"losses": ref["losses"][2:], "state": ref["state"]}
    fabric_tests._assert_equal(resumed, tail, "PowerSGD zero2 x 2 ranks -> zero1 one process")
    assert _max_diff(ref["state"], plain["state"]) > 1e-4  # PowerSGD changed the run


class _Overflowing(LoraLlama):
    """On rank 1 only, at batch 2, the loss is multiplied by 1e6: the fp16 gradients overflow there."""

    def __init__(self) -> None:
        super().__init__(lora=False)
        self.seen: list[tuple[bool, float, int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * 1e6 if batch_idx == 2 and self.global_rank == 1 else loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        plugin = self.trainer.precision_plugin
        assert isinstance(plugin, ParallelPrecision) and plugin.scaler is not None
        self.seen.append(
            (plugin.last_step_skipped, float(plugin.scaler.get_scale()), self.trainer.global_step)
        )


def _overflow_runs(rank: int, world: int) -> dict[str, Any]:
    torch_state = TorchPowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    hooks: dict[str, dict[str, Any]] = {
        "ours": {"comm_hook": "powersgd", "comm_hook_state": {"start_iter": 1}},
        "torch": {"comm_hook": powerSGD_hook, "comm_hook_state": torch_state},
    }
    out: dict[str, Any] = {}
    for name, hook in hooks.items():
        torch.manual_seed(0)
        module = _Overflowing()
        strategy = HybridParallelStrategy(zero_stage=1, powersgd_rank=2, **hook)
        trainer = cpu_trainer(strategy, devices=world, max_steps=6, plugins=[ParallelPrecision("16-mixed")])
        trainer.fit(module, DataLoader(LlamaTokens(32), batch_size=2))
        state = final_state(module, strategy)
        out[name] = {"seen": module.seen, "finite": all(bool(v.isfinite().all()) for v in state.values())}
    return out


def test_an_fp16_overflow_skips_one_step_and_compression_goes_on() -> None:
    """fp16 with PowerSGD (ours, and torch's hook through our strategy): one overflowing backward on one
    rank skips that step on every rank, and training goes on. Before, the non-finite gradient stayed in
    the compressor's error-feedback residuals and warm-started Q, so every later step overflowed and was
    skipped: the weights froze, the loss scale fell step after step, and a fit with max_steps never
    ended, without a word."""
    for r in run_distributed(_overflow_runs, WORLD, init_group=False, timeout=300):
        for name in ("ours", "torch"):
            skipped = [s for s, _, _ in r[name]["seen"]]
            assert skipped == [False, False, True, False, False, False, False], (name, r[name]["seen"])
            assert [scale for _, scale, _ in r[name]["seen"]][-1] == 32768.0  # halved once
            assert r[name]["seen"][-1][2] == 6 and r[name]["finite"], name


def _fabric_overflow(rank: int, world: int) -> dict[str, Any]:
    """A Fabric loop in real fp16 with PowerSGD at ZeRO-1; rank 1's loss overflows at step 2 only."""
    fp16 = ParallelPrecision("16-mixed")  # real fp16 on CPU (Lightning maps "16-mixed" to bf16 there)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=_fabric_psgd(1), plugins=[fp16])
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    gen = torch.Generator().manual_seed(rank)
    seen: list[tuple[bool, float, bool]] = []
    for step in range(6):
        x = torch.randn(8, 16, generator=gen)
        loss = model(x).float().pow(2).mean()
        fabric.backward(loss * 1e6 if step == 2 and rank == 1 else loss)
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        moved = any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        seen.append((bool(torch.isinf(norm)), float(fp16.scaler.get_scale()), moved))  # type: ignore[union-attr]
    finite = all(bool(p.isfinite().all()) for p in model.parameters())
    return {"seen": seen, "finite": finite}


def test_fabric_fp16_overflow_skips_one_step_and_compression_goes_on() -> None:
    """The Fabric loop's twin of the test above: the overflowing step is skipped on every rank
    (``fabric.clip_gradients`` returns an infinite norm for it, the weights stay), the loss scale halves
    once, and every later step updates the weights (before the compressor reset, each overflowed)."""
    for r in run_distributed(_fabric_overflow, WORLD, init_group=False, timeout=300):
        assert [inf for inf, _, _ in r["seen"]] == [False, False, True, False, False, False], r["seen"]
        assert [moved for _, _, moved in r["seen"]] == [True, True, False, True, True, True], r["seen"]
        assert r["seen"][-1][1] == r["seen"][0][1] / 2 and r["finite"], r["seen"]
