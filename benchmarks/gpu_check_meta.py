"""GPU check, parts 2 and 4: meta init at ZeRO-3 on the device, and the node health check.

Part 2: ``configure_model()`` under the strategy at ZeRO-3 builds on the meta device; after setup (and
after a step) every shard is on the device and no parameter is left on meta; the initial weights equal
:func:`~lightning_par.zero.meta_init.materialize_model` of an unsharded twin with the seed the engine
drew (what ``tests/test_zero3.py`` promises: the twin is built under the global generator captured at
``setup``, before ``configure_model``, and the seed is the engine's next draw from it); training from
them equals a ``meta_init=False`` run loaded with the same weights. Equality with the module's own eager
init is not promised (the units are seeded one by one) and only reported.

Part 4: :class:`~lightning_par.callbacks.NodeHealthCheck` once, at fit start (``action="warn"``, judged
here): its verdict and figures. At world size 1 it has no collective to probe.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from benchmarks.gpu_check_correctness import (
    FP32_TOL,
    CheckGPT,
    Fail,
    Recorder,
    Sizes,
    loader,
    max_diff,
    module,
    trainer,
)
from lightning_par import HybridParallelStrategy
from lightning_par.callbacks import NodeHealthCheck
from lightning_par.zero.meta_build import params_on_meta
from lightning_par.zero.meta_init import materialize_model


class MetaProbe(pl.Callback):
    """The global generator at setup (before ``configure_model``), where the shards live after setup
    and after a step, the initial and final weights."""

    def __init__(self) -> None:
        self.rng: Tensor | None = None
        self.facts: dict[str, Any] = {}
        self.initial: dict[str, Tensor] = {}
        self.final: dict[str, Tensor] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.rng = torch.get_rng_state()

    def _where(self, trainer: pl.Trainer, module: pl.LightningModule, when: str) -> None:
        engine: Any = trainer.strategy.engine  # type: ignore[attr-defined]
        self.facts[f"shard_devices_{when}"] = sorted({str(v.device) for *_, v in engine.shard_table()})
        self.facts[f"meta_params_{when}"] = [n for n, p in module.named_parameters() if p.is_meta]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.facts["engine"] = type(trainer.strategy.engine).__name__  # type: ignore[attr-defined]
        self._where(trainer, pl_module, "after_setup")
        self.initial = trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == 1:
            self._where(trainer, pl_module, "after_step")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.final = trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]


def part_meta(sizes: Sizes, device: str, root: str, fail: Fail) -> dict[str, Any]:
    sizes = dataclasses.replace(sizes, steps=min(sizes.steps, 3))
    runs: dict[str, Any] = {}
    for mode in ("meta", "eager"):
        m = module(sizes, device, token=False, optimizer="adamw", build=mode == "eager")
        if mode == "eager":  # meta_init=False from the meta run's initial weights
            m.load_state_dict(runs["meta"]["probe"].initial)
        probe, rec = MetaProbe(), Recorder()
        strategy = HybridParallelStrategy(zero_stage=3, meta_init=mode == "meta")
        t = trainer(
            device, strategy, "32-true", sizes.steps, sizes.accum, [probe, rec], default_root_dir=root
        )
        t.fit(m, loader(sizes))
        runs[mode] = {"probe": probe, "losses": rec.losses, "built_on_meta": m.built_on_meta}
    meta, eager = runs["meta"], runs["eager"]
    seen: MetaProbe = meta["probe"]
    assert seen.rng is not None
    # the unsharded twin: the same construction under the same generator, then the seed the engine drew
    torch.set_rng_state(seen.rng)
    twin = CheckGPT(
        token=False, optimizer="adamw", fused=False, **sizes.model.kwargs(), max_steps=sizes.steps
    )
    with params_on_meta():
        twin.configure_model()
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    materialize_model(twin, seed=seed, device=torch.device(device))
    twin_state = {k: v.detach().cpu() for k, v in twin.state_dict().items()}
    eager_init = {
        k: v.detach() for k, v in module(sizes, device, token=False, optimizer="adamw").state_dict().items()
    }
    want = "cuda:0" if device == "cuda" else "cpu"
    out = {
        **seen.facts,
        "built_on_meta": meta["built_on_meta"],
        "eager_run_built_on_meta": eager["built_on_meta"],
        "losses_meta": meta["losses"],
        "losses_eager": eager["losses"],
        "initial_vs_twin_max_diff": max_diff(seen.initial, twin_state),
        "final_vs_eager_run_max_diff": max_diff(seen.final, eager["probe"].final),
        "initial_vs_eager_init_max_diff (not promised)": max_diff(seen.initial, eager_init),
        "tied_head_equals_embedding": bool(
            torch.equal(seen.initial["model.head.lm_head.weight"], seen.initial["model.embed.tok.weight"])
        ),
    }
    checks = {
        "configure_model built the parameters on the meta device": out["built_on_meta"] is True,
        "the eager run was not on meta": out["eager_run_built_on_meta"] is False,
        f"every shard on {want} after setup and after a step": out["shard_devices_after_setup"] == [want]
        and out["shard_devices_after_step"] == [want],
        "no meta parameter after setup": not out["meta_params_after_setup"],
        "initial weights == materialize_model twin (the engine's seed)": out["initial_vs_twin_max_diff"]
        == 0.0,
        "final weights == meta_init=False run from the same initial weights": out[
            "final_vs_eager_run_max_diff"
        ]
        <= FP32_TOL,
        "finite losses": all(math.isfinite(x) for x in meta["losses"] + eager["losses"]),
        "tied head and embedding equal": out["tied_head_equals_embedding"],
    }
    for what, ok in checks.items():
        if not ok:
            fail(f"meta init: {what} failed ({out})")
    out["checks"] = checks
    return out


def part_health(sizes: Sizes, device: str, root: str, fail: Fail) -> dict[str, Any]:
    health = NodeHealthCheck(matmul_size=sizes.health_matmul, matmul_repeats=5, action="warn")
    m = module(dataclasses.replace(sizes, steps=1), device, token=False, optimizer="sgd")
    t = trainer(
        device, HybridParallelStrategy(zero_stage=0), "32-true", 1, 1, [health], default_root_dir=root
    )
    t.fit(m, loader(dataclasses.replace(sizes, steps=1, accum=1)))
    out = {
        "verdict": "healthy" if not health.problems else "problems",
        "problems": health.problems,
        "results": health.results,
        "matmul_size": sizes.health_matmul,
        "note": "world size 1: no collective-bandwidth probe (NodeHealthCheck probes groups of >= 2 ranks)",
    }
    mine = health.results[0] if health.results else {}
    if health.problems or mine.get("errors") or not mine.get("matmul_gflops", 0) > 0:
        fail(f"health: {out}")
    return out
