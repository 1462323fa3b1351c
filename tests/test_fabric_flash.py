"""``FlashSnapshots`` in Fabric loops: a crash and an automatic resume equal a run never interrupted.

A litgpt ``GPT`` (the pythia-14m config cut to 2 layers, 256-token vocabulary; no weights downloaded) is
trained with AdamW, gradient clipping and an LR schedule, on batches drawn from the global torch
generator (so the resume must restore the generators too). Snapshots every 2 steps, persisted every 4:

* 2 Gloo ranks, ``"zero2"``, ``"zero3"`` and Lightning's ``"ddp"`` (``snapshot_copy="blocking"``): a run
  crashes after step 7 (an exception leaves the ``with`` block); a fresh process builds a new Fabric,
  model (other initial weights), optimizer and scheduler, and ``restore`` brings back step 6 (from
  shared memory; at ZeRO-3 with the memory deleted, from disk) and the loop continues to step 10: the
  losses and final weights equal the uninterrupted run's bitwise. A model with another shape is refused
  with the difference named, and nothing on disk changes.
* One process, Lightning's single-device strategy (no engine): the same crash and resume.
* Bad input: option values, two models in one state dict, a negative step, an unsupported strategy.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import litgpt.config as litgpt_config
import litgpt.model as litgpt_model
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DataParallelStrategy

import lightning_par  # noqa: F401  (registers "zero0".."zero3" with Fabric)
from lightning_par.fabric import FlashSnapshots, HybridParallelStrategy
from tests.distributed import run_distributed

WORLD, MICRO, SEQ, STEPS, CRASH, EVERY, PERSIST = 2, 2, 16, 10, 7, 2, 4
STRATEGIES = ("zero2", "zero3", "ddp")


class Crash(RuntimeError):
    """The injected failure."""


def _fabric(strategy: str, devices: int) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    fabric.launch()
    return fabric


def _setup(fabric: Fabric, *, seed: int, n_layer: int = 2) -> dict[str, Any]:
    """A fresh model, optimizer and scheduler; ``seed`` sets the initial weights and the generators."""
    fabric.seed_everything(seed)
    config = litgpt_config.Config.from_name(
        "pythia-14m", n_layer=n_layer, block_size=SEQ, vocab_size=256, padded_vocab_size=256
    )
    with fabric.init_module():
        model = litgpt_model.GPT(config)
    # eps well above round-off: see tests/test_fabric.py (the key bias's exactly-zero gradient)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-5)
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}


def _train(
    fabric: Fabric,
    state: dict[str, Any],
    snaps: FlashSnapshots | None,
    *,
    start: int,
    crash: int = -1,
    losses: list[float] | None = None,
) -> list[float]:
    """Steps ``start``..``STEPS``: this rank's slice of a global batch drawn from the global generator,
    backward, clipping, the fence, the optimizer and scheduler steps, a snapshot every ``EVERY`` steps;
    the losses go into ``losses`` (kept when the crash injected after step ``crash`` is raised)."""
    model, optimizer = state["model"], state["optimizer"]
    losses = [] if losses is None else losses
    per = WORLD * MICRO // fabric.world_size
    for step in range(start, STEPS):
        batch = torch.randint(0, 256, (WORLD * MICRO, SEQ + 1))
        chunk = batch[fabric.global_rank * per : (fabric.global_rank + 1) * per]
        logits = model(chunk[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten())
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=0.5)
        if snaps is not None and not isinstance(fabric.strategy, HybridParallelStrategy):
            # Lightning's strategies: the loop fences (lightning_par's fences every optimizer step itself)
            snaps.fence()
        elif snaps is not None:
            assert len(fabric.strategy.before_optimizer_step) == 1
        optimizer.step()
        optimizer.zero_grad()
        state["scheduler"].step()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
        state["step"] = step + 1
        if snaps is not None and (step + 1) % EVERY == 0:
            snaps.snapshot(step + 1, state)
        if step + 1 == crash:
            raise Crash(f"injected crash after step {crash}")
    return losses


def _weights(fabric: Fabric, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    strategy = fabric.strategy
    if isinstance(strategy, HybridParallelStrategy) and strategy.zero_stage == 3:
        assert strategy.engine is not None
        full = strategy.engine.full_state_dict(to_rank=fabric.global_rank)  # type: ignore[attr-defined]
    else:
        full = state["model"].state_dict()
    weights = {k: v.detach().cpu().clone() for k, v in full.items() if k not in ("cos", "sin")}
    weights["lr"] = torch.tensor(state["optimizer"].param_groups[0]["lr"])
    return weights


def _snapshots(fabric: Fabric, tmp: Path, name: str) -> FlashSnapshots:
    return FlashSnapshots(
        fabric,
        tmp / name,
        persist_every_n_steps=PERSIST,
        shm_dir=tmp / f"shm-{name}",
        snapshot_copy="blocking" if name == "ddp" else "overlap",
    )


def _crash_and_reference(rank: int, world: int, tmp: str, names: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        fabric = _fabric(name, world)
        state = _setup(fabric, seed=0)
        reference = {"losses": _train(fabric, state, None, start=0), "weights": _weights(fabric, state)}
        fabric = _fabric(name, world)
        state = _setup(fabric, seed=0)
        losses: list[float] = []
        with pytest.raises(Crash), _snapshots(fabric, Path(tmp), name) as snaps:
            assert snaps.restore(state) is None  # nothing to resume: a fresh lineage
            _train(fabric, state, snaps, start=0, crash=CRASH, losses=losses)
        out[name] = {"reference": reference, "crashed": losses, "stats": snaps.stats}
    return out


def _listing(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def _resume(rank: int, world: int, tmp: str, names: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        if name == "zero3":  # the host rebooted: only the disk holds snapshots
            for d in (Path(tmp) / f"shm-{name}").glob(f"lightning_par_flash/*/rank{rank:05d}"):
                shutil.rmtree(d)
        fabric = _fabric(name, world)
        state = _setup(fabric, seed=1)  # other initial weights and generators: the restore sets them
        with _snapshots(fabric, Path(tmp), name) as snaps:
            start = snaps.restore(state)
            assert start is not None and state["step"] == start
            losses = _train(fabric, state, snaps, start=start)
        # the strategy's fence hook goes with the store
        assert getattr(fabric.strategy, "before_optimizer_step", []) == []
        out[name] = {"start": start, "losses": losses, "weights": _weights(fabric, state)}
        out[name]["resumed"] = snaps.resumed
    # another model in the same place: refused, naming the difference, and nothing on disk changes
    fabric = _fabric("zero2", world)
    state = _setup(fabric, seed=0, n_layer=1)
    before = _listing(Path(tmp) / "zero2")
    # the ranks share the directory, and opening the store writes and removes a probe file there: list
    # it only while no rank is inside the store
    fabric.barrier()
    with pytest.raises(ValueError) as refused, _snapshots(fabric, Path(tmp), "zero2") as snaps:
        snaps.restore(state)
    fabric.barrier()
    out["refused"] = str(refused.value)
    out["unchanged"] = before == _listing(Path(tmp) / "zero2")
    return out


def _assert_equal(got: Any, expected: Any, what: str) -> None:
    torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=lambda m: f"{what}\n{m}")


def test_fabric_loops_resume_bitwise_after_a_crash(tmp_path: Path) -> None:
    tmp = str(tmp_path)
    first = run_distributed(_crash_and_reference, WORLD, tmp, STRATEGIES, init_group=False, timeout=400)
    second = run_distributed(_resume, WORLD, tmp, STRATEGIES, init_group=False, timeout=400)
    for rank, (before, after) in enumerate(zip(first, second, strict=True)):
        for name in STRATEGIES:
            ref, crashed, resumed = before[name]["reference"], before[name]["crashed"], after[name]
            what = f"rank {rank} {name}"
            assert [(s["step"], s["persist"]) for s in before[name]["stats"]] == [
                (2, False),
                (4, True),
                (6, False),
            ], what
            assert resumed["start"] == 6, what
            source = "disk" if name == "zero3" else "memory"
            assert all(s.startswith(source) for s in resumed["resumed"]["sources"]), resumed["resumed"]
            _assert_equal(torch.tensor(crashed), torch.tensor(ref["losses"][:CRASH]), f"{what}: losses")
            _assert_equal(torch.tensor(resumed["losses"]), torch.tensor(ref["losses"][6:]), f"{what}: losses")
            _assert_equal(resumed["weights"], ref["weights"], f"{what}: final weights")
        refused = after["refused"]
        assert "written by another model or layout:" in refused and "Nothing was loaded" in refused
        assert "parameters not in the model: ['transformer.h.1.attn.proj.bias'" in refused, refused
        assert after["unchanged"], "a refused restore changed the snapshot directory"


def test_single_device_resume_and_bad_input(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=1)
    state = _setup(fabric, seed=0)
    reference = {"losses": _train(fabric, state, None, start=0), "weights": _weights(fabric, state)}
    state = _setup(fabric, seed=0)
    with pytest.raises(Crash), _snapshots(fabric, tmp_path, "single") as snaps:
        _train(fabric, state, snaps, start=0, crash=CRASH)
    state = _setup(fabric, seed=1)
    with _snapshots(fabric, tmp_path, "single") as snaps:
        start = snaps.restore(state)
        assert start == 6 and snaps.resumed is not None, snaps.resumed
        assert snaps.resumed["sources"][0].startswith("memory")
        losses = _train(fabric, state, snaps, start=6)
    _assert_equal(torch.tensor(losses), torch.tensor(reference["losses"][6:]), "single device: losses")
    _assert_equal(_weights(fabric, state), reference["weights"], "single device: final weights")
    assert not list((tmp_path / "shm-single").rglob("slot*.bin")), "a closed run keeps no shared memory"

    for options, message in (
        ({"persist_every_n_steps": 0}, "persist_every_n_steps must be a positive integer, got 0"),
        ({"keep_last": 1.5}, "keep_last must be a positive integer, got 1.5"),
        ({"memory_slots": 3}, "memory_slots must be 1 or 2, got 3"),
        ({"snapshot_copy": "lazy"}, r"snapshot_copy must be one of \('overlap', 'blocking'\)"),
        ({"flush_timeout_s": 0}, "flush_timeout_s must be a number > 0, got 0"),
    ):
        with pytest.raises(ValueError, match=f"FlashSnapshots: {message}"):
            FlashSnapshots(fabric, tmp_path / "bad", **options)
    with pytest.raises(TypeError, match="not DataParallelStrategy"):
        data_parallel = Fabric(accelerator="cpu", devices=1, strategy=DataParallelStrategy())
        FlashSnapshots(data_parallel, tmp_path / "bad")
    with FlashSnapshots(fabric, tmp_path / "bad", shm_dir=tmp_path / "shm-bad") as snaps:
        with pytest.raises(
            ValueError, match=r"the model fabric.setup\(\) returned, once \(modules \['a', 'b'\]"
        ):
            snaps.snapshot(2, {"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)})
        with pytest.raises(ValueError, match="step must be a non-negative integer, got -1"):
            snaps.snapshot(-1, state)
