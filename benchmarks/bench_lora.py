"""LoRA memory at ZeRO-3: bytes of parameters, gradients and AdamW state per rank, ours against torch FSDP2.

Run (from the repository root)::

    python -m benchmarks.bench_lora                  # Llama 109.5M (+1.18M LoRA), 2 ranks, ~3-4 min
    python -m benchmarks.bench_lora --small          # tiny smoke configuration, seconds
    python -m benchmarks.bench_lora --layers 6 --steps 5 --out /tmp/lora.json
    python -m benchmarks.bench_lora --help           # every field of LoraBenchConfig is a flag

What is measured
----------------
A Hugging Face ``LlamaForCausalLM`` built from a ``LlamaConfig`` (default hidden 768, 12 layers, 12 heads,
intermediate 2048, vocab 32000, tied embeddings: 109,529,856 parameters), fp32, on two forked Gloo ranks
with one torch thread each, random tokens, batch 2 x 64 per rank. For the LoRA rows it carries a PEFT adapter
(``get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj",
"o_proj"], lora_dropout=0.0))``: 1,179,648 trainable parameters, the base frozen). The optimizer is always
``torch.optim.AdamW(model.parameters())``, frozen parameters included, as users write it. Four
configurations, each alone in its own two fresh processes (so that the peak RSS is its own):

* ``ours_lora`` / ``ours_full``: ``lightning_par.zero.stage3.Stage3Engine(model, reduce_op="all_reduce")``
  and ``engine.shard_optimizers([opt])``; a step is ``zero_grad``, forward + cross-entropy inside
  ``engine.forward_context()``, ``loss.backward()``, ``opt.step()``, ``engine.after_step()``;
* ``fsdp2_lora`` / ``fsdp2_full``: ``torch.distributed.fsdp.fully_shard`` on every decoder layer and on the
  root (the torchtitan way); a step is ``zero_grad``, forward + cross-entropy, backward, ``opt.step()``.
  Should FSDP2 refuse the LoRA model, the exact error is recorded and ``fsdp2_lora_split`` (every LoRA
  ``lora_A``/``lora_B`` linear in its own ``fully_shard`` group, then the layers and the root) is measured.

Bytes per rank are taken after the first training step (gradients before the next ``zero_grad``): for
ours from ``lightning_par.memory.measure_memory`` (parameters = every local shard, trainable and frozen;
gradients; optimizer state) and ``engine.memory_bytes()`` (``frozen_shard``); for FSDP2 from the local
shards (``to_local()``) of the DTensor parameters, of their gradients and of the tensor optimizer states.
The analytic expectation is 4 bytes per parameter, 4 per trainable parameter for gradients and 8 for
AdamW's two moments, divided by the world size (optimizer ``step`` counters and shard padding are the
difference). Beside them: the gradient communication buffers ours keeps pooled between steps
(``comm_buffers``; FSDP2 allocates and frees its own per step, not measured). Also: the step time
(slowest rank; median after the warmup; ours ÷ FSDP2 as a ratio, the configurations ran one after the
other), the peak RSS per rank, and correctness in the same run: the global loss of every step of
``ours_lora`` and ``fsdp2_lora`` (same seed, same batches) must agree to 1e-5 relative, their final
adapter weights must agree, and the frozen base weights must be unchanged (bit checksum of every rank's
local shards before and after the steps, and float64 sums of the gathered shards against the weights
before sharding).
"""

from __future__ import annotations

import os
import statistics
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.bench_zero import current_rss_mib, git_state
from benchmarks.common import (
    StepTimer,
    config_from_args,
    config_parser,
    environment,
    fmt,
    launch,
    load_summary,
    loss_agreement,
    peak_rss_mib,
    time_ratios,
    timing,
    write_result,
)
from benchmarks.tables import LORA_CATEGORIES as CATEGORIES
from benchmarks.tables import lora_section, mib
from lightning_par.memory import measure_memory
from lightning_par.zero.stage3 import Stage3Engine

CONFIGS = ("ours_lora", "fsdp2_lora", "ours_full", "fsdp2_full")
SPLIT = "fsdp2_lora_split"  # measured only if FSDP2 refuses the LoRA model as is
LOSS_RTOL = 1e-5
ADAPTER_ATOL = 1e-6
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


@dataclass(frozen=True)
class LoraBenchConfig:
    """Everything one run depends on (saved in the JSON); every field is a command-line flag."""

    hidden: int = 768
    layers: int = 12
    heads: int = 12
    intermediate: int = 2048
    vocab: int = 32000
    tie_embeddings: bool = True
    lora_r: int = 16
    lora_alpha: int = 32
    seq: int = 64
    micro_batch: int = 2
    steps: int = 3  # measured steps per configuration (after the warmup)
    warmup: int = 1
    lr: float = 1e-3
    seed: int = 0
    world_size: int = 2
    threads_per_rank: int = 1
    configs: str = ",".join(CONFIGS)

    def config_list(self) -> list[str]:
        return [c.strip() for c in self.configs.split(",") if c.strip()]

    def llama_config(self) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.heads,
            intermediate_size=self.intermediate,
            vocab_size=self.vocab,
            max_position_embeddings=max(self.seq, 128),
            tie_word_embeddings=self.tie_embeddings,
            attn_implementation="sdpa",
        )


SMALL = LoraBenchConfig(
    hidden=64, layers=2, heads=4, intermediate=128, vocab=256, lora_r=4, lora_alpha=8, seq=32, steps=3,
)  # fmt: skip
"""Tiny smoke configuration (seconds)."""


# ---------------------------------------------------------------------------------------------- model
def build_model(cfg: LoraBenchConfig, lora: bool) -> nn.Module:
    """The Llama from ``cfg.seed`` (the same on every rank and for every configuration), with PEFT's LoRA."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    model: nn.Module = LlamaForCausalLM(cfg.llama_config())
    if lora:
        from peft import LoraConfig, get_peft_model

        # PEFT 0.21 still calls a property transformers 5 deprecates: noise in every rank's output
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

        peft_cfg = LoraConfig(
            r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules=LORA_TARGETS, lora_dropout=0.0
        )
        model = get_peft_model(model, peft_cfg)
    return model


def count_parameters(cfg: LoraBenchConfig, lora: bool) -> dict[str, int]:
    """Total and trainable parameters (tied weights once), counted on the meta device."""
    with torch.device("meta"):
        model = build_model(cfg, lora)
    params = list(model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return {"total": sum(p.numel() for p in params), "trainable": trainable}


def expected_bytes(counts: dict[str, int], world: int) -> dict[str, float]:
    """fp32 + AdamW per rank: 4 B/param, 4 B/trainable param (gradients), 8 B/trainable param (moments)."""
    return {
        "parameters": 4 * counts["total"] / world,
        "gradients": 4 * counts["trainable"] / world,
        "optimizer_state": 8 * counts["trainable"] / world,
        "frozen": 4 * (counts["total"] - counts["trainable"]) / world,
    }


def make_batches(cfg: LoraBenchConfig, rank: int) -> list[tuple[Tensor, Tensor]]:
    """Random token batches of this rank, one per step (the same for every configuration)."""
    g = torch.Generator().manual_seed(1000 + cfg.seed * 100 + rank)
    shape = (cfg.micro_batch, cfg.seq)
    return [
        (torch.randint(cfg.vocab, shape, generator=g), torch.randint(cfg.vocab, shape, generator=g))
        for _ in range(cfg.warmup + cfg.steps)
    ]


# ---------------------------------------------------------------------------------------------- ranks
def _bits(t: Tensor) -> int:
    """A checksum of the exact bits of a float32 tensor (any change of any element changes it)."""
    return int(t.detach().contiguous().view(torch.int32).to(torch.int64).sum())


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.model.layers


@dataclass
class Built:
    """One configuration on one rank."""

    model: nn.Module
    opt: torch.optim.Optimizer
    engine: Stage3Engine | None
    memory: Callable[[], dict[str, Any]]
    frozen_pieces: Callable[[], list[tuple[str, Tensor]]]  # (name, this rank's piece) of frozen weights
    adapters: Callable[[], list[tuple[str, int, np.ndarray]]]  # (name, flat offset, values) of LoRA weights


def build(name: str, cfg: LoraBenchConfig, group: dist.ProcessGroup) -> Built:
    model = build_model(cfg, lora="lora" in name)
    if name.startswith("ours"):
        engine = Stage3Engine(model, group=group, reduce_op="all_reduce")
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        engine.shard_optimizers([opt])
        trainable = {n for u in engine.units for n in u.names}

        def ours_memory() -> dict[str, Any]:
            m = measure_memory(model, engine, [opt])
            return {"categories": {k: m[k] for k in CATEGORIES}, "measure_memory": dict(m),
                    "engine_memory_bytes": engine.memory_bytes(),
                    "frozen": engine.memory_bytes()["frozen_shard"]}  # fmt: skip

        def ours_frozen() -> list[tuple[str, Tensor]]:
            return [(n, v) for n, _, _, v in engine.shard_table() if n not in trainable]

        def ours_adapters() -> list[tuple[str, int, np.ndarray]]:
            table = engine.fragment_table()
            return [(n, lo, v.detach().numpy().copy()) for n, lo, _, v in table if "lora_" in n]

        return Built(model, opt, engine, ours_memory, ours_frozen, ours_adapters)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(group),))
    if name == SPLIT:  # every LoRA linear its own group: one requires_grad value per group
        for mod_name, mod in model.named_modules():
            if isinstance(mod, nn.Linear) and (".lora_A." in mod_name or ".lora_B." in mod_name):
                fully_shard(mod, mesh=mesh)
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)

    def local(t: Tensor) -> Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def nbytes(ts: list[Tensor]) -> int:
        return sum(local(t).numel() * local(t).element_size() for t in ts)

    def fsdp_memory() -> dict[str, Any]:
        params = list(model.parameters())
        states = [v for s in opt.state.values() for v in s.values() if isinstance(v, Tensor)]
        cats = {
            "parameters": nbytes(params),
            "gradients": nbytes([p.grad for p in params if p.grad is not None]),
            "optimizer_state": nbytes(states),
        }
        return {"categories": cats, "frozen": nbytes([p for p in params if not p.requires_grad]),
                "params_are_dtensors": all(isinstance(p, DTensor) for p in params)}  # fmt: skip

    def fsdp_frozen() -> list[tuple[str, Tensor]]:
        return [(n, local(p).reshape(-1)) for n, p in model.named_parameters() if not p.requires_grad]

    def fsdp_adapters() -> list[tuple[str, int, np.ndarray]]:
        out = []
        for n, p in model.named_parameters():
            if "lora_" in n:
                full = p.full_tensor() if isinstance(p, DTensor) else p  # a collective: every rank calls it
                out.append((n, 0, full.detach().reshape(-1).numpy().copy()))
        return out if dist.get_rank(group) == 0 else []

    return Built(model, opt, None, fsdp_memory, fsdp_frozen, fsdp_adapters)


def rank_main(rank: int, world: int, cfg: LoraBenchConfig, name: str) -> dict[str, Any]:
    """Build configuration ``name`` on this (forked Gloo) rank, train it, return its measurements."""
    rss_at_start = current_rss_mib()
    group = dist.group.WORLD
    assert group is not None  # launch() initialised the default group
    t0 = time.perf_counter()
    b = build(name, cfg, group)
    setup_s = time.perf_counter() - t0
    frozen_before = {n: (_bits(v), float(v.double().sum())) for n, v in b.frozen_pieces()}
    rss_after_setup = current_rss_mib()
    timer = StepTimer(warmup=cfg.warmup)
    losses: list[float] = []
    memory: dict[str, Any] | None = None
    loadavg: list[float] = []
    for x, y in make_batches(cfg, rank):
        dist.barrier()
        with timer.step():
            with timer.phase("zero_grad"):
                b.opt.zero_grad(set_to_none=True)
            context = b.engine.forward_context() if b.engine is not None else nullcontext()
            with timer.phase("forward"), context:
                logits = b.model(input_ids=x, use_cache=False).logits
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            with timer.phase("backward"):
                loss.backward()
            with timer.phase("optimizer"):
                b.opt.step()
                if b.engine is not None:
                    b.engine.after_step()
        losses.append(loss.item())
        if memory is None:  # after the first real step, before the next zero_grad
            memory = b.memory()
        del logits, loss
        loadavg.append(os.getloadavg()[0])
    frozen_after = {n: (_bits(v), float(v.double().sum())) for n, v in b.frozen_pieces()}
    return {
        "rank": rank,
        "setup_s": setup_s,
        "times": timer.times,
        "cpu_times": timer.cpu_times,
        "phases": timer.phases,
        "losses": losses,
        "memory": memory,
        "rss_at_start_mib": rss_at_start,
        "rss_after_setup_mib": rss_after_setup,
        "peak_rss_mib": peak_rss_mib(),
        "frozen_bits_unchanged": all(frozen_before[n][0] == frozen_after[n][0] for n in frozen_before),
        "frozen_local_sums": {n: s for n, (_, s) in frozen_after.items()},
        "adapters": b.adapters(),
        "loadavg_1min_per_step": loadavg,
    }


def frozen_sums_reference(cfg: LoraBenchConfig) -> dict[str, float]:
    """float64 sum of every frozen weight of the LoRA model before any sharding (names as in the model)."""
    model = build_model(cfg, lora=True)
    return {n: float(p.detach().double().sum()) for n, p in model.named_parameters() if not p.requires_grad}


# ---------------------------------------------------------------------------------------------- report
def run_config(cfg: LoraBenchConfig, name: str) -> tuple[list[dict[str, Any]] | None, str | None]:
    """Per-rank results of configuration ``name`` in fresh processes, or ``(None, error)`` if it failed."""
    try:
        return launch(rank_main, cfg.world_size, cfg, name, threads_per_rank=cfg.threads_per_rank), None
    except RuntimeError as exc:
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        # the last line of the rank's traceback is "ExceptionType: message"
        return None, lines[-1].strip() if lines else str(exc)


def _adapter_table(per_rank: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    pieces: dict[str, list[tuple[int, np.ndarray]]] = {}
    for r in per_rank:
        for n, lo, v in r["adapters"]:
            pieces.setdefault(n, []).append((lo, v))
    return {n: np.concatenate([v for _, v in sorted(ps, key=lambda t: t[0])]) for n, ps in pieces.items()}


def summarize_config(cfg: LoraBenchConfig, name: str, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    counts = count_parameters(cfg, lora="lora" in name)
    exp = expected_bytes(counts, cfg.world_size)
    ranks = []
    for r in per_rank:
        cats = r["memory"]["categories"]
        ranks.append({
            "rank": r["rank"],
            "bytes": {**cats, "frozen": r["memory"]["frozen"]},
            "measured_over_expected": {k: cats[k] / exp[k] if exp[k] else None for k in CATEGORIES},
            "detail": {k: v for k, v in r["memory"].items() if k not in ("categories", "frozen")},
            "peak_rss_mib": r["peak_rss_mib"],
            "rss_at_start_mib": r["rss_at_start_mib"],
            "rss_after_setup_mib": r["rss_after_setup_mib"],
            "setup_s": r["setup_s"],
            "frozen_bits_unchanged": r["frozen_bits_unchanged"],
        })  # fmt: skip
    losses = [statistics.fmean(v) for v in zip(*(r["losses"] for r in per_rank), strict=True)]
    return {
        "parameters": counts,
        "expected_bytes_per_rank": exp,
        "per_rank": ranks,
        "timing": timing(per_rank, cfg.warmup),
        "losses": losses,
        "loadavg_1min_per_step": per_rank[0]["loadavg_1min_per_step"],
    }


def correctness(
    cfg: LoraBenchConfig, raw: dict[str, list[dict[str, Any]]], results: dict[str, Any]
) -> dict[str, Any]:
    """ours_lora against the FSDP2 LoRA run (losses, final adapters) and the frozen base unchanged."""
    out: dict[str, Any] = {"loss_rtol": LOSS_RTOL, "adapter_atol": ADAPTER_ATOL}
    ref_name = next((n for n in ("fsdp2_lora", SPLIT) if n in raw), None)
    if "ours_lora" in raw and ref_name is not None:
        out["reference"] = ref_name
        ours_losses, ref_losses = results["ours_lora"]["losses"], results[ref_name]["losses"]
        out.update(loss_agreement(ours_losses, ref_losses, rtol=LOSS_RTOL))
        ours, ref = _adapter_table(raw["ours_lora"]), _adapter_table(raw[ref_name])
        out["adapter_tensors"] = len(ref)
        out["adapter_same_names"] = set(ours) == set(ref)
        if out["adapter_same_names"]:
            diff = max(float(np.abs(ours[n] - ref[n]).max()) for n in ref)
            moved = max(float(np.abs(ref[n]).max()) for n in ref if "lora_B" in n)
            out.update(adapter_max_abs_diff=diff, adapter_lora_B_max_abs=moved)
            out["adapters_agree"] = diff <= ADAPTER_ATOL
    if "ours_full" in results and "fsdp2_full" in results:
        full = loss_agreement(results["ours_full"]["losses"], results["fsdp2_full"]["losses"], rtol=LOSS_RTOL)
        out["full_finetuning_losses"] = full
    reference = frozen_sums_reference(cfg) if any("lora" in n for n in raw) else {}
    frozen: dict[str, Any] = {}
    for name, per_rank in raw.items():
        if "lora" not in name:
            continue
        sums: dict[str, float] = {}
        for r in per_rank:
            for n, s in r["frozen_local_sums"].items():
                sums[n] = sums.get(n, 0.0) + s
        rel = max(abs(sums[n] - v) / max(abs(v), 1.0) for n, v in reference.items()) if sums else None
        frozen[name] = {
            "local_shard_bits_unchanged_all_ranks": all(r["frozen_bits_unchanged"] for r in per_rank),
            "frozen_tensors": len(sums),
            "all_frozen_names_present": set(sums) == set(reference),
            "max_rel_diff_of_sums_vs_before_sharding": rel,
            "unchanged": all(r["frozen_bits_unchanged"] for r in per_rank)
            and set(sums) == set(reference)
            and rel is not None
            and rel <= 1e-9,
        }
    out["frozen_base"] = frozen
    checks = [out.get("losses_agree"), out.get("adapters_agree"), *(f["unchanged"] for f in frozen.values())]
    out["passed"] = all(c is True for c in checks) and bool(checks)
    return out


def ratios(cfg: LoraBenchConfig, results: dict[str, Any]) -> dict[str, Any]:
    """Step time of ours over FSDP2's, for LoRA and full fine-tuning (configurations ran one after the
    other in fresh processes, so the paired ratio pairs the k-th steps of two different minutes)."""
    out: dict[str, Any] = {}
    for kind in ("lora", "full"):
        ref = f"fsdp2_{kind}" if f"fsdp2_{kind}" in results else (SPLIT if kind == "lora" else None)
        ours = f"ours_{kind}"
        if ref in results and ours in results:
            out[f"{ours}/{ref}"] = time_ratios(results[ours]["timing"], results[ref]["timing"], cfg.warmup)
    if "ours_lora" in results and "ours_full" in results:
        out["ours_lora/ours_full"] = time_ratios(
            results["ours_lora"]["timing"], results["ours_full"]["timing"], cfg.warmup
        )
    return out


def table_rows(payload: dict[str, Any]) -> list[list[str]]:
    """One row per configuration and category (rank 0 and the largest rank shown), plus refusals."""
    rows = []
    for name, res in payload["results"].items():
        exp = res["expected_bytes_per_rank"]
        t = res["timing"]["summary"]["median"]
        rss = max(r["peak_rss_mib"] for r in res["per_rank"])
        for i, cat in enumerate((*CATEGORIES, "frozen")):
            got = [r["bytes"][cat] for r in res["per_rank"]]
            rows.append([
                name if i == 0 else "", cat, " / ".join(mib(g) for g in got), mib(exp[cat]),
                f"{max(got) / exp[cat]:.4f}" if exp[cat] else "-",
                fmt(t) if i == 0 else "", f"{rss:.0f}" if i == 0 else "",
            ])  # fmt: skip
    for name, err in payload["refused"].items():
        rows.append([name, "refused: " + err, "", "", "", "", ""])
    return rows


HEADER = [
    "config", "category", "MiB/rank (r0 / r1)", "expected MiB", "max ÷ exp", "median s/step", "peak RSS MiB",
]  # fmt: skip


def print_table(payload: dict[str, Any]) -> None:
    rows = table_rows(payload)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADER)]
    print("  ".join(h.ljust(w) for h, w in zip(HEADER, widths, strict=True)))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> tuple[LoraBenchConfig, Any]:
    p = config_parser(LoraBenchConfig, name="lora")
    p.add_argument("--small", action="store_true", help="the same as --quick: tiny smoke configuration")
    ns = p.parse_args(argv)
    ns.quick = ns.quick or ns.small
    cfg = config_from_args(ns, SMALL if ns.quick else LoraBenchConfig())
    unknown = [c for c in cfg.config_list() if c not in (*CONFIGS, SPLIT)]
    if unknown or not cfg.config_list():
        p.error(f"--configs must be a comma-separated subset of {(*CONFIGS, SPLIT)}; got {cfg.configs!r}")
    if cfg.steps < 1 or cfg.warmup < 0 or cfg.world_size < 1:
        p.error("need --steps >= 1, --warmup >= 0, --world-size >= 1")
    return cfg, ns


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every configuration, print the table and the markdown snippet, write the JSON."""
    cfg, ns = parse_args(argv)
    env = environment(threads_per_rank=cfg.threads_per_rank, world_size=cfg.world_size)
    code = git_state()
    wall = time.perf_counter()
    raw: dict[str, list[dict[str, Any]]] = {}
    refused: dict[str, str] = {}
    wall_per_config: dict[str, float] = {}
    todo = cfg.config_list()
    for name in todo:
        t = time.perf_counter()
        per_rank, err = run_config(cfg, name)
        wall_per_config[name] = time.perf_counter() - t
        if per_rank is None:
            assert err is not None
            refused[name] = err
            print(f"{name}: refused: {err}")
            if name == "fsdp2_lora" and SPLIT not in todo:
                todo.append(SPLIT)  # the standard way around it
        else:
            raw[name] = per_rank
            print(f"{name}: done in {wall_per_config[name]:.1f} s")
    results = {name: summarize_config(cfg, name, per_rank) for name, per_rank in raw.items()}
    lora_counts = count_parameters(cfg, lora=True)
    payload: dict[str, Any] = {
        "benchmark": "lora",
        "description": "LoRA (PEFT) and full fine-tuning at ZeRO-3, Stage3Engine vs torch FSDP2: bytes/rank",
        "environment": {**env, "loadavg_at_end": list(os.getloadavg()), "code": code},
        "config": asdict(cfg),
        "model": {
            "name": "LlamaForCausalLM",
            "total_parameters": count_parameters(cfg, lora=False)["total"],
            "lora_parameters": lora_counts["trainable"],
            "lora_target_modules": LORA_TARGETS,
        },
        "results": results,
        "refused": refused,
        "time_ratios": ratios(cfg, results),
        "correctness": correctness(cfg, raw, results),
        "loadavg_1min_during_run": load_summary(
            [v for res in results.values() for v in res["loadavg_1min_per_step"]] or [os.getloadavg()[0]]
        ),
        "wall_time_per_config_s": wall_per_config,
    }
    payload["wall_time_s"] = time.perf_counter() - wall
    path = write_result("lora_small" if ns.quick else "lora", payload, ns.out)
    print()
    print_table(payload)
    print()
    print("\n".join(lora_section(payload)))
    print(f"\nwall time {payload['wall_time_s']:.1f} s; wrote {path}")
    return payload


if __name__ == "__main__":
    main()
