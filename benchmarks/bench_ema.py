"""EMA of the weights: what an average costs per rank, Lightning's way against ours, in one run.

Run (from the repository root)::

    python -m benchmarks.bench_ema            # Hugging Face Llama 20.8M, 2 ranks x 1 thread, ~1.5 min
    python -m benchmarks.bench_ema --quick    # tiny smoke configuration, seconds
    python -m benchmarks.bench_ema --help     # every field of EmaBenchConfig is a flag

What is measured
----------------
A Hugging Face ``LlamaForCausalLM`` from a ``LlamaConfig`` (default hidden 512, 4 layers, 8 heads,
intermediate 1376, vocab 8000), fp32, AdamW, random tokens, batch 2 x 64 per rank, on two forked Gloo
ranks with one thread each. Five configurations run in the same processes, one after the other:

* ``ddp``: torch DDP, no average;
* ``ddp_ema``: torch DDP plus what Lightning's ``EMAWeightAveraging`` does: ``AveragedModel(model,
  avg_fn=get_ema_avg_fn(decay), use_buffers=True)`` (a deep copy of the whole model on every rank),
  ``update_parameters(model)`` after every optimizer step;
* ``zero3``: our ZeRO-3 engine (``Stage3Engine``, the whole model one unit per decoder layer), no average;
* ``zero3_gathered_ema``: ZeRO-3 with the recipe before ``ShardedEMA``: a whole-model fp32 EMA on every rank,
  updated inside ``engine.gathered()`` (one all-gather of the model per update);
* ``zero3_sharded_ema``: ZeRO-3 with :class:`lightning_par.averaging.WeightAverages` (what ``ShardedEMA``
  runs): each rank averages its fp32 shard, nothing communicated.

Reported: bytes of averaging state per rank (the tensors each average holds), the step time (slowest rank,
median after ``warmup``) and each EMA's step time over its layout's plain step, and correctness in the same
run: after the steps, ``ddp_ema``'s averaged weights against ``zero3_sharded_ema``'s (copied into the model
and gathered) and ``zero3_gathered_ema``'s, as the largest absolute difference.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn

from benchmarks.common import (
    config_from_args,
    config_parser,
    environment,
    fmt,
    launch,
    load_summary,
    summarize,
    write_result,
)
from lightning_par.averaging import WeightAverages, ema_rule
from lightning_par.zero.stage3 import Stage3Engine


@dataclass(frozen=True)
class EmaBenchConfig:
    hidden: int = 512
    layers: int = 4
    heads: int = 8
    intermediate: int = 1376
    vocab: int = 8000
    batch: int = 2
    seq: int = 64
    steps: int = 32
    warmup: int = 2
    decay: float = 0.99


QUICK = EmaBenchConfig(hidden=64, layers=2, heads=4, intermediate=128, vocab=256, seq=16, steps=4, warmup=1)
CONFIGS = ("ddp", "ddp_ema", "zero3", "zero3_gathered_ema", "zero3_sharded_ema")


def _llama(cfg: EmaBenchConfig) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        max_position_embeddings=cfg.seq,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config)


def _batches(cfg: EmaBenchConfig, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g) for _ in range(cfg.steps)]


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def _run(name: str, cfg: EmaBenchConfig, rank: int) -> dict[str, Any]:
    model = _llama(cfg)
    group = dist.group.WORLD
    engine: Stage3Engine | None = None
    params = sum(p.numel() for p in model.parameters())
    if name.startswith("zero3"):
        engine = Stage3Engine(model, group=group, units=["model.layers.*"])
        net: nn.Module = model
    else:
        net = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if engine is not None:
        engine.shard_optimizers([optimizer])
    averaged: AveragedModel | None = None
    sharded: WeightAverages | None = None
    gathered: dict[str, torch.Tensor] = {}
    if name == "ddp_ema":
        averaged = AveragedModel(model, avg_fn=get_ema_avg_fn(cfg.decay), use_buffers=True)
    elif name == "zero3_sharded_ema":
        sharded = WeightAverages(model, engine, group=group, rule=ema_rule(cfg.decay))
    times: list[float] = []
    for step, ids in enumerate(_batches(cfg, rank)):
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        if engine is not None:
            with engine.forward_context():
                loss = _loss(net, ids)
        else:
            loss = _loss(net, ids)
        loss.backward()
        optimizer.step()
        if engine is not None:
            engine.after_step()
        if averaged is not None:
            averaged.update_parameters(model)
        if sharded is not None:
            sharded.update()
        if name == "zero3_gathered_ema":
            assert engine is not None
            with engine.gathered(), torch.no_grad():
                for n, p in model.named_parameters():
                    if step == 0:
                        gathered[n] = p.detach().clone()
                    else:
                        gathered[n].mul_(cfg.decay).add_(p.detach(), alpha=1 - cfg.decay)
        times.append(time.perf_counter() - start)
    state_bytes = 0
    final: dict[str, torch.Tensor] = {}
    if averaged is not None:
        state_bytes = sum(t.numel() * t.element_size() for t in averaged.module.state_dict().values())
        final = {n: p.detach().clone() for n, p in averaged.module.named_parameters()}
    if sharded is not None:
        state_bytes = sum(t.numel() * t.element_size() for *_, t in sharded.targets())
        sharded.copy_to_targets()
    if gathered:
        state_bytes = sum(t.numel() * t.element_size() for t in gathered.values())
        final = gathered
    if engine is not None and sharded is not None:
        with engine.gathered():
            final = {n: p.detach().clone() for n, p in model.named_parameters()}
    if engine is not None:
        engine.remove()
    return {"times": times, "state_bytes": state_bytes, "final": final, "params": params}


def _rank_main(rank: int, world: int, cfg: EmaBenchConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in CONFIGS:
        out[name] = _run(name, cfg, rank)
    finals = {name: out[name].pop("final") for name in CONFIGS}
    reference = finals["ddp_ema"]

    def gap(name: str) -> float:
        return max((finals[name][k] - v).abs().max().item() for k, v in reference.items())

    out["max_abs_diff"] = {name: gap(name) for name in ("zero3_sharded_ema", "zero3_gathered_ema")}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = config_parser(EmaBenchConfig, name="ema")
    ns = parser.parse_args(argv)
    cfg = config_from_args(ns, QUICK if ns.quick else EmaBenchConfig())
    load_before = [os.getloadavg()[0]]
    ranks = launch(_rank_main, 2, cfg)
    rows = {}
    for name in CONFIGS:
        steps = [max(v) for v in zip(*(r[name]["times"] for r in ranks), strict=True)]
        rows[name] = {
            "summary": summarize(steps[cfg.warmup :]).as_dict(),
            "state_bytes_per_rank": [r[name]["state_bytes"] for r in ranks],
            "step_times_s": steps,
        }
    median = {name: rows[name]["summary"]["median"] for name in CONFIGS}
    ratios = {
        "ddp_ema / ddp": median["ddp_ema"] / median["ddp"],
        "zero3_gathered_ema / zero3": median["zero3_gathered_ema"] / median["zero3"],
        "zero3_sharded_ema / zero3": median["zero3_sharded_ema"] / median["zero3"],
    }
    params = ranks[0]["ddp"]["params"]
    payload = {
        "config": asdict(cfg),
        "environment": environment(threads_per_rank=1, world_size=2),
        "load": load_summary(load_before + [os.getloadavg()[0]]),
        "parameters": params,
        "rows": rows,
        "ratios": ratios,
        "max_abs_diff_vs_ddp_ema": ranks[0]["max_abs_diff"],
    }
    path = write_result("ema" if not ns.quick else "ema_quick", payload, ns.out)
    print(f"Llama {params / 1e6:.1f}M parameters, fp32; averaging state per rank (MiB) and step time (s):")
    for name in CONFIGS:
        mib = statistics.fmean(rows[name]["state_bytes_per_rank"]) / 2**20
        print(f"  {name:20s} {mib:8.1f} MiB  {fmt(median[name])} s")
    for key, value in ratios.items():
        print(f"  {key}: {value:.3f}")
    print(f"  max |weights - ddp_ema's|: {ranks[0]['max_abs_diff']}")
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
