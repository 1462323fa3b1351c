"""The shipped ``"llama"`` tensor-parallel plan on a LLaVA model (Hugging Face's
``LlavaForConditionalGeneration``: a CLIP vision tower, a projector and a Llama), at tp2 on 2 Gloo ranks,
against the unsharded model.

CLIP's attention names its query, key and value projections as Llama's (``self_attn.{q,k,v}_proj``) but
its output projection ``out_proj``: before, the plan split the vision tower's attention by heads without
its row-parallel partner and refused at setup with advice (drop the plan's ``*.self_attn.*`` entries)
that would have left the language model's attention unsharded too. A shipped plan now leaves a block it
matches only in part replicated (``plans.whole_blocks``): the language model is sharded, the vision tower
and projector stay whole, and training equals the unsharded model (stages with the vision tower frozen,
as LLaVA's, and trained).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import group

from lightning_par.tensor_parallel.layers import ColumnParallelLinear
from lightning_par.tensor_parallel.plan import apply_tensor_parallel
from tests.distributed import run_distributed
from tests.test_tensor_parallel import gather_full

IMAGE = 63  # the image placeholder token
VISION: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16,
    patch_size=8,
)  # fmt: skip
TEXT: dict[str, Any] = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager",
)  # fmt: skip


def _llava() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**VISION),
        text_config=transformers.LlamaConfig(**TEXT),
        image_token_index=IMAGE,
    )
    return transformers.LlavaForConditionalGeneration(config)


def _batch() -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(1)
    text = torch.randint(1, IMAGE, (2, 8), generator=g)
    images = torch.full((2, 4), IMAGE)  # (16 / 8)^2 patch features per image
    ids = torch.cat([text[:, :2], images, text[:, 2:]], dim=1)
    labels = ids.masked_fill(ids == IMAGE, -100)
    return {"input_ids": ids, "labels": labels, "pixel_values": torch.randn(2, 3, 16, 16, generator=g)}


def _train(model: nn.Module, batch: dict[str, Tensor]) -> list[float]:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _job(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    batch = _batch()
    for frozen in (True, False):
        ref = _llava()
        ref.model.vision_tower.requires_grad_(not frozen)
        sharded = copy.deepcopy(ref)
        apply_tensor_parallel(sharded, group=group.WORLD, plan="llama")
        want = _train(ref, batch)
        out[frozen] = (want, _train(sharded, batch), gather_full(sharded), dict(ref.state_dict()))
    out["kinds"] = {
        name: type(sharded.get_submodule(name)).__name__
        for name in (
            "model.language_model.layers.0.self_attn.q_proj",
            "model.vision_tower.encoder.layers.0.self_attn.q_proj",
        )
    }
    out["sharded"] = isinstance(sharded.model.language_model.layers[1].mlp.up_proj, ColumnParallelLinear)
    return out


def test_llama_plan_on_llava_shards_the_language_model_and_equals_the_unsharded_model() -> None:
    for r in run_distributed(_job, 2):
        assert r["kinds"] == {
            "model.language_model.layers.0.self_attn.q_proj": "ColumnParallelLinear",
            "model.vision_tower.encoder.layers.0.self_attn.q_proj": "Linear",
        }
        assert r["sharded"]
        for frozen in (True, False):
            want, got, full, ref = r[frozen]
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), msg=f"frozen={frozen}")
            assert len(full) > 40
            for k, v in full.items():
                torch.testing.assert_close(v, ref[k].detach(), msg=f"frozen={frozen}: {k}")
