"""Mixed precision with fp32 masters in the ZeRO shards: bf16 tracks fp32, fp16 overflow is skipped on
every rank, the loss scaler survives a resume, and the memory report shows where the bytes are."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_par import HybridParallelStrategy
from lightning_par.loss_scaler import DynamicLossScaler
from lightning_par.memory import estimate_memory
from lightning_par.models import GPTModule
from lightning_par.precision import ParallelPrecision
from tests.distributed import run_distributed
from tests.test_strategy import LossRecorder

WORLD, MICRO, STEPS = 2, 4, 50
KW: dict[str, Any] = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=64, max_steps=STEPS)
# bf16 keeps 8 bits of mantissa: per-step losses of a bf16 run drift from the fp32 run by about 1e-2
# (measured: mean |diff| 0.004-0.01, max 0.02-0.04 over 50 steps of this model); the bounds leave room.
BF16_MEAN_TOL, BF16_MAX_TOL = 0.03, 0.1


class Tokens(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Learnable sequences: each token is the previous one plus a per-sample stride, modulo the vocab."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(123)
        start = torch.randint(0, 64, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.data = (start + stride * torch.arange(17)) % 64

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


def _module(cls: type[GPTModule] = GPTModule) -> GPTModule:
    pl.seed_everything(3)
    module = cls(**KW)
    module.configure_model()
    return module


def _trainer(strategy: Any, devices: int, tmp: str, callbacks: list[pl.Callback], **kw: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=kw.pop("max_steps", STEPS),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp,
        callbacks=callbacks,
        **kw,
    )


class Memory(pl.Callback):
    def __init__(self) -> None:
        self.report: dict[str, int] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.report = dict(trainer.strategy.memory_report())  # type: ignore[attr-defined]


def _bf16(rank: int, world: int, tmp: str) -> dict[str, Any]:
    out = {}
    for stage in (2, 3):
        rec, mem = LossRecorder(), Memory()
        module = _module()
        trainer = _trainer(
            HybridParallelStrategy(zero_stage=stage),
            world,
            tmp,
            [rec, mem],
            precision="bf16-mixed",
            max_steps=STEPS if stage == 2 else 10,
        )
        trainer.fit(module, DataLoader(Tokens(STEPS * MICRO * world), batch_size=MICRO, shuffle=True))
        out[stage] = {
            "losses": rec.losses,
            "memory": mem.report,
            "estimate": estimate_memory(_module(), zero_stage=stage, dp=world, precision="bf16-mixed"),
            "dtype": str(module.gpt.embed.tok.weight.dtype),
        }
    # bf16 reduction at stage 2: a bf16 gradient shard plus the fp32 copy the optimizer reads
    mem = Memory()
    plugin = ParallelPrecision("bf16-mixed", reduce_dtype="bf16")
    trainer = _trainer(HybridParallelStrategy(zero_stage=2), world, tmp, [mem], plugins=[plugin], max_steps=2)
    trainer.fit(_module(), DataLoader(Tokens(2 * MICRO * world), batch_size=MICRO))
    estimate = estimate_memory(_module(), zero_stage=2, dp=world, precision="bf16-mixed", reduce_dtype="bf16")
    out["reduce_bf16"] = {"memory": mem.report, "estimate": estimate}
    return out


def test_bf16_mixed_tracks_fp32_and_keeps_masters_in_the_shard(tmp_path: Path) -> None:
    results = run_distributed(_bf16, WORLD, str(tmp_path), init_group=False)
    # fp32 single-process reference on the same global batches (Lightning's shuffling replayed)
    from torch.utils.data import DistributedSampler

    order: list[list[int]] = []
    samplers = [
        DistributedSampler(Tokens(STEPS * MICRO * WORLD), num_replicas=WORLD, rank=r, shuffle=True, seed=3)
        for r in range(WORLD)
    ]
    per_rank = [list(s) for s in samplers]
    for k in range(STEPS):
        order.append([i for r in range(WORLD) for i in per_rank[r][k * MICRO : (k + 1) * MICRO]])
    rec = LossRecorder()
    _trainer("auto", 1, str(tmp_path / "ref"), [rec]).fit(
        _module(), DataLoader(Tokens(STEPS * MICRO * WORLD), batch_sampler=order)
    )
    ref = torch.tensor(rec.losses)
    n = _module().gpt.num_parameters()
    for stage, steps in ((2, STEPS), (3, 10)):
        got = torch.tensor([r[stage]["losses"] for r in results]).mean(0)
        diff = (got - ref[:steps]).abs()
        assert diff.mean() < BF16_MEAN_TOL and diff.max() < BF16_MAX_TOL, (stage, diff)
        assert got[-1] < ref[0] - 0.1, "the bf16 run must actually learn"
        for r in results:
            mem = r[stage]["memory"]
            # compute parameters are 2 bytes each (stage 2: whole; stage 3: 1/N of the fp32 master shard
            # plus gathered bf16 units); fp32 master + AdamW (4 + 8 bytes) live only in the 1/N shard
            if stage == 2:
                assert mem["parameters"] == pytest.approx(2 * n, rel=0.02)
                assert mem["optimizer_state"] == pytest.approx(12 * n / WORLD, rel=0.05)
            else:
                assert mem["parameters"] == pytest.approx(4 * n / WORLD, rel=0.05)
                assert mem["optimizer_state"] == pytest.approx(8 * n / WORLD, rel=0.05)
            # the gradient shard is fp32 (the default reduction dtype), and the prediction says so
            # (before, it counted 2 bytes per gradient element and, at stage 3, a 16-bit parameter shard)
            assert mem["gradients"] == pytest.approx(4 * n / WORLD, rel=0.05)
            for key in ("parameters", "gradients", "optimizer_state"):
                assert mem[key] == pytest.approx(r[stage]["estimate"][key], rel=0.05), (stage, key)
    for r in results:  # (before, the report left the fp32 copy out: 4 bytes per parameter / N)
        mem, estimate = r["reduce_bf16"]["memory"], r["reduce_bf16"]["estimate"]
        assert mem["gradients"] == pytest.approx((2 + 4) * n / WORLD, rel=0.05)
        assert mem["gradients"] == pytest.approx(estimate["gradients"], rel=0.05)


class Overflowing(GPTModule):
    """On rank 1 only, at optimizer step 2, the loss becomes huge: fp16 gradients overflow there."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 1 and batch_idx == 2:
            loss = loss * 1e30
        return loss


class Snapshot(pl.Callback):
    def __init__(self) -> None:
        self.before: dict[str, Any] = {}
        self.after: dict[str, Any] = {}

    def _take(self, trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
        opt = trainer.optimizers[0]
        return {
            "weights": {k: v.clone() for k, v in module.state_dict().items()},
            "opt": [
                {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for s in opt.state.values()
            ],
            "scale": trainer.precision_plugin.scaler.scale,  # type: ignore[attr-defined]
            "step": trainer.global_step,
            "lr": opt.param_groups[0]["lr"],
        }

    def on_train_batch_start(
        self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, i: int
    ) -> None:
        if i == 2:
            self.before = self._take(trainer, module)

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if args[-1] == 2:
            self.after = self._take(trainer, module)


def _fp16(rank: int, world: int, tmp: str) -> dict[str, Any]:
    snap = Snapshot()
    module = _module(Overflowing)
    ckpt = os.path.join(tmp, "fp16.ckpt")
    plugin = ParallelPrecision("16-mixed", loss_scale={"init_scale": 2.0**12})
    trainer = _trainer(
        HybridParallelStrategy(zero_stage=2), world, tmp, [snap], plugins=[plugin], max_steps=4
    )
    trainer.fit(module, DataLoader(Tokens(40), batch_size=MICRO, shuffle=True))
    trainer.save_checkpoint(ckpt)
    saved_scale = plugin.scaler.scale  # type: ignore[union-attr]
    skipped = plugin.scaler.skipped_steps  # type: ignore[union-attr]
    resumed_plugin = ParallelPrecision("16-mixed")
    resumed = _trainer(
        HybridParallelStrategy(zero_stage=2), world, tmp, [], plugins=[resumed_plugin], max_steps=5
    )
    resumed.fit(_module(Overflowing), DataLoader(Tokens(40), batch_size=MICRO, shuffle=True), ckpt_path=ckpt)
    return {
        "before": snap.before,
        "after": snap.after,
        "saved_scale": saved_scale,
        "skipped": skipped,
        "steps": trainer.global_step,
        "restored_scale": resumed_plugin.scaler.scale,
    }  # type: ignore[union-attr]


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(tmp_path: Path) -> None:
    results = run_distributed(_fp16, WORLD, str(tmp_path), init_group=False)
    for rank, r in enumerate(results):
        before, after = r["before"], r["after"]
        assert after["scale"] == before["scale"] / 2, rank
        assert after["step"] == before["step"], "a skipped step is not counted"
        assert after["lr"] == before["lr"], "the LR schedule does not advance on a skipped step"
        for k, v in before["weights"].items():
            assert torch.equal(after["weights"][k], v), (rank, k)
        assert len(after["opt"]) == len(before["opt"]) > 0
        for s_before, s_after in zip(before["opt"], after["opt"], strict=True):
            for k, v in s_before.items():
                assert torch.equal(s_after[k], v) if torch.is_tensor(v) else s_after[k] == v, (rank, k)
        # 4 counted steps took 5 batches (one skipped); the scaler state came back on resume
        assert r["skipped"] == 1 and r["steps"] == 4
        assert r["restored_scale"] == r["saved_scale"] == 2.0**11


def test_loss_scaler_policy_and_bad_values() -> None:
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=2, hysteresis=2)
    scaler.update(True)
    assert scaler.scale == 8.0  # hysteresis: the first overflow is tolerated
    scaler.update(True)
    assert scaler.scale == 4.0
    scaler.update(False)
    scaler.update(False)
    assert scaler.scale == 8.0 and scaler.skipped_steps == 2
    g = torch.tensor([1.0, float("inf")])
    assert DynamicLossScaler().unscale_and_check([g], groups=(), device=g.device) is True
    with pytest.raises(ValueError, match="backoff_factor must be in"):
        DynamicLossScaler(backoff_factor=2.0)
    with pytest.raises(ValueError, match="precision must be one of"):
        ParallelPrecision("8-mixed")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reduce in fp32 or in the compute dtype"):
        ParallelPrecision("bf16-mixed", reduce_dtype="fp16")


class _MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _after_fit(rank: int, world: int) -> dict[str, Any]:
    """The user's module after a bf16-mixed ``fit``: parameter dtypes, values, an eager forward; under
    ``"ddp"`` and ZeRO 1-3 (ours also the consolidated state)."""
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import TensorDataset

    from tests.fits import cpu_trainer, final_state

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g))
    probe = torch.randn(5, 8, generator=g)
    out: dict[str, Any] = {}
    for name, strategy in (
        ("ddp", DDPStrategy()),
        *((f"zero{s}", HybridParallelStrategy(zero_stage=s)) for s in (1, 2, 3)),
    ):
        module = _MLP()
        trainer = cpu_trainer(strategy, max_steps=3, precision="bf16-mixed")
        trainer.fit(module, DataLoader(data, batch_size=4))
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        with torch.no_grad():
            logits = module.net(probe)
        out[name] = {
            "dtypes": {str(p.dtype) for p in module.parameters()},
            "state": state,
            "logits": logits,
            "consolidated": final_state(module, strategy),
        }
    return out


def test_bf16_mixed_leaves_the_module_in_fp32_after_fit() -> None:
    """At ZeRO 1/2 the module's parameters were left as the 16-bit compute copies after ``fit`` (so
    ``torch.save(model.state_dict())`` saved bf16-rounded weights and an fp32 input failed in an eager
    forward); Lightning's mixed precision keeps them in fp32. Now every stage leaves them at the fp32
    masters' values: the module's state equals ``"ddp"``'s module and our own consolidated state."""
    results = run_distributed(_after_fit, WORLD, init_group=False)
    for rank, out in enumerate(results):
        reference = out["ddp"]
        assert reference["dtypes"] == {"torch.float32"}
        for stage in ("zero1", "zero2", "zero3"):
            got = out[stage]
            assert got["dtypes"] == {"torch.float32"}, (rank, stage, got["dtypes"])
            for key, value in reference["state"].items():
                torch.testing.assert_close(got["state"][key], value, msg=f"{rank} {stage} {key}")
                if rank == 0:  # the consolidated state lands on rank 0
                    torch.testing.assert_close(got["consolidated"][key], got["state"][key], rtol=0, atol=0)
            torch.testing.assert_close(got["logits"], reference["logits"], msg=f"{rank} {stage}")
