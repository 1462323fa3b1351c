"""Tensor parallelism under lightning_par's Fabric strategy, on Hugging Face's Llama (a model we did not
write; the shipped ``"llama"`` plan), compared with the same Fabric loop in one process.

On 4 Gloo ranks (dp 2 x tp 2), ZeRO-1 and ZeRO-3 each train 3 steps of AdamW with gradient accumulation
and clipping that bites: the losses, the final weights (gathered from the tp slices and dp shards) and
the clip norms (on every rank) equal Fabric's single-device run; the ZeRO-3 run with Hugging Face's
activation checkpointing on (non-reentrant, transformers 5's default). The ZeRO-3 run also ``fabric.save``s a
sharded checkpoint after step 2; it is loaded in one process at ZeRO-0 (no tensor parallelism) and the
last step there equals the uninterrupted run. ``torch.optim.Muon`` over the sliced weight matrices is
refused at ``setup_optimizers`` (it orthogonalises whole matrices). litgpt's GPT under its own plan is in
``tests/test_tp_litgpt.py``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

from lightning_par.checkpoint.full import gather_full_state_dict
from lightning_par.checkpoint.tp_reshard import tp_info
from lightning_par.fabric import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.third_party import LLAMA, checkpoint_layers, llama

WORLD, TP, MICRO, ACCUM, STEPS, SEQ, LR = 4, 2, 2, 2, 3, 16, 3e-3
DP = WORLD // TP


def _batches() -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, LLAMA["vocab_size"], (STEPS, ACCUM, DP * MICRO, SEQ + 1), generator=g)


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=1e-5)


def _loop(
    fabric: Fabric, model: Any, optimizer: Any, *, dp_rank: int, dp: int, steps: range, norms: list[float]
) -> list[float]:
    """The loop; the clip norms go into ``norms`` (AdamW barely sees a wrong clip factor: its update is
    nearly invariant to a gradient's scale, so the norm itself is compared)."""
    losses = []
    data = _batches()
    per = DP * MICRO // dp
    for step in steps:
        total = torch.zeros(())
        for k in range(ACCUM):
            chunk = data[step, k, dp_rank * per : (dp_rank + 1) * per]
            with fabric.no_backward_sync(model, enabled=k < ACCUM - 1):
                logits = model(input_ids=chunk[:, :-1]).logits
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten())
                fabric.backward(loss / ACCUM)
            total += loss.detach() / ACCUM
        norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=0.3)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(total, reduce_op="mean")))
    return losses


def _tp_run(rank: int, world: int, stage: int, save: str | None) -> dict[str, Any]:
    strategy = HybridParallelStrategy(zero_stage=stage, tensor_parallel_size=TP, tp_plan="llama")
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = llama(seed=0)
    if stage == 3:  # Hugging Face's activation checkpointing: ZeRO-3 gathers each layer again in backward
        checkpoint_layers(model, reentrant=False)
    model, optimizer = fabric.setup(model, _adamw(model))
    mesh = strategy.mesh
    assert fabric.strategy.distributed_sampler_kwargs == {"num_replicas": DP, "rank": mesh.dp_rank}
    norms: list[float] = []
    losses = _loop(fabric, model, optimizer, dp_rank=mesh.dp_rank, dp=DP, steps=range(STEPS - 1), norms=norms)
    if save is not None:
        fabric.save(save, {"model": model, "optimizer": optimizer, "step": STEPS - 1})
    losses += _loop(
        fabric, model, optimizer, dp_rank=mesh.dp_rank, dp=DP, steps=range(STEPS - 1, STEPS), norms=norms
    )
    module = strategy.module
    assert module is not None
    tp = tp_info(module, rank=mesh.tp_rank, size=TP)
    # the projections really are slices: q_proj holds half of its output rows on each tp rank
    assert tp["dims"]["model.layers.0.self_attn.q_proj.weight"] == 0
    if stage < 3:  # (at stage 3 the parameters are flat shards between steps)
        assert module.model.layers[0].self_attn.q_proj.weight.shape[0] == LLAMA["hidden_size"] // TP
    full = gather_full_state_dict(module, strategy.engine, tp=tp, dp_rank=mesh.dp_rank, group=None)
    state = {k: v.clone() for k, v in full.items()} if full else None
    return {"losses": losses, "norms": norms, "state": state}


def _muon_refused(world: int) -> str:
    """Muon over the weight matrices under tp2: it orthogonalises whole matrices, which each rank holds
    only slices of, so it is refused at setup."""
    strategy = HybridParallelStrategy(tensor_parallel_size=TP, tp_plan="llama")
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(llama(seed=0))
    with pytest.raises(TypeError) as refused:
        fabric.setup_optimizers(torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02))
    return str(refused.value)


def _tp_runs(rank: int, world: int, tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {
        "zero1": _tp_run(rank, world, 1, None),
        "zero3": _tp_run(rank, world, 3, str(Path(tmp) / "tp_sharded")),
        "muon": _muon_refused(world),
    }


def _resume(rank: int, world: int, path: str) -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=HybridParallelStrategy(zero_stage=0))
    fabric.launch()
    model = llama(seed=3)  # other initial weights: the checkpoint must replace them
    model, optimizer = fabric.setup(model, _adamw(model))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    assert fabric.load(path, state) == {} and state["step"] == STEPS - 1
    losses = _loop(fabric, model, optimizer, dp_rank=0, dp=1, steps=range(STEPS - 1, STEPS), norms=[])
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _reference() -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", devices=1)
    model = llama(seed=0)
    model, optimizer = fabric.setup(model, _adamw(model))
    norms: list[float] = []
    losses = _loop(fabric, model, optimizer, dp_rank=0, dp=1, steps=range(STEPS), norms=norms)
    return {
        "losses": losses,
        "norms": norms,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def _assert_equal(run: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    torch.testing.assert_close(
        torch.tensor(run["losses"]), torch.tensor(ref["losses"]), msg=lambda m: f"{what}: losses\n{m}"
    )
    assert set(run["state"]) == set(ref["state"]), what
    for name, value in ref["state"].items():
        torch.testing.assert_close(run["state"][name], value, msg=lambda m, n=name: f"{what}: {n}\n{m}")


def test_fabric_tensor_parallel_llama_equals_one_process() -> None:
    torch.set_num_threads(1)
    ref = _reference()
    initial = llama(seed=0).state_dict()
    assert max(float((ref["state"][k] - initial[k]).abs().max()) for k in initial) > 1e-3  # it trained
    with tempfile.TemporaryDirectory() as tmp:
        results = run_distributed(_tp_runs, WORLD, tmp, init_group=False, timeout=400)
        resumed = run_distributed(_resume, 1, str(Path(tmp) / "tp_sharded"), init_group=False)[0]
    for name in ("zero1", "zero3"):
        assert results[0][name]["state"] is not None
        _assert_equal(results[0][name], ref, f"{name} dp2 x tp2")
        for r in results:  # the global norm on every rank: tp-replicated norms counted once
            torch.testing.assert_close(torch.tensor(r[name]["norms"]), torch.tensor(ref["norms"]))
        for r in results[1:]:
            assert r[name]["losses"] == results[0][name]["losses"]  # every rank logs the same value
    for r in results:
        assert "Tensor parallelism" in r["muon"] and "cannot shard torch.optim.Muon" in r["muon"], r["muon"]
        assert "tensor_parallel_size=1" in r["muon"], r["muon"]
    tail = {"losses": ref["losses"][STEPS - 1 :], "state": ref["state"]}
    _assert_equal(resumed, tail, "zero3 dp2 x tp2 directory -> zero0 one process")


def test_fabric_tensor_parallel_bad_input() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        HybridParallelStrategy(tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"sequence_parallel=True splits .* tensor_parallel_size=1: set"):
        HybridParallelStrategy(sequence_parallel=True)
    with pytest.raises(ValueError, match="Unknown tp_plan 'mistral'"):
        HybridParallelStrategy(tensor_parallel_size=2, tp_plan="mistral")


def _metrics_and_saves(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from torch.utils.data import DataLoader
    from torchmetrics import MeanMetric, SumMetric

    fabric = Fabric(
        accelerator="cpu",
        devices=world,
        strategy=HybridParallelStrategy(tensor_parallel_size=TP, tp_plan="llama"),
    )
    fabric.launch()
    model = llama(0)
    model, optimizer = fabric.setup(model, _adamw(model))
    synced, plain = SumMetric().to(fabric.device), SumMetric().to(fabric.device)
    fabric.strategy.sync_metrics(synced)  # type: ignore[attr-defined]
    for batch in fabric.setup_dataloaders(DataLoader(torch.arange(8.0), batch_size=2)):
        synced.update(torch.ones_like(batch))
        plain.update(torch.ones_like(batch))
    mean = MeanMetric().to(fabric.device)
    mean.persistent(True)  # its running sums in its state_dict
    mean.update(torch.tensor([1.0, 3.0]))
    path = str(Path(tmp) / "with_metric")
    fabric.save(path, {"model": model, "optimizer": optimizer, "metric": mean, "step": 3})
    restored = MeanMetric().to(fabric.device)
    restored.persistent(True)
    rest = fabric.load(path, {"model": model, "optimizer": optimizer, "metric": restored})
    block = model.module.model.layers[0]  # a part of the model: this rank's slices only
    with pytest.raises(ValueError) as refused:
        fabric.save(str(Path(tmp) / "with_block"), {"model": model, "block": block})
    return {
        "synced": float(synced.compute()),
        "plain": float(plain.compute()),
        "restored": float(restored.compute()),
        "step": rest["step"],
        "copy": str(refused.value),
    }


def test_fabric_tp_metrics_outside_the_module_and_metric_checkpoints(tmp_path: Path) -> None:
    """At tp2 the two ranks hold the same samples. A torchmetrics object outside the set-up module, given
    to ``strategy.sync_metrics``, counts the 8 samples once (one synced over the world, as before, counts
    them twice). A metric in ``fabric.save``'s state is saved and loaded through its ``state_dict``, as
    at tp1 (before, every module other than the set-up one was refused under tp); a part of the model,
    which holds this rank's slices, is still refused."""
    for r in run_distributed(_metrics_and_saves, TP, str(tmp_path), init_group=False):
        assert r["synced"] == 8.0 and r["plain"] == 16.0, r
        assert r["restored"] == 2.0 and r["step"] == 3, r
        assert "holds this rank's tensor-parallel slices" in r["copy"], r
