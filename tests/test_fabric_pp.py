"""Pipeline parallelism in a Fabric loop (``fabric.strategy.pipeline``), on Hugging Face models cut by
``hf_pipeline_layers`` (passed as the strategy's ``pipeline_layers``), compared with one process training
the model itself on ``model(**window).loss``.

On 4 Gloo ranks (pp2 x dp2), each loop runs 2 optimizer steps of 2 accumulation steps
(``fabric.no_backward_sync``) over ragged micro-batches (3 samples per rank-step into 2):

* a left-padded Llama, 1F1B, ZeRO-1, the token-exact loss (``hf_causal_lm_loss``), AdamW, clipping that
  bites: losses, clip norms (every rank) and final weights equal the reference; ``evaluate`` with a
  metric and ``predict`` equal the trained reference's loss, accuracy and logits; a ``fabric.save`` after
  the first step, loaded by one process at ZeRO-0 (no pipeline), and a ``FlashSnapshots`` snapshot of
  the same step, restored into a fresh pp2 x dp2 loop, both resume to the same final weights;
* the same right-padded at pp2 x tp2 (the shipped ``llama`` plan, zb, dp 1);
* GPT-2 with its tied table, interleaved zb (2 chunks per rank), ZeRO-3, packed rows (equal valid
  tokens per row), the mean form with a metric (``{"loss", "acc"}``) and ``scale=1/2``: losses, metrics
  and weights equal the reference;
* litgpt's GPT in a loop shaped like litgpt's pretrain script: built on the meta device
  (``fabric.init_module(empty_init=True)``, ZeRO-3, zb, ``litgpt_pipeline_layers``), the optimizer made
  after ``setup_module`` from this stage's parameters, the weights from ``fabric.load_raw``, tuple
  batches: losses and weights equal plain torch in one process, and its one-file ``fabric.save`` holds
  the optimizer state in torch's format, numbered for an optimizer of the whole model (which loads it),
  equal to the reference's.

Also: under ``precision="bf16-mixed"`` the loss function sees autocast's bf16 logits and the losses are
the fp32 ones up to bf16 rounding; under ``"16-mixed"`` (loss scale 256) an SGD step equals the fp32
one up to fp16 rounding (a missing unscale would move the weights 256 times as far); the model called
directly, ``fabric.backward``, a module without its layers, a ZeRO-3 unit spanning both stages,
optimizers whose groups differ across stages, ``strategy.pipeline`` without a pipeline and bad options
are refused with the rule.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from torch import Tensor

from lightning_par.fabric import FlashSnapshots, HybridParallelStrategy
from lightning_par.pipeline import (
    hf_causal_lm_loss,
    hf_pipeline_layers,
    layer_costs,
    litgpt_pipeline_layers,
    partition,
)
from lightning_par.precision import ParallelPrecision
from tests.distributed import run_distributed
from tests.test_pp_hf import build
from tests.test_pp_litgpt import build as build_litgpt
from tests.test_pp_tokens import HFBatches

WORLD, PP, DP, ACCUM, BATCH, WINDOWS, SEED = 4, 2, 2, 2, 3, 2, 5
N = DP * ACCUM * BATCH * WINDOWS
MAX_NORM = 0.5
KEYS = ("input_ids", "attention_mask", "position_ids", "labels")


def _rows(side: str, idx: list[int]) -> dict[str, Tensor]:
    data = HFBatches(N, side)
    return {k: torch.stack([data[i][k] for i in idx]) for k in data[0] if k in KEYS}


def _window_rows(window: int, dp_rank: int, dp: int) -> list[list[int]]:
    """The sample indices of each accumulation step of ``window`` on ``dp_rank`` (of ``dp``)."""
    per = DP * BATCH // dp
    start = window * ACCUM * DP * BATCH
    return [
        list(range(start + k * DP * BATCH + dp_rank * per, start + k * DP * BATCH + (dp_rank + 1) * per))
        for k in range(ACCUM)
    ]


def _mean_loss(logits: Tensor, labels: Tensor) -> dict[str, Tensor]:
    """Hugging Face's mean causal-LM loss on a micro-batch, and the next-token accuracy."""
    shift, target = logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
    loss = torch.nn.functional.cross_entropy(shift.float(), target, ignore_index=-100)
    valid = target != -100
    acc = ((shift.argmax(-1) == target) & valid).sum() / valid.sum()
    return {"loss": loss, "acc": acc}


# name -> (family, padding side, optimizer, strategy options, loss form)
# (tp2 x pp2: the shipped llama plan, head-parallel attention beside the padding mask; dp 1)
CASES: dict[str, tuple[str, str, str, dict[str, Any], str]] = {
    "llama": ("llama", "left", "adamw", dict(zero_stage=1, pipeline_schedule="1f1b"), "tokens"),
    "gpt2": (
        "gpt2",
        "packed",
        "sgd",
        dict(zero_stage=3, pipeline_schedule="interleaved_zb", virtual_stages=2),
        "mean",
    ),
    "llama-tp2": (
        "llama",
        "right",
        "adamw",
        dict(zero_stage=1, pipeline_schedule="zb", tensor_parallel_size=2, tp_plan="llama"),
        "tokens",
    ),
}


def _dp(name: str) -> int:
    return WORLD // (PP * CASES[name][3].get("tensor_parallel_size", 1))


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-5)
    return torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)


def _fabric_loop(
    fabric: Fabric, strategy: HybridParallelStrategy, model: Any, optimizer: Any, name: str, windows: range
) -> dict[str, list[Any]]:
    _, side, _, _, form = CASES[name]
    loss_fn: Callable[[Tensor, Any], Any] = (
        (lambda out, mb: hf_causal_lm_loss(out, mb["labels"]))
        if form == "tokens"
        else (lambda out, mb: _mean_loss(out, mb["labels"]))
    )
    mesh = strategy.mesh
    out: dict[str, list[Any]] = {"losses": [], "norms": [], "accs": []}
    for w in windows:
        for k, idx in enumerate(_window_rows(w, mesh.dp_rank, mesh.dp_size)):
            with fabric.no_backward_sync(model, enabled=k < ACCUM - 1):
                result = strategy.pipeline.step(_rows(side, idx), loss_fn=loss_fn, scale=1 / ACCUM)
            assert isinstance(result, dict)
            out["losses"].append(float(result["loss"]))
            if "acc" in result:
                out["accs"].append(float(result["acc"]))
        out["norms"].append(float(fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    return out


def _full_state(strategy: HybridParallelStrategy) -> dict[str, Tensor] | None:
    full = strategy.consolidated_state_dict()  # every stage's weights, on rank 0
    return {k: v.clone() for k, v in full.items()} if full else None


def _local(model: torch.nn.Module) -> torch.nn.ParameterList:
    """This stage's parameters: other stages' stay meta placeholders here, which Fabric refuses in an
    optimizer made after ``fabric.setup_module`` (an optimizer made before ``fabric.setup`` follows the
    cut by itself)."""
    return torch.nn.ParameterList(p for p in model.parameters() if not p.is_meta)


def _run_case(name: str, save: str | None) -> dict[str, Any]:
    family, side, opt_kind, options, _ = CASES[name]
    strategy = HybridParallelStrategy(
        pipeline_parallel_size=PP, num_microbatches=2, pipeline_layers=hf_pipeline_layers, **options
    )
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    model = build(family, seed=SEED).train()
    # an optimizer made before setup follows the cut (other stages' parameters become placeholders)
    model, optimizer = fabric.setup(model, _optimizer(opt_kind, model))
    mesh = strategy.mesh
    assert strategy.distributed_sampler_kwargs == {"num_replicas": _dp(name), "rank": mesh.dp_rank}
    out = _fabric_loop(fabric, strategy, model, optimizer, name, range(1))
    if save is not None:  # after the first optimizer step: a sharded checkpoint and a flash snapshot
        state = {"model": model, "optimizer": optimizer, "step": 1}
        fabric.save(save, state)
        with _snapshots(fabric, save) as snaps:
            snaps.snapshot(1, state)
    more = _fabric_loop(fabric, strategy, model, optimizer, name, range(1, WINDOWS))
    out = {k: v + more[k] for k, v in out.items()}
    val = _rows(side, list(range(2 * BATCH)))
    evaluated = strategy.pipeline.evaluate(
        val,
        loss_fn=lambda o, mb: hf_causal_lm_loss(o, mb["labels"]),
        metrics_fn=lambda o, mb: {"acc": _mean_loss(o, mb["labels"])["acc"]},
    )
    assert isinstance(evaluated, dict)
    predicted = strategy.pipeline.predict(val)
    refusals = []
    for call in (lambda: model(**val), lambda: fabric.backward(evaluated["loss"])):
        with pytest.raises(RuntimeError) as refused:
            call()
        refusals.append(str(refused.value))
    state = _full_state(strategy)
    strategy.destroy_process_groups()
    return out | {
        "dp_rank": mesh.dp_rank,
        "eval": {k: float(v) for k, v in evaluated.items()},
        "predicted": predicted,
        "refusals": refusals,
        "state": state,
    }


def _snapshots(fabric: Fabric, save: str) -> FlashSnapshots:
    return FlashSnapshots(fabric, f"{save}-flash", shm_dir=f"{save}-shm", persist_every_n_steps=1)


def _fresh_llama(**options: Any) -> tuple[HybridParallelStrategy, Fabric, dict[str, Any]]:
    """A pp2 x dp2 Fabric (the Llama case's options, plus ``options``) and a fresh model with other
    weights, set up with AdamW: the state a loop restores a snapshot into."""
    strategy = HybridParallelStrategy(
        pipeline_parallel_size=PP,
        num_microbatches=2,
        pipeline_layers=hf_pipeline_layers,
        **CASES["llama"][3],
        **options,
    )
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    model = build("llama", seed=SEED + 1).train()
    model, optimizer = fabric.setup(model, _optimizer("adamw", model))
    return strategy, fabric, {"model": model, "optimizer": optimizer, "step": 0}


def _flash_resume(save: str) -> dict[str, Tensor] | None:
    """A fresh pp2 x dp2 Fabric and model (other weights) restored from the Llama run's flash snapshot
    of step 1, then the second window; the full state on rank 0."""
    strategy, fabric, state = _fresh_llama()
    model, optimizer = state["model"], state["optimizer"]
    with _snapshots(fabric, save) as snaps:
        assert snaps.restore(state) == 1 and state["step"] == 1
    _fabric_loop(fabric, strategy, model, optimizer, "llama", range(1, WINDOWS))
    full = _full_state(strategy)
    strategy.destroy_process_groups()
    return full


def _flash_elsewhere(save: str) -> tuple[str, list[int]]:
    """The Llama run's flash snapshot offered to a pp2 x dp2 job that cuts the layers elsewhere: refused on
    every rank, naming the snapshot's layer counts to resume with (a rank's share holds its layers only)."""
    layers = hf_pipeline_layers(build("llama", seed=SEED))
    default = [b - a for a, b in partition(layer_costs(layers, "compute"), PP)]
    elsewhere = [default[0] + 1, default[1] - 1] if default[1] > 1 else [default[0] - 1, default[1] + 1]
    strategy, fabric, state = _fresh_llama(partition_method=elsewhere)
    message = ""
    with _snapshots(fabric, save) as snaps:
        try:
            snaps.restore(state)
        except ValueError as err:
            message = str(err)
    strategy.destroy_process_groups()
    return message, default


def _bf16() -> dict[str, Any]:
    """The Llama case's first step under ``precision="bf16-mixed"``: the loss function sees the autocast
    logits (bf16), and the step's losses are the fp32 ones up to bf16 rounding."""
    strategy = HybridParallelStrategy(
        pipeline_parallel_size=PP, num_microbatches=2, pipeline_layers=hf_pipeline_layers, **CASES["llama"][3]
    )
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy, precision="bf16-mixed")
    fabric.launch()
    model = build("llama", seed=SEED).train()
    model, _ = fabric.setup(model, _optimizer("adamw", model))
    dtypes: set[torch.dtype] = set()

    def loss_fn(logits: Tensor, mb: Any) -> dict[str, Tensor]:
        dtypes.add(logits.dtype)
        return hf_causal_lm_loss(logits, mb["labels"])

    losses, dp_rank = [], strategy.mesh.dp_rank
    for k, idx in enumerate(_window_rows(0, dp_rank, DP)):
        with fabric.no_backward_sync(model, enabled=k < ACCUM - 1):  # one token rescale per window
            result = strategy.pipeline.step(_rows("left", idx), loss_fn=loss_fn, scale=1 / ACCUM)
        assert isinstance(result, dict)
        losses.append(float(result["loss"]))
    strategy.destroy_process_groups()
    return {"losses": losses, "dtypes": sorted(map(str, dtypes)), "dp_rank": dp_rank}


def _fp16() -> dict[str, Any]:
    """One optimizer step (SGD, 2 pipeline steps) of the Llama case under ``precision="16-mixed"`` with a
    loss scale of 256: each micro-batch's loss is scaled, the gradients unscaled once before the step."""
    strategy = HybridParallelStrategy(
        pipeline_parallel_size=PP, num_microbatches=2, pipeline_layers=hf_pipeline_layers, **CASES["llama"][3]
    )
    plugin = ParallelPrecision("16-mixed", loss_scale={"init_scale": 256.0})
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy, plugins=[plugin])
    fabric.launch()
    model = build("llama", seed=SEED).train()
    model, optimizer = fabric.setup(model, _optimizer("sgd", model))
    for k, idx in enumerate(_window_rows(0, strategy.mesh.dp_rank, DP)):
        with fabric.no_backward_sync(model, enabled=k < ACCUM - 1):
            strategy.pipeline.step(
                _rows("left", idx), loss_fn=lambda o, mb: hf_causal_lm_loss(o, mb["labels"]), scale=1 / ACCUM
            )
    optimizer.step()
    optimizer.zero_grad()
    scaler = strategy.precision.scaler
    assert scaler is not None
    state = _full_state(strategy)
    strategy.destroy_process_groups()
    return {"state": state, "scale": scaler.scale}


def _top1(logits: Tensor, mb: Any) -> dict[str, Tensor]:
    return {"top1": (logits[:, :-1].argmax(-1) == mb["labels"][:, 1:]).float().mean()}


def _conf(logits: Tensor, mb: Any) -> dict[str, Tensor]:
    return {"conf": logits[:, :-1].float().softmax(-1).max(-1).values.mean()}


def _refusals() -> list[Any]:
    """Setup-time errors under pp2, the same on every rank: a module without its layers, a ZeRO-3 unit
    (the whole decoder) that spans both stages, optimizers whose groups differ across the stages, and
    LBFGS (its step re-runs the loss through a closure)."""
    messages = []
    for kwargs, model in (
        ({}, torch.nn.Sequential(torch.nn.Linear(4, 4))),
        (
            {"pipeline_layers": hf_pipeline_layers, "zero_stage": 3, "zero3_units": ["model"]},
            build("llama", seed=SEED),
        ),
    ):
        strategy = HybridParallelStrategy(pipeline_parallel_size=PP, num_microbatches=2, **kwargs)
        fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
        fabric.launch()
        with pytest.raises((TypeError, ValueError)) as refused:
            fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        messages.append(str(refused.value))
        strategy.destroy_process_groups()
    # optimizers made after setup by another rule on each stage: two groups on the first, one on the last
    strategy = HybridParallelStrategy(
        pipeline_parallel_size=PP, num_microbatches=2, pipeline_layers=hf_pipeline_layers
    )
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(build("llama", seed=SEED))
    local = list(_local(model))
    groups = [local[:1], local[1:]] if strategy.mesh.pp_rank == 0 else [local]
    with pytest.raises(ValueError) as refused:
        fabric.setup_optimizers(torch.optim.SGD([{"params": g} for g in groups], lr=0.1))
    messages.append(str(refused.value))
    # LBFGS re-evaluates the loss through a closure: the schedule runs each step's passes once
    with pytest.raises(TypeError) as refused:
        fabric.setup_optimizers(torch.optim.LBFGS(local))
    messages.append(str(refused.value))
    # evaluate with another metrics_fn each call (a loop's validation, then its test): each call's names
    # (before, the second call returned the first's name with NaN)
    batch = _rows("left", _window_rows(0, strategy.mesh.dp_rank, DP)[0])
    model.eval()
    evaluated = [
        strategy.pipeline.evaluate(
            batch, loss_fn=lambda o, mb: hf_causal_lm_loss(o, mb["labels"]), metrics_fn=fn
        )
        for fn in (_top1, _conf)
    ]
    model.train()
    messages.append(evaluated)  # type: ignore[arg-type]
    # a training step with gradients off: refused on every rank before any transfer
    with torch.no_grad(), pytest.raises(RuntimeError) as refused:
        strategy.pipeline.step(batch, loss_fn=lambda o, mb: hf_causal_lm_loss(o, mb["labels"]))
    messages.append(str(refused.value))
    # the token-exact loss over a window of two steps that both synchronise: the second would rescale the
    # first's gradients again (before: silently, 7.5e-2 off one process after one SGD step)
    fabric.setup_optimizers(torch.optim.SGD(local, lr=0.1))
    with pytest.raises(RuntimeError) as refused:
        for k in range(2):
            idx = _window_rows(0, strategy.mesh.dp_rank, DP)[k]
            strategy.pipeline.step(
                _rows("left", idx), loss_fn=lambda o, mb: hf_causal_lm_loss(o, mb["labels"]), scale=0.5
            )
    messages.append(str(refused.value))
    strategy.destroy_process_groups()
    return messages


def _litgpt_windows(w: int, dp_rank: int, dp: int) -> list[tuple[Tensor, Tensor]]:
    """litgpt's pretraining batches (inputs and next-token targets of one token block) of window ``w`` on
    ``dp_rank``, one per accumulation step."""
    data = torch.randint(0, 64, (N, 17), generator=torch.Generator().manual_seed(11))
    return [(data[idx, :-1], data[idx, 1:]) for idx in _window_rows(w, dp_rank, dp)]


def _litgpt_loss(logits: Tensor, batch: Any) -> Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten())


def _litgpt(initial: str) -> dict[str, Any]:
    """A loop shaped like litgpt's pretrain script: the GPT built on the meta device
    (``fabric.init_module(empty_init=True)``, ZeRO-3), ``setup_module``, the optimizer from the set-up
    module, the initial weights from a full state dict (``fabric.load_raw``), tuple batches (the default
    input takes ``batch[0]``), zb over pp2 x dp2."""
    strategy = HybridParallelStrategy(
        pipeline_parallel_size=PP,
        num_microbatches=2,
        pipeline_schedule="zb",
        zero_stage=3,
        pipeline_layers=litgpt_pipeline_layers,
        save_distributed_checkpoint=False,  # fabric.save: one torch file, optimizer state in torch's format
    )
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = build_litgpt("llama")
    assert all(p.is_meta for p in model.parameters())
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(_optimizer("adamw", _local(model)))
    fabric.load_raw(initial, model)
    losses, dp_rank = [], strategy.mesh.dp_rank
    for w in range(WINDOWS):
        for k, batch in enumerate(_litgpt_windows(w, dp_rank, DP)):
            with fabric.no_backward_sync(model, enabled=k < ACCUM - 1):
                loss = strategy.pipeline.step(batch, loss_fn=_litgpt_loss, scale=1 / ACCUM)
            assert isinstance(loss, Tensor)
            losses.append(float(loss))
        fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    state = _full_state(strategy)
    fabric.save(initial.replace(".pt", "-trained.pt"), {"model": model, "optimizer": optimizer})
    strategy.destroy_process_groups()
    return {"losses": losses, "dp_rank": dp_rank, "state": state}


def _runs(rank: int, world: int, tmp: str) -> dict[str, Any]:
    save = str(Path(tmp) / "llama")
    return {
        "litgpt": _litgpt(str(Path(tmp) / "litgpt.pt")),
        "llama": _run_case("llama", save),
        "gpt2": _run_case("gpt2", None),
        "llama-tp2": _run_case("llama-tp2", None),
        "flash": _flash_resume(save),
        "flash_elsewhere": _flash_elsewhere(save),
        "bf16": _bf16(),
        "fp16": _fp16(),
        "refusals": _refusals(),
    }


def _resume(rank: int, world: int, path: str) -> dict[str, Any]:
    """The Llama checkpoint (pp2 x dp2, ZeRO-1) in one process at ZeRO-0, then the second window."""
    fabric = Fabric(accelerator="cpu", devices=1, strategy=HybridParallelStrategy(zero_stage=0))
    fabric.launch()
    model = build("llama", seed=SEED + 1).train()  # other weights: the checkpoint must replace them
    model, optimizer = fabric.setup(model, _optimizer("adamw", model))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    assert fabric.load(path, state) == {} and state["step"] == 1
    for w in range(1, WINDOWS):
        batch = _rows("left", [i for rows in _window_rows(w, 0, 1) for i in rows])
        fabric.backward(model(**batch, use_cache=False).loss)
        fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _reference(name: str) -> dict[str, Any]:
    """One process, plain torch: each window's samples on both dp ranks in one batch, the model's own
    loss, the same clip and optimizer."""
    family, side, opt_kind, _, form = CASES[name]
    model = build(family, seed=SEED).train()
    optimizer = _optimizer(opt_kind, model)
    losses, norms, accs, dp = [], [], [], _dp(name)
    for w in range(WINDOWS):
        for k in range(ACCUM):  # what each dp rank logs: its own batch's loss, before the update
            for d in range(dp):
                rows = _rows(side, _window_rows(w, d, dp)[k])
                with torch.no_grad():
                    result = _mean_loss(model(**rows, use_cache=False).logits, rows["labels"])
                losses.append((d, float(result["loss"])))
                accs.append((d, float(result["acc"])))
        batch = _rows(side, [i for d in range(DP) for rows in _window_rows(w, d, DP) for i in rows])
        model(**batch, use_cache=False).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    val = _rows(side, list(range(2 * BATCH)))
    with torch.no_grad():
        logits = model(**val, use_cache=False).logits
    shifted = hf_causal_lm_loss(logits, val["labels"])
    # the accuracy metric: the mean over the two micro-batches (of equal size) of each one's accuracy
    accuracy = (
        sum(float(_mean_loss(logits[h], val["labels"][h])["acc"]) for h in (slice(0, 3), slice(3, 6))) / 2
    )
    return {
        "losses": losses,
        "accs": accs,
        "norms": norms,
        "eval": {"loss": float(shifted["loss_sum"] / shifted["tokens"]), "acc": accuracy},
        "logits": logits,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "form": form,
    }


def _litgpt_reference() -> dict[str, Any]:
    model = build_litgpt("llama")
    optimizer = _optimizer("adamw", model)
    losses = []
    for w in range(WINDOWS):
        per_rank = [_litgpt_windows(w, d, DP) for d in range(DP)]
        with torch.no_grad():
            losses += [(d, float(_litgpt_loss(model(b[0]), b))) for d in range(DP) for b in per_rank[d]]
        x = torch.cat([b[0] for batches in per_rank for b in batches])
        y = torch.cat([b[1] for batches in per_rank for b in batches])
        _litgpt_loss(model(x), (x, y)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return {
        "losses": losses,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
    }


def test_fabric_pipeline_equals_one_process_on_hugging_face_models() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(build_litgpt("llama").state_dict(), Path(tmp) / "litgpt.pt")
        results = run_distributed(_runs, WORLD, tmp, init_group=False, timeout=600)
        resumed = run_distributed(_resume, 1, str(Path(tmp) / "llama"), init_group=False)[0]
        saved = torch.load(Path(tmp) / "litgpt-trained.pt", weights_only=False)
    for name in CASES:
        ref = _reference(name)
        initial = build(CASES[name][0], seed=SEED).state_dict()
        assert max(float((ref["state"][k] - initial[k]).abs().max()) for k in initial) > 1e-3, name
        state = results[0][name]["state"]
        assert state is not None and set(state) >= {k for k in ref["state"] if "rotary" not in k}, name
        for key, value in ref["state"].items():
            if key in state:
                torch.testing.assert_close(state[key], value, msg=lambda m, k=key, c=name: f"{c} {k}\n{m}")
        # every rank: the clip norm is the global one (stages, dp shards; the tied table counted once)
        for r in results:
            torch.testing.assert_close(torch.tensor(r[name]["norms"]), torch.tensor(ref["norms"]))
        # each rank returns its dp replica's batch losses (token means; the pipeline ranks of a replica
        # agree), and in the mean form its accuracy metric
        for r in results:
            replica = r[name]["dp_rank"]
            want = [v for d, v in ref["losses"] if d == replica]
            torch.testing.assert_close(torch.tensor(r[name]["losses"]), torch.tensor(want), msg=name)
            if ref["form"] == "mean":
                want = [v for d, v in ref["accs"] if d == replica]
                torch.testing.assert_close(torch.tensor(r[name]["accs"]), torch.tensor(want), msg=name)
            assert r[name]["eval"]["acc"] == pytest.approx(ref["eval"]["acc"], rel=1e-5), name
        for r in results:  # evaluation and prediction: the same on every rank, equal to the reference
            assert r[name]["eval"]["loss"] == pytest.approx(ref["eval"]["loss"], rel=1e-5), name
            torch.testing.assert_close(r[name]["predicted"], ref["logits"], rtol=1e-4, atol=1e-5)
            assert "pipeline.step(batch" in r[name]["refusals"][0]
            assert "fabric.backward is not used with pipeline parallelism" in r[name]["refusals"][1]
    litgpt = _litgpt_reference()
    state = results[0]["litgpt"]["state"]
    for key, value in litgpt["state"].items():
        if key not in ("cos", "sin"):
            torch.testing.assert_close(state[key], value, msg=lambda m, k=key: f"litgpt {k}\n{m}")
    for r in results:
        want = [v for d, v in litgpt["losses"] if d == r["litgpt"]["dp_rank"]]
        torch.testing.assert_close(torch.tensor(r["litgpt"]["losses"]), torch.tensor(want))
    # the one-file checkpoint of the optimizers built from each stage's parameters: torch's format,
    # numbered as an optimizer of the whole model, which loads it and holds the reference's moments
    model = build_litgpt("llama")
    optimizer = _optimizer("adamw", model)
    optimizer.load_state_dict(saved["optimizer"])
    want_state = litgpt["optimizer"]["state"]
    assert len(saved["optimizer"]["state"]) == len(want_state) == len(list(model.parameters()))
    for index, moments in want_state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                saved["optimizer"]["state"][index][key], moments[key], msg=f"{index} {key}"
            )
    # fp16: the step taken (not skipped) and unscaled: one process's fp32 SGD step up to fp16 rounding
    model = build("llama", seed=SEED).train()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    window = _rows("left", [i for d in range(DP) for rows in _window_rows(0, d, DP) for i in rows])
    model(**window, use_cache=False).loss.backward()
    _optimizer("sgd", model).step()
    fp16 = results[0]["fp16"]
    assert fp16["scale"] == 256.0  # no overflow: the step was taken
    moved = max(float((v - initial[k]).abs().max()) for k, v in model.state_dict().items())
    for key, value in model.state_dict().items():
        if "rotary" not in key:
            torch.testing.assert_close(fp16["state"][key], value, rtol=0, atol=moved / 20, msg=key)
    reference = _reference("llama")
    # the loss runs on the last stage's ranks (one per dp replica) and sees autocast's logits
    assert sorted(r["bf16"]["dtypes"] for r in results) == [[]] * DP + [["torch.bfloat16"]] * DP
    for r in results:
        want = [v for d, v in reference["losses"] if d == r["bf16"]["dp_rank"]][:ACCUM]
        torch.testing.assert_close(torch.tensor(r["bf16"]["losses"]), torch.tensor(want), rtol=2e-2, atol=0)
        layers, units, groups, lbfgs, evaluated, no_grad, resynced = r["refusals"]
        assert "called with gradients disabled" in no_grad and "pipeline.evaluate" in no_grad, no_grad
        rows = _rows("left", _window_rows(0, r["bf16"]["dp_rank"], DP)[0])
        with torch.no_grad():
            logits = (
                build("llama", seed=SEED).eval()(**{k: v for k, v in rows.items() if k != "labels"}).logits
            )
        assert [sorted(e) for e in evaluated] == [["loss", "tokens", "top1"], ["conf", "loss", "tokens"]]
        torch.testing.assert_close(evaluated[0]["top1"], _top1(logits, rows)["top1"])
        torch.testing.assert_close(evaluated[1]["conf"], _conf(logits, rows)["conf"])
        assert "a second gradient synchronisation before the optimizer step" in resynced, resynced
        assert "fabric.no_backward_sync(model)" in resynced, resynced
        assert "optimizers differ across pipeline stages" in groups and "[(1,), (2,)]" in groups, groups
        assert "Pipeline parallelism cannot run torch.optim.lbfgs.LBFGS" in lbfgs and "closure" in lbfgs
        assert "define Sequential.pipeline_layers()" in layers and "hf_pipeline_layers" in layers
        assert "selects 'model' as a ZeRO-3 unit" in units and "cross a stage boundary" in units, units
        elsewhere, default = r["flash_elsewhere"]
        assert f"pipeline cut: the snapshot's stages held {default} layers per piece" in elsewhere, elsewhere
        assert f"resume with partition_method={default}" in elsewhere and "Nothing was loaded" in elsewhere
    llama = reference["state"]
    flash = results[0]["flash"]
    for key, value in llama.items():
        torch.testing.assert_close(resumed[key], value, msg=lambda m, k=key: f"resumed {k}\n{m}")
        if "rotary" not in key:
            torch.testing.assert_close(flash[key], value, msg=lambda m, k=key: f"flash {k}\n{m}")


def test_fabric_pipeline_bad_input() -> None:
    with pytest.raises(ValueError, match="pipeline_schedule must be one of"):
        HybridParallelStrategy(pipeline_parallel_size=2, pipeline_schedule="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="zb"):
        HybridParallelStrategy(pipeline_parallel_size=4, num_microbatches=2, pipeline_schedule="zb")
    with pytest.raises(ValueError, match="pipeline_layers must be a function"):
        HybridParallelStrategy(pipeline_parallel_size=2, pipeline_layers="hf")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"strategy\.pipeline exists under pipeline_parallel_size > 1"):
        _ = HybridParallelStrategy().pipeline
    # what loss_fn returns on the last stage: a one-element tensor with a graph, else named (before,
    # torch's errors deep in the schedule: "'float' object has no attribute 'detach'", an expand error)
    from lightning_par.pipeline.steps import _trainable_loss

    weight = torch.ones(3, requires_grad=True)
    assert _trainable_loss((weight * 2).mean().reshape(1), where="loss_fn").shape == ()
    for bad, got in (
        (0.5, "returned a float"),
        (weight * 2, "shape (3,)"),
        ((weight * 2).mean().detach(), "requires_grad=False"),
    ):
        with pytest.raises(TypeError, match=rf"loss_fn must return the micro-batch's loss.*{re.escape(got)}"):
            _trainable_loss(bad, where="loss_fn")
