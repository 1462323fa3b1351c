"""Memory planner: which (ZeRO stage, tp, pp, precision, micro-batch) layouts fit, before launching.

``lightning-par-plan`` (or :func:`plan`) enumerates the layouts of a GPT-shaped model over a world of
ranks and predicts, per rank:

* model states: :func:`lightning_par.memory.estimate_memory` (parameters, gradients, optimizer state,
  communication buffers; the same accounting ``memory_report()`` is tested against);
* activations of one micro-batch per layer, ``b s h (34 + 5 a s / h)`` bytes at 2-byte precision
  (Korthikanti et al., 2022; twice that in fp32), divided by ``t`` inside tensor-parallel regions (by
  ``t`` everywhere with sequence parallelism), ``2 b s h`` per layer with activation checkpointing (plus
  one layer recomputed); a pipeline stage holds ``L / p`` layers and, with 1F1B, up to ``p``
  micro-batches in flight;
* communication per rank for one optimizer step of ``m = p`` micro-batches (the least that fills a
  pipeline): data parallel ``2 Ψ`` gradient-equivalents for stages 0-2 and ``3 Ψ`` for stage 3 (ring
  collectives move ``(N-1)/N`` of that per rank), tensor parallel 4 all-reduces of ``b s h`` per layer
  and micro-batch, pipeline ``2 b s h`` (activation out, gradient back) per micro-batch.

Layouts are ranked: those within the memory budget first, then by communication per sample, then by
memory.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lightning_par.memory import estimate_memory

_BYTES = {"32-true": 4, "64-true": 8, "bf16-mixed": 2, "16-mixed": 2, "bf16-true": 2}


@dataclass(frozen=True)
class ModelShape:
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    seq_len: int

    @property
    def params(self) -> int:
        """GPT with tied embeddings: 12 h^2 per block (+ biases and norms), embeddings V h + s h."""
        h = self.n_embd
        return self.n_layer * (12 * h * h + 13 * h) + self.vocab_size * h + self.seq_len * h + 2 * h


@dataclass(frozen=True)
class Layout:
    zero_stage: int
    tp: int
    pp: int
    dp: int
    precision: str
    micro_batch: int
    model_states_gib: float
    activations_gib: float
    buffers_gib: float
    total_gib: float
    comm_gib_per_step: float
    fits: bool


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def activation_bytes(
    shape: ModelShape, *, micro_batch: int, tp: int, pp: int, precision: str, checkpointing: bool, sp: bool
) -> float:
    b, s, h, a = micro_batch, shape.seq_len, shape.n_embd, shape.n_head
    scale = _BYTES[precision] / 2  # the formula counts 2-byte activations
    per_layer_full = s * b * h * (34 + 5 * a * s / h) * scale
    # outside tensor-parallel regions (norms, dropout, residual) ~10 sbh of the 34 stay replicated without SP
    per_layer = (
        per_layer_full / tp if sp else (per_layer_full - 10 * s * b * h * scale) / tp + 10 * s * b * h * scale
    )
    layers = math.ceil(shape.n_layer / pp)
    in_flight = pp  # 1F1B keeps at most p micro-batches on the first stage
    if checkpointing:
        return (2 * s * b * h * scale * layers) * in_flight + per_layer
    return per_layer * layers * in_flight


def plan(
    shape: ModelShape,
    *,
    world: int,
    memory_gib: float,
    micro_batches: Sequence[int] = (1, 2, 4, 8),
    precisions: Sequence[str] = ("bf16-mixed", "32-true"),
    stages: Sequence[int] = (0, 1, 2, 3),
    checkpointing: bool = False,
    sequence_parallel: bool = False,
    max_tp: int = 8,
) -> list[Layout]:
    """All layouts of ``shape`` over ``world`` ranks, ranked (see the module docstring)."""
    out: list[Layout] = []
    psi = shape.params
    for tp in _divisors(world):
        if tp > max_tp or shape.n_head % tp or shape.n_embd % tp:
            continue
        for pp in _divisors(world // tp):
            if pp > shape.n_layer:
                continue
            dp = world // (tp * pp)
            for stage in stages:
                for precision in precisions:
                    est = estimate_memory(psi, zero_stage=stage, dp=dp, tp=tp, pp=pp, precision=precision)
                    states = est["parameters"] + est["gradients"] + est["optimizer_state"] + est["live_units"]
                    for b in micro_batches:
                        act = activation_bytes(
                            shape,
                            micro_batch=b,
                            tp=tp,
                            pp=pp,
                            precision=precision,
                            checkpointing=checkpointing,
                            sp=sequence_parallel,
                        )
                        # the 16-bit modes reduce in fp32; fp32 and fp64 in their own dtype
                        grad_bytes = _BYTES[precision] if precision in ("32-true", "64-true") else 4
                        dp_factor = (3 if stage == 3 else 2) * (dp - 1) / dp if dp > 1 else 0.0
                        comm = dp_factor * psi / (tp * pp) * grad_bytes
                        sbh = b * shape.seq_len * shape.n_embd * _BYTES[precision]
                        if tp > 1:
                            comm += 4 * shape.n_layer / pp * sbh * 2 * (tp - 1) / tp * pp
                        if pp > 1:
                            comm += 2 * sbh * pp
                        gib = 2**30
                        total = states + act + est["comm_buffers"]
                        out.append(
                            Layout(
                                zero_stage=stage,
                                tp=tp,
                                pp=pp,
                                dp=dp,
                                precision=precision,
                                micro_batch=b,
                                model_states_gib=states / gib,
                                activations_gib=act / gib,
                                buffers_gib=est["comm_buffers"] / gib,
                                total_gib=total / gib,
                                comm_gib_per_step=comm / gib,
                                fits=total / gib <= memory_gib,
                            )
                        )
    out.sort(
        key=lambda lay: (not lay.fits, lay.comm_gib_per_step / (lay.micro_batch * lay.pp), lay.total_gib)
    )
    return out


def draw(
    layouts: Sequence[Layout], path: str | Path, *, top: int = 12, memory_gib: float | None = None
) -> Path:
    """A stacked bar chart of the memory breakdown of the first ``top`` layouts, written as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = list(layouts[:top])
    labels = [f"z{x.zero_stage} t{x.tp} p{x.pp} d{x.dp}\n{x.precision} b{x.micro_batch}" for x in shown]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(shown)), 4.5))
    bottom = [0.0] * len(shown)
    for key, label in (
        ("model_states_gib", "model states"),
        ("activations_gib", "activations"),
        ("buffers_gib", "comm buffers"),
    ):
        values = [getattr(x, key) for x in shown]
        ax.bar(labels, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    if memory_gib is not None:
        ax.axhline(memory_gib, color="black", linestyle="--", linewidth=1, label="budget")
    ax.set_ylabel("GiB per rank")
    ax.set_title("Predicted memory per rank by layout")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Print the ranked layouts for the command line ``argv``; return them as dicts (see :func:`cli`)."""
    p = argparse.ArgumentParser(prog="lightning-par-plan", description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, required=True)
    p.add_argument("--n-embd", type=int, required=True)
    p.add_argument("--n-head", type=int, required=True)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--memory-gib", type=float, default=80.0)
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--precisions", nargs="+", default=["bf16-mixed", "32-true"], choices=sorted(_BYTES))
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--png", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.world < 1 or min(args.micro_batches) < 1:
        p.error("--world and --micro-batches must be >= 1")
    shape = ModelShape(args.n_layer, args.n_embd, args.n_head, args.vocab, args.seq)
    layouts = plan(
        shape,
        world=args.world,
        memory_gib=args.memory_gib,
        micro_batches=args.micro_batches,
        precisions=args.precisions,
        checkpointing=args.checkpointing,
        sequence_parallel=args.sequence_parallel,
    )
    print(f"{shape.params / 1e6:.1f}M parameters, world {args.world}, budget {args.memory_gib} GiB per rank")
    print(
        f"{'zero':>4} {'tp':>3} {'pp':>3} {'dp':>3} {'precision':>10} {'b':>3} {'states':>8} {'activ':>8} "
        f"{'total':>8} {'comm/b':>8} fits"
    )
    for x in layouts[: args.top]:
        print(
            f"{x.zero_stage:>4} {x.tp:>3} {x.pp:>3} {x.dp:>3} {x.precision:>10} {x.micro_batch:>3}"
            f" {x.model_states_gib:8.2f} {x.activations_gib:8.2f} {x.total_gib:8.2f}"
            f" {x.comm_gib_per_step / x.micro_batch:8.3f} {'yes' if x.fits else 'no'}"
        )
    rows = [asdict(x) for x in layouts]
    if args.png:
        draw(layouts, args.png, top=args.top, memory_gib=args.memory_gib)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


def cli() -> None:
    """Console script ``lightning-par-plan`` (returns nothing: a console script's return value becomes
    its exit status)."""
    main()


if __name__ == "__main__":
    cli()
