"""Evaluation whose data-parallel ranks run different numbers of batches, at ZeRO-3, on 2 Gloo ranks.

``trainer.predict`` splits its samples over the ranks without padding (9 samples: 5 on rank 0, 4 on rank
1, so with batches of 4 rank 0 runs one batch more), and a user's per-rank or iterable evaluation data
may end sooner on one rank. Under ``"ddp"`` that is harmless; at ZeRO-3 every forward all-gathers over
the dp group, and before, the rank that ran out left the other waiting in its next gather forever
(``trainer.predict`` of 9 samples hung). Now the ranks join (``lightning_par/eval_join.py``,
``lightning_par/zero/stage3_join.py``). Each case is compared with Lightning's ``"ddp"`` in the same
processes, on a Hugging Face Llama:

* ``predict`` of 9 samples: each rank's predictions equal ``"ddp"``'s (rank 0: batches of 4 and 1);
* ``predict`` of 3 prompts with ``generate()`` (rank 0 gets two, and its first generation meets the
  end-of-sequence token at once): each rank's generations equal ``"ddp"``'s (before, a hang:
  ``generate()``'s per-token all-reduce met the done rank's gathers);
* ``validate`` with two dataloaders of uneven counts per rank (3 and 1 batches on rank 0, 1 and 2 on
  rank 1, Lightning's sampler off) and with an iterable dataset without length (3 batches against 1):
  the logged metrics equal ``"ddp"``'s;
* ``fit`` with such uneven validation every epoch: the final weights equal ``"ddp"``'s (training after a
  joined validation is unchanged); equal counts on every rank plan no join;
* ``validate`` of uneven counts whose ``on_validation_epoch_end`` samples text with ``generate()``, rank
  0's generation ending at once: each rank's equals ``"ddp"``'s (before, the join stayed on until the
  loop's end, so ``generate()`` ran unsynced and the longer generation's gathers met the other rank's
  teardown: gloo aborted on a "collective mismatch");
* Fabric: a ZeRO-3 evaluation loop of 3 batches on rank 0 and 1 on rank 1 inside
  ``fabric.strategy.join()`` gives the logits of the one-process model on every batch;
* refused before any batch, the same on every rank: a dataloader that gives one rank no batch, an
  unsized dataloader followed by another when counts differ, a ``validation_step(dataloader_iter)`` when
  counts differ, and uneven counts under pipeline parallelism.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

from lightning_par import HybridParallelStrategy
from lightning_par.eval_join import eval_count_table, plan_eval_join
from lightning_par.fabric import HybridParallelStrategy as FabricStrategy
from tests.distributed import run_distributed
from tests.third_party import LoraLlama, Tokens, llama

BATCH = 4


class Stream(IterableDataset[tuple[Tensor, Tensor]]):
    """``n`` rows of ``Tokens``, without a length."""

    def __init__(self, n: int) -> None:
        self.tokens = Tokens(n)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        return (self.tokens[i] for i in range(len(self.tokens)))


class Counted(LoraLlama):
    """Counts the validation steps per dataloader (every step runs, none is skipped or repeated)."""

    def __init__(self) -> None:
        super().__init__(lora=False)
        self.steps: dict[int, int] = {}

    def validation_step(
        self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> Tensor:
        self.steps[dataloader_idx] = self.steps.get(dataloader_idx, 0) + 1
        return super().validation_step(batch, batch_idx)


PROMPTS = [torch.tensor([[k, 2, 3, 4]]) for k in (1, 2, 3)]  # rank 0 predicts the 1st and 3rd


def _eos() -> int:
    """The first token the model generates after the first prompt: that generation stops at once."""
    return int(llama(seed=0).generate(PROMPTS[0], max_new_tokens=1, do_sample=False, pad_token_id=0)[0, -1])


class Generates(pl.LightningModule):
    """Greedy generation in ``predict_step``, ending at ``eos``: ranks run different numbers of
    forwards per step as well as different numbers of steps."""

    def __init__(self, eos: int) -> None:
        super().__init__()
        self.model = llama(seed=0)
        self.eos = eos

    def predict_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self.model.generate(
            batch, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=self.eos
        )


class SamplesAtEpochEnd(Counted):
    """Greedy generation in ``on_validation_epoch_end``, a prompt per rank, ending at ``eos``."""

    def __init__(self, eos: int) -> None:
        super().__init__()
        self.eos = eos
        self.samples: list[Tensor] = []

    def on_validation_epoch_end(self) -> None:
        assert self.model is not None
        prompt = PROMPTS[0] if self.global_rank == 0 else PROMPTS[1]
        out = self.model.generate(
            prompt, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=self.eos
        )
        self.samples.append(out)


def _trainer(strategy: Any, **kw: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def _uneven(rank: int, counts: tuple[int, ...]) -> DataLoader[Any]:
    """``counts[rank]`` batches of 4 rows (this rank's own data, Lightning's sampler off)."""
    return DataLoader(Tokens(BATCH * counts[rank]), batch_size=BATCH)


def _runs(rank: int, world: int, strategy_fn: Any, eos: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    pl.seed_everything(3)
    module = Counted()
    trainer = _trainer(strategy_fn())
    out["predict"] = torch.cat(trainer.predict(module, DataLoader(Tokens(9), batch_size=BATCH)))  # type: ignore[arg-type]
    trainer = _trainer(strategy_fn())
    out["generate"] = trainer.predict(Generates(eos), DataLoader(PROMPTS, batch_size=None))
    trainer = _trainer(strategy_fn(), use_distributed_sampler=False)
    loaders = [_uneven(rank, (3, 1)), _uneven(rank, (1, 2))]
    out["validate"] = trainer.validate(module, loaders, verbose=False)
    out["steps"] = dict(module.steps)
    stream = DataLoader(Stream(BATCH * (3 if rank == 0 else 1)), batch_size=BATCH)
    out["stream"] = trainer.validate(module, stream, verbose=False)
    sampler = SamplesAtEpochEnd(eos)
    _trainer(strategy_fn(), use_distributed_sampler=False).validate(
        sampler, _uneven(rank, (2, 1)), verbose=False
    )
    out["epoch_end"] = sampler.samples
    pl.seed_everything(3)
    module = Counted()
    trainer = _trainer(strategy_fn(), use_distributed_sampler=False, max_epochs=2, num_sanity_val_steps=0)
    trainer.fit(module, _uneven(rank, (2, 2)), _uneven(rank, (1, 3)))
    out["fit"] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return out


def _zero3() -> HybridParallelStrategy:
    return HybridParallelStrategy(zero_stage=3, meta_init=False)  # the module's own initial weights


class IterStep(Counted):
    """A validation step that takes its own batches from the iterator."""

    def validation_step(self, dataloader_iter: Iterator[Any]) -> Tensor:  # type: ignore[override]
        batch, batch_idx, _ = next(dataloader_iter)
        return super().validation_step(batch, batch_idx)


def _refusals(rank: int, world: int) -> list[str]:
    messages = []
    for module, loaders in (
        (Counted(), _uneven(rank, (2, 0))),  # rank 1: no batch
        (
            Counted(),
            [DataLoader(Stream(BATCH * (2 if rank == 0 else 1)), batch_size=BATCH), _uneven(rank, (1, 1))],
        ),
        (IterStep(), _uneven(rank, (2, 1))),
    ):
        trainer = _trainer(_zero3(), use_distributed_sampler=False)
        with pytest.raises(ValueError) as refused:
            trainer.validate(module, loaders, verbose=False)
        messages.append(str(refused.value))
    # the counts compared over this job's group: ZeRO-3 under a pipeline refuses uneven ones
    table = eval_count_table([2 + rank], group=dist.group.WORLD, device=torch.device("cpu"))
    with pytest.raises(ValueError) as refused:
        plan_eval_join(table, rank=rank, pipelined=True, loop="test")
    messages.append(str(refused.value))
    with pytest.raises(ValueError) as refused:  # predict keeps its last batch: drop_last is no fix there
        plan_eval_join(table, rank=rank, pipelined=True, loop="predict")
    messages.append(str(refused.value))
    even = eval_count_table([2, 3], group=dist.group.WORLD, device=torch.device("cpu"))
    assert plan_eval_join(even, rank=rank, pipelined=True, loop="test") is None  # equal: nothing to join
    return messages


def test_uneven_evaluation_at_zero3_equals_ddp() -> None:
    eos = _eos()
    ddp = run_distributed(_runs, 2, lambda: "ddp", eos, init_group=False)
    ours = run_distributed(_runs, 2, _zero3, eos, init_group=False)
    # rank 0: its first generation stops at once, its second runs 4 tokens; rank 1 has one prompt
    assert [g.shape[1] for g in ddp[0]["generate"]] == [5, 8] and len(ddp[1]["generate"]) == 1
    assert ddp[0]["epoch_end"][0].shape[1] == 5 and ddp[1]["epoch_end"][0].shape[1] == 8
    for rank, (got, want) in enumerate(zip(ours, ddp, strict=True)):
        assert got["predict"].shape[0] == (5 if rank == 0 else 4)
        torch.testing.assert_close(got["predict"], want["predict"], msg=f"rank {rank} predictions")
        assert len(got["generate"]) == len(want["generate"]), rank
        for g, w in zip(got["generate"], want["generate"], strict=True):
            assert torch.equal(g, w), (rank, g.tolist(), w.tolist())
        assert [t.tolist() for t in got["epoch_end"]] == [t.tolist() for t in want["epoch_end"]], rank
        assert got["steps"] == want["steps"] == ({0: 3, 1: 1} if rank == 0 else {0: 1, 1: 2}), rank
        for key in ("validate", "stream"):
            assert len(got[key]) == len(want[key]), key
            for ours_dl, ddp_dl in zip(got[key], want[key], strict=True):
                assert ours_dl.keys() == ddp_dl.keys(), key
                for name, value in ddp_dl.items():
                    assert ours_dl[name] == pytest.approx(value, rel=1e-6), (rank, key, name)
        for name, value in want["fit"].items():
            torch.testing.assert_close(got["fit"][name], value, msg=f"rank {rank} {name}")


def test_uneven_evaluation_that_cannot_join_is_refused() -> None:
    for empty, unsized, iterator, pipelined, predicted in run_distributed(_refusals, 2):
        assert "drop_last" not in predicted and "distributed_sampler_kwargs" in predicted, predicted
        assert "drop_last=True" in pipelined, pipelined
        assert "validation_step(dataloader_iter) takes its own batches" in iterator, iterator
        assert "dp rank 0: 2, dp rank 1: 0" in empty and "at least one batch" in empty, empty
        assert "Dataloader 0 has no length and another follows it" in unsized, unsized
        assert "Give it a __len__, or make it the last one" in unsized, unsized
        assert "dp rank 0: [2]; dp rank 1: [3]" in pipelined and "pipeline parallelism" in pipelined, (
            pipelined
        )


def _fabric_join(rank: int, world: int) -> list[Tensor]:
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=FabricStrategy(zero_stage=3))
    fabric.launch()
    model = fabric.setup(llama(seed=0))
    outputs = []
    with fabric.strategy.join(), torch.no_grad():  # type: ignore[attr-defined]
        for x, _ in _uneven(rank, (3, 1)):
            outputs.append(model(input_ids=x).logits)
    return outputs


def test_fabric_join_evaluates_uneven_batches_at_zero3_as_one_process() -> None:
    torch.set_num_threads(1)
    model = llama(seed=0)
    with torch.no_grad():
        want = [model(input_ids=x).logits for x, _ in _uneven(0, (3,))]
    got = run_distributed(_fabric_join, 2, init_group=False)
    assert [len(r) for r in got] == [3, 1]
    for rank, outputs in enumerate(got):
        for k, logits in enumerate(outputs):
            torch.testing.assert_close(logits, want[k], msg=f"rank {rank} batch {k}")
