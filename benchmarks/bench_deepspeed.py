"""Optional reference: DeepSpeed ZeRO-1/2/3 on CPU/Gloo beside torch DDP, on ``bench_zero``'s GPT and data.

DeepSpeed is *not* a dependency of ``lightning_par``: install it in a separate virtual environment that
sees the system's torch (and pin torch, which DeepSpeed's requirements would otherwise move)::

    python -m venv --system-site-packages /work/venv-ds
    echo "torch==2.13.0" > /tmp/ds-constraints.txt
    /work/venv-ds/bin/pip install -c /tmp/ds-constraints.txt deepspeed==0.19.8

Run (from the repository root; the command starts ``torchrun --nproc-per-node=2`` itself, once for the
interleaved timing run and once per implementation for the memory runs)::

    /work/venv-ds/bin/python -m benchmarks.bench_deepspeed            # same model/data/steps as bench_zero
    /work/venv-ds/bin/python -m benchmarks.bench_deepspeed --quick    # tiny smoke configuration
    python -m benchmarks.bench_zero --deepspeed-json benchmarks/results/deepspeed.json   # compare with ours
    python -m benchmarks.report                                        # or: tables from both JSON files

What is measured
----------------
The configuration (``bench_zero.ZeroConfig``, every field a flag) and data (``bench_dp.make_batches``) are
``bench_zero``'s, so a default run trains the same 19.2M-parameter GPT on the same batches with the same
AdamW (``torch.optim.AdamW`` handed to DeepSpeed as the client optimizer, so the update is torch's in
both benchmarks), no gradient clipping (``"gradient_clipping": 0.0``; DeepSpeed clips at 1.0 by
default), fp32, and the same bucket size (``reduce_bucket_size``/``allgather_bucket_size``; other ZeRO
settings are DeepSpeed's defaults, e.g. ZeRO-3 keeps parameters under 1e5 elements unpartitioned). Ranks
are started by ``torchrun`` (``DS_ACCELERATOR=cpu``, Gloo, one torch thread each). Plain torch DDP runs in
the *same* processes, in the same rotating order, so ``ds_z<k>/ddp`` ratios exist; since this is another
run than ``bench_zero``'s (other minutes, other load), DeepSpeed is compared with ours only through that
shared DDP baseline: ``(ds/ddp here) / (ours/ddp there)``. A step is ``engine(x)`` + cross-entropy,
``engine.backward(loss)``, ``engine.step()`` (DeepSpeed zeroes the gradients in its step). DeepSpeed's
first start compiles its CPU shared-memory communication op (~25-40 s, cached in
``~/.cache/torch_extensions``); that and all engine construction happen before the timed steps
(``setup_s`` in the JSON). Peak RSS per rank is measured per implementation in fresh ``torchrun`` ranks;
these start from a fresh interpreter (not forked from a parent as in ``bench_zero``), so compare absolute
RSS across the two benchmarks only through ``peak - start`` or the DDP row of each.

Without DeepSpeed the command prints why and exits with status 2; ``bench_zero`` never needs it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from benchmarks.bench_zero import (
    QUICK,
    Impl,
    ZeroConfig,
    aggregate,
    build_impl,
    compare,
    current_rss_mib,
    git_state,
    run_rotation,
)
from benchmarks.common import environment, free_port, write_result

SPEC_ENV = "LP_BENCH_DEEPSPEED_SPEC"  # worker mode: path of the JSON spec (torchrun would parse argv flags)
DS_STAGES = (1, 2, 3)


def deepspeed_config(cfg: ZeroConfig, stage: int) -> dict[str, Any]:
    """The DeepSpeed config of ZeRO ``stage``: fp32, no clipping, our bucket size, otherwise defaults."""
    # fp32 elements, as ours and DDP (rounded to DeepSpeed's alignment, which asserts it)
    bucket_numel = max(64, int(cfg.bucket_mb * 1024 * 1024) // 4 // 64 * 64)
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": bucket_numel}
    if stage < 3:
        zero["allgather_bucket_size"] = bucket_numel
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # the client optimizer is torch.optim.AdamW
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


# ---------------------------------------------------------------------------------------------- worker
def _build_deepspeed(stage: int, cfg: ZeroConfig) -> Impl:
    import deepspeed

    torch.manual_seed(cfg.seed)
    from lightning_par.models.gpt import GPT

    model = GPT(cfg.gpt_config())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=deepspeed_config(cfg, stage))

    def full() -> dict[str, Tensor]:
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
            return {n: p.detach().clone() for n, p in engine.module.named_parameters()}

    return Impl(
        name=f"ds_z{stage}",
        model=engine,
        inner=engine.module,
        optimizer=None,
        after_step=None,
        full_params=full,
        engine=None,
        backward_fn=engine.backward,
        step_fn=engine.step,
    )


def worker(spec_path: str) -> None:
    """One torchrun rank: build the implementations of the spec, train them, write this rank's raw data."""
    spec = json.loads(Path(spec_path).read_text())
    cfg = ZeroConfig(**spec["config"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(cfg.threads_per_rank)
    rss_at_start = current_rss_mib()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        setup = time.perf_counter()
        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo")  # adopts the group; builds the shm op once
        group = dist.group.WORLD
        assert group is not None
        built: dict[str, Impl] = {}
        for name in spec["impls"]:
            if name == "ddp":
                built[name] = build_impl("ddp", cfg, group)
            else:
                built[name] = _build_deepspeed(int(name.removeprefix("ds_z")), cfg)
        setup = time.perf_counter() - setup
        out = run_rotation(rank, cfg, built, rss_at_start=rss_at_start)
        out["setup_s"] = setup
        Path(spec["out_dir"], f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- parent
def _torchrun(cfg: ZeroConfig, impls: list[str], workdir: Path, tag: str) -> list[dict[str, Any]]:
    """Run ``impls`` on ``cfg.world_size`` torchrun ranks; return their raw data by rank."""
    out_dir = workdir / tag
    out_dir.mkdir()
    spec = workdir / f"{tag}.json"
    spec.write_text(json.dumps({"config": asdict(cfg), "impls": impls, "out_dir": str(out_dir)}))
    env = {
        **os.environ,
        SPEC_ENV: str(spec),
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": str(cfg.threads_per_rank),
    }
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.world_size}",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "benchmarks.bench_deepspeed",
    ]  # fmt: skip
    log = workdir / f"{tag}.log"
    with log.open("w") as f:
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0:
        lines = log.read_text().splitlines()
        rank_lines = [line for line in lines if line.startswith("[rank")]  # a rank's own traceback
        tail = "\n".join((rank_lines or lines)[-40:])
        raise RuntimeError(f"torchrun ({tag}) exited with {rc}; last lines of {log}:\n{tail}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(cfg.world_size)]


def deepspeed_unavailable() -> str | None:
    """Why DeepSpeed cannot be used from this interpreter, or None if it can be imported."""
    if importlib.util.find_spec("deepspeed") is None:
        return (
            f"deepspeed is not installed for {sys.executable}; install it in a separate venv (see the module"
            " docstring) and run this module with that venv's python"
        )
    return None


def _print(cfg: ZeroConfig, agg: dict[str, Any], memory: dict[str, Any] | None) -> None:
    impls = agg["implementations"]
    print(
        f"\nDeepSpeed vs DDP, GPT {cfg.num_parameters() / 1e6:.2f}M params, micro-batch {cfg.micro_batch}, "
        f"{cfg.steps} measured + {cfg.warmup} warmup steps each"
    )
    header = (
        ("median s", 10),
        ("IQR s", 9),
        ("CPU s", 8),
        ("vs DDP", 8),
        ("paired", 8),
        ("RSS MiB", 9),
        ("loss", 10),
    )
    print(f"{'impl':<8}" + "".join(f"{h:>{w}}" for h, w in header))
    for name, d in impls.items():
        c = agg["comparisons"].get(f"{name}/ddp")
        rss = max(memory[name]["peak_rss_mib_per_rank"]) if memory else float("nan")
        diff = agg["loss_agreement_vs_ddp"].get(name, {}).get("loss_max_abs_diff")
        print(
            f"{name:<8}{d['summary']['median']:>10.3f}{d['summary']['iqr']:>9.3f}"
            f"{d['cpu_summary']['median']:>8.3f}{c['ratio_of_medians'] if c else 1.0:>8.3f}"
            f"{c['median_paired_ratio'] if c else 1.0:>8.3f}{rss:>9.0f}"
            f"{'ref' if diff is None else format(diff, '.1e'):>10}"
        )


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Run DeepSpeed ZeRO-1/2/3 and DDP, print a table and write ``benchmarks/results/deepspeed.json``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="bench_zero's tiny smoke configuration")
    p.add_argument("--stages", default="1,2,3", help="DeepSpeed ZeRO stages to run (default 1,2,3)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--memory-steps", type=int, default=None, dest="memory_steps")
    p.add_argument("--micro-batch", type=int, default=None, dest="micro_batch")
    p.add_argument("--n-layer", type=int, default=None, dest="n_layer")
    p.add_argument("--out", default=None, help="JSON path (default results/deepspeed[_quick].json)")
    ns = p.parse_args(argv)
    reason = deepspeed_unavailable()
    if reason is not None:
        print(f"DeepSpeed skipped: {reason}", file=sys.stderr)
        raise SystemExit(2)
    base = QUICK if ns.quick else ZeroConfig()
    flags = ("steps", "warmup", "memory_steps", "micro_batch", "n_layer")
    overrides = {k: getattr(ns, k) for k in flags if getattr(ns, k) is not None}
    cfg = replace(base, **overrides)
    stages = sorted({int(s) for s in ns.stages.split(",") if s.strip()})
    if not stages or any(s not in DS_STAGES for s in stages):
        p.error(f"--stages must be a comma-separated list of 1, 2, 3; got {ns.stages!r}")
    impls = ["ddp", *(f"ds_z{s}" for s in stages)]
    env = environment(threads_per_rank=cfg.threads_per_rank, world_size=cfg.world_size)
    code = git_state()
    import deepspeed

    wall = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_ds_") as tmp:
        workdir = Path(tmp)
        per_rank = _torchrun(cfg, impls, workdir, "timing")
        agg = aggregate(cfg, per_rank)
        agg["comparisons"] = {
            f"{name}/ddp": compare(agg["implementations"], name, "ddp", cfg.warmup, None)
            for name in impls
            if name != "ddp"
        }
        memory: dict[str, Any] | None = None
        if cfg.memory_steps > 0:
            alone = replace(cfg, steps=cfg.memory_steps, warmup=0)
            memory = {"steps": cfg.memory_steps}
            for name in impls:
                ranks = _torchrun(alone, [name], workdir, f"memory_{name}")
                memory[name] = {
                    "peak_rss_mib_per_rank": [r["peak_rss_mib"] for r in ranks],
                    "rss_at_start_mib_per_rank": [r["rss_at_start_mib"] for r in ranks],
                    "peak_rss_after_step_mib_per_rank": [r["peak_rss_after_step_mib"][name] for r in ranks],
                }
    wall = time.perf_counter() - wall
    payload: dict[str, Any] = {
        "benchmark": "deepspeed",
        "description": "DeepSpeed ZeRO-1/2/3 (CPU, Gloo, torchrun) beside torch DDP in the same processes",
        "environment": {
            **env,
            "loadavg_at_end": list(os.getloadavg()),
            "deepspeed": deepspeed.__version__,
            "code": code,
        },
        "config": asdict(cfg),
        "impls": impls,
        "deepspeed_configs": {f"ds_z{s}": deepspeed_config(cfg, s) for s in stages},
        "model": {"name": "GPT", "num_parameters": cfg.num_parameters(), **asdict(cfg.gpt_config())},
        "setup_s_per_rank": [r["setup_s"] for r in per_rank],
        **agg,
        "memory_alone": memory,
        "wall_time_s": wall,
    }
    path = write_result("deepspeed_quick" if ns.quick else "deepspeed", payload, ns.out)
    _print(cfg, agg, memory)
    print(f"setup (engines, op build) {max(payload['setup_s_per_rank']):.1f} s, not timed; wall {wall:.1f} s")
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    if os.environ.get(SPEC_ENV):
        worker(os.environ[SPEC_ENV])
    else:
        main()
