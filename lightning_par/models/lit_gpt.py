"""Lightning wrapper around :class:`~lightning_par.models.gpt.GPT` for next-token language modelling.

Batches are ``(x, y)`` pairs of int64 tensors of shape (B, T) where ``y`` is ``x`` shifted by one token.
The module implements the pipeline protocol (``pipeline_layers``/``pipeline_input``/``pipeline_loss``)
so the hybrid strategy can split it into stages without model-specific code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.text import Perplexity

from lightning_par.models.gpt import GPT, GPTConfig

__all__ = ["GPTModule", "warmup_cosine"]

# Targets equal to this are masked out of both the loss and the perplexity (F.cross_entropy's default).
IGNORE_INDEX = -100


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Learning-rate multiplier at optimizer step ``step`` (0-based).

    Linear warmup ``(step + 1) / warmup_steps`` for ``step < warmup_steps`` (so the first step already
    trains), then cosine decay from 1 at ``step = warmup_steps`` to ``min_ratio`` at ``step = total_steps``::

        progress = (step - warmup_steps) / (total_steps - warmup_steps)
        ratio = min_ratio + (1 - min_ratio) * (1 + cos(pi * progress)) / 2

    Steps past ``total_steps`` stay at ``min_ratio``.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / decay_steps, 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy over unmasked positions; logits (B, T, V), targets (B, T)."""
    # fp32 log-softmax: under bf16-true/16-true the logits are low precision and the loss must not be.
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)


class GPTModule(pl.LightningModule):
    """Next-token training of a :class:`GPT` with AdamW and a warmup-cosine schedule.

    The network is built in :meth:`configure_model` (not ``__init__``) so that strategies can create it
    under a meta-device or sharded context; :attr:`gpt` is the built network. Its :attr:`tp_plan` is the
    shipped ``"gpt"`` plan, which a strategy with ``tensor_parallel_size > 1`` and no ``tp_plan`` of its
    own applies.
    """

    tp_plan = "gpt"

    def __init__(
        self,
        *,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
        tie_weights: bool = True,
        learning_rate: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
        max_steps: int | None = None,
    ) -> None:
        super().__init__()
        if learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {learning_rate}.")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}.")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}.")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}.")
        if max_steps is not None and max_steps <= 0:
            raise ValueError(f"max_steps must be a positive integer or None, got {max_steps}.")
        self.save_hyperparameters()
        self.config = GPTConfig(
            vocab_size=vocab_size,
            block_size=block_size,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            dropout=dropout,
            bias=bias,
            tie_weights=tie_weights,
        )
        self.learning_rate = learning_rate
        self.weight_decay = weight_decay
        self.betas = betas
        self.warmup_steps = warmup_steps
        self.min_lr_ratio = min_lr_ratio
        self.max_steps = max_steps
        self.model: GPT | None = None
        # Metric objects (not tensors) are logged so Lightning syncs their state across ranks.
        self.val_ppl = Perplexity(ignore_index=IGNORE_INDEX)
        self.test_ppl = Perplexity(ignore_index=IGNORE_INDEX)

    def configure_model(self) -> None:
        """Build the network once; later calls (e.g. after a strategy already built it) are no-ops."""
        if self.model is None:
            self.model = GPT(self.config)

    @property
    def gpt(self) -> GPT:
        """The built :class:`GPT`; raises if :meth:`configure_model` has not run yet."""
        if self.model is None:
            raise RuntimeError(
                "GPTModule.model is not built yet: call `module.configure_model()` first "
                "(the Trainer does this in fit/validate/test/predict)."
            )
        return self.model

    def forward(self, idx: Tensor) -> Tensor:
        """Token ids (B, T) -> logits (B, T, vocab_size)."""
        return self.gpt(idx)

    # --- pipeline protocol -------------------------------------------------------------------------------

    def pipeline_layers(self) -> list[nn.Module]:
        """``[embed, *blocks, head]``; running them in order equals :meth:`forward`."""
        return self.gpt.layers()

    def pipeline_input(self, batch: Sequence[Tensor]) -> Tensor:
        """The first stage's input: the token ids ``x`` of an ``(x, y)`` batch."""
        return batch[0]

    def pipeline_loss(self, output: Tensor, batch: Sequence[Tensor]) -> Tensor:
        """Mean cross-entropy of the last stage's logits ``output`` against the targets ``batch[1]``."""
        return _lm_loss(output, batch[1])

    # --- steps -------------------------------------------------------------------------------------------

    def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor:
        logits = self(self.pipeline_input(batch))
        loss = self.pipeline_loss(logits, batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor:
        return self._eval_step(batch, stage="val", metric=self.val_ppl)

    def test_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor:
        return self._eval_step(batch, stage="test", metric=self.test_ppl)

    def predict_step(self, batch: Sequence[Tensor] | Tensor, batch_idx: int) -> Tensor:
        """Logits for the token ids of ``batch`` (an ``(x, y)`` pair or a bare (B, T) tensor)."""
        idx = batch if isinstance(batch, Tensor) else self.pipeline_input(batch)
        return self(idx)

    def pipeline_predict(self, output: Tensor, batch: Any) -> Tensor:
        """Under pipeline parallelism, what :meth:`predict_step` returns: the logits (the last layer's
        output)."""
        return output

    def _eval_step(self, batch: Sequence[Tensor], *, stage: str, metric: Perplexity) -> Tensor:
        logits = self(self.pipeline_input(batch))
        loss = self.pipeline_loss(logits, batch)
        self.log(f"{stage}_loss", loss, sync_dist=True)
        metric.update(logits.float(), batch[1])
        self.log(f"{stage}_ppl", metric, prog_bar=True)
        return loss

    # --- optimisation ------------------------------------------------------------------------------------

    def configure_optimizers(self) -> Any:
        """AdamW with weight decay on matrices/embeddings only, and a per-step warmup-cosine schedule.

        Decay group: parameters with ``dim >= 2``; no-decay group: biases and LayerNorm (``dim < 2``).
        ``named_parameters`` yields a tied weight once, so no parameter lands in two groups.
        """
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        for _, param in self.named_parameters():
            if param.requires_grad:
                (decay if param.dim() >= 2 else no_decay).append(param)
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.learning_rate,
            betas=self.betas,
        )
        lr_lambda = partial(
            warmup_cosine,
            warmup_steps=self.warmup_steps,
            total_steps=self._total_steps(),
            min_ratio=self.min_lr_ratio,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _total_steps(self) -> int:
        if self.max_steps is not None:
            return self.max_steps
        estimated = self.trainer.estimated_stepping_batches
        if not math.isfinite(estimated) or estimated <= 0:
            raise ValueError(
                f"Cannot size the LR schedule: trainer.estimated_stepping_batches is {estimated}. "
                "Pass GPTModule(max_steps=...) or give the Trainer a finite max_steps/max_epochs."
            )
        return int(estimated)
