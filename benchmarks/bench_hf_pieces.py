"""What cutting a Hugging Face model into pipeline pieces costs: the pieces chained in one process against
the model's own forward, step time and logits, side by side.

Run (from the repository root)::

    python -m benchmarks.bench_hf_pieces             # 4 families x 3 batch forms, ~2 min on 2 cores
    python -m benchmarks.bench_hf_pieces --quick     # tiny smoke configuration, seconds

What is measured
----------------
For each family (``llama``, ``gpt2``, ``gemma3_text`` with local and global layers, ``qwen3``) a model of
``layers`` blocks, hidden ``hidden``, built from a config (fp32, sdpa attention, training mode), and for
each batch form, ``batch`` x ``seq`` random tokens: ``plain`` (no mask), ``left`` (left-padded rows with
their ``attention_mask``, a quarter of the rows padded by a quarter of the sequence) and ``packed`` (rows
of four documents with restarting ``position_ids``). One step is a forward, the mean of the logits and a
backward, either through ``model(**batch, use_cache=False)`` (``model``) or through the chain of
``hf_pipeline_layers(model)`` fed the same dict (``pieces``), the way the first pipeline stage is fed
by the default input. The two alternate step by step (``rounds`` x (model, pieces), after ``warmup``
rounds), so drift on a shared machine hits both; the figure is the median of each and their ratio
(pieces / model). One process, ``threads`` torch threads.

Correctness in the same run: the logits of the pieces equal the model's bitwise, for every row.
Results: ``benchmarks/results/hf_pieces.json`` (``--out`` to change).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import Tensor

from benchmarks.common import config_from_args, config_parser, environment, write_result
from lightning_par.pipeline import hf_pipeline_layers

NAME = "hf_pieces"
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
if int(transformers.__version__.split(".")[0]) < 5:  # hf_pipeline_layers refuses Gemma before 5.0
    del FAMILIES["gemma3_text"]
FORMS = ("plain", "left", "packed")


@dataclass(frozen=True)
class PiecesBenchConfig:
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    vocab: int = 2048
    batch: int = 4
    seq: int = 256
    rounds: int = 10
    warmup: int = 2
    threads: int = 1
    seed: int = 0


QUICK = PiecesBenchConfig(layers=2, hidden=32, heads=4, vocab=64, batch=2, seq=16, rounds=2, warmup=1)


def build(family: str, cfg: PiecesBenchConfig) -> Any:
    config_name, model_name = FAMILIES[family]
    config_cls, model_cls = getattr(transformers, config_name), getattr(transformers, model_name)
    torch.manual_seed(cfg.seed)
    if family == "gpt2":
        kw: dict[str, Any] = dict(
            vocab_size=cfg.vocab, n_positions=cfg.seq, n_embd=cfg.hidden, n_layer=cfg.layers,
            n_head=cfg.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
    else:
        kw = dict(
            vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=2 * cfg.hidden,
            num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads // 2,
            max_position_embeddings=cfg.seq, head_dim=cfg.hidden // cfg.heads,
        )  # fmt: skip
    if family == "gemma3_text":  # a global layer after every local one
        kw |= {
            "sliding_window": cfg.seq // 4,
            "layer_types": ["sliding_attention", "full_attention"] * (cfg.layers // 2)
            + ["sliding_attention"] * (cfg.layers % 2),
        }
    return model_cls(config_cls(**kw, attn_implementation="sdpa")).train()


def batch_of(form: str, cfg: PiecesBenchConfig) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(cfg.seed)
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g)
    if form == "plain":
        return {"input_ids": ids}
    if form == "left":
        mask = torch.ones_like(ids)
        mask[: max(1, cfg.batch // 4), : cfg.seq // 4] = 0
        return {"input_ids": ids, "attention_mask": mask}
    doc = max(1, cfg.seq // 4)
    positions = (torch.arange(cfg.seq) % doc).expand(cfg.batch, cfg.seq)
    return {"input_ids": ids, "position_ids": positions}


def _step(
    model: Any, pieces: Sequence[torch.nn.Module] | None, batch: dict[str, Tensor]
) -> tuple[Tensor, float]:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    if pieces is None:
        logits = model(**batch, use_cache=False).logits
    else:
        x: Any = batch
        for piece in pieces:
            x = piece(x)
        logits = x
    logits.float().mean().backward()
    return logits.detach(), time.perf_counter() - start


def measure(family: str, form: str, cfg: PiecesBenchConfig) -> dict[str, Any]:
    model = build(family, cfg)
    pieces = hf_pipeline_layers(model)
    batch = batch_of(form, cfg)
    times: dict[str, list[float]] = {"model": [], "pieces": []}
    equal = True
    for round_ in range(cfg.warmup + cfg.rounds):
        want, t_model = _step(model, None, batch)
        got, t_pieces = _step(model, pieces, batch)
        equal = equal and torch.equal(got, want)
        if round_ >= cfg.warmup:
            times["model"].append(t_model)
            times["pieces"].append(t_pieces)
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {
        "family": family,
        "form": form,
        "model_ms": 1e3 * medians["model"],
        "pieces_ms": 1e3 * medians["pieces"],
        "pieces_over_model": medians["pieces"] / medians["model"],
        "logits_equal": equal,
        "step_times_s": times,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ns = config_parser(PiecesBenchConfig, name=NAME).parse_args(argv)
    cfg = config_from_args(ns, QUICK if ns.quick else PiecesBenchConfig())
    torch.set_num_threads(cfg.threads)
    start = time.perf_counter()
    rows = [measure(family, form, cfg) for family in FAMILIES for form in FORMS]
    payload = {
        "environment": environment(threads_per_rank=cfg.threads, world_size=1),
        "config": dataclasses.asdict(cfg),
        "rows": rows,
        "correct": all(r["logits_equal"] for r in rows),
        "wall_time_s": time.perf_counter() - start,
    }
    path = write_result(NAME + ("_quick" if ns.quick else ""), payload, ns.out)
    for r in rows:
        print(
            f"{r['family']:>12} {r['form']:>6}: model {r['model_ms']:7.1f} ms,"
            f" pieces {r['pieces_ms']:7.1f} ms, ratio {r['pieces_over_model']:.3f},"
            f" logits equal {r['logits_equal']}"
        )
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
