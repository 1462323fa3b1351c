"""Hugging Face's ``GPT2LMHeadModel`` cut into pipeline layers, for the pipeline benchmarks: a model we did
not write, whose blocks hold ``Conv1D`` layers (weights stored ``(in, out)``) instead of ``nn.Linear``.

``transformers`` is a test dependency: it is imported when the model is built, not with this module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


class _Embed(nn.Module):
    """Token plus position embeddings, as ``GPT2Model.forward`` adds them (dropout off)."""

    def __init__(self, wte: nn.Module, wpe: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, ids: Tensor) -> Tensor:
        return self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))


class _Block(nn.Module):
    """One ``GPT2Block`` on hidden states (causal through SDPA, no mask)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden: Tensor) -> Tensor:
        out = self.block(hidden)
        return out[0] if isinstance(out, tuple) else out


class _Head(nn.Module):
    def __init__(self, ln_f: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(hidden))


class HFGPT2(nn.Module):
    """``GPT2LMHeadModel`` (token table tied to the LM head, dropout off) with the benchmark GPT's
    interface: ``layers()`` for ``apply_pipeline``, ``forward(ids) -> logits`` through the model's own
    ``forward`` (the unpipelined reference), ``num_parameters()`` (the tied table once)."""

    def __init__(self, *, vocab: int, seq: int, n_layer: int, n_head: int, n_embd: int) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        options: dict[str, Any] = dict(
            vocab_size=vocab, n_positions=seq, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
            bos_token_id=0, eos_token_id=0, attn_implementation="sdpa",
        )  # fmt: skip
        config = GPT2Config(**options)
        self.model = GPT2LMHeadModel(config)
        t = self.model.transformer
        # plain list: the wrappers are views of the model's modules, not submodules of this one
        self._layers: list[nn.Module] = [
            _Embed(t.wte, t.wpe), *(_Block(b) for b in t.h), _Head(t.ln_f, self.model.lm_head)
        ]  # fmt: skip

    def layers(self) -> list[nn.Module]:
        return self._layers

    def forward(self, ids: Tensor) -> Any:
        return self.model(ids).logits

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
