"""Token-exact gradient accumulation with unevenly masked micro-batches (the late-2024 accumulation bug)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_par.loss import TokenNormalizer, token_loss_sum
from lightning_par.models import GPTModule
from tests.distributed import run_distributed

SEED = 11
WORLD, MICRO, ACCUM = 2, 2, 2
N = WORLD * MICRO * ACCUM  # samples in the first optimizer step
LR = 0.5
KW: dict[str, Any] = dict(
    vocab_size=32, block_size=12, n_layer=1, n_head=2, n_embd=16, bias=False, max_steps=1
)


class Masked(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample i keeps a very different number of valid targets (1 ... 12); the rest is ignore_index."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.data = torch.randint(0, 32, (N, 13), generator=g)
        self.valid = [1, 12, 2, 11, 3, 1, 12, 6][:N]

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.data[i, 1:].clone()
        y[self.valid[i] :] = -100
        return self.data[i, :-1], y


class TokenGPT(GPTModule):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss_sum, n = token_loss_sum(self(batch[0]), batch[1])
        return self.trainer.strategy.token_normalized(loss_sum, n)  # type: ignore[attr-defined]


def _module() -> TokenGPT:
    pl.seed_everything(SEED)
    m = TokenGPT(**KW)
    m.configure_model()
    return m


def _run(rank: int, world: int, tmp: str) -> dict[str, Any]:
    out = {}
    for name in ("zero0", "zero2"):
        module = _module()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=name,
            max_steps=1,
            accumulate_grad_batches=ACCUM,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            default_root_dir=tmp,
        )
        trainer.fit(module, DataLoader(Masked(), batch_size=MICRO, shuffle=True))
        out[name] = {k: v.clone() for k, v in module.state_dict().items()}
    return out


def test_token_normalized_accumulation_equals_global_token_mean(tmp_path: Path) -> None:
    results = run_distributed(_run, WORLD, str(tmp_path), init_group=False)
    # the single optimizer step consumes every sample exactly once, over both ranks and micro-batches
    ds = Masked()
    x = torch.stack([ds[i][0] for i in range(N)])
    y = torch.stack([ds[i][1] for i in range(N)])

    def grads(loss_fn: Any) -> dict[str, torch.Tensor]:
        module = _module()
        module.zero_grad()
        loss_fn(module).backward()
        return {n: p.grad.clone() for n, p in module.named_parameters()}  # type: ignore[union-attr]

    def exact(m: TokenGPT) -> torch.Tensor:
        s, n = token_loss_sum(m(x), y)
        return s / n

    def mean_of_means(m: TokenGPT) -> torch.Tensor:  # what per-micro-batch mean losses compute
        parts = [token_loss_sum(m(x[i : i + MICRO]), y[i : i + MICRO]) for i in range(0, N, MICRO)]
        return sum(s / n for s, n in parts) / len(parts)  # type: ignore[return-value]

    g_exact, g_naive = grads(exact), grads(mean_of_means)
    start = _module().state_dict()
    names = dict(_module().named_parameters())
    assert any((g_exact[n] - g_naive[n]).abs().max() > 1e-3 for n in g_exact), "the case must be non-trivial"
    for strategy in ("zero0", "zero2"):
        for rank, r in enumerate(results):
            for n in names:
                expected = start[n] - LR * g_exact[n]
                torch.testing.assert_close(r[strategy][n], expected, msg=f"{strategy} rank {rank} {n}")


def test_token_normalizer_all_masked_step_keeps_a_zero_gradient() -> None:
    """No valid token anywhere: the summed loss has a zero gradient, and the factor (computed on the device,
    with no host read) stays finite, so the gradient stays zero instead of becoming NaN."""
    norm = TokenNormalizer(group=None)
    logits = torch.randn(2, 3, 5, requires_grad=True)
    s, n = token_loss_sum(logits, torch.full((2, 3), -100))
    norm.add(n)
    norm.add(0)
    s.backward()
    factor = norm.grad_scale(loss_scale=1.0, dp_size=1)
    assert logits.grad is not None and bool(torch.isfinite(factor))
    assert torch.equal(logits.grad * factor, torch.zeros_like(logits))
    norm.add(torch.tensor(6))
    norm.add(2)
    assert float(norm.grad_scale(loss_scale=0.5, dp_size=2)) == 2 / (0.5 * 8)
