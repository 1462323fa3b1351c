"""Optimizers and callbacks the ZeRO stages must serve as Lightning's ``"ddp"`` does, on 2 Gloo ranks.

* A user's own element-wise optimizer (Lion, written here) at ZeRO-2: refused at setup without
  ``allow_untested_optimizer`` (a ``TypeError`` naming the class and the flag, before any step); with the
  flag the final weights equal ``"ddp"`` with the same Lion, at stage 2 and at stage 3. ``torch.optim.Rprop``
  (element-wise, not in the tested list) with the flag at stage 1 equals ``"ddp"`` too; ``LBFGS`` is refused
  even with the flag, saying that the flag does not change that. Under tensor parallelism (stage 0) the
  same rule holds for the optimizers that hold a slice (Muon and Adafactor refused at setup), and under
  pipeline parallelism an optimizer whose ``step()`` needs a closure (LBFGS) is refused.
* Manual optimization with two optimizers (a GAN's alternating discriminator / generator steps with
  ``toggle_optimizer``): at stages 1, 2 and 3 the final weights of both networks equal ``"ddp"`` with
  ``find_unused_parameters=True`` (which Lightning's ddp needs here too); without the flag the error names
  the parameters that got no gradient. Two checks guard earlier bugs: at stage 3 with the default units
  (the whole model one root unit) the generator step, a second forward inside the same
  ``training_step`` after the discriminator's backward, must compute with real weights, not the
  placeholders left by the root unit's release; and ``toggle_optimizer`` must freeze the other network at
  stages 1-3, where ``optimizer.param_groups`` holds this rank's fragments, not the module's parameters.
* Weight averaging (``StochasticWeightAveraging`` and ``EMAWeightAveraging``) at ZeRO 1/2 in fp32 equals
  ``"ddp"``, EMA also on a model with BatchNorm. SWA on a model with BatchNorm ends with a statistics epoch
  whose ``optimizer.step()`` runs without backward or ``zero_grad``: ``"ddp"`` re-applies the last
  gradients there, ZeRO 1/2 (gradients released after each step) cannot, so it is checked to match at
  ZeRO-0 and refused at ZeRO 1/2. At ZeRO-3, with tensor parallelism and with low-precision parameters
  (separate fp32 masters) both are refused at setup with a ``ValueError`` naming the reason and the
  alternative, before any step.

Every reference is Lightning's ``"ddp"`` run in the same ranks, one fit after the other, on the same data
(the same ``DistributedSampler`` order): with 2 ranks both reduce each gradient as ``(g_0 + g_1) / 2``,
so even sign-based (Lion, Rprop) and Adam updates can be compared with ``torch.testing.assert_close``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_par import HybridParallelStrategy
from lightning_par.zero.grad_sync import UnusedParametersError
from tests.distributed import run_distributed

SEED, WORLD, MICRO, N = 5, 2, 4, 32  # 4 optimizer steps per epoch on 2 ranks
State = dict[str, Tensor]


# ---------------------------------------------------------------------------------------------- data, models
class Pairs(Dataset[tuple[Tensor, Tensor]]):
    """Regression pairs ``(x, y)``; for the GAN, ``x`` is a real sample and ``y`` its latent noise."""

    def __init__(self, n: int, x_dim: int = 8, y_dim: int = 1) -> None:
        g = torch.Generator().manual_seed(17)
        self.x = torch.randn(n, x_dim, generator=g) * 0.5 + 1.0
        self.y = torch.randn(n, y_dim, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): ``p -= lr * (sign(b1 m + (1 - b1) g) + wd p)``, then
    ``m = b2 m + (1 - b2) g``. Element-wise, but not in the package's list of tested optimizers."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return loss


OPTIMIZERS: dict[str, Callable[[Iterable[Any]], torch.optim.Optimizer]] = {
    "lion": lambda ps: Lion(ps, lr=0.01, weight_decay=0.1),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=0.01),
    "lbfgs": lambda ps: torch.optim.LBFGS(ps, lr=0.1),
    "muon": lambda ps: torch.optim.Muon([p for p in ps if p.ndim == 2], lr=0.02),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=0.01),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
}


class Regressor(pl.LightningModule):
    """A small MLP (optionally with BatchNorm) trained with the optimizer named ``optimizer``."""

    def __init__(self, optimizer: str, batchnorm: bool = False) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        norm: list[nn.Module] = [nn.BatchNorm1d(16)] if batchnorm else []
        self.net = nn.Sequential(
            nn.Linear(8, 16), *norm, nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
        )

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return OPTIMIZERS[self.optimizer_name](self.parameters())


class PipeRegressor(Regressor):
    """The regressor as pipeline layers (its ``nn.Sequential``'s modules, cut into two stages)."""

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.net)

    def pipeline_loss(self, output: Tensor, batch: tuple[Tensor, Tensor]) -> Tensor:
        return F.mse_loss(output, batch[1])


# the regressor's first two linear layers, column- then row-parallel
TP_PLAN = {"net.0": "colwise", "net.2": "rowwise"}


class GAN(pl.LightningModule):
    """Manual optimization, two optimizers: a discriminator step (fake samples detached), then a generator
    step, each inside ``toggle_optimizer``/``untoggle_optimizer``. Records whether the discriminator was
    frozen (``requires_grad`` False) during the generator step, as ``toggle_optimizer`` means it to be."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.d_trainable_in_g_step: list[bool] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        real, z = batch
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)

        self.toggle_optimizer(opt_d)
        fake = self.generator(z).detach()
        d_loss = F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
        d_loss = d_loss + F.binary_cross_entropy_with_logits(self.discriminator(fake), zeros)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        self.toggle_optimizer(opt_g)
        self.d_trainable_in_g_step.append(any(p.requires_grad for p in self.discriminator.parameters()))
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self.generator(z)), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.Adam(self.generator.parameters(), lr=1e-3, betas=(0.5, 0.999)),
            torch.optim.SGD(self.discriminator.parameters(), lr=0.05, momentum=0.9),
        ]


# ---------------------------------------------------------------------------------------------- runs
def _trainer(strategy: Any, epochs: int, tmp: str, callbacks: list[pl.Callback], **kw: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=tmp,
        callbacks=callbacks,
        **kw,
    )


def _loader(module: pl.LightningModule) -> DataLoader[tuple[Tensor, Tensor]]:
    y_dim = 4 if isinstance(module, GAN) else 1  # the GAN's second column is its latent noise
    return DataLoader(Pairs(N, y_dim=y_dim), batch_size=MICRO, shuffle=True)


def _fit(
    module_fn: Callable[[], pl.LightningModule],
    strategy: Any,
    tmp: str,
    *,
    epochs: int = 1,
    callbacks: list[pl.Callback] | None = None,
) -> dict[str, Any]:
    """Final state dict (every rank holds the whole model after fit at every stage), step count and,
    for the GAN, what it recorded about ``toggle_optimizer``."""
    pl.seed_everything(SEED)
    module = module_fn()
    trainer = _trainer(strategy, epochs, tmp, callbacks or [])
    trainer.fit(module, _loader(module))
    return {
        "state": _state(module),
        "steps": trainer.global_step,
        "toggle": getattr(module, "d_trainable_in_g_step", None),
    }


def _state(module: nn.Module) -> State:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _refused(
    module_fn: Callable[[], pl.LightningModule],
    strategy: Any,
    tmp: str,
    error: type[Exception],
    callbacks: list[pl.Callback] | None = None,
    **kw: Any,
) -> dict[str, Any]:
    """The error a fit raises (on every rank alike), and the step count when it did (0: before any step)."""
    pl.seed_everything(SEED)
    module = module_fn()
    trainer = _trainer(strategy, 1, tmp, callbacks or [], **kw)
    with pytest.raises(error) as info:
        trainer.fit(module, _loader(module))
    return {"type": type(info.value).__name__, "message": str(info.value), "global_step": trainer.global_step}


def _lion() -> Regressor:
    return Regressor("lion")


def _rprop() -> Regressor:
    return Regressor("rprop")


def _lbfgs() -> Regressor:
    return Regressor("lbfgs")


def _muon() -> Regressor:
    return Regressor("muon")


def _adafactor() -> Regressor:
    return Regressor("adafactor")


def _lbfgs_pipe() -> Regressor:
    return PipeRegressor("lbfgs")


def _plain() -> Regressor:
    return Regressor("sgd")


def _with_bn() -> Regressor:
    return Regressor("sgd", batchnorm=True)


def _optimizer_runs(rank: int, world: int, tmp: str) -> dict[str, Any]:
    hp = HybridParallelStrategy
    untested = dict(allow_untested_optimizer=True)
    unused = dict(find_unused_parameters=True)
    s3 = dict(zero_stage=3, meta_init=False)  # meta_init=False: the initial weights are the module's own
    plan: dict[str, Callable[[], Any]] = {
        "lion_refused": lambda: _refused(_lion, hp(zero_stage=2), tmp, TypeError),
        "lion_ddp": lambda: _fit(_lion, "ddp", tmp, epochs=2),
        "lion_s2": lambda: _fit(_lion, hp(zero_stage=2, **untested), tmp, epochs=2),
        "lion_s3": lambda: _fit(_lion, hp(**s3, **untested), tmp, epochs=2),
        "rprop_ddp": lambda: _fit(_rprop, "ddp", tmp),
        "rprop_s1": lambda: _fit(_rprop, hp(zero_stage=1, **untested), tmp),
        "lbfgs_s2_refused": lambda: _refused(_lbfgs, hp(zero_stage=2, **untested), tmp, TypeError),
        "lbfgs_s3_refused": lambda: _refused(_lbfgs, hp(**s3, **untested), tmp, TypeError),
        # whole-matrix optimizers on tensor-parallel slices, even with the flag; a closure under pp
        "muon_tp2_refused": lambda: _refused(
            _muon, hp(tensor_parallel_size=2, tp_plan=TP_PLAN, **untested), tmp, TypeError
        ),
        "adafactor_tp2_refused": lambda: _refused(
            _adafactor, hp(tensor_parallel_size=2, tp_plan=TP_PLAN), tmp, TypeError
        ),
        "lbfgs_pp2_refused": lambda: _refused(_lbfgs_pipe, hp(pipeline_parallel_size=2), tmp, TypeError),
        "gan_ddp": lambda: _fit(GAN, DDPStrategy(find_unused_parameters=True), tmp),
        "gan_s1": lambda: _fit(GAN, hp(zero_stage=1, **unused), tmp),
        "gan_s2": lambda: _fit(GAN, hp(zero_stage=2, **unused), tmp),
        "gan_s3_units": lambda: _fit(
            GAN, hp(**s3, **unused, zero3_units=["generator", "discriminator"]), tmp
        ),
        "gan_s3": lambda: _fit(GAN, hp(**s3, **unused), tmp),
        "gan_s2_unused": lambda: _refused(GAN, hp(zero_stage=2), tmp, UnusedParametersError),
        "gan_s3_unused": lambda: _refused(GAN, hp(**s3), tmp, UnusedParametersError),
    }
    return _timed(plan)


def _averaging_runs(rank: int, world: int, tmp: str) -> dict[str, Any]:
    hp = HybridParallelStrategy

    def swa() -> list[pl.Callback]:
        return [StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=2)]

    def ema() -> list[pl.Callback]:
        return [EMAWeightAveraging(decay=0.6)]

    plan: dict[str, Callable[[], Any]] = {"none_ddp": lambda: _fit(_plain, "ddp", tmp, epochs=3)}
    for name, module_fn, callbacks, layouts in (
        ("swa", _plain, swa, ("ddp", 1, 2)),
        ("ema", _plain, ema, ("ddp", 1, 2)),
        ("ema_bn", _with_bn, ema, ("ddp", 2)),
        ("swa_bn", _with_bn, swa, ("ddp", 0)),  # refused at stages 1/2, see below
    ):
        for layout in layouts:
            strategy = "ddp" if layout == "ddp" else hp(zero_stage=layout)
            key = f"{name}_{layout if layout == 'ddp' else f's{layout}'}"
            plan[key] = lambda m=module_fn, s=strategy, c=callbacks: _fit(m, s, tmp, epochs=3, callbacks=c())
    for stage in (1, 2):
        plan[f"swa_bn_s{stage}_refused"] = lambda st=stage: _refused(
            _with_bn, hp(zero_stage=st), tmp, ValueError, callbacks=swa()
        )
    for name, callbacks in (("swa", swa), ("ema", ema)):
        for layout, strategy, kw in (
            ("s3", lambda: hp(zero_stage=3), {}),
            ("tp2", lambda: hp(tensor_parallel_size=2), {}),
            ("bf16", lambda: hp(zero_stage=2), {"precision": "bf16-true"}),
        ):
            plan[f"{name}_{layout}_refused"] = lambda c=callbacks, s=strategy, k=kw: _refused(
                _plain, s(), tmp, ValueError, callbacks=c(), **k
            )
    return _timed(plan)


def _timed(plan: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"seconds": {}}
    for name, run in plan.items():
        start = time.perf_counter()
        out[name] = run()
        out["seconds"][name] = round(time.perf_counter() - start, 3)
    return out


# ---------------------------------------------------------------------------------------------- checks
@pytest.fixture(scope="module")
def optimizer_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_optimizer_runs, WORLD, str(tmp_path_factory.mktemp("opt")), init_group=False)


@pytest.fixture(scope="module")
def averaging_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_averaging_runs, WORLD, str(tmp_path_factory.mktemp("avg")), init_group=False)


def _initial(module_fn: Callable[[], nn.Module]) -> State:
    pl.seed_everything(SEED)
    return _state(module_fn())


def _assert_same(got: State, ref: State, what: str) -> None:
    assert set(got) == set(ref), what
    for key, value in ref.items():
        torch.testing.assert_close(got[key], value, msg=lambda m, k=key: f"{what}: {k}: {m}")


def _assert_moved(state: State, initial: State, keys: Iterable[str], what: str) -> None:
    for key in keys:
        assert not torch.allclose(state[key], initial[key]), f"{what}: {key} did not change"


def test_untested_optimizers_refused_at_setup(optimizer_results: list[dict[str, Any]]) -> None:
    """A user's Lion at ZeRO-2 without ``allow_untested_optimizer``: a ``TypeError`` at setup naming the
    class and the flag; LBFGS with the flag at stages 2 and 3: refused, saying the flag does not change that.
    At tp2 (stage 0), Muon (with the flag) and Adafactor over the sliced weights, and LBFGS at pp2: refused,
    naming the layout and the fix (before, tp2 trained on with Muon 1e-3 from one process in 8 steps;
    LBFGS at pp2 died in its step on the other stage's meta parameters). No step was taken in any case."""
    for r in optimizer_results:
        lion = r["lion_refused"]
        assert lion["type"] == "TypeError" and lion["global_step"] == 0
        assert "tests.test_optimizers_averaging.Lion" in lion["message"]
        assert "allow_untested_optimizer=True" in lion["message"]
        for key in ("lbfgs_s2_refused", "lbfgs_s3_refused"):
            lbfgs = r[key]
            assert lbfgs["type"] == "TypeError" and lbfgs["global_step"] == 0, key
            assert "torch.optim.lbfgs.LBFGS" in lbfgs["message"], key
            assert "allow_untested_optimizer does not change that" in lbfgs["message"], key
        for key, name in (("muon_tp2_refused", "Muon"), ("adafactor_tp2_refused", "Adafactor")):
            error = r[key]
            assert error["type"] == "TypeError" and error["global_step"] == 0, key
            assert "Tensor parallelism (net.0.weight (8, 8) is this rank's slice)" in error["message"], key
            assert f"cannot shard torch.optim.{name}" in error["message"], key
            assert "tensor_parallel_size=1" in error["message"], key
        lbfgs = r["lbfgs_pp2_refused"]
        assert lbfgs["type"] == "TypeError" and lbfgs["global_step"] == 0
        assert "Pipeline parallelism cannot run torch.optim.lbfgs.LBFGS" in lbfgs["message"]
        assert "pipeline_parallel_size=1" in lbfgs["message"]


def test_untested_elementwise_optimizers_match_ddp(optimizer_results: list[dict[str, Any]]) -> None:
    """With ``allow_untested_optimizer=True``: Lion at ZeRO-2 and ZeRO-3 (8 steps) and Rprop at ZeRO-1
    (4 steps) end with the weights of Lightning's ``"ddp"`` with the same optimizer, on both ranks."""
    lion0, rprop0 = _initial(_lion), _initial(_rprop)
    for rank, r in enumerate(optimizer_results):
        assert r["lion_ddp"]["steps"] == 8 and r["rprop_ddp"]["steps"] == 4
        _assert_moved(r["lion_ddp"]["state"], lion0, lion0, "lion ddp")
        _assert_moved(r["rprop_ddp"]["state"], rprop0, rprop0, "rprop ddp")
        for key in ("lion_s2", "lion_s3"):
            assert r[key]["steps"] == 8, key
            _assert_same(r[key]["state"], r["lion_ddp"]["state"], f"rank {rank} {key}")
        assert r["rprop_s1"]["steps"] == 4
        _assert_same(r["rprop_s1"]["state"], r["rprop_ddp"]["state"], f"rank {rank} rprop_s1")


def test_manual_two_optimizers_gan_matches_ddp(optimizer_results: list[dict[str, Any]]) -> None:
    """The GAN (manual optimization, Adam for the generator, SGD with momentum for the discriminator, 8
    optimizer steps) at ZeRO 1, 2 and 3 (units = the two networks) with ``find_unused_parameters=True``
    ends with both networks' weights equal to ``"ddp"`` with ``find_unused_parameters=True``. Without the
    flag, the discriminator step (fake samples detached) fails at once with ``UnusedParametersError``
    naming the generator's parameters, which ``toggle_optimizer`` froze, at stage 2 and stage 3."""
    initial = _initial(GAN)
    for rank, r in enumerate(optimizer_results):
        ref = r["gan_ddp"]
        assert ref["steps"] == 8
        _assert_moved(ref["state"], initial, initial, "gan ddp")
        for key in ("gan_s1", "gan_s2", "gan_s3_units"):
            assert r[key]["steps"] == 8, key
            _assert_same(r[key]["state"], ref["state"], f"rank {rank} {key}")
        for key in ("gan_s2_unused", "gan_s3_unused"):
            error = r[key]
            assert error["type"] == "UnusedParametersError" and error["global_step"] == 0, key
            assert "generator.0.weight" in error["message"], key
            assert "find_unused_parameters=True" in error["message"], key
            assert "discriminator" not in error["message"], key
            # toggle_optimizer froze them: the message says so (before, "freeze them before training")
            assert "They are frozen (requires_grad=False) now but were trainable" in error["message"], key


def test_manual_two_optimizers_gan_matches_ddp_at_stage3_default_units(
    optimizer_results: list[dict[str, Any]],
) -> None:
    """The same GAN at ZeRO-3 with the default units (no ``nn.ModuleList``: the whole model is the root
    unit) equals ``"ddp"``: its second forward inside one ``training_step`` (the generator step, after the
    discriminator's backward) must see real weights, not placeholders."""
    for rank, r in enumerate(optimizer_results):
        assert r["gan_s3"]["steps"] == 8
        _assert_same(r["gan_s3"]["state"], r["gan_ddp"]["state"], f"rank {rank} gan_s3 (default units)")


def test_toggle_optimizer_freezes_the_other_network_as_in_ddp(
    optimizer_results: list[dict[str, Any]],
) -> None:
    """``toggle_optimizer(opt_g)`` sets ``requires_grad=False`` on the discriminator for the generator step
    under ``"ddp"``; ZeRO 1-3 must do the same (it decides what backward computes and reduces)."""
    for r in optimizer_results:
        assert r["gan_ddp"]["toggle"] == [False] * 4
        for key in ("gan_s1", "gan_s2", "gan_s3_units"):
            assert r[key]["toggle"] == [False] * 4, f"{key}: discriminator trainable in the generator step"


def test_weight_averaging_matches_ddp(averaging_results: list[dict[str, Any]]) -> None:
    """3 epochs of SGD: ``StochasticWeightAveraging`` (from epoch 2) and ``EMAWeightAveraging`` at ZeRO 1 and
    2 in fp32, EMA on a model with BatchNorm at ZeRO-2 (buffers averaged too), and SWA on the BatchNorm model
    at ZeRO-0 (with its extra statistics epoch) end with ``"ddp"``'s weights and buffers on both ranks; each
    callback did change the result (against ``"ddp"`` without it)."""
    for rank, r in enumerate(averaging_results):
        plain = r["none_ddp"]["state"]
        for name in ("swa", "ema"):
            _assert_moved(r[f"{name}_ddp"]["state"], plain, plain, f"{name} ddp against no averaging")
        assert r["swa_bn_ddp"]["steps"] == 13  # 12 steps, then the statistics epoch's step
        for key in ("swa_s1", "swa_s2", "ema_s1", "ema_s2", "ema_bn_s2", "swa_bn_s0"):
            ref = r[key.rsplit("_", 1)[0] + "_ddp"]
            assert r[key]["steps"] == ref["steps"], key
            _assert_same(r[key]["state"], ref["state"], f"rank {rank} {key}")


def test_weight_averaging_refused_where_it_cannot_match_ddp(averaging_results: list[dict[str, Any]]) -> None:
    """At ZeRO-3, with ``tensor_parallel_size=2`` and with bf16 parameters (separate fp32 masters) at ZeRO-2,
    SWA and EMA are refused at setup with a ``ValueError`` naming the callback, the reason and the
    alternative, before any step. So is SWA on a model with BatchNorm at ZeRO 1/2 (its statistics epoch's
    ``optimizer.step()`` without backward re-applies the last gradients under ``"ddp"``, not here)."""
    reasons = {"s3": "ZeRO stage 3", "tp2": "tensor parallelism", "bf16": "fp32 masters"}
    for r in averaging_results:
        for name, callback in (("swa", "StochasticWeightAveraging"), ("ema", "EMAWeightAveraging")):
            for layout, reason in reasons.items():
                error = r[f"{name}_{layout}_refused"]
                assert error["type"] == "ValueError" and error["global_step"] == 0, (name, layout)
                assert error["message"].startswith(f"{callback} cannot be used with this layout"), error
                assert reason in error["message"], error
                assert "zero_stage 0, 1 or 2 in precision='32-true'" in error["message"], error
                advice = "ShardedEMA" if name == "ema" else "SWALR as the scheduler"
                assert advice in error["message"], error
        for stage in (1, 2):
            error = r[f"swa_bn_s{stage}_refused"]
            assert error["type"] == "ValueError" and error["global_step"] == 0
            assert "BatchNorm" in error["message"] and f"ZeRO stage {stage}" in error["message"], error
            assert "Use zero_stage=0" in error["message"], error
