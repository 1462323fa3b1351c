"""GPU check, part 1: the correctness matrix; and what every part shares (sizes, data, module, Trainer).

Everything runs at world size 1 (NCCL on CUDA, Gloo with ``--device cpu``) through Lightning's
``Trainer`` and :class:`~lightning_par.HybridParallelStrategy`, on a small GPT (tied embedding and head,
no biases). Each part returns a JSON-able dict and appends what went wrong to ``failures``.

Part 1, the matrix: ZeRO 0-3 x ``32-true`` / ``bf16-mixed`` / ``16-mixed`` x token-exact loss off/on,
``steps`` optimizer steps of ``accum`` micro-batches each (masked targets: micro-batches hold different
numbers of valid tokens, so token-exact normalisation changes the gradients), global-norm clipping that
bites; SGD with momentum (linear in the gradients, see :func:`tolerance`), and at ``32-true`` also
AdamW (fused on CUDA: the sharded optimizer keeps ``fused=True``), stages 0-3. ``16-mixed`` is our
``ParallelPrecision`` plugin with ``init_scale`` 2^7 (on a CPU Lightning turns the string into bf16; a
fixed, low start scale also keeps every stage from skipping a different first step). References:
Lightning's own single-device Trainer with the same module (SGD at ``32-true`` and ``bf16-mixed``;
token-exact: a loss divided by the window's known token count).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_par import HybridParallelStrategy
from lightning_par.loss import token_loss_sum
from lightning_par.models import GPTModule
from lightning_par.models.lit_gpt import IGNORE_INDEX
from lightning_par.precision import ParallelPrecision

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
UNIT = {"bf16-mixed": 2.0**-8, "16-mixed": 2.0**-11}  # unit round-off of the compute dtype
FP32_TOL = 1e-6
SAME_NUMERICS = 8.0  # x u U: stages 1-3 among themselves, stage 0 against Lightning's own autocast
CROSS_NUMERICS = 16.0  # x u U: stage 0 (fp32 weights under autocast) against 16-bit weights + masters
FP16_INIT_SCALE = 2.0**7
CLIP = 0.5
ADAMW_LR = 1e-3
ADAMW_FRACTION = 0.01  # x lr x steps: the AdamW rows' tolerance (see tolerance())
SEED = 13
Fail = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class Model:
    vocab: int
    seq: int
    n_layer: int
    n_head: int
    n_embd: int

    def kwargs(self) -> dict[str, Any]:
        return dict(
            vocab_size=self.vocab,
            block_size=self.seq,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            bias=False,
        )


@dataclasses.dataclass(frozen=True)
class Sizes:
    model: Model
    micro: int
    accum: int
    steps: int
    flash_model: Model
    flash_micro: int
    health_matmul: int


FULL = Sizes(Model(128, 64, 2, 4, 128), 8, 2, 5, Model(256, 256, 4, 12, 768), 8, 4096)
QUICK = Sizes(Model(64, 16, 1, 2, 32), 4, 2, 3, Model(64, 16, 1, 2, 32), 4, 256)


def child_env(*, deterministic: bool) -> dict[str, str]:
    """The environment of a child process: not this process' rendezvous port (its store still listens
    there); the deterministic cuBLAS workspace the driver set only where a bitwise comparison needs it
    (the throughput runs get what users run)."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE")
    }
    if not deterministic and env.pop("GPU_CHECK_SET_CUBLAS", None):
        env.pop("CUBLAS_WORKSPACE_CONFIG", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@contextlib.contextmanager
def deterministic(device: str) -> Iterator[None]:
    """CUDA kernels that give the same bits every run: the math attention backend (the fused ones
    accumulate with atomics), ``torch.use_deterministic_algorithms`` (``CUBLAS_WORKSPACE_CONFIG`` is set
    by the driver before cuBLAS starts). A no-op on the CPU."""
    if device != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(before)


class Tokens(Dataset[tuple[Tensor, Tensor]]):
    """Learnable sequences (start + stride * t mod vocab); sample i keeps 2 ... seq valid targets."""

    def __init__(self, n: int, model: Model) -> None:
        g = torch.Generator().manual_seed(5)
        start = torch.randint(0, model.vocab, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.data = (start + stride * torch.arange(model.seq + 1)) % model.vocab
        self.keep = torch.randint(2, model.seq + 1, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        y = self.data[i, 1:].clone()
        y[int(self.keep[i]) :] = IGNORE_INDEX
        return self.data[i, :-1], y


class CheckGPT(GPTModule):
    """The package's GPT with a chosen optimizer and loss. ``token``: the strategy's token-exact loss;
    ``window_tokens``: Lightning's reference for it (each micro-batch's summed loss over the valid
    tokens of its whole window, times ``accum`` since Lightning divides by it)."""

    def __init__(
        self, *, token: bool, optimizer: str, fused: bool, window_tokens: list[int] | None = None, **kw: Any
    ) -> None:
        super().__init__(**kw)
        self.token, self.optimizer_name, self.fused = token, optimizer, fused
        self.window_tokens = window_tokens
        self.window: list[tuple[float, int]] = []  # (loss sum, tokens) of this window's micro-batches
        self.built_on_meta: bool | None = None

    def configure_model(self) -> None:
        fresh = self.model is None
        super().configure_model()
        if fresh:
            self.built_on_meta = all(p.is_meta for p in self.gpt.parameters())

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adamw":
            fused = {"fused": True} if self.fused else {}
            return torch.optim.AdamW(self.parameters(), lr=ADAMW_LR, eps=1e-6, weight_decay=0.01, **fused)
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss_sum, n = token_loss_sum(self(x), y, ignore_index=IGNORE_INDEX)
        self.window.append((float(loss_sum.detach()), int(n)))
        accum = self.trainer.accumulate_grad_batches
        if self.window_tokens is not None:
            return loss_sum * accum / self.window_tokens[batch_idx // accum]
        if self.token:
            return self.trainer.strategy.token_normalized(loss_sum, n)  # type: ignore[attr-defined]
        return loss_sum / n


class Recorder(pl.Callback):
    """Per optimizer step: the window's token-mean loss, the clip norm, skipped or not; the final
    weights (consolidated from the shards) at the end."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.skipped: list[bool] = []
        self.final: dict[str, Tensor] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if (args[-1] + 1) % trainer.accumulate_grad_batches:
            return
        window = module.window  # type: ignore[attr-defined]
        self.losses.append(sum(s for s, _ in window) / max(sum(n for _, n in window), 1))
        window.clear()
        plugin = trainer.strategy.precision_plugin
        norm = getattr(plugin, "last_grad_norm", None)
        self.norms.append(float(norm) if norm is not None else math.nan)
        self.skipped.append(bool(getattr(plugin, "last_step_skipped", False)))

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if isinstance(trainer.strategy, HybridParallelStrategy):
            self.final = trainer.strategy.consolidated_state_dict()
        else:
            self.final = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def trainer(
    device: str,
    strategy: Any,
    precision: str,
    steps: int,
    accum: int,
    callbacks: list[pl.Callback],
    **kw: Any,
) -> pl.Trainer:
    if precision == "16-mixed":
        kw["plugins"] = [ParallelPrecision("16-mixed", loss_scale={"init_scale": FP16_INIT_SCALE})]
    else:
        kw["precision"] = precision
    kw.setdefault("limit_val_batches", 0)  # no validation unless a part asks for it
    return pl.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        strategy=strategy,
        max_steps=steps,
        accumulate_grad_batches=accum,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        callbacks=callbacks,
        **kw,
    )


def module(
    sizes: Sizes, device: str, *, token: bool, optimizer: str, build: bool = True, **kw: Any
) -> CheckGPT:
    pl.seed_everything(SEED, verbose=False)
    m = CheckGPT(
        token=token,
        optimizer=optimizer,
        fused=device == "cuda",
        **sizes.model.kwargs(),
        max_steps=sizes.steps,
        **kw,
    )
    if build:
        m.configure_model()
    return m


def loader(sizes: Sizes) -> DataLoader[Any]:
    data = Tokens(sizes.micro * sizes.accum * sizes.steps, sizes.model)
    return DataLoader(data, batch_size=sizes.micro, shuffle=False)


def window_tokens(sizes: Sizes) -> list[int]:
    keep = Tokens(sizes.micro * sizes.accum * sizes.steps, sizes.model).keep  # valid targets per sample
    return [int(w.sum()) for w in keep.view(sizes.steps, -1)]


def max_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].is_floating_point())


def tolerance(
    precision: str, factor: float, start: dict[str, Tensor], end: dict[str, Tensor], adamw_steps: int = 0
) -> float:
    """Absolute tolerance for two runs' final weights.

    SGD with momentum (every row but the AdamW ones) is linear in the gradients, so rounding differences
    of a few ``u`` (relative) in each step's gradient move the weights by a few ``u U``, ``U =
    max|W_T - W_0|`` the total update. ``32-true``: 1e-6 (the package's own: the order of sums moves
    the last bits; at world size 1 the stages give the same bits). 16-bit: ``factor * u * U``, ``u`` the
    unit round-off (2^-8 bf16, 2^-11 fp16): ``SAME_NUMERICS`` (8, the package's own matrix tolerance)
    where both runs compute the same way; ``CROSS_NUMERICS`` (16) for stage 0 against stages 1-3: stage 0
    keeps fp32 weights under autocast, so its embedding output and residual stream stay fp32 and its
    LayerNorm weights unrounded, while stages 1-3 compute from 16-bit copies of the masters and round the
    residual stream at every add - more rounding sites than a reordered sum (measured on CPU: 0.5 to 1.2
    u U). A lost scaling, a stale master or a missed gradient moves the weights by about ``U`` itself,
    2^8 / 16 = 16x (bf16) to 2^11 / 16 = 128x (fp16) above the tolerance.

    AdamW (``32-true`` only, stages 0-3): where a gradient element is as small as its rounding noise (a
    cancellation), the update ``lr g / (|g| + eps)`` follows the noise, by up to ``lr * noise / eps``
    per step whatever ``U`` is: Lightning's token-exact reference (the loss scaled before backward, not
    the gradients after) differed from stage 0 by 9e-7 after 5 steps on the CPU even with ``eps=1e-6``.
    So AdamW rows get ``ADAMW_FRACTION * lr * steps`` (5e-5 on the GPU sizes): 50x that noise, and 100x
    below what a bug moves (``lr`` per element per step). On CUDA the ``32-true`` runs use
    deterministic kernels (:func:`deterministic`), so identical arithmetic gives identical bits."""
    if adamw_steps:
        return ADAMW_FRACTION * ADAMW_LR * adamw_steps
    if precision == "32-true":
        return FP32_TOL
    return factor * UNIT[precision] * max_diff(end, start)


def fit(
    sizes: Sizes,
    device: str,
    stage: int | None,
    precision: str,
    token: bool,
    optimizer: str,
    root: str,
    *,
    strategy_kw: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One run: ``stage`` None is Lightning's own single-device strategy (the reference); ``strategy_kw``
    adds keywords of our strategy (compression, gather dtype)."""
    ref_tokens = window_tokens(sizes) if stage is None and token else None
    m = module(
        sizes, device, token=token and stage is not None, optimizer=optimizer, window_tokens=ref_tokens
    )
    rec = Recorder()
    kw = {"zero_stage": stage, "meta_init": False, **(strategy_kw or {})}
    strategy: Any = "auto" if stage is None else HybridParallelStrategy(**kw)
    t = trainer(
        device,
        strategy,
        precision,
        sizes.steps,
        sizes.accum,
        [rec],
        gradient_clip_val=CLIP,
        default_root_dir=root,
    )
    start = time.perf_counter()
    with deterministic(device) if precision == "32-true" else contextlib.nullcontext():
        t.fit(m, loader(sizes))
    fused = [g.get("fused") for opt in t.optimizers for g in opt.param_groups]
    return {
        "losses": rec.losses,
        "norms": rec.norms,
        "skipped": rec.skipped,
        "final": rec.final,
        "seconds": time.perf_counter() - start,
        "optimizer": f"{type(t.optimizers[0]).__name__}{' fused' if any(fused) else ''}",
        "plugin": type(t.strategy.precision_plugin).__name__,
    }


def initial_state(sizes: Sizes, device: str) -> dict[str, Tensor]:
    m = module(sizes, device, token=False, optimizer="sgd")
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def variants() -> list[tuple[str, bool, str]]:
    """(precision, token-exact, optimizer): every precision x token off/on with SGD, and AdamW (fused on
    CUDA, as in the throughput part) at 32-true."""
    return [(p, t, "sgd") for p in PRECISIONS for t in (False, True)] + [("32-true", False, "adamw")]


def part_matrix(
    sizes: Sizes, device: str, root: str, fail: Fail, log: Callable[[str], None]
) -> dict[str, Any]:
    start_w = initial_state(sizes, device)
    rows: dict[str, Any] = {}
    stage0_fp32: dict[bool, dict[str, Tensor]] = {}
    for precision, token, optimizer in variants():
        suffix = f"{precision}{'-token' if token else ''}{'-adamw' if optimizer == 'adamw' else ''}"
        runs: dict[Any, dict[str, Any]] = {}
        for stage in (0, 1, 2, 3, None):
            if stage is None and (precision == "16-mixed" or optimizer == "adamw"):
                continue  # Lightning's fp16 GradScaler starts elsewhere and skips other steps
            runs[stage] = r = fit(sizes, device, stage, precision, token, optimizer, root)
            name = f"{'lightning' if stage is None else f'zero{stage}'}-{suffix}"
            log(f"  {name}: losses {[round(x, 4) for x in r['losses']]} ({r['seconds']:.1f} s)")
            if not all(math.isfinite(x) for x in r["losses"]):
                fail(f"matrix {name}: non-finite loss {r['losses']}")
        base, masters = runs[0], runs[1]
        if precision == "32-true" and optimizer == "sgd":
            stage0_fp32[token] = base["final"]
        adamw = sizes.steps if optimizer == "adamw" else 0
        tol0 = tolerance(precision, CROSS_NUMERICS, start_w, base["final"], adamw)
        tol1 = tolerance(precision, SAME_NUMERICS, start_w, masters["final"], adamw)
        for stage, r in runs.items():
            name = f"{'lightning' if stage is None else f'zero{stage}'}-{suffix}"
            row: dict[str, Any] = {k: r[k] for k in ("losses", "norms", "skipped", "seconds", "optimizer")}
            row.update(final_loss=r["losses"][-1], plugin=r["plugin"], precision=precision)
            if stage is None:  # Lightning computes as our stage 0 does: fp32 weights (under autocast)
                tol = tolerance(precision, SAME_NUMERICS, start_w, base["final"])
                row.update(max_dw_vs_stage0=max_diff(r["final"], base["final"]), tol_vs_stage0=tol)
            elif stage > 0:
                row.update(max_dw_vs_stage0=max_diff(r["final"], base["final"]), tol_vs_stage0=tol0)
                if stage > 1:
                    row.update(max_dw_vs_stage1=max_diff(r["final"], masters["final"]), tol_vs_stage1=tol1)
            else:
                row.update(max_dw_vs_stage0=0.0, tol_vs_stage0=tol0)
            for ref in ("stage0", "stage1"):
                if f"max_dw_vs_{ref}" in row and row[f"max_dw_vs_{ref}"] > row[f"tol_vs_{ref}"]:
                    fail(
                        f"matrix {name}: max|dW| vs {ref} {row[f'max_dw_vs_{ref}']:.3g}"
                        f" > tolerance {row[f'tol_vs_{ref}']:.3g}"
                    )
            if r["skipped"] != base["skipped"]:
                fail(f"matrix {name}: skipped steps {r['skipped']} != stage 0's {base['skipped']}")
            if all(r["skipped"]):
                fail(f"matrix {name}: every step was skipped")
            if stage is not None and r["plugin"] != "ParallelPrecision":
                fail(f"matrix {name}: precision plugin {r['plugin']}, expected ParallelPrecision")
            if device == "cuda" and optimizer == "adamw" and r["optimizer"] != "AdamW fused":
                fail(f"matrix {name}: optimizer {r['optimizer']}, expected fused AdamW")
            rows[name] = row
    effect = max_diff(stage0_fp32[True], stage0_fp32[False])
    if not effect > 100 * FP32_TOL:
        fail(f"matrix: token-exact loss changed the 32-true weights by only {effect:.3g} (expected > 1e-4)")
    worst = {
        p: max(r["max_dw_vs_stage0"] / r["tol_vs_stage0"] for r in rows.values() if r["precision"] == p)
        for p in PRECISIONS
    }
    return {"combinations": rows, "token_effect_32_true": effect, "worst_fraction_of_tolerance": worst}
