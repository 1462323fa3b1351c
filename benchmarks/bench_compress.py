"""Gradient compression with DDP communication hooks: ours (ZeRO-0 with ``comm_hook``) beside torch DDP
with the same hook, on a communication-heavy MLP and on the GPT.

Run (from the repository root)::

    python -m benchmarks.bench_compress          # MLP 4 x 1024^2 (40 steps) and GPT 0.4M (300 steps): ~5 min
    python -m benchmarks.bench_compress --quick  # tiny smoke configuration (used by no test)

Two forked Gloo ranks, one torch thread each, AdamW, the same data for every run. Hooks: none, torch's
``bf16_compress_hook``, ``powerSGD_hook`` with rank 1 and rank 4 (error feedback, warm start, compressing
from step 10). Reported per model, hook and implementation: the median step time after the warm-up, the
loss of the last step, and the payload bytes handed to ``all_reduce`` per step, counted exactly by
wrapping ``torch.distributed.all_reduce`` in the benchmark's ranks (a ring all-reduce then sends
``2 (N-1) / N`` of that per rank). DDP's built-in reduction (no hook) runs in C++ and is not counted;
its payload equals the fp32 gradient bytes. torch DDP refuses the bf16 hook on Gloo (it wants CUDA and
NCCL); ours runs it, so that row has no DDP figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from benchmarks.common import environment, launch, write_result
from lightning_par.models.gpt import GPT, GPTConfig
from lightning_par.zero.engine import apply_zero

HOOKS = ("none", "bf16", "powersgd_r1", "powersgd_r4")


@dataclass
class Config:
    mlp_hidden: int = 1024
    mlp_layers: int = 4
    mlp_batch: int = 8
    mlp_steps: int = 40
    gpt_layers: int = 2
    gpt_embd: int = 128
    gpt_seq: int = 64
    gpt_batch: int = 8
    gpt_steps: int = 300
    warmup: int = 12
    start_powersgd: int = 10


def _hook(name: str) -> tuple[Any, Any]:
    if name == "bf16":
        return default_hooks.bf16_compress_hook, dist.group.WORLD
    rank = int(name.rsplit("r", 1)[1])
    state = powerSGD_hook.PowerSGDState(
        process_group=dist.group.WORLD, matrix_approximation_rank=rank, start_powerSGD_iter=10, random_seed=0
    )
    return powerSGD_hook.powerSGD_hook, state


def _model(kind: str, cfg: Config) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        h = cfg.mlp_hidden
        return nn.Sequential(*(nn.Sequential(nn.Linear(h, h), nn.Tanh()) for _ in range(cfg.mlp_layers)))
    gc = GPTConfig(
        vocab_size=64, block_size=cfg.gpt_seq, n_layer=cfg.gpt_layers, n_head=4, n_embd=cfg.gpt_embd
    )
    return GPT(gc)


def _batch(kind: str, cfg: Config, rank: int, step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    if kind == "mlp":
        x = torch.randn(cfg.mlp_batch, cfg.mlp_hidden, generator=g)
        return x, torch.tanh(x.flip(1))
    start = torch.randint(0, 64, (cfg.gpt_batch, 1), generator=g)
    stride = torch.randint(1, 8, (cfg.gpt_batch, 1), generator=g)
    tokens = (start + stride * torch.arange(cfg.gpt_seq + 1)) % 64
    return tokens[:, :-1], tokens[:, 1:]


def _loss(kind: str, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    if kind == "mlp":
        return nn.functional.mse_loss(model(x), y)
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _run(rank: int, world: int, kind: str, impl: str, hook_name: str, cfg: Config) -> dict[str, Any] | None:
    model = _model(kind, cfg)
    hook, state = _hook(hook_name) if hook_name != "none" else (None, None)
    if impl == "ddp":
        net: nn.Module = DistributedDataParallel(model, bucket_cap_mb=25)
        if hook is not None:
            try:
                net.register_comm_hook(state, hook)
            except TypeError:  # torch DDP takes the bf16 hook only on CUDA with NCCL
                return None
    else:
        net = model
        engine = apply_zero(model, group=dist.group.WORLD, stage=0, comm_hook=hook, comm_hook_state=state)  # type: ignore[arg-type]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sent = [0]
    real = dist.all_reduce

    def counting(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
        sent[0] += tensor.numel() * tensor.element_size()
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting  # type: ignore[assignment]
    times, per_step, losses = [], [], []
    steps = cfg.mlp_steps if kind == "mlp" else cfg.gpt_steps
    try:
        for step in range(steps):
            x, y = _batch(kind, cfg, rank, step)
            dist.barrier()
            before, t0 = sent[0], time.perf_counter()
            opt.zero_grad()
            loss = _loss(kind, net, x, y)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            per_step.append(sent[0] - before)
            losses.append(float(loss.detach()))
    finally:
        dist.all_reduce = real  # type: ignore[assignment]
    if impl != "ddp":
        engine.remove()
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "step_s": statistics.median(times[cfg.warmup :]),
        "bytes_per_step": statistics.median(per_step[cfg.warmup :]),
        "grad_bytes": grad_bytes,
        "final_loss": statistics.mean(losses[-5:]),
    }


def _all(rank: int, world: int, cfg: Config) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("mlp", "gpt"):
        for hook in HOOKS:
            for impl in ("ours", "ddp"):
                out[f"{kind}/{hook}/{impl}"] = _run(rank, world, kind, impl, hook, cfg)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    ns = parser.parse_args(argv)
    cfg = Config()
    if ns.quick:
        cfg = Config(mlp_hidden=256, mlp_steps=15, gpt_layers=1, gpt_embd=64, gpt_steps=15, warmup=12)
    ranks = launch(_all, 2, cfg)
    slow = {  # the slower rank sets the pace
        key: None if ranks[0][key] is None else max(ranks, key=lambda r: r[key]["step_s"])[key]
        for key in ranks[0]
    }
    table: dict[str, Any] = {}
    for kind in ("mlp", "gpt"):
        base = slow[f"{kind}/none/ours"]
        for hook in HOOKS:
            ours, ddp = slow[f"{kind}/{hook}/ours"], slow[f"{kind}/{hook}/ddp"]
            if ddp is None:  # refused by torch DDP here: report ours alone
                ddp = {"step_s": None, "bytes_per_step": None, "grad_bytes": None, "final_loss": None}
            table[f"{kind}/{hook}"] = {
                "ours_step_s": ours["step_s"],
                "ddp_step_s": ddp["step_s"],
                "ours_vs_ddp": ours["step_s"] / ddp["step_s"] if ddp["step_s"] else None,
                "speedup_vs_uncompressed": base["step_s"] / ours["step_s"],
                "bytes_per_step": ours["bytes_per_step"],
                "bytes_cut_vs_uncompressed": base["bytes_per_step"] / max(1, ours["bytes_per_step"]),
                "ddp_bytes_per_step": ddp["bytes_per_step"] if hook != "none" else ddp["grad_bytes"],
                "final_loss": ours["final_loss"],
                "final_loss_vs_uncompressed": ours["final_loss"] / base["final_loss"],
                "ddp_final_loss": ddp["final_loss"],
            }
    payload = {
        "benchmark": "compress",
        "config": asdict(cfg),
        "results": table,
        "environment": environment(threads_per_rank=1, world_size=2),
    }
    path = write_result("compress" if not ns.quick else "compress_quick", payload, ns.out)
    print(json.dumps(table, indent=1))
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
