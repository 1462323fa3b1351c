"""Lightning's own demo model, ``lightning.pytorch.demos.Transformer`` (an ``nn.Transformer``
encoder-decoder), under pipeline parallelism: the user writes ``pipeline_layers()`` over the model's own
modules, and the encoder's output (the decoder's memory) travels beside the decoder's states as a tuple
between stages, its gradient back from every decoder layer. ``nn.MultiheadAttention`` multiplies by
``out_proj.weight`` without calling ``out_proj``, so the zero-bubble split must leave that weight in
``B``. At pp2 with 1F1B and with zb, the per-step losses and the final weights equal one process running
the demo's own ``training_step`` (gradients clipped at 0.5 on both sides)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.demos import LightningTransformer, Transformer
from torch import Tensor, nn
from torch.nn.modules.transformer import _detect_is_causal_mask
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import rank_state
from tests.test_pp_trainer import _trainer  # the pipeline tests' Trainer (clipping at 0.5)

SEED, VOCAB, T, N, BATCH, M, EPOCHS = 3, 64, 12, 16, 8, 4, 2


class Pairs(Dataset[tuple[Tensor, Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randint(0, VOCAB, (N, T), generator=g)
        self.y = torch.randint(0, VOCAB, (N, T), generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


class _Embed(nn.Module):
    """Both sequences embedded and position-encoded, as ``Transformer.forward`` does."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.embedding, self.pos_encoder, self.scale = (
            model.embedding,
            model.pos_encoder,
            math.sqrt(model.ninp),
        )

    def forward(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        inputs, target = batch
        encode = self.pos_encoder
        return encode(self.embedding(inputs) * self.scale), encode(self.embedding(target) * self.scale)


class _Encoder(nn.Module):
    """One encoder layer (or the encoder's final norm) on the source; the target passes through."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        src, tgt = x
        return self.layer(src), tgt


class _Decoder(nn.Module):
    """One decoder layer on the target with the causal mask the demo builds; the memory passes on."""

    def __init__(self, layer: nn.Module, model: Transformer) -> None:
        super().__init__()
        self.layer = layer
        self.__dict__["model"] = model  # referenced, not registered: the model owns it

    def forward(self, x: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        memory, tgt = x
        mask = self.__dict__["model"].generate_square_subsequent_mask(tgt.shape[1]).to(tgt.device)
        causal = _detect_is_causal_mask(mask, None, tgt.shape[1])  # as nn.TransformerDecoder decides
        return memory, self.layer(tgt, memory, tgt_mask=mask, tgt_is_causal=causal)


class _Head(nn.Module):
    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.norm, self.decoder, self.vocab = model.transformer.decoder.norm, model.decoder, model.vocab_size

    def forward(self, x: tuple[Tensor, Tensor]) -> Tensor:
        return F.log_softmax(self.decoder(self.norm(x[1])), dim=-1).view(-1, self.vocab)


class PipelinedDemo(LightningTransformer):
    def __init__(self) -> None:
        super().__init__(vocab_size=VOCAB)
        torch.manual_seed(SEED)
        self.model = Transformer(vocab_size=VOCAB, ninp=32, nhead=2, nhid=64, nlayers=2, dropout=0.0)
        self._layers: list[nn.Module] | None = None

    def pipeline_layers(self) -> list[nn.Module]:
        if self._layers is None:
            t = self.model.transformer
            self._layers = [
                _Embed(self.model),
                *(_Encoder(layer) for layer in t.encoder.layers),
                _Encoder(t.encoder.norm),
                *(_Decoder(layer, self.model) for layer in t.decoder.layers),
                _Head(self.model),
            ]
        return self._layers

    def prepare_data(self) -> None:
        """Nothing to fetch: the demo downloads WikiText-2 here, these tests bring their data."""

    def pipeline_input(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        return batch[0], batch[1]

    def pipeline_loss(self, output: Tensor, batch: tuple[Tensor, Tensor]) -> Tensor:
        return F.nll_loss(output, batch[1].reshape(-1))  # the demo's training_step loss


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *a: Any
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


def _pipelined(rank: int, world: int, schedule: str, tmp: str) -> dict[str, Any]:
    pl.seed_everything(SEED)
    module, losses = PipelinedDemo(), Losses()
    strategy = HybridParallelStrategy(
        pipeline_parallel_size=2, num_microbatches=M, pipeline_schedule=schedule
    )
    _trainer(strategy, 2, tmp, [losses], EPOCHS).fit(module, DataLoader(Pairs(), batch_size=BATCH))
    return {
        "losses": losses.losses,
        # this stage's entries, from the LightningModule's own traversal (a submodule's state_dict() under a
        # pipeline is refused: it would hold the other stages' placeholders)
        "state": {
            k.removeprefix("model."): v for k, v in rank_state(module).items() if k.startswith("model.")
        },
    }


def _reference(tmp: str) -> tuple[list[float], dict[str, Tensor]]:
    """One process, the demo's own forward and training_step, the batches in the order Lightning's
    distributed sampler dealt them (it shuffles training data, seeded by seed_everything)."""
    pl.seed_everything(SEED)
    module, losses = PipelinedDemo(), Losses()
    orders = []
    for epoch in range(EPOCHS):
        sampler = DistributedSampler(Pairs(), num_replicas=1, rank=0, shuffle=True, seed=SEED)
        sampler.set_epoch(epoch)
        order = list(sampler)
        orders += [order[i : i + BATCH] for i in range(0, N, BATCH)]
    # both epochs' orders, one after the other, in a single epoch
    _trainer("auto", 1, tmp, [losses]).fit(module, DataLoader(Pairs(), batch_sampler=orders))
    return losses.losses, module.model.state_dict()


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_lightning_demo_transformer_under_pipeline_equals_one_process(schedule: str, tmp_path: Path) -> None:
    results = run_distributed(_pipelined, 2, schedule, str(tmp_path), init_group=False)
    ref_losses, ref_state = _reference(str(tmp_path / "ref"))
    for r in results:  # every pipeline rank logs the step's loss
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses))
    merged = {k: v for r in results for k, v in r["state"].items()}
    assert set(merged) == set(ref_state)
    for name, value in ref_state.items():
        torch.testing.assert_close(merged[name], value, msg=name)
