"""Reference GPT, its Lightning module and the stdlib corpus datamodule (CPU, fast)."""

from __future__ import annotations

import math
from functools import partial

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_par.models import GPT, GPTConfig, GPTModule, StdlibCorpusDataModule
from lightning_par.models.corpus import load_corpus_bytes
from lightning_par.models.gpt import Block, CausalSelfAttention
from lightning_par.models.lit_gpt import warmup_cosine

SMALL = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)


def _tokens(batch: int, seq: int, vocab: int = SMALL.vocab_size) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))


# --- GPT --------------------------------------------------------------------------------------------------


def test_forward_shape() -> None:
    model = GPT(SMALL)
    logits = model(_tokens(3, 10))
    assert logits.shape == (3, 10, SMALL.vocab_size)
    assert torch.isfinite(logits).all()


def test_layers_compose_to_forward() -> None:
    model = GPT(SMALL).eval()
    idx = _tokens(2, SMALL.block_size)
    layers = model.layers()
    assert len(layers) == SMALL.n_layer + 2
    assert layers[0] is model.embed and layers[-1] is model.head
    x: torch.Tensor = idx
    for layer in layers:
        x = layer(x)
    torch.testing.assert_close(x, model(idx), rtol=0, atol=0)


def test_tied_weights_shared_and_counted_once() -> None:
    tied = GPT(SMALL)
    untied = GPT(GPTConfig(**{**SMALL.__dict__, "tie_weights": False}))
    assert tied.head.lm_head.weight is tied.embed.tok.weight
    assert untied.head.lm_head.weight is not untied.embed.tok.weight
    table = SMALL.vocab_size * SMALL.n_embd
    assert untied.num_parameters() - tied.num_parameters() == table
    assert tied.num_parameters() == sum(p.numel() for p in tied.parameters())
    embeddings = table + SMALL.block_size * SMALL.n_embd
    assert tied.num_parameters(exclude_embeddings=True) == tied.num_parameters() - embeddings


def test_init_is_deterministic_and_gpt2_scaled() -> None:
    torch.manual_seed(123)
    a = GPT(SMALL)
    torch.manual_seed(123)
    b = GPT(SMALL)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=name)
    block = a.blocks[0]
    assert isinstance(block, Block)
    assert torch.all(block.attn.q_proj.bias == 0) and torch.all(block.ln_1.weight == 1)
    # Residual projections are scaled down by sqrt(2 * n_layer) relative to the 0.02 of other weights.
    big_block = GPT(GPTConfig(n_layer=2, n_embd=256, n_head=4)).blocks[0]
    assert isinstance(big_block, Block)
    assert big_block.mlp.fc_out.weight.std().item() == pytest.approx(0.02 / math.sqrt(4), rel=0.05)
    assert big_block.mlp.fc_in.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_sequence_longer_than_block_size_raises() -> None:
    model = GPT(SMALL)
    with pytest.raises(ValueError, match=r"exceeds block_size=16"):
        model(_tokens(1, SMALL.block_size + 1))


def test_config_validation_names_numbers() -> None:
    with pytest.raises(ValueError, match=r"n_embd=30 is not divisible by n_head=4"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="dropout"):
        GPTConfig(dropout=1.0)


def test_attention_infers_local_heads_from_sharded_projections() -> None:
    """Split heads in two halves (column-shard q/k/v, row-shard out_proj): partial outputs sum to the full."""
    torch.manual_seed(0)
    full = CausalSelfAttention(SMALL).eval()
    x = torch.randn(2, 8, SMALL.n_embd)
    half = SMALL.n_embd // 2

    def shard(rows: slice) -> CausalSelfAttention:
        part = CausalSelfAttention(SMALL).eval()
        for name in ("q_proj", "k_proj", "v_proj"):
            src: nn.Linear = getattr(full, name)
            lin = nn.Linear(SMALL.n_embd, half)
            lin.weight.data.copy_(src.weight.data[rows])
            lin.bias.data.copy_(src.bias.data[rows])
            setattr(part, name, lin)
        part.out_proj = nn.Linear(half, SMALL.n_embd, bias=False)
        part.out_proj.weight.data.copy_(full.out_proj.weight.data[:, rows])
        return part

    with torch.no_grad():
        y0 = shard(slice(0, half))(x)
        y1 = shard(slice(half, None))(x)
        expected = full(x)
    assert y0.shape == (2, 8, SMALL.n_embd)
    torch.testing.assert_close(y0 + y1 + full.out_proj.bias, expected)


# --- GPTModule --------------------------------------------------------------------------------------------


def test_warmup_cosine_schedule() -> None:
    ratio = partial(warmup_cosine, warmup_steps=10, total_steps=110, min_ratio=0.1)
    assert ratio(0) == pytest.approx(0.1)  # first step: lr / warmup_steps
    assert ratio(9) == pytest.approx(1.0)  # last warmup step reaches the peak
    assert ratio(10) == pytest.approx(1.0)
    assert ratio(60) == pytest.approx(0.55)  # half-way through the cosine: mean of 1 and min_ratio
    assert ratio(110) == pytest.approx(0.1)
    assert ratio(500) == pytest.approx(0.1)
    assert warmup_cosine(0, warmup_steps=0, total_steps=5, min_ratio=0.0) == pytest.approx(1.0)


def test_param_groups_split_decay_and_cover_everything_once() -> None:
    module = GPTModule(n_layer=2, n_embd=32, n_head=2, block_size=16, max_steps=100, weight_decay=0.1)
    with pytest.raises(RuntimeError, match="configure_model"):
        _ = module.gpt
    module.configure_model()
    config = module.configure_optimizers()
    optimizer = config["optimizer"]
    assert config["lr_scheduler"]["interval"] == "step"
    decay_group, no_decay_group = optimizer.param_groups
    assert decay_group["weight_decay"] == 0.1 and no_decay_group["weight_decay"] == 0.0
    decay_ids = {id(p) for p in decay_group["params"]}
    no_decay_ids = {id(p) for p in no_decay_group["params"]}
    gpt = module.gpt
    block = gpt.blocks[0]
    assert isinstance(block, Block)
    assert id(block.attn.q_proj.weight) in decay_ids
    assert id(gpt.embed.tok.weight) in decay_ids
    assert id(block.attn.q_proj.bias) in no_decay_ids
    assert id(block.ln_1.weight) in no_decay_ids
    assert id(gpt.head.norm.weight) in no_decay_ids
    all_ids = [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert len(all_ids) == len(set(all_ids))
    assert set(all_ids) == {id(p) for p in module.parameters() if p.requires_grad}
    # Scheduler starts at lr / warmup_steps.
    assert optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 / 10)


def test_pipeline_protocol_matches_training_loss() -> None:
    module = GPTModule(n_layer=1, n_embd=32, n_head=2, block_size=16)
    module.configure_model()
    x, y = _tokens(2, 16, 256), _tokens(2, 16, 256).roll(1)
    out = module.pipeline_input((x, y))
    for layer in module.pipeline_layers():
        out = layer(out)
    loss = module.pipeline_loss(out, (x, y))
    expected = nn.functional.cross_entropy(module(x).flatten(0, 1), y.flatten())
    torch.testing.assert_close(loss, expected)


# --- data -------------------------------------------------------------------------------------------------


def _datamodule(**kwargs: object) -> StdlibCorpusDataModule:
    dm = StdlibCorpusDataModule(**{"block_size": 32, "batch_size": 4, "max_bytes": 50_000, **kwargs})  # type: ignore[arg-type]
    dm.setup("fit")
    return dm


def test_datamodule_is_deterministic() -> None:
    a, b = _datamodule(), _datamodule()
    xa, ya = next(iter(a.train_dataloader()))
    xb, yb = next(iter(b.train_dataloader()))
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert xa.dtype == torch.int64 and xa.shape == (4, 32)
    assert a.corpus_source == "stdlib"


def test_datamodule_split_sizes_and_shift() -> None:
    dm = _datamodule(val_fraction=0.1)
    assert dm.train_set is not None and dm.val_set is not None
    n_train = int(50_000 * 0.9)
    assert dm.train_set.data.numel() == n_train
    assert dm.val_set.data.numel() == 50_000 - n_train
    assert len(dm.train_set) == (n_train - 1) // 32
    assert len(dm.val_set) == (50_000 - n_train - 1) // 32
    x0, y0 = dm.train_set[0]
    x1, _ = dm.train_set[1]
    assert torch.equal(x0[1:], y0[:-1])
    assert y0[-1] == x1[0]  # windows are contiguous and non-overlapping
    data, _ = load_corpus_bytes(max_bytes=50_000)
    assert bytes(x0.tolist()) == data[:32]


def test_datamodule_synthetic_fallback(tmp_path: object) -> None:
    with pytest.warns(UserWarning, match="synthetic corpus"):
        dm = _datamodule(stdlib_dir=str(tmp_path))
    assert dm.corpus_source == "synthetic"
    x, y = next(iter(dm.val_dataloader()))
    assert x.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])
    with pytest.warns(UserWarning):
        again, source = load_corpus_bytes(stdlib_dir=str(tmp_path), max_bytes=50_000)
    assert source == "synthetic" and len(again) == 50_000
    assert torch.equal(dm.train_set.data[:1000], torch.tensor(list(again[:1000]), dtype=torch.uint8))  # type: ignore[union-attr]


def test_datamodule_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="val_fraction"):
        StdlibCorpusDataModule(val_fraction=0.0)
    with pytest.raises(ValueError, match="block_size"):
        _datamodule(block_size=40_000)


# --- end to end -------------------------------------------------------------------------------------------


def test_fit_three_steps_logs_finite_loss_and_perplexity() -> None:
    pl.seed_everything(0)
    model = GPTModule(n_layer=1, n_embd=32, n_head=2, block_size=32)
    dm = StdlibCorpusDataModule(block_size=32, batch_size=4, max_bytes=50_000)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        # max_steps stops mid-epoch, before the end-of-epoch validation; validate at step 3 explicitly.
        val_check_interval=3,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 3
    metrics = trainer.callback_metrics
    assert math.isfinite(metrics["train_loss"].item())
    assert "val_ppl" in metrics and "val_loss" in metrics
    # Perplexity is exp of the mean token cross-entropy; an untrained byte model sits near 256.
    assert metrics["val_ppl"].item() == pytest.approx(math.exp(metrics["val_loss"].item()), rel=1e-3)
    assert 1.0 < metrics["val_ppl"].item() < 1000.0
