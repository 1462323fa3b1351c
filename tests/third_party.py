"""Models this package did not write, wrapped as LightningModules the way users wrap them: Hugging Face
GPT-2 and Llama, the Llama with a PEFT LoRA adapter, a Hugging Face ResNet (BatchNorm), and helpers to
replay Lightning's distributed data order in a single-process reference."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset, DistributedSampler

from tests.test_strategy import LossRecorder

__all__ = [
    "GPT2",
    "LLAMA",
    "LORA_TARGETS",
    "T5",
    "LoraLlama",
    "LossRecorder",
    "Tokens",
    "add_lora",
    "checkpoint_layers",
    "gpt2",
    "hf_model",
    "llama",
    "replay_order",
]

LLAMA: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    attn_implementation="eager",
)
LORA_TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


def hf_model(model_class: str, config_class: str, *, seed: int = 0, **options: Any) -> torch.nn.Module:
    """``transformers.<model_class>(transformers.<config_class>(**options))``, seeded."""
    import transformers

    torch.manual_seed(seed)
    return getattr(transformers, model_class)(getattr(transformers, config_class)(**options))


def llama(seed: int = 0) -> torch.nn.Module:
    return hf_model("LlamaForCausalLM", "LlamaConfig", seed=seed, **LLAMA)


GPT2: dict[str, Any] = dict(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4)


def gpt2(seed: int = 0) -> torch.nn.Module:
    """Hugging Face's GPT-2: a tied table, ``Conv1D`` layers, residual projections initialised smaller."""
    return hf_model("GPT2LMHeadModel", "GPT2Config", seed=seed, **GPT2)


T5: dict[str, Any] = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=64)  # its model sets the shared table


def add_lora(
    model: torch.nn.Module, *, seed: int = 1, modules_to_save: list[str] | None = None
) -> torch.nn.Module:
    """PEFT LoRA on the attention and MLP projections, with B made non-zero so the adapters matter from
    the first step (PEFT starts B at zero); ``modules_to_save``: layers trained as whole copies."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=LORA_TARGETS, lora_dropout=0.0, modules_to_save=modules_to_save
    )
    peft_model = get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name and not p.is_meta:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return peft_model


def checkpoint_layers(model: Any, *, reentrant: bool) -> None:
    """Hugging Face's activation checkpointing of every decoder layer, as a user turns it on: each layer's
    forward runs again inside the backward. The reentrant form (transformers 4's default) runs each
    layer's backward as a nested pass and, under a frozen embedding, needs inputs that require grad
    (``enable_input_require_grads``, Hugging Face's advice)."""
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers 5's name
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.enable_input_require_grads()


class LoraLlama(pl.LightningModule):
    """A user's fine-tuning module: ``AdamW(self.parameters())`` over a model whose base is frozen."""

    def __init__(
        self, lr: float = 1e-2, lora: bool = True, seed: int = 0, checkpointing: bool = False
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        model = llama(self.hparams["seed"])
        if self.hparams["checkpointing"]:
            checkpoint_layers(model, reentrant=True)
        self.model = add_lora(model) if self.hparams["lora"] else model

    def forward(self, ids: Tensor) -> Tensor:
        assert self.model is not None
        return self.model(input_ids=ids, use_cache=False).logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])


class Tokens(Dataset[tuple[Tensor, Tensor]]):
    def __init__(self, n: int, length: int = 16, vocab: int = 64, seed: int = 123) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab, (n, length + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


def replay_order(n: int, *, dp: int, micro: int, epochs: int, seed: int) -> list[list[int]]:
    """The global micro-batches Lightning's DistributedSampler gives ``dp`` ranks (rank 0's k-th batch,
    then rank 1's, ...), for a single-process reference with batch size ``dp * micro``."""
    batches: list[list[int]] = []
    for epoch in range(epochs):
        per_rank = []
        for r in range(dp):
            sampler = DistributedSampler(range(n), num_replicas=dp, rank=r, shuffle=True, seed=seed)  # type: ignore[arg-type]
            sampler.set_epoch(epoch)
            per_rank.append(list(sampler))
        for k in range(len(per_rank[0]) // micro):
            batches.append([i for r in range(dp) for i in per_rank[r][k * micro : (k + 1) * micro]])
    return batches
