"""Gradient compression: ours (ZeRO-0 with ``comm_hook``) beside torch DDP with torch's hook of the same
kind, on a communication-heavy MLP and on the GPT.

Run (from the repository root)::

    python -m benchmarks.bench_compress          # MLP 4 x 1024^2 (40 steps) and GPT 0.4M (300 steps): ~8 min
    python -m benchmarks.bench_compress --quick  # tiny smoke configuration (used by no test)
    python -m benchmarks.bench_compress --only mlp --link 1gbit   # over a loopback shaped to 1 Gbit/s

Two forked Gloo ranks, one torch thread each, AdamW, the same data for every run. Per model and hook:

* ``none``: our bucketed all-reduce vs DDP's;
* ``bf16``: our ``comm_hook="bf16"`` (the reduction in bf16) vs DDP with ``bf16_compress_hook`` (which
  torch refuses on Gloo: no DDP figure);
* ZeRO-3 (GPT only, ours alone): gradients reduced in bf16, parameters gathered as bf16 or int8
  (``gather_dtype``), and both; bytes of every all-reduce and every parameter all-gather (its gathered
  size);
* ``powersgd_r1``/``powersgd_r4``: our PowerSGD (``comm_hook="powersgd"``, :mod:`lightning_par.zero.powersgd`)
  vs DDP with torch's ``powerSGD_hook``, and torch's hook run on our engine (``ours_torch_hook``); error
  feedback, warm start, compressing from step 10 in all three.

The GPT (0.4M parameters, bytes as tokens) trains on windows of the main job's corpus (this Python's
standard-library sources; ``--gpt-data arithmetic`` for the earlier synthetic sequences, which a model
of this size memorises). Reported: the median step time after the warm-up, the loss after the last step
on held-out batches (the corpus' last 10%; fresh samples for the MLP), every step's training loss (the
mean over the ranks, for the plot), and the payload bytes handed to ``all_reduce`` per step, counted
exactly by wrapping ``torch.distributed.all_reduce`` in the ranks (a ring all-reduce sends
``2 (N-1) / N`` of that per rank). DDP's built-in reduction (no hook) runs in C++ and is not counted; its
payload equals the fp32 gradient bytes. ``python -m benchmarks.report`` draws the loss curves.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from benchmarks.common import environment, launch, write_result
from lightning_par.models.corpus import load_corpus_bytes
from lightning_par.models.gpt import GPT, GPTConfig
from lightning_par.zero import unit as unit_module
from lightning_par.zero.comm_hooks import resolve_comm_hook
from lightning_par.zero.engine import apply_zero
from lightning_par.zero.stage3 import Stage3Engine

HOOKS = ("none", "bf16", "powersgd_r1", "powersgd_r4")
IMPLS = {
    "none": ("ours", "ddp"),
    "bf16": ("ours", "ddp"),
    "powersgd_r1": ("ours", "ddp", "ours_torch_hook"),
    "powersgd_r4": ("ours", "ddp", "ours_torch_hook"),
}


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
    gpt_data: str = "stdlib"  # "stdlib": byte windows of the main job's corpus; "arithmetic": synthetic
    eval_batches: int = 8
    kinds: tuple[str, ...] = ("mlp", "gpt")
    warmup: int = 12
    start_powersgd: int = 10
    powersgd_seed: int = 0


def _torch_hook(name: str, cfg: Config) -> tuple[Any, Any]:
    """torch's hook of the same kind, for DDP (and run on our engine as ``ours_torch_hook``)."""
    if name == "bf16":
        return default_hooks.bf16_compress_hook, dist.group.WORLD
    state = powerSGD_hook.PowerSGDState(
        process_group=dist.group.WORLD,
        matrix_approximation_rank=int(name.rsplit("r", 1)[1]),
        start_powerSGD_iter=cfg.start_powersgd,
        random_seed=cfg.powersgd_seed,
    )
    return powerSGD_hook.powerSGD_hook, state


def _ours(name: str, cfg: Config) -> tuple[Any, Any, int]:
    """Our strategy's option for hook ``name``, resolved as the strategies resolve it."""
    if name == "bf16":
        return "bf16", None, 1
    fields = {"start_iter": cfg.start_powersgd, "seed": cfg.powersgd_seed}
    return "powersgd", fields, int(name.rsplit("r", 1)[1])


def _model(kind: str, cfg: Config) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        h = cfg.mlp_hidden
        return nn.Sequential(*(nn.Sequential(nn.Linear(h, h), nn.Tanh()) for _ in range(cfg.mlp_layers)))
    gc = GPTConfig(
        vocab_size=_vocab(cfg), block_size=cfg.gpt_seq, n_layer=cfg.gpt_layers, n_head=4, n_embd=cfg.gpt_embd
    )
    return GPT(gc)


def _batch(kind: str, cfg: Config, rank: int, step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    if kind == "mlp":
        x = torch.randn(cfg.mlp_batch, cfg.mlp_hidden, generator=g)
        return x, torch.tanh(x.flip(1))
    if cfg.gpt_data == "stdlib":  # training windows from the first 90% of the corpus
        corpus = _corpus()
        starts = torch.randint(0, int(0.9 * len(corpus)) - cfg.gpt_seq - 1, (cfg.gpt_batch,), generator=g)
        tokens = torch.stack([corpus[s : s + cfg.gpt_seq + 1] for s in starts.tolist()])
    else:
        start = torch.randint(0, 64, (cfg.gpt_batch, 1), generator=g)
        stride = torch.randint(1, 8, (cfg.gpt_batch, 1), generator=g)
        tokens = (start + stride * torch.arange(cfg.gpt_seq + 1)) % 64
    return tokens[:, :-1], tokens[:, 1:]


@functools.cache
def _corpus() -> Tensor:
    data, _ = load_corpus_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def _vocab(cfg: Config) -> int:
    return 256 if cfg.gpt_data == "stdlib" else 64


@torch.no_grad()
def _held_out_loss(kind: str, model: nn.Module, cfg: Config) -> float:
    """The loss on fixed batches no step trained on (MLP: fresh samples; GPT: the corpus' last 10%)."""
    losses = []
    for i in range(cfg.eval_batches):
        if kind == "gpt" and cfg.gpt_data == "stdlib":
            corpus = _corpus()
            lo = int(0.9 * len(corpus)) + i * cfg.gpt_batch * cfg.gpt_seq
            starts = [lo + j * cfg.gpt_seq for j in range(cfg.gpt_batch)]
            tokens = torch.stack([corpus[s : s + cfg.gpt_seq + 1] for s in starts])
            x, y = tokens[:, :-1], tokens[:, 1:]
        else:
            x, y = _batch(kind, cfg, rank=-1, step=10_000 + i)
        losses.append(float(_loss(kind, model, x, y)))
    return statistics.mean(losses)


def _loss(kind: str, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    if kind == "mlp":
        return nn.functional.mse_loss(model(x), y)
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _run(rank: int, world: int, kind: str, impl: str, hook_name: str, cfg: Config) -> dict[str, Any] | None:
    model = _model(kind, cfg)
    if impl == "ddp":
        net: nn.Module = DistributedDataParallel(model, bucket_cap_mb=25)
        if hook_name != "none":
            try:
                net.register_comm_hook(*reversed(_torch_hook(hook_name, cfg)))
            except TypeError:  # torch DDP takes the bf16 hook only on CUDA with NCCL
                return None
    else:
        net = model
        option: Any = None
        state: Any = None
        rank_r = 1
        if impl == "ours_torch_hook":
            option, state = _torch_hook(hook_name, cfg)
        elif hook_name != "none":
            option, state, rank_r = _ours(hook_name, cfg)
        compression = resolve_comm_hook(option, state, group=dist.group.WORLD, powersgd_rank=rank_r)  # type: ignore[arg-type]
        engine = apply_zero(
            model,
            group=dist.group.WORLD,  # type: ignore[arg-type]
            stage=0,
            comm_hook=compression.hook,
            comm_hook_state=compression.state,
            comm_dtype=compression.dtype,
        )
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
        "final_loss": _held_out_loss(kind, model, cfg),
        "train_loss_last10": statistics.mean(losses[-10:]),
        "losses": losses,
    }


ZERO3 = {  # ZeRO-3 variants: (comm_hook, gather_dtype)
    "none": (None, None),
    "bf16_reduce": ("bf16", None),
    "bf16_gather": (None, torch.bfloat16),
    "int8_gather": (None, torch.int8),
    "bf16_reduce+int8_gather": ("bf16", torch.int8),
}


def _run_zero3(rank: int, world: int, variant: str, cfg: Config) -> dict[str, Any]:
    """The GPT at ZeRO-3 (a unit per block) with low-precision gradient reductions and/or parameter
    gathers; bytes counted at every all-reduce and every parameter all-gather."""
    hook, gather = ZERO3[variant]
    model = _model("gpt", cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dtype = resolve_comm_hook(hook, None, group=dist.group.WORLD, powersgd_rank=1).dtype  # type: ignore[arg-type]
    engine = Stage3Engine(
        model,
        group=dist.group.WORLD,  # type: ignore[arg-type]
        reduce_op="all_reduce",  # what "auto" picks on Gloo; counted at dist.all_reduce like the rest
        comm_dtype=dtype,
        gather_dtype=gather,
    )
    engine.shard_optimizers([opt])
    sent = [0]
    real_reduce, real_gather = dist.all_reduce, unit_module.all_gather_flat

    def reduce(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
        sent[0] += tensor.numel() * tensor.element_size()
        return real_reduce(tensor, *args, **kwargs)

    def gather_(out: Tensor, src: Tensor, **kwargs: Any) -> Any:
        sent[0] += src.numel() * src.element_size() * world  # what every rank receives
        return real_gather(out, src, **kwargs)

    dist.all_reduce, unit_module.all_gather_flat = reduce, gather_  # type: ignore[assignment]
    times, per_step = [], []
    try:
        for step in range(cfg.gpt_steps):
            x, y = _batch("gpt", cfg, rank, step)
            dist.barrier()
            before, t0 = sent[0], time.perf_counter()
            opt.zero_grad()
            with engine.forward_context():
                loss = _loss("gpt", model, x, y)
            loss.backward()
            opt.step()
            engine.after_step()
            times.append(time.perf_counter() - t0)
            per_step.append(sent[0] - before)
    finally:
        dist.all_reduce, unit_module.all_gather_flat = real_reduce, real_gather  # type: ignore[assignment]
    with engine.forward_context():
        held_out = _held_out_loss("gpt", model, cfg)
    engine.remove()
    return {
        "step_s": statistics.median(times[cfg.warmup :]),
        "bytes_per_step": statistics.median(per_step[cfg.warmup :]),
        "final_loss": held_out,
    }


def _all(rank: int, world: int, cfg: Config) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in cfg.kinds:
        for hook in HOOKS:
            for impl in IMPLS[hook]:
                out[f"{kind}/{hook}/{impl}"] = _run(rank, world, kind, impl, hook, cfg)
        if kind == "gpt":
            for variant in ZERO3:
                out[f"zero3/{variant}"] = _run_zero3(rank, world, variant, cfg)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--gpt-data", choices=("stdlib", "arithmetic"), default="stdlib")
    parser.add_argument("--only", choices=("mlp", "gpt"), default=None, help="one model (a quick look)")
    parser.add_argument("--powersgd-seed", type=int, default=0, help="seed of PowerSGD's initial Q")
    parser.add_argument("--start-powersgd", type=int, default=10, help="uncompressed steps first")
    parser.add_argument(
        "--link",
        default=None,
        help="run in a new network namespace whose loopback tc shapes to this rate (e.g. 1gbit): the two"
        " ranks then talk over a link like Ethernet between nodes (needs root)",
    )
    parser.add_argument("--shaped", default=None, help=argparse.SUPPRESS)  # set inside that namespace
    ns = parser.parse_args(argv)
    if ns.link and not ns.shaped:
        return _in_shaped_namespace(ns.link, argv if argv is not None else sys.argv[1:])
    cfg = Config(
        gpt_data=ns.gpt_data,
        kinds=(ns.only,) if ns.only else ("mlp", "gpt"),
        powersgd_seed=ns.powersgd_seed,
        start_powersgd=ns.start_powersgd,
    )
    if ns.quick:
        cfg = Config(
            gpt_data=cfg.gpt_data,
            kinds=cfg.kinds,
            powersgd_seed=cfg.powersgd_seed,
            start_powersgd=cfg.start_powersgd,
            mlp_hidden=256,
            mlp_steps=15,
            gpt_layers=1,
            gpt_embd=64,
            gpt_steps=15,
            warmup=12,
            eval_batches=2,
        )
    ranks = launch(_all, 2, cfg)
    slow = {  # the slower rank sets the pace
        key: None if ranks[0][key] is None else max(ranks, key=lambda r: r[key]["step_s"])[key]
        for key in ranks[0]
    }
    none: dict[str, Any] = {"step_s": None, "bytes_per_step": None, "grad_bytes": None, "final_loss": None}
    table: dict[str, Any] = {}
    curves: dict[str, list[float]] = {}
    for kind in cfg.kinds:
        base, ddp_base = slow[f"{kind}/none/ours"], slow[f"{kind}/none/ddp"]
        for hook in HOOKS:
            ours, ddp = slow[f"{kind}/{hook}/ours"], slow[f"{kind}/{hook}/ddp"] or none
            mixed = slow.get(f"{kind}/{hook}/ours_torch_hook") or none
            for impl in IMPLS[hook]:
                if ranks[0][f"{kind}/{hook}/{impl}"] is not None:  # the mean loss over the ranks, per step
                    per_rank = [r[f"{kind}/{hook}/{impl}"]["losses"] for r in ranks]
                    curves[f"{kind}/{hook}/{impl}"] = [
                        statistics.mean(v) for v in zip(*per_rank, strict=True)
                    ]
            table[f"{kind}/{hook}"] = {
                "ours_step_s": ours["step_s"],
                "ddp_step_s": ddp["step_s"],
                "ours_torch_hook_step_s": mixed["step_s"],
                "ours_vs_ddp": ours["step_s"] / ddp["step_s"] if ddp["step_s"] else None,
                "speedup_vs_uncompressed": base["step_s"] / ours["step_s"],
                "ddp_speedup_vs_uncompressed": ddp_base["step_s"] / ddp["step_s"] if ddp["step_s"] else None,
                "bytes_per_step": ours["bytes_per_step"],
                "bytes_cut_vs_uncompressed": base["bytes_per_step"] / max(1, ours["bytes_per_step"]),
                "ddp_bytes_per_step": ddp["bytes_per_step"] if hook != "none" else ddp["grad_bytes"],
                "final_loss": ours["final_loss"],
                "final_loss_vs_uncompressed": ours["final_loss"] / base["final_loss"],
                "ddp_final_loss": ddp["final_loss"],
                "ours_torch_hook_final_loss": mixed["final_loss"],
            }
    zero3: dict[str, Any] = {}
    if "gpt" in cfg.kinds:
        base3 = slow["zero3/none"]
        for variant in ZERO3:
            r = slow[f"zero3/{variant}"]
            zero3[variant] = {
                **r,
                "speedup_vs_uncompressed": base3["step_s"] / r["step_s"],
                "bytes_cut_vs_uncompressed": base3["bytes_per_step"] / r["bytes_per_step"],
                "final_loss_vs_uncompressed": r["final_loss"] / base3["final_loss"],
            }
    payload = {
        "benchmark": "compress",
        "link": ns.shaped or "loopback",
        "config": asdict(cfg),
        "results": table,
        "loss_curves": curves,
        "zero3": zero3,
        "environment": environment(threads_per_rank=1, world_size=2),
    }
    name = "compress" + (f"_{ns.shaped}" if ns.shaped else "") + ("_quick" if ns.quick else "")
    path = write_result(name, payload, ns.out)
    print(json.dumps(table, indent=1))
    print(f"wrote {path}")
    return payload


def _in_shaped_namespace(rate: str, argv: list[str]) -> dict[str, Any]:
    """Re-run this benchmark in a fresh network namespace (``unshare -n``) whose loopback is shaped by a
    token bucket to ``rate``; only this benchmark's own traffic, on its own loopback, is affected."""
    if not re.fullmatch(r"\d+(\.\d+)?[kmg]?bit", rate):
        raise SystemExit(f"--link takes a tc rate such as 1gbit or 500mbit, got {rate!r}.")
    inner = [sys.executable, "-m", "benchmarks.bench_compress", *argv, "--shaped", rate]
    script = (
        "ip link set lo up && tc qdisc add dev lo root tbf rate "
        f"{rate} burst 256kb latency 50ms && exec {shlex.join(inner)}"
    )
    subprocess.run(["unshare", "-n", "sh", "-c", script], check=True)
    return {"link": rate}


if __name__ == "__main__":
    main()
