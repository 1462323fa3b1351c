"""Where the pipeline cuts a model: the ``"compute"`` cost model against counted FLOPs on models we did not
write, explicit layer counts, option checks, and agreement of the cut across ranks.

The FLOP reference is ``torch.utils.flop_counter.FlopCounterMode`` on one micro-batch's forward + backward
through each pipeline layer (meta tensors): the cut minimising the largest stage's counted FLOPs is what
a balanced pipeline needs. The previous default, ``"parameters"``, weighs a vocabulary-sized embedding
(a gather) like a head of the same size (a product over the vocabulary), which starves the first stage.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import transformers
from omegaconf import OmegaConf
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_par import HybridParallelStrategy
from lightning_par.fabric import HybridParallelStrategy as FabricHybridParallelStrategy
from lightning_par.models.gpt import GPT, GPTConfig
from lightning_par.pipeline import hf_pipeline_layers, layer_costs, partition
from lightning_par.pipeline.partition import agree, as_cut, cut
from tests.distributed import run_distributed


def _flops(layers: list[nn.Module], first: torch.Tensor) -> list[float]:
    x: Any = first
    out = []
    for layer in layers:
        with FlopCounterMode(display=False) as counter:
            y = layer(x)
            y.float().sum().backward()
        out.append(float(counter.get_total_flops()))
        x = y.detach().requires_grad_(True)
    return out


def _gpt2() -> nn.Module:  # GPT-2's proportions, small: the tied head's product is ~2.7 blocks
    config = transformers.GPT2Config(
        vocab_size=8192, n_positions=32, n_embd=64, n_layer=6, n_head=4, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=8192, hidden_size=64, intermediate_size=176, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _ours() -> nn.Module:
    return GPT(GPTConfig(vocab_size=8192, block_size=32, n_layer=6, n_head=4, n_embd=64))


@pytest.mark.parametrize("build", [_gpt2, _llama, _ours], ids=["hf-gpt2-tied", "hf-llama", "our-gpt-tied"])
def test_compute_costs_cut_as_counted_flops(build: Any) -> None:
    with torch.device("meta"):
        model = build()
    layers = hf_pipeline_layers(model) if isinstance(model, transformers.PreTrainedModel) else model.layers()
    costs = layer_costs(layers, "compute")
    assert costs[0] == 1.0  # token (and position) tables: lookups
    assert costs[-1] >= 8192 * 64  # the head's product, whether or not its weight is the token table
    flops = _flops(layers, torch.zeros(2, 32, dtype=torch.int64, device="meta"))
    for p in (2, 3):
        best = max(sum(flops[a:b]) for a, b in partition(flops, p))
        ours = max(sum(flops[a:b]) for a, b in partition(costs, p))
        by_parameters = max(sum(flops[a:b]) for a, b in partition(layer_costs(layers, "parameters"), p))
        assert ours <= 1.02 * best, (p, ours / best)  # measured: the FLOP-optimal cut itself
        if p == 2:  # the parameter count weighs the token table as compute: stage 0 gets too few blocks
            assert by_parameters >= 1.25 * best, (p, by_parameters / best)


def test_partition_option_is_checked_before_launch() -> None:
    assert as_cut("compute") == "compute"
    assert as_cut([3, 1]) == (3, 1)
    assert as_cut(OmegaConf.create({"c": [9, 5]}).c) == (9, 5)  # a Hydra list
    for bad in ("random", [0, 3], [True, 1], [2.5, 1], [], 3):
        with pytest.raises(ValueError, match="partition_method must be one of"):
            as_cut(bad)
    for strategy in (HybridParallelStrategy, FabricHybridParallelStrategy):
        assert strategy(pipeline_parallel_size=2, partition_method=[3, 1]).partition_method == (3, 1)
        assert strategy(pipeline_parallel_size=2).partition_method == "compute"
        with pytest.raises(ValueError, match=r"gives 3 layer counts for 2 stages x 2 virtual stages"):
            strategy(
                pipeline_parallel_size=2,
                pipeline_schedule="interleaved_1f1b",
                virtual_stages=2,
                partition_method=[1, 2, 3],
            )


def test_explicit_counts_cut_where_told() -> None:
    layers = [nn.Linear(2, 2) for _ in range(6)]
    assert cut(layers, (4, 2), pieces=2) == [(0, 4), (4, 6)]
    assert cut(layers, (1, 2, 2, 1), pieces=4) == [(0, 1), (1, 3), (3, 5), (5, 6)]
    with pytest.raises(ValueError, match="places 5 layers, but pipeline_layers\\(\\) returned 6"):
        cut(layers, (3, 2), pieces=2)
    with pytest.raises(ValueError, match="gives 3 layer counts, but the pipeline has 2 pieces"):
        cut(layers, (2, 2, 2), pieces=2)


def _agreement(rank: int, world: int) -> dict[str, Any]:
    group = dist.new_group(list(range(world)))
    # per-rank costs, as "profile" measures them: alone, the ranks would cut differently
    mine = [1.0, 5.0, 1.0, 1.0] if rank == 0 else [1.0, 1.0, 1.0, 5.0]
    alone = partition(mine, 2)
    agreed = agree(mine, [group])
    layers = [nn.Linear(2, 2) for _ in range(4 + rank)]  # rank 1 lists one layer more
    try:
        cut(layers, "uniform", pieces=2, groups=[group])
        message = ""
    except ValueError as err:
        message = str(err)
    try:
        cut(layers, (2, 2 + rank), pieces=2, groups=[group])
        counts_message = ""
    except ValueError as err:
        counts_message = str(err)
    return {"alone": alone, "agreed": agreed, "message": message, "counts_message": counts_message}


def test_every_rank_cuts_the_same_way() -> None:
    results = run_distributed(_agreement, 2)
    assert results[0]["alone"] != results[1]["alone"]  # what each rank would have done by itself
    assert results[0]["agreed"] == results[1]["agreed"] == [1.0, 3.0, 1.0, 3.0]
    for r in results:  # raised on every rank, none left waiting in a collective
        assert "different numbers of layers on different ranks ({0: 4, 1: 5} by global rank)" in r["message"]
        assert "different numbers of layers" in r["counts_message"]
