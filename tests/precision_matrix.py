"""The mixed-precision combination matrix: ZeRO stage 0-3 x tp 1/2 x pp 1/2 x precision (``32-true``,
``bf16-mixed``, ``16-mixed``, ``bf16-true``) x token-exact loss on/off, with gradient accumulation 2,
global-norm clipping that bites, and a GPT whose token table is tied to its LM head. Used by
``tests/test_precision_matrix.py``; ``python -m tests.precision_matrix`` runs it and prints the README
table.

Every combination runs on 4 ranks (dp = 4 / (tp * pp)) and records, after each optimizer step and on
every rank: the global gradient norm the clip used, whether the step was skipped (fp16), and a checksum
of the tied parameter's local copy; at the end the consolidated weights. The reference is the same
LightningModule, strategy stage and precision on one process (dp = tp = pp = 1), fed the same global
batches: a data order that does not depend on dp (each rank takes its contiguous block of every global
batch). In ``16-mixed`` the loss of the second optimizer step is poisoned with inf on data-parallel rank
0 only, so every rank must skip that step because one did.

Exact invariants: the tied copies are bitwise equal on every pipeline stage after every step; every
rank's clip norm is the same number; every rank skips the same steps, and the reference's. Approximate:
the final weights and the clip norms against the reference, within ``tolerance(precision)`` (see there).
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from lightning_par import HybridParallelStrategy
from lightning_par.loss import token_loss_sum
from lightning_par.models import GPTModule
from lightning_par.models.lit_gpt import IGNORE_INDEX, _lm_loss
from lightning_par.precision import ParallelPrecision

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2))  # (tp, pp) on 4 ranks
WORLD, GLOBAL, ACCUM, STEPS, SEED = 4, 8, 2, 3, 13
KW: dict[str, Any] = dict(vocab_size=64, block_size=8, n_layer=2, n_head=4, n_embd=32, bias=False)
CLIP = 0.5  # below the gradient norms of this model: clipping scales every step


@dataclass(frozen=True)
class Combo:
    stage: int
    tp: int
    pp: int
    precision: str
    token: bool

    @property
    def name(self) -> str:
        return f"zero{self.stage}-tp{self.tp}-pp{self.pp}-{self.precision}{'-token' if self.token else ''}"

    @property
    def dp(self) -> int:
        return WORLD // (self.tp * self.pp)


def refusal(combo: Combo) -> str | None:
    """Why a combination is not run (the package refuses it, or it does not apply), else None."""
    return None


def combos() -> list[Combo]:
    out = []
    for stage, (tp, pp), precision, token in itertools.product(range(4), LAYOUTS, PRECISIONS, (False, True)):
        out.append(Combo(stage=stage, tp=tp, pp=pp, precision=precision, token=token))
    return out


def reference_key(combo: Combo) -> tuple[bool, str, bool]:
    """Which single-process run a combination compares with: stages 1-3 keep fp32 masters in the shards
    (one numerics), stage 0 keeps fp32 parameters under autocast (another)."""
    return combo.stage > 0, combo.precision, combo.token


class Tokens(Dataset[tuple[Tensor, Tensor]]):
    """Learnable sequences; with ``masked`` a varying number of targets per sample is ignore_index, so the
    token counts of micro-batches and ranks differ (token-exact normalisation matters)."""

    def __init__(self, n: int, *, masked: bool) -> None:
        g = torch.Generator().manual_seed(5)
        start = torch.randint(0, 64, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.data = (start + stride * torch.arange(KW["block_size"] + 1)) % 64
        self.keep = torch.randint(2, KW["block_size"] + 1, (n,), generator=g) if masked else None

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        x, y = self.data[i, :-1], self.data[i, 1:].clone()
        if self.keep is not None:
            y[int(self.keep[i]) :] = IGNORE_INDEX
        return x, y


class BlockSampler(Sampler[int]):
    """Rank ``r`` of ``dp`` takes block ``r`` of every global batch: the global batches, and so the
    single-process reference, do not depend on dp."""

    def __init__(self, n: int, *, dp: int, rank: int) -> None:
        self.n, self.dp, self.rank = n, dp, rank

    def __iter__(self) -> Iterator[int]:
        per = GLOBAL // self.dp
        for start in range(0, self.n, GLOBAL):
            yield from range(start + self.rank * per, start + (self.rank + 1) * per)

    def __len__(self) -> int:
        return self.n // self.dp


class MatrixGPT(GPTModule):
    """The package's GPT (tied embedding and head, pipeline protocol) with SGD, an optional token-exact
    loss (``token_normalized`` in ``training_step``, ``{"loss_sum", "tokens"}`` from ``pipeline_loss``),
    and (16-mixed) an inf loss on dp rank 0 in the second optimizer step."""

    def __init__(self, *, token: bool, poison: bool, **kw: Any) -> None:
        super().__init__(**kw)
        self.token, self.poison = token, poison
        self._batch_idx = 0

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._batch_idx = batch_idx

    def _poisoned(self, loss: Tensor) -> Tensor:
        strategy = self.trainer.strategy
        dp_rank = (
            strategy.distributed_sampler_kwargs["rank"] if isinstance(strategy, HybridParallelStrategy) else 0
        )
        if self.poison and self._batch_idx // ACCUM == 1 and dp_rank == 0:
            return loss * float("inf")
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        if not self.token:
            return self._poisoned(_lm_loss(logits, y))
        loss_sum, n_tokens = token_loss_sum(logits, y, ignore_index=IGNORE_INDEX)
        strategy = self.trainer.strategy
        assert isinstance(strategy, HybridParallelStrategy)
        return self._poisoned(strategy.token_normalized(loss_sum, n_tokens))

    def pipeline_loss(self, output: Tensor, batch: Any) -> Any:
        if not self.token:
            return self._poisoned(super().pipeline_loss(output, batch))
        # the pipeline's token-exact form: the stages' gradients are normalised by the window's tokens
        loss_sum, n_tokens = token_loss_sum(output, batch[1], ignore_index=IGNORE_INDEX)
        return {"loss_sum": self._poisoned(loss_sum), "tokens": n_tokens}


class Record(pl.Callback):
    """Per optimizer step: the clip norm, skipped or not, and a checksum of the tied parameter's copy."""

    def __init__(self, every: int = ACCUM) -> None:
        self.every = every  # batches per optimizer step
        self.norms: list[float] = []
        self.skipped: list[bool] = []
        self.tied: list[tuple[float, int] | None] = []
        self.export: dict[str, Tensor] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if (args[-1] + 1) % self.every:  # batch_idx: only at the end of an accumulation window
            return
        plugin = trainer.strategy.precision_plugin
        norm = getattr(plugin, "last_grad_norm", None)
        self.norms.append(float(norm) if norm is not None else math.nan)
        self.skipped.append(bool(getattr(plugin, "last_step_skipped", False)))
        gpt = module.gpt  # type: ignore[attr-defined]
        tied = gpt.embed.tok.weight if not gpt.embed.tok.weight.is_meta else gpt.head.lm_head.weight
        engine = getattr(trainer.strategy, "_engine", None)
        if engine is not None and engine.shards_params and not tied.is_meta:
            # ZeRO-3: the copy is sharded over the stage's dp group; gather it (collective over dp)
            full = engine.full_state_dict(to_rank=engine.rank)
            names = ("embed.tok.weight", "lm_head.weight")
            tied = next(v for k, v in sorted(full.items()) if k.endswith(names))
        self.tied.append(None if tied.is_meta else _checksum(tied))

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.export = trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]


def _checksum(t: Tensor) -> tuple[float, int]:
    """(float64 sum, hash of the bytes) of a tensor: equal only for bitwise-equal tensors in practice."""
    data = t.detach().float().cpu().contiguous()
    return float(data.double().sum()), hash(data.numpy().tobytes())


def _plugin(precision: str, reduce_dtype: str = "fp32") -> ParallelPrecision:
    # fp16: a start scale low enough that only the poisoned step overflows (2**16 overflows this model's
    # summed token losses in the first step, which would leave the matrix one clean fp16 step)
    scale = {"init_scale": 2.0**10} if precision == "16-mixed" else None
    return ParallelPrecision(precision, loss_scale=scale, reduce_dtype=reduce_dtype)  # type: ignore[arg-type]


def _trainer(
    strategy: Any,
    devices: int,
    precision: str,
    callbacks: list[pl.Callback],
    reduce_dtype: str = "fp32",
    clip: float | None = CLIP,
) -> pl.Trainer:
    # the plugin itself, not the string: on CPU Lightning turns the string "16-mixed" into bf16-mixed
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        plugins=[_plugin(precision, reduce_dtype)],
        max_epochs=1,
        accumulate_grad_batches=ACCUM,
        gradient_clip_val=clip,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
    )


def run(
    combo: Combo, *, world: int, dp_rank: int, reduce_dtype: str = "fp32", clip: float | None = CLIP
) -> dict[str, Any]:
    """One combination on ``world`` ranks (``world == 1``: the reference)."""
    pl.seed_everything(SEED, verbose=False)
    kw: dict[str, Any] = dict(
        zero_stage=combo.stage,
        tensor_parallel_size=combo.tp,
        pipeline_parallel_size=combo.pp,
        meta_init=False,
    )
    if combo.tp > 1:
        kw["tp_plan"] = "gpt"
    if combo.pp > 1:
        kw["num_microbatches"] = 2
    module = MatrixGPT(token=combo.token, poison=combo.precision == "16-mixed", **KW, max_steps=STEPS)
    module.configure_model()
    record = Record()
    trainer = _trainer(HybridParallelStrategy(**kw), world, combo.precision, [record], reduce_dtype, clip)
    n = GLOBAL * ACCUM * STEPS
    dp = world // (combo.tp * combo.pp)
    data = Tokens(n, masked=combo.token)
    loader = DataLoader(data, batch_size=GLOBAL // dp, sampler=BlockSampler(n, dp=dp, rank=dp_rank))
    trainer.fit(module, loader)
    trainer.strategy.destroy_process_groups()  # type: ignore[attr-defined]  # 128 combinations in a row
    return {"norms": record.norms, "skipped": record.skipped, "tied": record.tied, "export": record.export}


def run_matrix(rank: int, world: int, selected: list[Combo]) -> dict[str, Any]:
    """Every selected combination on this rank of the world-4 spawn (errors recorded, not raised)."""
    out: dict[str, Any] = {}
    for combo in selected:
        dp = combo.dp
        tp_pp = combo.tp * combo.pp
        # the mesh puts tp innermost, then dp, then pp: dp coordinate of this rank
        dp_rank = (rank // combo.tp) % dp if tp_pp < world else 0
        try:
            out[combo.name] = run(combo, world=world, dp_rank=dp_rank)
        except Exception as exc:  # a refusal the matrix must list, or a failure the test reports
            out[combo.name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def run_references(rank: int, world: int, keys: list[tuple[bool, str, bool]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for masters, precision, token in keys:
        combo = Combo(stage=1 if masters else 0, tp=1, pp=1, precision=precision, token=token)
        out[repr((masters, precision, token))] = run(combo, world=1, dp_rank=0)
    return out


def tolerance(
    precision: str, reference: dict[str, Tensor], initial: dict[str, Tensor], *, stored_low: bool
) -> float:
    """Absolute tolerance for the final weights against the single-process run.

    Layouts change the order of floating-point sums (dp all-reduces, tp partial products, micro-batch
    splits), which perturbs each step's gradients by about the unit round-off ``u`` of the arithmetic
    the model runs in, relative to their size; through ``STEPS`` SGD steps with momentum the weights then
    differ by a few ``u`` times the size of the total update ``U = max|W_T - W_0|``. Where the weights
    themselves are stored in 16 bits (``stored_low``: ``bf16-true`` without masters) one rounding of a
    weight, ``u max|W|``, comes on top. So ``tol = 8 u U (+ u max|W|)``, with ``u = 2^-8`` for bf16
    arithmetic, ``2^-11`` for fp16, and for fp32 a floor of 1e-6 (reduction order moves the last bits).
    Measured over the whole matrix (README table): at most 1.5 u U (bf16-mixed), 0.9 u U (16-mixed), and
    1.2e-7 in fp32, so the factor 8 leaves about 5x; a lost tied-weight gradient moves the weights by
    about 80 u U and is caught."""
    if precision == "32-true":
        return 1e-6
    u = {"bf16-mixed": 2.0**-8, "16-mixed": 2.0**-11, "bf16-true": 2.0**-8}[precision]
    update = max(float((reference[k].float() - initial[k].float()).abs().max()) for k in reference)
    size = max(float(v.float().abs().max()) for v in reference.values())
    return 8 * u * update + (u * size if stored_low else 0.0)


def initial_state() -> dict[str, Tensor]:
    pl.seed_everything(SEED, verbose=False)
    module = MatrixGPT(token=False, poison=False, **KW, max_steps=STEPS)
    module.configure_model()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def table(rows: list[dict[str, Any]]) -> str:
    """The README table: one row per (stage, tp, pp), one column per precision (token-exact on/off)."""
    cells: dict[tuple[int, int, int], dict[str, str]] = {}
    for row in rows:
        key = (row["stage"], row["tp"], row["pp"])
        column = row["precision"]
        mark = {"ok": "✓", "refused": "refused", "n/a": "n/a"}.get(row["status"], "✗")
        cell = cells.setdefault(key, {}).get(column, "")
        cells[key][column] = (cell + " / " if cell else "") + mark
    header = "| ZeRO stage | tp | pp | " + " | ".join(PRECISIONS) + " |"
    lines = [header, "|" + "---|" * (3 + len(PRECISIONS))]
    for (stage, tp, pp), by_precision in sorted(cells.items()):
        values = " | ".join(by_precision.get(p, "") for p in PRECISIONS)
        lines.append(f"| {stage} | {tp} | {pp} | {values} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Run the matrix and print the README table (cells: token-exact off / on)."""
    from tests.distributed import run_distributed
    from tests.test_precision_matrix import evaluate

    selected = [c for c in combos() if refusal(c) is None]
    results = run_distributed(run_matrix, WORLD, selected, init_group=False, timeout=3000.0)
    keys = sorted({reference_key(c) for c in selected})
    references = run_distributed(run_references, 1, keys, init_group=False, timeout=1000.0)[0]
    rows = evaluate(results, references, strict=False)
    Path(argv[0] if argv else "precision_matrix.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    print()
    for precision in PRECISIONS:
        ok = [r for r in rows if r["precision"] == precision and r["status"] == "ok"]
        worst = max(ok, key=lambda r: r["deviation"] / r["tolerance"])
        print(
            f"- `{precision}`: {len(ok)} combinations; largest deviation {worst['deviation']:.2g}"
            f" ({worst['name']}), {worst['deviation'] / worst['tolerance']:.2f} of its tolerance;"
            f" clip norms within {max(r['norm_deviation'] for r in ok):.1e} (relative) of the reference's"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
