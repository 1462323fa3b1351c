"""Hugging Face's ``GPT2LMHeadModel`` for the pipeline benchmarks: a model we did not write, whose blocks
hold ``Conv1D`` layers (weights stored ``(in, out)``) instead of ``nn.Linear``, cut into pipeline layers by
:func:`lightning_par.pipeline.hf_pipeline_layers`.

``transformers`` is a test dependency: it is imported when the model is built, not with this module.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from lightning_par.pipeline import hf_pipeline_layers


class HFGPT2(nn.Module):
    """``GPT2LMHeadModel`` (token table tied to the LM head, dropout off, sdpa attention) with the benchmark
    GPT's interface: ``layers()`` for ``apply_pipeline``, ``forward(ids) -> logits`` through the model's
    own ``forward`` (the unpipelined reference), ``num_parameters()`` (the tied table once)."""

    def __init__(self, *, vocab: int, seq: int, n_layer: int, n_head: int, n_embd: int) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        options: dict[str, Any] = dict(
            vocab_size=vocab, n_positions=seq, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
            bos_token_id=0, eos_token_id=0, attn_implementation="sdpa",
        )  # fmt: skip
        self.model = GPT2LMHeadModel(GPT2Config(**options))
        # plain list: the pieces are views of the model's modules, not submodules of this one
        self._layers = hf_pipeline_layers(self.model)

    def layers(self) -> list[nn.Module]:
        return self._layers

    def forward(self, ids: Tensor) -> Any:
        return self.model(ids).logits

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
