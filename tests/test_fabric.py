"""Lightning Fabric loops on lightning_par's Fabric strategy, with litgpt's GPT as the client.

A litgpt ``GPT`` (the pythia-14m config cut to 2 layers, 256-token vocabulary; no weights downloaded) is
trained by a loop shaped like litgpt's pretrain loop (``fabric.no_backward_sync`` over accumulation
micro-batches, ``fabric.backward``, ``fabric.clip_gradients``, ``optimizer.step``) on 2 Gloo ranks, and
compared with the same loop in one process on Fabric's own single-device strategy:

* ``"zero2"`` and ``"zero3"`` (names registered in Fabric's registry): losses and final weights equal;
* ZeRO-3 with ``fabric.init_module(empty_init=True)`` and ``fabric.load_raw`` of the reference's initial
  weights: equal too;
* ``model.state_dict()`` at the end of a ZeRO-3 loop (a user's ``torch.save`` of it) is refused, naming
  ``consolidated_state_dict()``: the parameters are NaN placeholders there (before, 16 of 16 tensors of
  a small model came back NaN); the strategy's own reads (``fabric.save``, the consolidation) pass;
* ``fabric.save`` at ZeRO-3 on 2 ranks after 2 steps, ``fabric.load`` at ZeRO-1 in one process, 2 more
  steps: the final weights equal the uninterrupted run; the same from a single file
  (``save_distributed_checkpoint=False``);
* bad input: a module set up twice, an optimizer made from meta parameters before ``setup_module`` at
  ZeRO-3 (the rule: create it after), pipeline parallelism under Fabric, a Fabric precision plugin
  without an equivalent. Tensor parallelism under Fabric: ``tests/test_fabric_tp.py``.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

# litgpt is installed with --no-deps by the README's test command (its pins would replace other packages)
import litgpt.config as litgpt_config
import litgpt.model as litgpt_model
import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import HalfPrecision

import lightning_par  # noqa: F401  (registers "zero0".."zero3" with Fabric)
from lightning_par.checkpoint import consolidate, consolidate_cli
from lightning_par.checkpoint.full import gather_full_state_dict
from lightning_par.checkpoint.sharded import FABRIC_KEYS
from lightning_par.checkpoint.tp_reshard import tp_info
from lightning_par.fabric import HybridParallelStrategy
from lightning_par.fabric.precision import to_parallel_precision
from lightning_par.precision import ParallelPrecision
from tests.distributed import run_distributed

WORLD, MICRO, ACCUM, STEPS, SEQ, LR = 2, 2, 2, 4, 32, 3e-3


def _config() -> Any:
    return litgpt_config.Config.from_name(
        "pythia-14m", n_layer=2, block_size=SEQ, vocab_size=256, padded_vocab_size=256
    )


def _adamw(model: Any) -> torch.optim.Optimizer:
    # eps well above round-off: the key bias gets an exactly-zero gradient (softmax ignores it), whose
    # round-off noise (different summation orders over ranks) AdamW would otherwise blow up to lr-size steps
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=1e-5)


def _sgd(model: Any) -> torch.optim.Optimizer:
    # for the bf16 comparison: an update linear in the gradient, so rounding differences stay rounding-sized
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _batches() -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, 256, (STEPS, ACCUM, WORLD * MICRO, SEQ + 1), generator=g)


def _state(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k not in ("cos", "sin")}


def _loop(fabric: Fabric, model: Any, optimizer: Any, *, rank: int, world: int, steps: range) -> list[float]:
    """litgpt's pretrain inner loop, on this rank's slice of every global micro-batch."""
    losses = []
    data = _batches()
    per = WORLD * MICRO // world
    for step in steps:
        total = torch.zeros(())
        for k in range(ACCUM):
            chunk = data[step, k, rank * per : (rank + 1) * per]
            x, y = chunk[:, :-1], chunk[:, 1:]
            with fabric.no_backward_sync(model, enabled=k < ACCUM - 1):
                logits = model(x)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
                fabric.backward(loss / ACCUM)
            total += loss.detach() / ACCUM
        fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(total, reduce_op="mean")))
    return losses


def _fabric(strategy: Any, devices: int, precision: str = "32-true") -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy, precision=precision)  # type: ignore[arg-type]
    fabric.launch()
    return fabric


def _run(
    rank: int,
    world: int,
    strategy: Any,
    *,
    raw: str | None = None,
    save: str | None = None,
    precision: str = "32-true",
    make_optimizer: Any = _adamw,
    final: str | None = None,
) -> dict[str, Any]:
    fabric = _fabric(strategy, world, precision)
    fabric.seed_everything(0 if raw is None else 1)  # with raw weights, the module's own init must not matter
    with fabric.init_module(empty_init=raw is not None):
        model = litgpt_model.GPT(_config())
    if raw is None:
        optimizer = make_optimizer(model)
        model, optimizer = fabric.setup(model, optimizer)
    else:  # meta parameters become shards in setup_module: the optimizer is made from them after (the rule)
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(make_optimizer(model))
        fabric.load_raw(raw, model)
    losses = _loop(fabric, model, optimizer, rank=rank, world=world, steps=range(2))
    notes: list[int] = []  # per fabric.save: the directory notes it gave
    if save is not None:
        notes.append(_save(fabric, save, {"model": model, "optimizer": optimizer, "step": 2}))
    losses += _loop(fabric, model, optimizer, rank=rank, world=world, steps=range(2, STEPS))
    refused = ""
    if getattr(fabric.strategy, "zero_stage", 0) == 3:
        # torch.save(model.state_dict()) at the loop's end: the parameters are NaN placeholders there
        with pytest.raises(RuntimeError) as info:
            model.state_dict()
        refused = str(info.value)
    state = _full_state(fabric, model)
    saved: dict[str, Any] = {}
    if final is not None:  # the model alone, as litgpt saves its result: one file, loadable without Fabric
        notes.append(_save(fabric, final, {"model": model, "optimizer": optimizer}))  # a directory, replaced
        notes.append(_save(fabric, final, {"model": model}))  # by the file
        saved = {"file": Path(final).is_file()}
        if rank == 0:
            saved["model"] = torch.load(final, weights_only=True)["model"]
    fabric.strategy.destroy_process_groups()  # type: ignore[attr-defined]  # loop after loop in one process
    groups = len(dist.distributed_c10d._world.pg_map)
    return {
        "losses": losses,
        "state": state,
        "groups": groups,
        "refused": refused,
        "saved": saved,
        "notes": notes,
    }


def _save(fabric: Fabric, path: str, state: dict[str, Any]) -> int:
    """``fabric.save``, counting the notes that the directory it wrote cannot be opened by torch.load."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.save(path, state)
    return sum("lightning-par-consolidate DIR OUT.pth" in str(w.message) for w in caught)


def _full_state(fabric: Fabric, model: Any) -> dict[str, torch.Tensor] | None:
    """The weights at master precision: ZeRO-3's shards gathered on every rank; at stages 1/2 with fp32
    masters the full state gathered on rank 0 (None elsewhere); else the module's own."""
    strategy = fabric.strategy
    if isinstance(strategy, HybridParallelStrategy) and strategy.zero_stage == 3:
        assert strategy.engine is not None
        full = strategy.engine.full_state_dict(to_rank=fabric.global_rank)  # type: ignore[attr-defined]
        return {k: v.clone() for k, v in full.items() if k not in ("cos", "sin")}
    if isinstance(strategy, HybridParallelStrategy) and strategy.precision.uses_masters:
        module = strategy.module
        assert module is not None
        tp = tp_info(module, rank=0, size=1)
        full = gather_full_state_dict(module, strategy.engine, tp=tp, dp_rank=fabric.global_rank, group=None)
        return {k: v.clone() for k, v in full.items() if k not in ("cos", "sin")} if full else None
    return _state(model)


def _resume(rank: int, world: int, path: str, plain: bool = False) -> dict[str, Any]:
    """ZeRO-1 in one process (``plain``: Fabric's own single-device strategy), from the ZeRO-3 checkpoint
    of 2 ranks, for the last 2 steps."""
    fabric = _fabric("auto" if plain else HybridParallelStrategy(zero_stage=1), 1)
    with fabric.init_module():
        model = litgpt_model.GPT(_config())
    optimizer = _adamw(model)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    rest = fabric.load(path, state)
    # Fabric's own load hands back what no state entry took: our layout's bookkeeping only
    assert state["step"] == 2 and set(rest) == ({"fabric_keys", "lightning_par"} if plain else set()), rest
    losses = _loop(fabric, model, optimizer, rank=0, world=1, steps=range(2, STEPS))
    return {"losses": losses, "state": _state(model)}


def _two_ranks(rank: int, world: int, tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {
        "zero2": _run(rank, world, "zero2", final=str(Path(tmp) / "final.pt")),
        "zero3": _run(rank, world, HybridParallelStrategy(zero_stage=3, zero3_units=[litgpt_model.Block])),
        "zero3_meta": _run(
            rank, world, HybridParallelStrategy(zero_stage=3), raw=str(Path(tmp) / "initial.pt")
        ),
        "zero3_saved": _run(rank, world, "zero3", save=str(Path(tmp) / "sharded")),
        "zero3_saved_file": _run(
            rank,
            world,
            HybridParallelStrategy(zero_stage=3, save_distributed_checkpoint=False),
            save=str(Path(tmp) / "full.pt"),
        ),
    }


def _reference(tmp: str, precision: str = "32-true", make_optimizer: Any = _adamw) -> dict[str, Any]:
    """One process, Fabric's own single-device strategy, the global micro-batches whole."""
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)  # type: ignore[arg-type]
    fabric.seed_everything(0)
    with fabric.init_module():
        model = litgpt_model.GPT(_config())
    torch.save(model.state_dict(), Path(tmp) / "initial.pt")
    optimizer = make_optimizer(model)
    model, optimizer = fabric.setup(model, optimizer)
    losses = _loop(fabric, model, optimizer, rank=0, world=1, steps=range(STEPS))
    return {"losses": losses, "state": _state(model)}


def _assert_equal(run: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    losses = torch.tensor(run["losses"]), torch.tensor(ref["losses"])
    torch.testing.assert_close(*losses, msg=lambda m: f"{what}: losses\n{m}")
    assert set(run["state"]) == set(ref["state"]), what
    for name, value in ref["state"].items():
        torch.testing.assert_close(run["state"][name], value, msg=lambda m, n=name: f"{what}: {n}\n{m}")


def test_litgpt_fabric_loops_equal_the_single_process_run(capsys: pytest.CaptureFixture[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ref = _reference(tmp)
        results = run_distributed(_two_ranks, WORLD, tmp, init_group=False, timeout=400)
        resumed = run_distributed(_resume, 1, str(Path(tmp) / "sharded"), init_group=False)[0]
        resumed_file = run_distributed(_resume, 1, str(Path(tmp) / "full.pt"), init_group=False)[0]
        # the directory consolidated into fabric.save's one-file layout, which Fabric's own strategies
        # read (before, the Trainer's: "KeyError: 'model'")
        consolidated = consolidate(Path(tmp) / "sharded")
        assert set(consolidated) == set(torch.load(Path(tmp) / "full.pt", weights_only=False))
        torch.save(consolidated, Path(tmp) / "consolidated.pt")
        # the command line's report counts what it wrote (before: "0 parameters in 0 tensors, 0 optimizer
        # state(s)" for fabric.save's layout)
        assert consolidate_cli.main([str(Path(tmp) / "sharded"), str(Path(tmp) / "cli.pt")]) == 0
        written = torch.load(Path(tmp) / "cli.pt", weights_only=False)
        keys = written[FABRIC_KEYS]
        module = {(v.data_ptr(), v.numel()): v.numel() for v in written[keys["module"]].values()}
        report = capsys.readouterr().out
        assert f"{sum(module.values()):,} parameters in {len(module)} tensors" in report, report
        assert f"{len(keys['optimizers'])} optimizer state(s)" in report and keys["optimizers"], report
        resumed_plain = run_distributed(
            _resume, 1, str(Path(tmp) / "consolidated.pt"), True, init_group=False
        )[0]
    for rank, r in enumerate(results):
        for name in ("zero2", "zero3", "zero3_meta", "zero3_saved", "zero3_saved_file"):
            _assert_equal(r[name], ref, f"rank {rank} {name}")
            assert r[name]["groups"] == 1, (name, r[name]["groups"])  # the default group only
            if name.startswith("zero3"):  # the fabric.save / consolidated reads above were not refused
                assert "state_dict() of the whole model (GPT)" in r[name]["refused"], r[name]["refused"]
                assert "consolidated_state_dict()" in r[name]["refused"], r[name]["refused"]
                assert "with strategy.gathered_params():" in r[name]["refused"], r[name]["refused"]
    # fabric.save(path, {"model": model}) at ZeRO-2: one file of the weights (before, a directory)
    assert all(r["zero2"]["saved"]["file"] for r in results)
    # a directory is announced on rank 0 with the ways to one file (before, litgpt's final save at ZeRO-3
    # became a directory named like a file, silently, and its tools failed on IsADirectoryError)
    notes = {
        name: [r[name]["notes"] for r in results] for name in ("zero2", "zero3_saved", "zero3_saved_file")
    }
    assert notes == {"zero2": [[1, 0], [0, 0]], "zero3_saved": [[1], [0]], "zero3_saved_file": [[0], [0]]}, (
        notes
    )
    _assert_equal(
        {"losses": ref["losses"], "state": results[0]["zero2"]["saved"]["model"]}, ref, "final file"
    )
    # continued from the checkpoint of step 2: the last two steps and the final weights
    tail = {"losses": ref["losses"][2:], "state": ref["state"]}
    _assert_equal(resumed, tail, "zero3 directory -> zero1 one process")
    _assert_equal(resumed_file, tail, "zero3 single file -> zero1 one process")
    _assert_equal(resumed_plain, tail, "zero3 directory consolidated -> Fabric's single device")


def _bf16_runs(rank: int, world: int, tmp: str) -> dict[Any, Any]:
    torch.set_num_threads(1)
    out: dict[Any, Any] = {
        stage: _run(
            rank,
            world,
            HybridParallelStrategy(zero_stage=stage),
            precision="bf16-mixed",
            make_optimizer=_sgd,
            final=str(Path(tmp) / f"final{stage}.pt") if stage == 2 else None,
        )
        for stage in (0, 2, 3)
    }
    # full weights into ZeRO-2's fp32 masters (the bf16 compute copy alone would round them)
    out["2_load_raw"] = _run(
        rank,
        world,
        HybridParallelStrategy(zero_stage=2),
        precision="bf16-mixed",
        make_optimizer=_sgd,
        raw=str(Path(tmp) / "initial.pt"),
    )
    return out


def test_litgpt_fabric_bf16_mixed_within_bf16_tolerance() -> None:
    """bf16-mixed, stage 0 (fp32 parameters under autocast, Fabric's own numerics) and stages 2/3 (bf16
    parameters, fp32 masters; at stage 2 also with the initial weights given by fabric.load_raw): each
    within 16 u max|W_T - W_0| (u = 2^-8) of Fabric's single-device bf16-mixed run. SGD with momentum:
    AdamW would turn bf16 round-off in near-zero gradients into lr-sized steps. The runs moved the
    weights, so the bound is not vacuous."""
    with tempfile.TemporaryDirectory() as tmp:
        ref = _reference(tmp, "bf16-mixed", _sgd)
        initial = torch.load(Path(tmp) / "initial.pt")
        results = run_distributed(_bf16_runs, WORLD, tmp, init_group=False, timeout=400)
    # the model alone at ZeRO-2: one file holding the fp32 masters (rank 0's gathered state), not the
    # bf16 compute copies
    assert all(r[2]["saved"]["file"] for r in results)
    masters, saved = results[0][2]["state"], results[0][2]["saved"]["model"]
    for name, value in masters.items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0, msg=name)
    moved = max(float((ref["state"][n] - initial[n]).abs().max()) for n in ref["state"])
    assert moved > 1e-3
    tolerance = 16 * 2.0**-8 * moved
    for r in results:
        for stage, run in r.items():
            if run["state"] is None:  # stages 1/2 with masters: gathered on rank 0
                continue
            worst = max(float((run["state"][n] - v).abs().max()) for n, v in ref["state"].items())
            assert worst <= tolerance, (stage, worst, tolerance)
            torch.testing.assert_close(
                torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=0.02, atol=0
            )


def _setup_twice(rank: int, world: int) -> list[str]:
    fabric = _fabric(HybridParallelStrategy(zero_stage=2), world)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fabric.setup(model, optimizer)
    with pytest.raises(ValueError, match="already set up") as twice:
        fabric.setup(model, optimizer)
    fabric = _fabric(HybridParallelStrategy(zero_stage=3), world)
    with fabric.init_module(empty_init=True):
        meta = litgpt_model.GPT(_config())
    with pytest.raises(ValueError, match="holds meta-device parameters") as early:
        fabric.setup(meta, torch.optim.AdamW(meta.parameters()))
    return [str(twice.value), str(early.value)]


def test_fabric_bad_input() -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a positive integer"):
        HybridParallelStrategy(pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="cannot be used with lightning_par's Fabric strategy"):
        to_parallel_precision(HalfPrecision("16-true"))
    assert to_parallel_precision(Fabric(accelerator="cpu", precision="bf16-mixed")._precision).precision == (
        "bf16-mixed"
    )
    twice, early = run_distributed(_setup_twice, 1, init_group=False)[0]
    assert "fabric.setup() (or setup_module()) once per module" in twice
    assert "create the optimizer after model = fabric.setup_module(model)" in early


def _clip_by_value(rank: int, world: int) -> dict[str, torch.Tensor]:
    fp16 = ParallelPrecision("16-mixed")  # real fp16 on CPU (Lightning maps "16-mixed" to bf16 there)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=HybridParallelStrategy(), plugins=[fp16])
    fabric.launch()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = fabric.strategy.precision.scaler  # type: ignore[attr-defined]
    assert scaler is not None
    fabric.backward(model(torch.randn(8, 4)).float().pow(2).mean())
    true_grad = model.weight.grad.detach() / scaler.scale
    before = model.weight.detach().clone()
    fabric.clip_gradients(model, optimizer, clip_val=1e-3)
    optimizer.step()
    return {"grad": true_grad, "before": before, "after": model.weight.detach().clone()}


def test_fabric_fp16_clip_by_value_sees_unscaled_gradients() -> None:
    """fp16 on the Fabric strategy: ``fabric.clip_gradients(clip_val=...)`` clips the unscaled gradients
    (the step's one unscale happens first), so the update equals SGD on the clamped true gradient. In a
    child process: Fabric's launch makes a process group, which forked ranks of later tests must not
    inherit."""
    r = run_distributed(_clip_by_value, 1, init_group=False)[0]
    assert float(r["grad"].abs().max()) > 1e-2  # the clip bites
    torch.testing.assert_close(r["after"], r["before"] - 0.1 * r["grad"].clamp(-1e-3, 1e-3))
