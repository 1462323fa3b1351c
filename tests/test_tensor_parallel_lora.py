"""Tensor parallelism on models we did not write: a Hugging Face Llama under a PEFT LoRA adapter, frozen
parameters, refused adapters, and applying a plan twice; each against an unsharded single-process twin."""

from __future__ import annotations

import copy
from typing import Any

import peft
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_par.models.gpt import GPT, GPTConfig
from lightning_par.pipeline.weight_grad import weight_layout
from lightning_par.tensor_parallel import TP_DIM_ATTR, TP_STATE_ATTR, apply_tensor_parallel
from lightning_par.tensor_parallel.layers import SUMMED_ATTR
from tests.distributed import run_distributed
from tests.test_tensor_parallel import LlamaForCausalLM as ToyLlama
from tests.test_tensor_parallel import gather_full
from tests.third_party import llama

WORLD = dist.group.WORLD
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
# the llama plan's projections without region inputs: each column-parallel layer (LoRA included) copies
# its own input, so the LoRA path's copy_to on lora_A's input is what sums its partial input gradients
NO_REGION_PLAN = {
    "*.self_attn.q_proj": "colwise",
    "*.self_attn.k_proj": "colwise",
    "*.self_attn.v_proj": "colwise",
    "*.self_attn.o_proj": "rowwise",
    "*.mlp.gate_proj": "colwise",
    "*.mlp.up_proj": "colwise",
    "*.mlp.down_proj": "rowwise",
}
CASES: list[tuple[str, str | dict[str, str], bool]] = [
    ("llama", "llama", False),
    ("llama-sp", "llama", True),
    ("no-region", NO_REGION_PLAN, False),
    # PEFT's modules_to_save: a trained copy of the head and of the embedding beside the frozen originals,
    # all four sharded by the plan's styles, the wrappers kept (before, refused: "needs an nn.Linear")
    ("llama-saved", "llama", False),
]
SAVED = {"llama-saved": ["lm_head", "embed_tokens"]}


def hf_llama(**lora: Any) -> nn.Module:
    """A seeded tiny transformers Llama under a LoRA adapter whose B is non-zero (so it matters)."""
    model = llama(0)  # eager attention: deterministic and mask-explicit, no kernel choice
    options: dict[str, Any] = dict(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
    options.update(lora)
    model = peft.get_peft_model(model, peft.LoraConfig(**options))
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.5)
    return model


def _batches() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(2)
    data = torch.randint(0, 64, (3, 4, 17), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]  # sequence length 16: divisible by tp=2 for SP


def _loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())


def _gather_grads(model: nn.Module) -> dict[str, Tensor]:
    """Full gradients of the trainable parameters (pieces of sharded ones concatenated along their dim)."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.detach()
        dim = getattr(p, TP_DIM_ATTR, None)
        if dim is not None:
            parts = [torch.empty_like(g) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, g.contiguous())
            g = torch.cat(parts, dim=dim)
        out[name] = g.clone()
    return out


def _train(model: nn.Module, tp: bool) -> dict[str, Any]:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.2, momentum=0.9)
    losses, first_grads, replicated = [], {}, {}
    for step, (x, y) in enumerate(_batches()):
        opt.zero_grad()
        loss = _loss(model, x, y)
        loss.backward()
        if step == 0:
            first_grads = _gather_grads(model) if tp else {n: p.grad.clone() for n, p in _grads(model)}
            replicated = {
                n: p.grad.clone() for n, p in _grads(model) if not hasattr(p, TP_DIM_ATTR)
            }  # must be identical on the ranks
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "first_grads": first_grads, "replicated_grads": replicated}


def _grads(model: nn.Module) -> list[tuple[str, Any]]:
    return [(n, p) for n, p in model.named_parameters() if p.grad is not None]


def _merged_logits(model: nn.Module) -> Tensor:
    """PEFT's own merge on the (sharded) wrapper: B_r A / B A_r has exactly the local base shard's shape."""
    x, _ = _batches()[0]
    model.merge_adapter()
    with torch.no_grad():
        logits = model(input_ids=x).logits
    model.unmerge_adapter()
    return logits


def _peft_case(plan: str | dict[str, str], sp: bool, saved: list[str] | None) -> dict[str, Any]:
    model = hf_llama(modules_to_save=saved)
    ref = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    applied = apply_tensor_parallel(model, group=WORLD, plan=plan, sequence_parallel=sp)
    dims = {n: getattr(p, TP_DIM_ATTR, None) for n, p in model.named_parameters()}
    summed = _replace_summed(model)
    kept_in_b = sorted(n for n, m in model.named_modules() if "lora_" in n and weight_layout(m) is None)
    got = _train(model, tp=True)
    want = _train(ref, tp=False)
    return {
        "applied": applied,
        "got": got,
        "want": want,
        "initial": initial,
        "state": gather_full(model),
        "ref_state": {n: p.detach().clone() for n, p in ref.named_parameters()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "ref_requires_grad": {n: p.requires_grad for n, p in ref.named_parameters()},
        "dims": dims,
        "merged": _merged_logits(model),
        "ref_merged": _merged_logits(ref),
        "summed": summed,
        "kept_in_b": kept_in_b,
    }


def _replace_summed(model: nn.Module) -> list[str]:
    """Replace every parameter whose gradient is summed over the group by a new Parameter of the same
    values, as ZeRO-3's meta init and pretrained loading replace parameters after the plan; the sums must
    follow (before, their hooks stayed on the objects replaced). Returns the names replaced."""
    names = []
    for module_name, m in model.named_modules():
        for attr in sorted(getattr(m, SUMMED_ATTR, ())):
            old = m._parameters[attr]
            assert old is not None
            new = nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad)
            new.__dict__.update(old.__dict__)
            m._parameters[attr] = new
            names.append(f"{module_name}.{attr}")
    return names


def _frozen_gpt(rank: int, world: int) -> dict[str, Any]:
    """GPT with frozen pieces (weight and bias apart), under 'gpt' with SP and under a custom plan."""
    out: dict[str, Any] = {}
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, bias=True)
    # no region inputs: every column-parallel layer copies its own input
    custom = {
        "*.attn.q_proj": "colwise",
        "*.attn.k_proj": "colwise",
        "*.attn.v_proj": "colwise",
        "*.attn.out_proj": "rowwise",
        "*.mlp.fc_in": "colwise",
        "*.mlp.fc_out": "rowwise",
    }
    for key, plan, sp in (("gpt-sp", "gpt", True), ("custom", custom, False)):
        torch.manual_seed(0)
        model = GPT(cfg)
        model.embed.tok.weight.requires_grad_(False)  # vocab (and the tied colwise_gather head)
        model.blocks[0].attn.q_proj.weight.requires_grad_(False)  # colwise: weight frozen, bias not
        model.blocks[0].mlp.fc_in.bias.requires_grad_(False)  # colwise: bias frozen, weight not
        model.blocks[1].mlp.fc_out.weight.requires_grad_(False)  # rowwise
        model.blocks[0].ln_1.weight.requires_grad_(False)  # SP region input: a hook cannot go on it
        model.blocks[1].ln_2.weight.requires_grad_(False)  # ... and unfrozen below, after the conversion
        ref = copy.deepcopy(model)
        apply_tensor_parallel(model, group=WORLD, plan=plan, sequence_parallel=sp)
        assert model.head.lm_head.weight is model.embed.tok.weight
        for m in (model, ref):
            m.blocks[1].ln_2.weight.requires_grad_(True)
        rg = {n: p.requires_grad for n, p in model.named_parameters()}
        losses = []
        for m in (ref, model):
            opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)
            steps = []
            for x, y in _batches()[:2]:
                opt.zero_grad()
                loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
                loss.backward()
                opt.step()
                steps.append(loss.item())
            losses.append(steps)
        out[key] = {
            "requires_grad": rg,
            "ref_requires_grad": {n: p.requires_grad for n, p in ref.named_parameters()},
            "losses": losses,
            "state": gather_full(model),
            "ref_state": {n: p.detach().clone() for n, p in ref.named_parameters()},
        }
    return out


def _toy_heads(rank: int, world: int) -> dict[str, Any]:
    """LoRA on the toy Llama, whose attention counts its heads: the wrappers' parent is still found."""
    out: dict[str, Any] = {}
    for sp in (False, True):
        torch.manual_seed(0)
        model = peft.get_peft_model(ToyLlama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                nn.init.normal_(p, std=0.5)
        ref = copy.deepcopy(model)
        apply_tensor_parallel(model, group=WORLD, plan="llama", sequence_parallel=sp)
        attn = model.base_model.model.model.layers[0].self_attn
        x, y = _batches()[0]
        losses = [F.cross_entropy(m(x).flatten(0, 1), y.flatten()) for m in (model, ref)]
        for loss in losses:
            loss.backward()
        out[f"sp={sp}"] = {
            "heads": (attn.num_heads, attn.num_key_value_heads),
            "loss": tuple(loss.detach() for loss in losses),
            "grads": (_gather_grads(model), {n: p.grad.clone() for n, p in _grads(ref)}),
        }
    return out


def _refusals(rank: int, world: int, singles: list[Any]) -> str:
    for lora, reason in (
        ({"use_dora": True}, r"use_dora=True"),
        ({"lora_bias": True}, r"lora_bias=True"),
        ({"target_modules": ["embed_tokens", "q_proj"]}, r"LoRA on an embedding"),
    ):
        model = hf_llama(**lora)
        with pytest.raises(ValueError, match=r"base_model\.model\.model\..*" + reason):
            apply_tensor_parallel(model, group=WORLD, plan="llama")
        assert not any(hasattr(p, TP_DIM_ATTR) for p in model.parameters()), "refused: left unchanged"
    # PEFT's other in-layer methods: named as such (before, "needs an nn.Linear, but ... is Linear")
    for config in (
        peft.IA3Config(target_modules=TARGETS, feedforward_modules=[]),
        peft.LoKrConfig(r=4, target_modules=TARGETS),
    ):
        model = peft.get_peft_model(llama(0), config)
        with pytest.raises(ValueError, match=r"PEFT's peft\.tuners\..*plain LoRA .* tensor_parallel_size=1"):
            apply_tensor_parallel(model, group=WORLD, plan="llama")
    # prefix tuning: virtual keys and values of every head, refused by name, the model left unchanged
    # (before, a size mismatch inside transformers' cache); prompt tuning prepends embeddings and passes
    model = peft.get_peft_model(
        llama(0), peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    )
    with pytest.raises(ValueError, match=r"prefix tuning \['default'\] under tensor parallelism.*size=1"):
        apply_tensor_parallel(model, group=WORLD, plan="llama")
    assert not any(hasattr(p, TP_DIM_ATTR) for p in model.parameters()), "refused: left unchanged"
    prompt = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    model = peft.get_peft_model(llama(0), prompt)
    assert apply_tensor_parallel(model, group=WORLD, plan="llama")
    merged = hf_llama()
    merged.merge_adapter()
    with pytest.raises(ValueError, match=r"self_attn\.q_proj'.*merged into the base weight"):
        apply_tensor_parallel(merged, group=WORLD, plan="llama")

    # the same plan twice: a no-op (same dict, same Parameter objects, same outputs)
    model = hf_llama()
    x, _ = _batches()[0]
    applied = apply_tensor_parallel(model, group=WORLD, plan="llama", sequence_parallel=True)
    params = dict(model.named_parameters())
    with torch.no_grad():
        before = model(input_ids=x).logits
    again = apply_tensor_parallel(model, group=WORLD, plan="llama", sequence_parallel=True)
    record = getattr(model, TP_STATE_ATTR)
    assert again == applied == record["applied"] and record["size"] == 2 and record["sequence_parallel"]
    assert [(n, id(p)) for n, p in model.named_parameters()] == [(n, id(p)) for n, p in params.items()]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=x).logits, before, rtol=0, atol=0)
    # another layout: refused, saying what the model already is
    already = r"already tensor-parallel with tp_plan='llama', tensor_parallel_size=2, sequence_parallel=True"
    for kwargs in (
        {"group": WORLD, "plan": "llama", "sequence_parallel": False},
        {"group": WORLD, "plan": NO_REGION_PLAN, "sequence_parallel": True},
        {"group": singles[rank], "plan": "llama", "sequence_parallel": True},
    ):
        with pytest.raises(ValueError, match=already + r".*build a fresh model"):
            apply_tensor_parallel(model, **kwargs)
    # a converted sub-model met by a pattern: the clear message, not "needs an nn.Linear"
    attn = model.base_model.model.model.layers[0].self_attn
    with pytest.raises(ValueError, match=r"'q_proj' is already tensor-parallel"):
        apply_tensor_parallel(attn, group=WORLD, plan={"q_proj": "colwise"})
    gpt = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=4, n_embd=32))
    apply_tensor_parallel(gpt, group=WORLD, plan="gpt")
    with pytest.raises(ValueError, match=r"'attn\.q_proj' is already tensor-parallel \(style 'colwise'\)"):
        apply_tensor_parallel(gpt.blocks[0], group=WORLD, plan={"*.attn.q_proj": "colwise"})
    return "ok"


def _all(rank: int, world: int) -> dict[str, Any]:
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    out: dict[str, Any] = {key: _peft_case(plan, sp, SAVED.get(key)) for key, plan, sp in CASES}
    out["gpt"] = _frozen_gpt(rank, world)
    out["toy"] = _toy_heads(rank, world)
    out["refusals"] = _refusals(rank, world, singles)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_all, 2)


# which LoRA factors are sharded (and along which dim) and which are replicated
EXPECTED_DIMS = {
    "q_proj.base_layer": 0,
    "q_proj.lora_A": None,
    "q_proj.lora_B": 0,
    "v_proj.lora_A": None,
    "v_proj.lora_B": 0,
    "o_proj.base_layer": 1,
    "o_proj.lora_A": 1,
    "o_proj.lora_B": None,
    "down_proj.lora_A": 1,
    "down_proj.lora_B": None,
    "gate_proj": 0,
}


@pytest.mark.parametrize("key", [c[0] for c in CASES])
def test_peft_lora_llama_trains_like_unsharded(results: list[dict[str, Any]], key: str) -> None:
    for rank, r in enumerate(results):
        c = r[key]
        names = list(c["ref_state"])
        assert list(c["state"]) == names, "parameter names stay PEFT's"
        assert c["requires_grad"] == c["ref_requires_grad"]
        assert any(c["requires_grad"].values()) and not all(c["requires_grad"].values())
        assert "base_model.model.model.layers.0.self_attn.q_proj" in c["applied"]
        for n, dim in c["dims"].items():
            for part, want in EXPECTED_DIMS.items():
                if f".{part}." in n:
                    assert dim == want, f"{n}: {TP_DIM_ATTR}={dim}, want {want}"
        torch.testing.assert_close(torch.tensor(c["got"]["losses"]), torch.tensor(c["want"]["losses"]))
        grads, ref_grads = c["got"]["first_grads"], c["want"]["first_grads"]
        assert sorted(grads) == sorted(ref_grads)
        assert all("lora_" in n or ".modules_to_save." in n for n in grads)
        saved = [n for n in c["dims"] if ".original_module." in n or ".modules_to_save." in n]
        assert len(saved) == (4 if key in SAVED else 0), saved
        for n in saved:  # the original and the trained copy are sharded alike (rows: vocab / output)
            assert c["dims"][n] == 0, (n, c["dims"][n])
        for n, g in ref_grads.items():
            torch.testing.assert_close(grads[n], g, msg=f"rank {rank} {key} grad {n}")
        for n, v in c["ref_state"].items():
            torch.testing.assert_close(c["state"][n], v, msg=f"rank {rank} {key} {n}")
            if not c["requires_grad"][n]:
                torch.testing.assert_close(c["state"][n], c["initial"][n], rtol=0, atol=0)
            else:
                assert not torch.equal(c["state"][n], c["initial"][n]), f"{n} trained"
        torch.testing.assert_close(c["merged"], c["ref_merged"])
        # lora_A of a column-parallel layer has its gradient summed: replaced, it still trained as above,
        # and the zero-bubble split keeps it in B (a deferred W would skip the sum); so is a row-parallel
        # layer's lora_B under sequence parallelism (it saw a sequence shard), deferred otherwise
        assert any(".q_proj.lora_A." in n for n in c["summed"])
        assert [n for n in c["kept_in_b"] if ".q_proj.lora_A." in n], c["kept_in_b"]
        sp = {k: sp for k, _, sp in CASES}[key]
        assert bool([n for n in c["kept_in_b"] if ".o_proj.lora_B." in n]) == sp, c["kept_in_b"]
    # replicated gradients (lora_A of colwise layers, lora_B of rowwise ones) are the same on the ranks
    rep0, rep1 = results[0][key]["got"]["replicated_grads"], results[1][key]["got"]["replicated_grads"]
    assert sorted(rep0) == sorted(rep1) and any("q_proj.lora_A" in n for n in rep0)
    for n in rep0:
        torch.testing.assert_close(rep0[n], rep1[n], rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("key", ["gpt-sp", "custom"])
def test_requires_grad_kept(results: list[dict[str, Any]], key: str) -> None:
    for r in results:
        c = r["gpt"][key]
        assert c["requires_grad"] == c["ref_requires_grad"]
        assert not c["requires_grad"]["blocks.0.attn.q_proj.weight"]
        assert c["requires_grad"]["blocks.0.attn.q_proj.bias"]
        assert not c["requires_grad"]["blocks.0.mlp.fc_in.bias"]
        torch.testing.assert_close(torch.tensor(c["losses"][1]), torch.tensor(c["losses"][0]))
        for n, v in c["ref_state"].items():
            torch.testing.assert_close(c["state"][n], v, msg=f"{key} {n}")


@pytest.mark.parametrize("sp", [False, True])
def test_lora_wrapper_heads_divided(results: list[dict[str, Any]], sp: bool) -> None:
    for r in results:
        c = r["toy"][f"sp={sp}"]
        assert c["heads"] == (2, 1), "num_heads 4 -> 2, num_key_value_heads 2 -> 1 over tp=2"
        torch.testing.assert_close(*c["loss"])
        got, want = c["grads"]
        assert sorted(got) == sorted(want) and any("lora_A" in n for n in want)
        for n, g in want.items():
            torch.testing.assert_close(got[n], g, msg=n)


def test_refusals_and_idempotence(results: list[dict[str, Any]]) -> None:
    assert [r["refusals"] for r in results] == ["ok", "ok"]
