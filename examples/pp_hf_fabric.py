"""Fine-tune a Hugging Face causal LM under pipeline parallelism in a Lightning Fabric loop.

    python examples/pp_hf_fabric.py --steps 6 --schedule zb --padding left

An ordinary ``LlamaForCausalLM`` (a small config: nothing is downloaded) goes to ``fabric.setup`` as it
is; the strategy cuts it with ``pipeline_layers=hf_pipeline_layers`` over 2 stages. Each optimizer step
accumulates 2 pipeline steps (``fabric.no_backward_sync``), each a call to
``strategy.pipeline.step(batch, loss_fn=...)`` with the model's own shifted loss in the token-exact form
(``hf_causal_lm_loss``); clipping and ``optimizer.step()`` are the loop's, as in any Fabric loop. The
dict batches of a collator (``input_ids``, ``attention_mask``, ``labels``; right, ``--padding left``, or
``--padding packed`` rows with ``position_ids``) enter the first stage as they are. With ``--check``,
rank 0 then trains the same model in this process on ``model(**batch).loss`` over the same batches and
prints the largest weight difference.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the dataset and model of the Trainer example
from pp_hf_finetune import LR, SEED, Padded, build

from lightning_par.fabric import HybridParallelStrategy
from lightning_par.pipeline import hf_causal_lm_loss, hf_pipeline_layers

ACCUMULATE, MAX_NORM = 2, 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zb"])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--padding", default="right", choices=["right", "left", "packed"])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()

    strategy = HybridParallelStrategy(
        pipeline_parallel_size=2,
        num_microbatches=4,
        pipeline_schedule=args.schedule,
        pipeline_layers=hf_pipeline_layers,
    )
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(SEED)
    data = Padded(args.steps * ACCUMULATE * args.batch_size, args.padding)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=args.batch_size))
    model = build()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))

    def loss_fn(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return hf_causal_lm_loss(logits, batch["labels"])  # on the last stage

    loss = torch.zeros(())
    for i, batch in enumerate(loader):
        with fabric.no_backward_sync(model, enabled=(i + 1) % ACCUMULATE != 0):
            result = strategy.pipeline.step(batch, loss_fn=loss_fn)
        loss = result["loss"] if isinstance(result, dict) else result
        if (i + 1) % ACCUMULATE == 0:
            fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()
    state = strategy.consolidated_state_dict()  # every stage's weights, on rank 0
    if fabric.global_rank != 0:
        return
    print(f"trained {args.steps} steps, last loss={float(loss):.4f}")
    if args.check:
        reference = build()
        opt = torch.optim.SGD(reference.parameters(), lr=LR)
        # the loader's order (Fabric's sampler over one data-parallel replica keeps the dataset's order)
        for window in DataLoader(data, batch_size=ACCUMULATE * args.batch_size):
            reference(**window, use_cache=False).loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
            opt.step()
            opt.zero_grad()
        diff = max(float((state[n] - p.detach()).abs().max()) for n, p in reference.named_parameters())
        print(f"max |W_pp - W_one_process| = {diff:.2e}")


if __name__ == "__main__":
    main()
