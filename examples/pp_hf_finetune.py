"""Fine-tune a Hugging Face causal LM under pipeline parallelism, launched by Lightning itself.

    python examples/pp_hf_finetune.py --steps 6 --schedule zb --padding left

The LightningModule holds an ordinary ``LlamaForCausalLM`` (built from a small config: nothing is
downloaded) and gives the pipeline protocol in three lines: ``hf_pipeline_layers`` cuts the model into
embedding, blocks and head, ``hf_causal_lm_loss`` is the model's own shifted loss in the token-exact form,
and the dict batches of a collator (``input_ids``, ``attention_mask``, ``labels`` with ``-100`` on the
padding, right or ``--padding left``; or ``--padding packed`` rows with ``position_ids``) need no
``pipeline_input``: the mask and the positions reach every block. Its ``training_step`` (the model's own
loss) is what runs without pipeline parallelism. With ``--check``, rank 0 then trains the same model in this
process on ``model(**batch).loss`` over the same batches and prints the largest weight difference.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_par import HybridParallelStrategy
from lightning_par.pipeline import hf_causal_lm_loss, hf_pipeline_layers

VOCAB, LENGTH, LR, SEED = 128, 24, 0.2, 3
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=LENGTH, attn_implementation="sdpa",
)  # fmt: skip


class Padded(Dataset[dict[str, Tensor]]):
    """Token sequences of 4 to ``LENGTH`` tokens as a collator would hand them over: padded on the right
    or on the left (``padding_side`` of the tokenizer), or packed: two documents per row, no padding,
    ``position_ids`` restarting at the second and ``-100`` at each document's first token."""

    def __init__(self, n: int, padding: str = "right") -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
        self.lengths = torch.randint(4, LENGTH + 1, (n,), generator=g)
        self.padding = padding

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        valid = int(self.lengths[i])
        if self.padding == "packed":
            ids, where = self.ids[i].clone(), torch.arange(LENGTH)
            positions = torch.where(where < valid, where, where - valid)
            return {
                "input_ids": ids,
                "position_ids": positions,
                "labels": ids.masked_fill(positions == 0, -100),
            }
        ids, mask = self.ids[i].clone(), (torch.arange(LENGTH) < valid).long()
        ids[valid:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        shift = LENGTH - valid if self.padding == "left" else 0
        return {
            "input_ids": ids.roll(shift),
            "attention_mask": mask.roll(shift),
            "labels": labels.roll(shift),
        }


def build() -> LlamaForCausalLM:
    torch.manual_seed(1)
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


class Finetune(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = build()
        self._layers: list[nn.Module] = []

    def pipeline_layers(self) -> list[nn.Module]:
        self._layers = self._layers or hf_pipeline_layers(self.model)  # built once
        return self._layers

    def pipeline_loss(self, logits: Tensor, batch: dict[str, Tensor]) -> Any:
        return hf_causal_lm_loss(logits, batch["labels"])

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        # what runs without pipeline parallelism (Lightning requires it); under pp the pipeline runs the
        # protocol's methods instead
        return self.model(**batch, use_cache=False).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zb"])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--padding", default="right", choices=["right", "left", "packed"])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()

    pl.seed_everything(SEED)
    data = Padded(args.steps * args.batch_size, args.padding)
    strategy = HybridParallelStrategy(
        pipeline_parallel_size=2, num_microbatches=4, pipeline_schedule=args.schedule
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Finetune(), DataLoader(data, batch_size=args.batch_size))
    state = strategy.consolidated_state_dict()  # every stage's weights, on rank 0
    if not trainer.is_global_zero:
        return
    loss = float(trainer.callback_metrics["train_loss"])
    print(f"trained {trainer.global_step} steps, last train_loss={loss:.4f}")
    if args.check:
        model = build()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        # the same batches in the same order: Lightning's sampler shuffles training data (seed: the
        # seed_everything above)
        order = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=SEED)
        for batch in DataLoader(data, batch_size=args.batch_size, sampler=order):
            opt.zero_grad()
            model(**batch, use_cache=False).loss.backward()
            opt.step()
        pairs = [(state[f"model.{n}"], p.detach()) for n, p in model.named_parameters()]
        diff = max(float((a - b).abs().max()) for a, b in pairs)
        print(f"max |W_pp - W_one_process| = {diff:.2e}")


if __name__ == "__main__":
    main()
