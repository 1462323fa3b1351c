"""A reference GPT (decoder-only transformer) with seams for tensor and pipeline parallelism.

The module tree is part of the contract: tensor-parallel plans match these attribute names and the
pipeline runtime consumes :meth:`GPT.layers`::

    GPT
      embed:  GPTEmbedding   tok (vocab -> C), pos (block_size -> C), drop
      blocks: ModuleList[Block]
                ln_1, attn: CausalSelfAttention (q_proj, k_proj, v_proj, out_proj, resid_drop),
                ln_2, mlp:  MLP (fc_in, act, fc_out, drop)
      head:   GPTHead        norm, lm_head (C -> vocab, no bias; tied to embed.tok.weight by default)

Each block is pre-norm: ``x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))``.

Tensor-parallel seams: attention infers its *local* number of heads from the width of the q/k/v
projections, so column-sharding ``q_proj``/``k_proj``/``v_proj`` (whole heads per rank) and
row-sharding ``out_proj`` needs no change to this code; likewise ``fc_in`` (column) / ``fc_out`` (row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPT", "MLP", "Block", "CausalSelfAttention", "GPTConfig", "GPTEmbedding", "GPTHead"]

_INIT_STD = 0.02


@dataclass
class GPTConfig:
    """Shape of a :class:`GPT`.

    ``n_embd`` (C) is split into ``n_head`` heads of ``head_dim = C // n_head``; the MLP hidden width is
    ``mlp_ratio * C``. ``block_size`` is the longest sequence the position table covers.
    """

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}.")
        if self.n_embd % self.n_head != 0:
            suggestion = self.n_head * max(1, round(self.n_embd / self.n_head))
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                f"choose n_embd as a multiple of n_head (e.g. n_embd={suggestion})."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}.")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def _residual_std(config: GPTConfig) -> float:
    return _INIT_STD / math.sqrt(2 * config.n_layer)


class InitLinear(nn.Linear):
    """``nn.Linear`` whose ``reset_parameters`` is the GPT-2 law: weight ~ N(0, std), bias 0."""

    def __init__(
        self, in_features: int, out_features: int, *, bias: bool = True, std: float = _INIT_STD
    ) -> None:
        self.std = std  # read by reset_parameters, which nn.Linear.__init__ calls
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=getattr(self, "std", _INIT_STD))
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class InitEmbedding(nn.Embedding):
    """``nn.Embedding`` initialised N(0, 0.02)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=_INIT_STD)


class GPTEmbedding(nn.Module):
    """Token plus learned absolute position embedding: ``h[b, t] = tok[idx[b, t]] + pos[t]``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.block_size = config.block_size
        self.tok = InitEmbedding(config.vocab_size, config.n_embd)
        self.pos = InitEmbedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, idx: Tensor) -> Tensor:
        """``idx`` (B, T) integer token ids -> hidden states (B, T, C). Raises if T > block_size."""
        if idx.dim() != 2:
            raise ValueError(f"Expected token ids of shape (B, T), got shape {tuple(idx.shape)}.")
        seq_len = idx.size(1)
        if seq_len > self.block_size:
            raise ValueError(
                f"Sequence length {seq_len} exceeds block_size={self.block_size}; "
                f"truncate the input or build the model with block_size >= {seq_len}."
            )
        positions = torch.arange(seq_len, device=idx.device)
        return self.drop(self.tok(idx) + self.pos(positions))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q/k/v/out projections.

    ``y = out_proj(concat_h softmax(q_h k_h^T / sqrt(d) + causal_mask) v_h)``. The number of heads in
    forward is ``q_proj.out_features // head_dim``, which equals ``n_head / tp`` when the projections
    are column-sharded over ``tp`` ranks; ``out_proj`` then row-sharded gives partial sums to all-reduce.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.q_proj = InitLinear(config.n_embd, config.n_embd, bias=config.bias)
        self.k_proj = InitLinear(config.n_embd, config.n_embd, bias=config.bias)
        self.v_proj = InitLinear(config.n_embd, config.n_embd, bias=config.bias)
        self.out_proj = InitLinear(config.n_embd, config.n_embd, bias=config.bias, std=_residual_std(config))
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """(B, T, C) -> (B, T, C)."""
        batch, seq_len, _ = x.shape
        # -1 heads: the local head count follows from the (possibly sharded) projection width.
        q = self.q_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(batch, seq_len, -1)
        return self.resid_drop(self.out_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: ``fc_out(gelu_tanh(fc_in(x)))`` with hidden width ``mlp_ratio * C``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.n_embd
        self.fc_in = InitLinear(config.n_embd, hidden, bias=config.bias)
        self.act = nn.GELU(approximate="tanh")
        self.fc_out = InitLinear(hidden, config.n_embd, bias=config.bias, std=_residual_std(config))
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """(B, T, C) -> (B, T, C)."""
        return self.drop(self.fc_out(self.act(self.fc_in(x))))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        """(B, T, C) -> (B, T, C)."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPTHead(nn.Module):
    """Final LayerNorm and the vocabulary projection: hidden (B, T, C) -> logits (B, T, V)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = InitLinear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.norm(hidden))


class GPT(nn.Module):
    """Decoder-only transformer: ``head(blocks[-1](...blocks[0](embed(idx))))`` -> logits (B, T, V).

    Composing :meth:`layers` in order is exactly :meth:`forward`; the pipeline splitter relies on it.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = GPTEmbedding(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.head = GPTHead(config)
        self.tie_weights()
        self.reset_parameters()

    def tie_weights(self) -> None:
        """Share the token table with the output projection (one Parameter object) if configured.

        Public because moving a model off the meta device (``to_empty``) creates a new Parameter per
        module and silently unties them; call this again afterwards.
        """
        if self.config.tie_weights:
            self.head.lm_head.weight = self.embed.tok.weight

    def reset_parameters(self) -> None:
        """GPT-2 initialisation, deterministic under ``torch.manual_seed``.

        Each parameter-owning module initialises itself (``InitLinear``/``InitEmbedding``: N(0, std),
        biases 0; LayerNorm (1, 0)), so a model created on the meta device and materialised module by
        module (ZeRO-3) follows the same law. ``std`` is 0.02, and ``0.02 / sqrt(2 * n_layer)`` for the
        two projections that write into the residual stream (``out_proj``, ``fc_out``), so the residual
        variance stays O(1) with depth.
        """
        self.tie_weights()
        for module in self.modules():
            reset = getattr(module, "reset_parameters", None)
            if module is not self and callable(reset):
                reset()

    def layers(self) -> list[nn.Module]:
        """``[embed, *blocks, head]``: a flat sequence whose composition equals :meth:`forward`."""
        return [self.embed, *self.blocks, self.head]

    def forward(self, idx: Tensor) -> Tensor:
        """``idx`` (B, T) token ids with T <= block_size -> logits (B, T, vocab_size)."""
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        """Number of distinct parameter elements (a tied weight counts once).

        With ``exclude_embeddings`` the token and position tables are left out (the "non-embedding"
        count of scaling-law papers); a tied output projection is the token table, so it goes too.
        """
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= sum(p.numel() for p in self.embed.parameters())
        return total
