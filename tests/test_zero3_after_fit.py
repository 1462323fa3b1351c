"""ZeRO-3 after ``fit``: the model is whole on every rank, and what the user does with it then counts.

A Hugging Face Llama trained 2 steps at ZeRO-3 (2 Gloo ranks), then, as after a fit under Lightning's
``"ddp"``: the embedding read inside ``gathered_params()`` (before, refused on every rank: "parameter ...
was replaced or modified outside a forward pass", though nothing had changed), the head halved inside
``gathered_params(writeback=True)`` and the final norm shifted in place outside it; then
``consolidated_state_dict()`` and ``trainer.save_checkpoint`` (consolidated). Both equal ``"ddp"``'s model
after the same edits; before, they returned the weights as they were at the end of fit (the shards),
dropping the edits without a word. A parameter whose shape changed after fit cannot go back into its
shards: refused, naming ``torch.save(model.state_dict())``.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.checkpoint import consolidate
from tests.distributed import run_distributed
from tests.fits import cpu_trainer
from tests.test_strategy import Tokens
from tests.third_party import LoraLlama


def _job(rank: int, world: int, tmp: str, name: str) -> dict[str, Any]:
    torch.manual_seed(0)
    strategy: Any = "ddp" if name == "ddp" else HybridParallelStrategy(zero_stage=3, meta_init=False)
    module = LoraLlama(lora=False)
    trainer = cpu_trainer(strategy, devices=world, max_steps=2, limit_val_batches=0)
    trainer.fit(module, DataLoader(Tokens(16), batch_size=2))
    model = module.model
    assert model is not None
    # "ddp" has no gathered_params(): its model is whole anyway
    gathered = getattr(trainer.strategy, "gathered_params", lambda **_: nullcontext())
    with gathered():
        embed = model.get_input_embeddings().weight.detach().clone()
    with gathered(writeback=True), torch.no_grad():
        model.lm_head.weight.mul_(0.5)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    if name == "ddp":
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    else:
        state = trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]
    path = Path(tmp) / f"after_{name}"
    trainer.save_checkpoint(path)
    saved: dict[str, torch.Tensor] = {}
    if rank == 0:
        ckpt = torch.load(path, weights_only=False) if path.is_file() else consolidate(path)
        saved = ckpt["state_dict"]
    refused = ""
    if name != "ddp":
        model.resize_token_embeddings(80)  # a new embedding: its shards cannot hold it
        try:
            trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]
        except RuntimeError as exc:
            refused = str(exc)
        trainer.strategy.destroy_process_groups()  # type: ignore[attr-defined]
    return {"embed": embed, "state": state, "saved": saved, "refused": refused}


def test_edits_after_fit_reach_the_export_and_the_checkpoint_as_under_ddp(tmp_path: Path) -> None:
    ref = run_distributed(_job, 2, str(tmp_path), "ddp", init_group=False, timeout=300)
    ours = run_distributed(_job, 2, str(tmp_path), "zero3", init_group=False, timeout=300)
    want = ref[0]["state"]
    for rank in range(2):
        torch.testing.assert_close(ours[rank]["embed"], ref[rank]["embed"], msg=f"rank {rank} embedding")
    for what in ("state", "saved"):
        got = ours[0][what]
        assert set(got) == set(want), (what, sorted(set(got) ^ set(want)))
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, msg=f"{what}: {k}")
    for rank in range(2):
        assert "changed shape" in ours[rank]["refused"], ours[rank]["refused"]
        assert "torch.save(model.state_dict())" in ours[rank]["refused"]
