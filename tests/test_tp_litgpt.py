"""litgpt's ``GPT`` under tensor parallelism with the shipped ``"litgpt"`` plan
(``lightning_par/tensor_parallel/litgpt_family.py``, ``slices.py``), against the unsharded model.

Before, litgpt had no plan, and a hand-written one (``"*.attn.qkv": "colwise"``) failed in torch at the
first forward: a plain cut of the fused projection gave one rank the query heads and the other the keys
and values, and the attention read the full head counts from the config every block shares.

* The plan at tp2 on 2 Gloo ranks: Pythia- (parallel residual, biases), Llama- (grouped queries),
  Gemma-2- (post-norms, scaled embeddings, soft-capping) and Phi-2-shaped (parallel residual sharing
  ``norm_1``, partial rotary) configs, Llama and Gemma 2 also with sequence parallelism, train 3 SGD steps
  with the unsharded model's losses and weights; generation with litgpt's KV cache gives its logits.
* Gemma-3-shaped configs (the default ``norm_qk``: one norm of ``head_size`` over every query and key
  head), with and without SP, equal it too: the norms' gradients are summed over the tp group.
* Refused before any change, naming the fix: one key/value group at tp2 (multi-query), OLMo 2's
  ``norm_qk_type="olmo2"`` (a norm over all heads), a mixture-of-experts MLP, a LoRA wrapper on the fused
  projection.
* Fabric at ZeRO-3 with meta init (``fabric.init_module(empty_init=True)``), 2 ranks: at tp2 the
  initial model equals the dp2 run's bitwise (each rank's rows drawn from the full fused matrix, per
  segment); both train as one process from that model; the tp2 run's sharded checkpoint resumes in one
  process at ZeRO-0 as if uninterrupted; ``fabric.load_raw`` of a full state dict loads into the tp2
  slices.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

import peft
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from litgpt.config import Config
from litgpt.model import GPT
from safetensors.torch import save_file
from torch import Tensor
from torch.distributed import group

from lightning_par.checkpoint.load_pretrained import plan_pretrained
from lightning_par.fabric import HybridParallelStrategy
from lightning_par.tensor_parallel.plan import apply_tensor_parallel
from tests.distributed import run_distributed
from tests.test_pp_litgpt import SHAPES, SMALL, build
from tests.test_tensor_parallel import gather_full

PHI2 = ("phi-2", dict(intermediate_size=64))
PLAN_CASES = {  # name: (litgpt config name, overrides, sequence parallel)
    "pythia": (*SHAPES["pythia"], False),
    "llama": (*SHAPES["llama"], False),
    "llama_sp": (*SHAPES["llama"], True),
    "gemma2": (*SHAPES["gemma2"], False),
    "gemma2_sp": (*SHAPES["gemma2"], True),
    "phi2": (*PHI2, False),
    # the default norm_qk: one norm of head_size over every query and key head, its gradient summed
    "gemma3": (*SHAPES["gemma3"], False),
    "gemma3_sp": (*SHAPES["gemma3"], True),
}


def _gpt(name: str, extra: dict[str, Any], seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(Config.from_name(name, **(SMALL | extra)))


def _sgd(model: GPT, ids: Tensor) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _generate(model: GPT, ids: Tensor) -> Tensor:
    """Logits of a prompt and then of one token at a time, through litgpt's KV cache."""
    model.eval()
    model.set_kv_cache(batch_size=ids.shape[0])
    with torch.no_grad():
        out = [model(ids[:, :4], input_pos=torch.arange(4))]
        for pos in range(4, 7):
            out.append(model(ids[:, pos : pos + 1], input_pos=torch.tensor([pos])))
    model.clear_kv_cache()
    return torch.cat(out, dim=1)


def _refused(model: Any, plan: Any = "litgpt") -> tuple[str, str]:
    with pytest.raises(ValueError) as refused:
        apply_tensor_parallel(model, group=group.WORLD, plan=plan)
    qkv = model.get_submodule("transformer.h.0.attn.qkv")
    return str(refused.value), type(qkv).__name__


def _plan(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    out: dict[str, Any] = {}
    for name, (config_name, extra, sp) in PLAN_CASES.items():
        ref = _gpt(config_name, extra)
        model = copy.deepcopy(ref)
        apply_tensor_parallel(model, group=group.WORLD, plan="litgpt", sequence_parallel=sp)
        want, got = _sgd(ref, ids), _sgd(model, ids)
        state = gather_full(model)
        out[name] = (want, got, {k: (state[k], v.detach()) for k, v in ref.named_parameters()})
        if not sp:
            out[f"{name}_generate"] = (_generate(model, ids), _generate(ref, ids))
    attention = model.transformer.h[0].attn
    out["shared_config"] = (attention.config.n_head, model.config.n_head)
    mqa = _gpt(*SHAPES["llama"][:1], SHAPES["llama"][1] | {"n_query_groups": 1})
    out["mqa"] = _refused(mqa)
    olmo2 = {"norm_qk": True, "norm_qk_type": "olmo2"}
    out["norm_qk"] = _refused(_gpt(*SHAPES["llama"][:1], SHAPES["llama"][1] | olmo2))
    moe = dict(mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2, moe_intermediate_size=32)
    out["moe"] = _refused(_gpt(*SHAPES["llama"][:1], SHAPES["llama"][1] | moe))
    lora = peft.get_peft_model(_gpt(*SHAPES["llama"]), peft.LoraConfig(r=2, target_modules=["qkv"]))
    out["lora"] = _refused(lora, {"*.attn.qkv": "colwise", "*.attn.proj": "rowwise"})
    out["litgpt_lora"] = _refused(build("llama", lora=True))  # litgpt's own LoRA layers
    out["llama_plan"] = _refused(_gpt(*SHAPES["llama"]), "llama")
    out["pretrained"] = _pretrained(rank)
    return out


def _pretrained(rank: int) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The strategies' ``pretrained=`` loader: a saved full state dict into a tp2 model's slices (read
    whole and cut by segment for the fused projection)."""
    saved = _gpt(*SHAPES["llama"], seed=5)
    model = _gpt(*SHAPES["llama"])
    apply_tensor_parallel(model, group=group.WORLD, plan="litgpt")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "weights.safetensors"
        save_file(saved.state_dict(), str(path))
        loader = plan_pretrained(model, str(path), tp_rank=rank, tp_size=2)
        loader.load_local(model)
        loader.close()
    return gather_full(model), {k: v.detach() for k, v in saved.named_parameters()}


def test_litgpt_plan_equals_the_unsharded_model() -> None:
    for rank, got in enumerate(run_distributed(_plan, 2)):
        for name in PLAN_CASES:
            want, losses, state = got[name]
            torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-5, msg=f"{rank} {name}")
            for key, (ours, unsharded) in state.items():
                torch.testing.assert_close(ours, unsharded, rtol=1e-5, atol=1e-6, msg=f"{rank} {name} {key}")
            if f"{name}_generate" in got:
                ours, unsharded = got[f"{name}_generate"]
                torch.testing.assert_close(
                    ours, unsharded, rtol=1e-5, atol=1e-5, msg=f"{rank} {name} generate"
                )
        # each attention got its own config with half the heads; the model's keeps the full count
        assert got["shared_config"] == (2, 4), got["shared_config"]
        message, kept = got["mqa"]
        assert "n_query_groups=1, not divisible by tensor_parallel_size=2" in message, message
        assert kept == "Linear"  # nothing was converted before the refusal
        message, kept = got["norm_qk"]
        assert "norm_qk_type='olmo2'" in message and "tensor_parallel_size=1" in message, message
        assert kept == "Linear", message
        message, kept = got["moe"]
        assert "mixture-of-experts MLP" in message and "LLaMAMoE" in message and kept == "Linear", message
        message, _ = got["lora"]
        assert "a fused projection (query/key/value or gate/up)" in message and "LoRA wrapper" in message, (
            message
        )
        assert "target_modules without 'qkv'" in message, message
        message, kept = got["litgpt_lora"]
        assert "LoRAQKVLinear" in message and "litgpt.lora / litgpt.adapter models" in message, message
        message, _ = got["llama_plan"]
        assert "use tp_plan='litgpt'" in message, message
        loaded, saved = got["pretrained"]
        for key, value in saved.items():
            torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=f"pretrained {key}")


# ---------------------------------------------------------------------------------------------- Fabric
FABRIC_SHAPE = SHAPES["llama"]
STEPS, MICRO, SEQ, LR = 3, 2, 12, 3e-3


def _batches() -> Tensor:
    return torch.randint(0, 64, (STEPS, 2 * MICRO, SEQ + 1), generator=torch.Generator().manual_seed(5))


def _loop(fabric: Fabric, model: Any, optimizer: Any, *, dp_rank: int, dp: int, steps: range) -> list[float]:
    losses = []
    data = _batches()
    per = 2 * MICRO // dp
    for step in steps:
        chunk = data[step, dp_rank * per : (dp_rank + 1) * per]
        loss = F.cross_entropy(model(chunk[:, :-1]).flatten(0, 1), chunk[:, 1:].flatten())
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
    return losses


def _adamw(model: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _fabric_runs(rank: int, world: int, tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    tp = dict(tensor_parallel_size=world, tp_plan="litgpt")
    zero3 = dict(zero_stage=3, zero3_units=["Block"])
    layouts: dict[str, dict[str, Any]] = {
        "dp": zero3,
        "tp": zero3 | tp,
        "tp_load_raw": zero3 | tp,
        "tp_zero1_load_raw": dict(zero_stage=1) | tp,
    }
    out: dict[str, Any] = {}
    for name, kw in layouts.items():
        strategy = HybridParallelStrategy(**kw)
        fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
        fabric.launch()
        with fabric.init_module(empty_init=True):
            model = GPT(Config.from_name(FABRIC_SHAPE[0], **(SMALL | FABRIC_SHAPE[1])))
        torch.manual_seed(17 + rank)  # the init's seed: drawn by the first rank, agreed by all
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(_adamw(model))
        if "load_raw" in name:  # a full state dict, cut into each rank's slices (of the shards)
            fabric.load_raw(str(Path(tmp) / "initial.pt"), model)
        initial = {k: v.clone() for k, v in strategy.consolidated_state_dict().items()}
        dp_rank, dp = strategy.mesh.dp_rank, strategy.mesh.dp_size
        losses = _loop(fabric, model, optimizer, dp_rank=dp_rank, dp=dp, steps=range(STEPS - 1))
        if name == "tp":
            fabric.save(str(Path(tmp) / "tp_ckpt"), {"model": model, "optimizer": optimizer})
        losses += _loop(fabric, model, optimizer, dp_rank=dp_rank, dp=dp, steps=range(STEPS - 1, STEPS))
        final = {k: v.clone() for k, v in strategy.consolidated_state_dict().items()}
        strategy.destroy_process_groups()
        out[name] = {"initial": initial, "losses": losses, "final": final}
    return out


def _one_process(initial: dict[str, Tensor], steps: range, ckpt: str | None = None) -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=HybridParallelStrategy(zero_stage=0))
    fabric.launch()
    model = _gpt(*FABRIC_SHAPE, seed=99)
    model.load_state_dict(initial)
    model, optimizer = fabric.setup(model, _adamw(model))
    if ckpt is not None:
        fabric.load(ckpt, {"model": model, "optimizer": optimizer})
    losses = _loop(fabric, model, optimizer, dp_rank=0, dp=1, steps=steps)
    return {"losses": losses, "final": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _assert_run(run: dict[str, Any], ref: dict[str, Any], what: str, *, state: bool = True) -> None:
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), msg=what)
    if not state:
        return
    assert run["final"].keys() == ref["final"].keys(), what
    for k, v in ref["final"].items():
        # AdamW divides by the root of the second moment, so an element whose gradient is rounding-sized
        # moves by up to lr per step on rounding alone: the tp shards and one process sum in other orders
        # (1.5e-5 apart on one machine's kernels, within 1e-5 on another's)
        torch.testing.assert_close(
            run["final"][k], v, rtol=1.3e-6, atol=5e-5, msg=lambda m, k=k: f"{what}: {k}\n{m}"
        )


def test_fabric_zero3_meta_init_tp2_litgpt_equals_one_process_and_resumes() -> None:
    torch.set_num_threads(1)
    pretrained = _gpt(*FABRIC_SHAPE, seed=3).state_dict()
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(pretrained, Path(tmp) / "initial.pt")
        runs = run_distributed(_fabric_runs, 2, tmp, init_group=False, timeout=400)
        initial = runs[0]["dp"]["initial"]
        ref = run_distributed(_one_process_job, 1, initial, None, init_group=False)[0]
        resumed = run_distributed(_one_process_job, 1, initial, str(Path(tmp) / "tp_ckpt"), init_group=False)[
            0
        ]
        from_file = run_distributed(_one_process_job, 1, pretrained, None, init_group=False)[0]
    # meta init at tp2 draws each rank's rows of the fused qkv from the full matrix, segment by segment
    for k, v in initial.items():
        torch.testing.assert_close(runs[0]["tp"]["initial"][k], v, rtol=0, atol=0, msg=f"tp initial: {k}")
    for k, v in pretrained.items():
        for layout in ("tp_load_raw", "tp_zero1_load_raw"):
            torch.testing.assert_close(runs[0][layout]["initial"][k], v, rtol=0, atol=0, msg=f"{layout} {k}")
    assert max(float((ref["final"][k] - initial[k]).abs().max()) for k in initial) > 1e-3  # it trained
    for rank, run in enumerate(runs):  # the consolidated state lands on rank 0; every rank logs the losses
        _assert_run(run["dp"], ref, "dp2 ZeRO-3", state=rank == 0)
        _assert_run(run["tp"], ref, "tp2 ZeRO-3", state=rank == 0)
        _assert_run(run["tp_load_raw"], from_file, "tp2 ZeRO-3 after fabric.load_raw", state=rank == 0)
        _assert_run(run["tp_zero1_load_raw"], from_file, "tp2 ZeRO-1 after fabric.load_raw", state=rank == 0)
    _assert_run(resumed, {"losses": ref["losses"][STEPS - 1 :], "final": ref["final"]}, "tp2 -> one process")


def _one_process_job(rank: int, world: int, initial: dict[str, Tensor], ckpt: str | None) -> dict[str, Any]:
    torch.set_num_threads(1)
    steps = range(STEPS - 1, STEPS) if ckpt is not None else range(STEPS)
    return _one_process(initial, steps, ckpt)
