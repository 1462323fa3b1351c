"""ZeRO stage 3 (Stage3Engine) against the unsharded single-process reference, without a Trainer."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_par.grad_norm import clip_grad_norm_
from lightning_par.models.gpt import GPT, Block, GPTConfig
from lightning_par.models.lit_gpt import warmup_cosine
from lightning_par.zero.meta_build import params_on_meta
from lightning_par.zero.meta_init import materialize_model
from lightning_par.zero.stage3 import Stage3Engine
from lightning_par.zero.units import plan_units
from tests.distributed import run_distributed
from tests.reference import data_parallel_backward
from tests.third_party import T5, gpt2, hf_model, llama

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32, bias=False)
BATCH, STEPS, MICRO = 8, 4, 2


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, CFG.vocab_size, (STEPS, BATCH, CFG.block_size + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def _checkpoint_blocks(model: GPT) -> None:
    for block in model.blocks:
        inner = block.forward
        block.forward = partial(checkpoint, inner, use_reentrant=False)  # type: ignore[method-assign]


def _opt(model: nn.Module, kind: str = "adamw") -> tuple[torch.optim.Optimizer, Any]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    opt: torch.optim.Optimizer
    if kind == "adamw":
        opt = torch.optim.AdamW(groups, lr=1e-2)
    else:  # 4 ranks: see tests/reference.py
        opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, partial(warmup_cosine, warmup_steps=2, total_steps=STEPS, min_ratio=0.1)
    )
    return opt, sched


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _reference(
    world: int = 2, kind: str = "adamw"
) -> tuple[list[float], dict[str, torch.Tensor], torch.Tensor]:
    """Unsharded, one process; gradients added in the order the units reduce them (tests/reference.py)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt, sched = _opt(model, kind)
    losses = []
    for x, y in _batches():
        opt.zero_grad()
        parts = data_parallel_backward(
            model, _loss, x, y, world=world, micro=MICRO, reduce_every_micro_batch=True
        )
        total = sum(parts) / world
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(total)
    model.eval()
    with torch.no_grad():
        out = model(_batches()[0][0])
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, out


def _train(
    rank: int, world: int, *, checkpointing: bool, reduce_op: str, reshard: bool, kind: str = "adamw"
) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(CFG)
    if checkpointing:
        _checkpoint_blocks(model)
    engine = Stage3Engine(
        model,
        group=dist.group.WORLD,
        reduce_op=reduce_op,  # type: ignore[arg-type]
        reshard_after_forward=reshard,
    )
    opt, sched = _opt(model, kind)
    engine.shard_optimizers([opt])
    per = BATCH // world
    losses = []
    live_max = 0
    for x, y in _batches():
        opt.zero_grad()
        xs, ys = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        total = torch.zeros(())
        for k, (mx, my) in enumerate(zip(xs.chunk(MICRO), ys.chunk(MICRO), strict=True)):
            loss = _loss(model, mx, my) / MICRO
            if k < MICRO - 1:
                with engine.no_sync():
                    loss.backward()
            else:
                loss.backward()
            total += loss.detach()
            live_max = max(live_max, engine.memory_bytes()["live_units"])
        grads = [m.grad for g in opt.param_groups for m in g["params"] if m.grad is not None]
        clip_grad_norm_(grads, 1.0, groups=[dist.group.WORLD])
        opt.step()
        engine.after_step()
        sched.step()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append(total.item())
    model.eval()
    with torch.no_grad():
        out = model(_batches()[0][0])
    states = [engine.full_state_dict(to_rank=r) for r in range(world)]
    mem = engine.memory_bytes()
    # the root stays gathered after its no-grad forward (code after it reads root parameters), as FSDP2's
    assert engine.root is not None and mem["live_units"] == engine.root.full_bytes
    engine.after_step()  # the next optimizer step (or load) frees it
    mem = engine.memory_bytes()
    engine.remove()
    return {"losses": losses, "state": states[rank], "out": out, "mem": mem, "live_max": live_max}


def _cases(rank: int, world: int) -> dict[str, Any]:
    return {
        "plain": _train(rank, world, checkpointing=False, reduce_op="reduce_scatter", reshard=True),
        "ckpt_ar": _train(rank, world, checkpointing=True, reduce_op="all_reduce", reshard=True),
        "keep": _train(rank, world, checkpointing=False, reduce_op="all_reduce", reshard=False),
        "twice": _twice(rank, world),
        "reentrant": _reentrant(rank, world),
        "meta": _meta_init(rank, world),
        "errors": _errors(rank, world),
    }


def _check(results: list[dict[str, Any]], world: int) -> None:
    ref_losses, ref_state, ref_out = _reference()
    n_params = sum(p.numel() for p in GPT(CFG).parameters())
    for case in ("plain", "ckpt_ar", "keep"):
        for rank, r in enumerate(results):
            got = r[case]
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), msg=case)
            for k, v in ref_state.items():
                torch.testing.assert_close(got["state"][k], v, msg=f"{case} rank {rank} {k}")
            torch.testing.assert_close(got["out"], ref_out, msg=f"{case} eval output")
            # parameters are held 1/N between uses (+ padding); at most a few units are ever gathered
            assert got["mem"]["param_shard"] <= 4 * (n_params // world + world * 8)
            assert got["mem"]["live_units"] == 0
            largest = got["mem"]["largest_unit"]
            assert got["live_max"] <= 3 * largest, (case, got["live_max"], largest)
    for r in results:
        assert r["twice"] == r["reentrant"] == r["meta"] == r["errors"] == "ok"


def test_zero3_matches_single_process_two_ranks() -> None:
    _check(run_distributed(_cases, 2), 2)


def _four(rank: int, world: int) -> dict[str, Any]:
    return {
        "plain": _train(rank, world, checkpointing=True, reduce_op="reduce_scatter", reshard=True, kind="sgd")
    }


def test_zero3_matches_single_process_four_ranks() -> None:
    results = run_distributed(_four, 4)
    ref_losses, ref_state, _ = _reference(world=4, kind="sgd")
    for rank, r in enumerate(results):
        torch.testing.assert_close(torch.tensor(r["plain"]["losses"]), torch.tensor(ref_losses))
        for k, v in ref_state.items():
            torch.testing.assert_close(r["plain"]["state"][k], v, msg=f"rank {rank} {k}")


class Twice(nn.Module):
    """One unit called twice per forward, and an unused tail."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layers[0](x))
        return self.layers[1](torch.tanh(self.layers[0](h)))


def _equals_reference(rank: int, ref: nn.Module, model: nn.Module) -> str:
    """Two SGD steps of ``model`` at ZeRO-3 on this rank's half of a batch and of ``ref`` on all of it,
    from the same weights: the gathered weights must be equal."""
    model.load_state_dict(ref.state_dict())
    engine = Stage3Engine(model, group=dist.group.WORLD)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    engine.shard_optimizers([opt])
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2), requires_grad=True)
    for _ in range(2):
        model(x[rank * 2 : rank * 2 + 2]).pow(2).mean().backward()
        opt.step()
        engine.after_step()
        ref_opt.zero_grad()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
    state = engine.full_state_dict(to_rank=rank)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v, msg=k)
    assert engine.memory_bytes()["live_units"] == 0
    engine.remove()
    return "ok"


def _twice(rank: int, world: int) -> str:
    torch.manual_seed(1)
    return _equals_reference(rank, Twice(), Twice())


class _FrozenThenTrained(nn.Module):
    """A frozen layer, then a trained one: in backward the trained weight's gradient is done before the
    frozen weight has computed the input's gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(6, 6).requires_grad_(False)
        self.trained = nn.Linear(6, 6)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.trained(self.frozen(h)))


class Reentrant(nn.Module):
    """Units called through ``checkpoint(block, h, use_reentrant=True)``, as transformers 4 calls its
    layers: the units' hooks run inside the checkpoint, again in the recomputation, whose backward is a
    nested pass of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_FrozenThenTrained() for _ in range(2))
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True)
        return self.head(x)


def _reentrant(rank: int, world: int) -> str:
    """The frozen weights stay gathered until the nested pass has computed the unit's input gradient
    (before, the unit was freed once its trained weights' gradients were reduced: "setStorage ... out of
    bounds for storage of size 0")."""
    torch.manual_seed(1)
    return _equals_reference(rank, Reentrant(), Reentrant())


def _meta_init(rank: int, world: int) -> str:
    """Created on the meta device, materialised shard by shard: equals the unsharded twin, sliced. Our GPT
    built under ``torch.device("meta")``; Hugging Face's GPT-2 and Llama under ``params_on_meta()``, as the
    strategies build them, initialised by their own ``_init_weights`` (``tests/test_meta_init_hf.py``).
    Parents that set a child's parameter, with the child in an earlier unit: GPT-2 with its residual
    projections as units (their attention and MLP modules, which scale them, are in the root unit) and
    an untied T5 (transformers 4; 5 ties it regardless) whose model sets its LM head, a unit of its own.
    Each parent's init runs for both units, the child's sharded the second time."""
    t5 = partial(hf_model, "T5ForConditionalGeneration", "T5Config", **T5, tie_word_embeddings=False)
    builds = [
        (partial(GPT, CFG), partial(torch.device, "meta"), None),
        (gpt2, params_on_meta, None),
        (gpt2, params_on_meta, ["*.c_proj"]),  # scaled by their attention / MLP, in the root unit
        (llama, params_on_meta, None),
        (t5, params_on_meta, ["lm_head", "encoder.block.?", "decoder.block.?"]),
    ]
    twins: list[nn.Module] = []
    for build, context, units in builds:
        with context():
            model = build()
        engine = Stage3Engine(model, group=dist.group.WORLD, init_seed=123, units=units)
        state = engine.full_state_dict(to_rank=rank)
        with context():
            twin = build()
        materialize_model(twin, units=units, seed=123, device=torch.device("cpu"))
        for k, v in twin.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=0, atol=0, msg=k)
        engine.remove()
        twins.append(twin)
    gpt, hf_gpt2 = twins[:2]  # ties survive materialisation
    assert gpt.head.lm_head.weight is gpt.embed.tok.weight
    assert hf_gpt2.lm_head.weight is hf_gpt2.transformer.wte.weight
    return "ok"


def _errors(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = GPT(CFG)
    engine = Stage3Engine(model, group=dist.group.WORLD)
    weight = model.blocks[1].mlp.fc_in.weight
    with torch.no_grad(), pytest.raises(RuntimeError, match="single memory location"):
        weight.mul_(2.0)  # sharded: an in-place change outside forward is refused on the spot
    weight.data = torch.ones(weight.shape)  # a replacement is caught at the next gather, with its name
    with pytest.raises(RuntimeError, match=r"blocks\.1\.mlp\.fc_in\.weight.*outside a forward"):
        model(_batches()[0][0])
    engine.remove()
    return "ok"


class ZBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)


def test_unit_policy_errors_and_ownership() -> None:
    model = GPT(CFG)
    with pytest.raises(ValueError, match=r"matches no module.*'embed'"):
        plan_units(model, ["decoder.layers.*"])
    plan = plan_units(model, [nn.TransformerEncoderLayer, "blocks.1"])
    assert [name for name, _, _ in plan.units] == ["blocks.1", ""]
    # a class named by a string (as a YAML file or command line gives it), bare or dotted, selects what
    # the class does; a string that is neither a name pattern nor a class name says what would match
    by_class = [name for name, _, _ in plan_units(model, [Block]).units]
    assert by_class == ["blocks.0", "blocks.1", "blocks.2", ""]
    for spelled in ("Block", f"{Block.__module__}.{Block.__qualname__}"):
        assert [name for name, _, _ in plan_units(model, spelled).units] == by_class
    # the model's block class first, torch's own classes last (before, the first 8 alphabetically, which
    # on a Hugging Face Swin were all torch's)
    with pytest.raises(ValueError, match=r"module classes are \[.*'Block'"):
        plan_units(model, ["Blocks"])
    net = nn.Sequential(nn.Embedding(8, 4), nn.ModuleList([ZBlock(), ZBlock()]), nn.LayerNorm(4))
    with pytest.raises(ValueError, match=r"module classes are \['ZBlock', 'Embedding', "):
        plan_units(net, ["ZBlocks"])
    # the default: the children of the outermost module lists (a list in a list looked into, as a U-Net's);
    # a list inside a block (a mixture's experts) stays in the block's unit; a name pattern selects the
    # outermost modules it matches ("*" crosses dots), not every module inside them
    moe = nn.ModuleDict(
        {
            "blocks": nn.ModuleList(nn.ModuleDict({"experts": nn.ModuleList([ZBlock()])}) for _ in range(2)),
            "downs": nn.ModuleList([nn.ModuleList([ZBlock(), nn.Linear(4, 4)])]),
        }
    )
    blocks = ["blocks.0", "blocks.1", "downs.0.0", "downs.0.1", ""]
    assert [name for name, _, _ in plan_units(moe).units] == blocks
    assert [name for name, _, _ in plan_units(moe, "blocks.*").units] == ["blocks.0", "blocks.1", ""]
    default = plan_units(model)
    root_names = [n for n, _ in default.units[-1][2]]
    # the tied embedding/head weight has one owner (the root) and appears once
    assert root_names.count("embed.tok.weight") == 1 and "head.lm_head.weight" not in root_names
