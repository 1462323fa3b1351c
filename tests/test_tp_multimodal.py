"""The shipped ``"llama"`` tensor-parallel plan on a LLaVA model (Hugging Face's
``LlavaForConditionalGeneration``: a CLIP vision tower, a projector and a Llama), at tp2 on 2 Gloo ranks,
against the unsharded model.

CLIP's attention names its query, key and value projections as Llama's (``self_attn.{q,k,v}_proj``) but
its output projection ``out_proj``: before, the plan split the vision tower's attention by heads without
its row-parallel partner and refused at setup with advice (drop the plan's ``*.self_attn.*`` entries)
that would have left the language model's attention unsharded too. A shipped plan now leaves a block it
matches only in part replicated (``plans.whole_blocks``): the language model is sharded, the vision tower
and projector stay whole, and training equals the unsharded model (stages with the vision tower frozen,
as LLaVA's, and trained). Qwen2.5-VL's vision MLP has Llama's names in full but no norm the plan makes its
region input: before, sharded, and the first batch with an image was refused ("reads an input that no
region_input module's output reaches"); now replicated too, and a batch with an image equals the
unsharded model.
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


def _qwen_vl() -> nn.Module:
    """Qwen2.5-VL: its vision blocks' MLP has Llama's names (``gate/up/down_proj``) beside ``norm1`` /
    ``norm2``, which the plan does not make region inputs."""
    import transformers

    torch.manual_seed(0)
    vision = dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32, patch_size=4,
        spatial_merge_size=2, temporal_patch_size=1, in_channels=3, fullatt_block_indexes=[0], window_size=8,
    )  # fmt: skip
    text = dict(
        TEXT, vocab_size=300, head_dim=8, model_type="qwen2_5_vl_text",
        rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
    )  # fmt: skip
    config = transformers.Qwen2_5_VLConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=299,
        video_token_id=298,
        vision_start_token_id=297,
    )
    return transformers.Qwen2_5_VLForConditionalGeneration(config)


def _qwen_batch() -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(1)
    text = torch.randint(1, 290, (1, 8), generator=g)
    ids = torch.cat([text[:, :2], torch.tensor([[297, 299, 299, 299, 299]]), text[:, 2:]], 1)
    return {
        "input_ids": ids,
        "labels": ids.masked_fill(ids == 299, -100),
        "pixel_values": torch.randn(16, 48, generator=g),  # 4 x 4 patches, merged 2 x 2: 4 image tokens
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
    }


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
    qwen = _qwen_vl()
    qwen_sharded = copy.deepcopy(qwen)
    apply_tensor_parallel(qwen_sharded, group=group.WORLD, plan="llama")
    want = _train(qwen, _qwen_batch())
    out["qwen"] = (
        want,
        _train(qwen_sharded, _qwen_batch()),
        gather_full(qwen_sharded),
        dict(qwen.state_dict()),
    )
    out["qwen_vision"] = type(qwen_sharded.model.visual.blocks[0].mlp.gate_proj).__name__
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
        assert r["sharded"] and r["qwen_vision"] == "Linear"
        for frozen in (True, False, "qwen"):
            want, got, full, ref = r[frozen]
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), msg=f"frozen={frozen}")
            assert len(full) > 40
            for k, v in full.items():
                torch.testing.assert_close(v, ref[k].detach(), msg=f"frozen={frozen}: {k}")
