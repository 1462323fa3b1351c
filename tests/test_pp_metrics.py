"""The user's own metrics, prediction and export under pipeline parallelism (pp 2, world 2), against the
single-process Trainer running the same module's ordinary steps.

``pipeline_loss`` returns ``{"loss", "acc", "conf"}`` and ``pipeline_eval`` adds ``"margin"``; under pp the
last stage computes them per micro-batch and every rank logs their mean over the batch, which equals
what the reference's ``training_step`` / ``validation_step`` log on whole batches. Also: ``predict``
returns the reference's logits on every rank; ``consolidated_state_dict()`` gathers the stages into the
reference's weights on rank 0; a metric the last stage cannot report, or metric names that change after
the first step, raise the same error on every rank.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler
from transformers import BatchEncoding

from lightning_par import HybridParallelStrategy
from lightning_par.pipeline.lightning import micro_weights, split_batch
from lightning_par.pipeline.metrics import PipelineMetricError
from tests.distributed import run_distributed
from tests.test_pp_trainer import KW, SEED, SGDGPT, _trainer
from tests.test_strategy import Tokens

GLOBAL = 8


class MetricGPT(SGDGPT):
    """A GPT whose loss comes with metrics (pipeline protocol) and whose ordinary steps log the same."""

    def pipeline_loss(self, output: Tensor, batch: Sequence[Tensor]) -> Any:  # type: ignore[override]
        loss = super().pipeline_loss(output, batch)
        probs = output.float().softmax(-1)
        return {
            "loss": loss,
            "acc": (output.argmax(-1) == batch[1]).float().mean(),
            "conf": probs.max(-1).values.mean(),
        }

    def pipeline_eval(self, output: Tensor, batch: Sequence[Tensor]) -> dict[str, Tensor]:
        top2 = output.float().topk(2, dim=-1).values
        return {"margin": (top2[..., 0] - top2[..., 1]).mean()}

    def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor:
        result = self.pipeline_loss(self(batch[0]), batch)
        for name, value in result.items():
            self.log(f"train_{name}", value)
        return result["loss"]

    def validation_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor:
        logits = self(batch[0])
        result = {**self.pipeline_loss(logits, batch), **self.pipeline_eval(logits, batch)}
        for name, value in result.items():
            self.log(f"val_{name}", value, sync_dist=True)
        return result["loss"]


class ArgmaxGPT(MetricGPT):
    """A ``predict_step`` of its own, which a pipeline does not run: warned."""

    def predict_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor:
        return self(batch[0]).argmax(-1)


class ArgmaxPipelineGPT(ArgmaxGPT):
    """The same through the protocol: ``pipeline_predict`` runs on the last stage."""

    def pipeline_predict(self, output: Tensor, batch: Any) -> Tensor:
        return output.argmax(-1)


class LoaderGPT(MetricGPT):
    """``pipeline_predict`` and ``pipeline_eval`` told which dataloader the batch came from (its steps
    take ``dataloader_idx``, which Lightning checks with several dataloaders even where a pipeline runs
    the protocol instead)."""

    def validation_step(self, batch: Sequence[Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        raise AssertionError("not run under a pipeline")

    def predict_step(self, batch: Sequence[Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        raise AssertionError("not run under a pipeline")

    def pipeline_predict(self, output: Tensor, batch: Any, dataloader_idx: int = 0) -> Tensor:
        return output.argmax(-1) + 1000 * dataloader_idx

    def pipeline_eval(  # type: ignore[override]
        self, output: Tensor, batch: Sequence[Tensor], **kwargs: int
    ) -> dict[str, Tensor]:
        return {"loader": output.new_full((), float(kwargs["dataloader_idx"]))}


class DictPredictGPT(MetricGPT):
    """A ``pipeline_predict`` returning what a ``predict_step`` may: a dict (refused, on every rank)."""

    def pipeline_predict(self, output: Tensor, batch: Any) -> Any:
        return {"tokens": output.argmax(-1)}


class BadMetricGPT(MetricGPT):
    def pipeline_eval(self, output: Tensor, batch: Sequence[Tensor]) -> dict[str, Tensor]:
        return {"per_token": output.float().mean(-1)}  # a tensor per token, not a scalar


class ChangingMetricGPT(MetricGPT):
    """Drops a metric after the first training step (as a metric logged only now and then would)."""

    def pipeline_loss(self, output: Tensor, batch: Sequence[Tensor]) -> Any:  # type: ignore[override]
        result = super().pipeline_loss(output, batch)
        if self.trainer.training and self.trainer.global_step >= 1:
            del result["conf"]
        return result


class Metrics(pl.Callback):
    """Every training step's logged metrics, and the last validation's."""

    def __init__(self) -> None:
        self.train: list[dict[str, float]] = []
        self.val: dict[str, float] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        m = trainer.callback_metrics
        self.train.append({k: float(m[f"train_{k}"]) for k in ("loss", "acc", "conf")})

    def on_validation_epoch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        m = trainer.callback_metrics
        self.val = {k: float(m[f"val_{k}"]) for k in ("loss", "acc", "conf", "margin")}


def _module(cls: type = MetricGPT) -> MetricGPT:
    pl.seed_everything(SEED)
    m = cls(**KW)
    m.configure_model()
    return m


def _pp(rank: int, world: int, tmp: str, zero_stage: int, n: int, val_n: int, val_bs: int) -> dict[str, Any]:
    strategy = HybridParallelStrategy(
        pipeline_parallel_size=2, num_microbatches=4, pipeline_schedule="1f1b", zero_stage=zero_stage
    )
    metrics = Metrics()
    trainer = _trainer(strategy, world, tmp, [metrics], limit_val_batches=1.0)  # every batch, the short one
    module = _module()
    val = DataLoader(Tokens(val_n), batch_size=val_bs)
    trainer.fit(module, DataLoader(Tokens(n), batch_size=GLOBAL, shuffle=True), val)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        predictions = trainer.predict(module, DataLoader(Tokens(val_n), batch_size=val_bs))
        full = strategy.consolidated_state_dict()
        # fresh modules from here on (the export above is the trained one's)
        trainer.predict(_module(ArgmaxGPT), DataLoader(Tokens(8), batch_size=8))
        tokens = trainer.predict(_module(ArgmaxPipelineGPT), DataLoader(Tokens(8), batch_size=8))
        two = [DataLoader(Tokens(8), batch_size=8), DataLoader(Tokens(8), batch_size=8)]
        by_loader = trainer.predict(_module(LoaderGPT), two)
        val_by_loader = _trainer(
            HybridParallelStrategy(pipeline_parallel_size=2, num_microbatches=4), world, tmp, []
        ).validate(_module(LoaderGPT), two, verbose=False)
    warned = [str(w.message) for w in caught if "predict_step is not run" in str(w.message)]
    bad = _module(BadMetricGPT)
    error = ""
    try:
        _trainer(
            HybridParallelStrategy(pipeline_parallel_size=2, num_microbatches=4), world, tmp, []
        ).validate(bad, DataLoader(Tokens(8), batch_size=8), verbose=False)
    except PipelineMetricError as exc:
        error = str(exc)
    predicted = ""
    try:  # refused on the last stage, told to the others (before, they died on the lost connection)
        _trainer(
            HybridParallelStrategy(pipeline_parallel_size=2, num_microbatches=4), world, tmp, []
        ).predict(_module(DictPredictGPT), DataLoader(Tokens(8), batch_size=8))
    except (TypeError, RuntimeError) as exc:
        predicted = str(exc)
    changed = ""
    try:  # the second step's metrics differ: every rank raises at the next step's end, none waits
        _trainer(HybridParallelStrategy(pipeline_parallel_size=2, num_microbatches=4), world, tmp, []).fit(
            _module(ChangingMetricGPT), DataLoader(Tokens(3 * GLOBAL), batch_size=GLOBAL)
        )
    except PipelineMetricError as exc:
        changed = str(exc)
    return {
        "train": metrics.train,
        "val": metrics.val,
        "predictions": torch.cat([p.detach() for p in predictions]),  # type: ignore[union-attr]
        "full": {k: v.clone() for k, v in full.items()},
        "error": error,
        "predicted": predicted,
        "changed": changed,
        "warned": warned,
        "tokens": torch.cat(tokens),  # type: ignore[arg-type]
        "by_loader": [torch.cat(out) for out in by_loader],  # type: ignore[arg-type, union-attr]
        "val_by_loader": val_by_loader,
    }


def _orders(n: int) -> list[list[int]]:
    """The global batches of the distributed run's one epoch (Lightning shuffles with the seed)."""
    perm = list(DistributedSampler(Tokens(n), num_replicas=1, rank=0, shuffle=True, seed=SEED))
    return [perm[i : i + GLOBAL] for i in range(0, n, GLOBAL)]


def _single(tmp: Path, n: int, val_n: int, val_bs: int) -> dict[str, Any]:
    metrics = Metrics()
    module = _module()
    trainer = _trainer("auto", 1, str(tmp / "ref"), [metrics], limit_val_batches=1.0)
    train = DataLoader(Tokens(n), batch_sampler=_orders(n))
    trainer.fit(module, train, DataLoader(Tokens(val_n), batch_size=val_bs))
    predictions = trainer.predict(module, DataLoader(Tokens(val_n), batch_size=val_bs))
    return {
        "train": metrics.train,
        "val": metrics.val,
        "predictions": torch.cat([p.detach() for p in predictions]),  # type: ignore[union-attr]
        "state": {k: v.detach().clone() for k, v in module.state_dict().items()},
    }


@pytest.mark.parametrize(
    ("zero_stage", "n", "val_n", "val_bs"), [(0, 32, 8, 8), (1, 30, 11, 4)], ids=["zero0", "zero1-ragged"]
)
def test_pipeline_metrics_predict_and_export_equal_the_single_process_run(
    zero_stage: int, n: int, val_n: int, val_bs: int, tmp_path: Path
) -> None:
    """With ``n=30`` the last training batch has 6 samples (micro-batches of 2, 2, 1 and 1, weighted by
    size): every step must still see its batch's mean. The validation and prediction sets' batches of 4,
    4 and 3 samples: the last runs in 3 micro-batches of one (before, refused before the first batch, "use
    a batch size of at least 4 ... (or drop_last=True)", which would have left samples out of the metric)."""
    results = run_distributed(
        _pp, 2, str(tmp_path), zero_stage, n, val_n, val_bs, init_group=False, timeout=300
    )
    ref = _single(tmp_path, n, val_n, val_bs)
    for rank, r in enumerate(results):
        assert len(r["train"]) == len(ref["train"]) > 0
        for got, want in zip(r["train"], ref["train"], strict=True):
            for name in ("loss", "conf"):
                assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-6), (rank, name)
            assert got["acc"] == pytest.approx(want["acc"], abs=1.5 / (GLOBAL * 16)), rank  # argmax ties
        for name, want in ref["val"].items():
            assert r["val"][name] == pytest.approx(want, rel=1e-5, abs=1e-6), (rank, name)
        torch.testing.assert_close(r["predictions"], ref["predictions"], msg=f"rank {rank} predictions")
        assert "'per_token'" in r["error"] and "one floating-point number" in r["error"], r["error"]
        assert "train step: the metrics changed from ['acc', 'conf'] to" in r["changed"], r["changed"]
        assert "return the same names every step" in r["changed"], r["changed"]
    assert results[0]["train"] == results[1]["train"]  # every rank logs the same numbers
    refused = "needs pipeline_predict to return a tensor with the micro-batch along dim 0"
    assert results[1]["predicted"].startswith("predict under pipeline") and refused in results[1]["predicted"]
    assert results[0]["predicted"].startswith("predict failed on the last pipeline stage (global rank 1)")
    assert refused in results[0]["predicted"], results[0]["predicted"]
    # a predict_step of the user's own is not run by the schedule: said once (rank 0), not silently
    (warned,) = results[0]["warned"]
    assert "ArgmaxGPT.predict_step is not run under pipeline parallelism" in warned, warned
    assert results[1]["warned"] == []
    # pipeline_predict: computed on the last stage, returned on every rank, equal to the model's own step
    with torch.no_grad():  # the same fresh module in one process, its own predict_step
        want = _module(ArgmaxGPT).predict_step((Tokens(8).data[:, :-1],), 0)
    for r in results:
        assert r["tokens"].dtype == torch.int64 and torch.equal(r["tokens"], want), r["tokens"]
        # with two dataloaders, pipeline_predict / pipeline_eval are told which (a dataloader_idx keyword)
        first, second = r["by_loader"]
        assert torch.equal(first, want) and torch.equal(second, want + 1000)
        assert [d[f"val_loader/dataloader_idx_{i}"] for i, d in enumerate(r["val_by_loader"])] == [0, 1]
    full = results[0]["full"]
    assert set(full) >= {k for k in ref["state"] if not k.endswith((".cos", ".sin"))}
    for k, v in ref["state"].items():
        if k in full:
            torch.testing.assert_close(full[k], v, msg=k)
    assert results[1]["full"] == {}  # the export lives on global rank 0 only


class Named(NamedTuple):
    x: Tensor
    y: Tensor


@dataclasses.dataclass
class Record:
    x: Tensor
    tag: str


def test_ragged_batches_split_by_size_and_too_small_ones_are_refused() -> None:
    x, y = torch.arange(6), torch.arange(6) * 10
    micro = split_batch((x, y), 4)
    assert [len(mb[0]) for mb in micro] == [2, 2, 1, 1] and torch.equal(micro[3][1], torch.tensor([50]))
    weights = micro_weights(micro)
    assert weights == [4 * 2 / 6, 4 * 2 / 6, 4 / 6, 4 / 6] and sum(weights) == pytest.approx(4)
    assert micro_weights(split_batch(torch.zeros(8, 3), 4)) == [1.0] * 4
    with pytest.raises(ValueError, match=r"A batch of 3 samples cannot fill num_microbatches=4.*drop_last"):
        split_batch({"x": torch.zeros(3, 2)}, 4)
    # containers keep their type and are split too: Hugging Face's BatchEncoding (a UserDict: before, every
    # micro-batch got the whole batch, and predict returned it m times), named tuples (before, a
    # TypeError), dataclasses (before, whole in every micro-batch); other leaves go whole into each
    encoded = split_batch(BatchEncoding({"input_ids": torch.arange(6), "n": 3}), 2)
    assert [type(mb).__name__ for mb in encoded] == ["BatchEncoding"] * 2
    assert torch.equal(encoded[1]["input_ids"], torch.tensor([3, 4, 5])) and encoded[1]["n"] == 3
    assert micro_weights(split_batch(BatchEncoding({"input_ids": torch.arange(5)}), 2)) == [1.2, 0.8]
    named = split_batch(Named(torch.arange(4), torch.arange(4) * 2), 2)
    assert isinstance(named[1], Named) and torch.equal(named[1].y, torch.tensor([4, 6]))
    record = split_batch(Record(torch.arange(4), "tag"), 2)
    assert isinstance(record[0], Record) and torch.equal(record[0].x, torch.tensor([0, 1]))
    assert record[0].tag == record[1].tag == "tag"
    # a 0-dim tensor goes whole into each micro-batch (before: IndexError); sizes the micro-batches would
    # split into other shares are refused (before: a combined batch of 8 and 6 samples was weighted by the
    # first tensor's split alone, 1.1e-3 off one process after an epoch), and so is a tensor too short to
    # cut among larger ones (a broadcast position_ids, a list of per-sample spans)
    scalar = split_batch({"x": torch.arange(8), "w": torch.tensor(2.0)}, 4)
    assert all(mb["w"].item() == 2.0 for mb in scalar) and micro_weights(scalar) == [1.0] * 4
    assert len(split_batch({"a": torch.zeros(8), "b": torch.zeros(4)}, 4)) == 4  # both divide: exact
    # each refusal names a tensor of each size by its place in the batch
    sizes = r"sizes \[6, 8\] \(batch\['b'\]\[0\]: 6, batch\['a'\]\[0\]: 8\) that num_microbatches=4"
    with pytest.raises(ValueError, match=sizes):
        split_batch({"a": (torch.zeros(8), torch.zeros(8)), "b": (torch.zeros(6), torch.zeros(6))}, 4)
    with pytest.raises(
        ValueError,
        match=r"\(batch\['position_ids'\]\) has 1 rows along dim 0 among tensors of 8.*position_ids",
    ):
        split_batch({"input_ids": torch.zeros(8, 3), "position_ids": torch.zeros(1, 3)}, 4)
    with pytest.raises(
        ValueError, match=r"\(batch\['spans'\]\[0\]\) has 3 rows along dim 0 among tensors of 8.*per-sample"
    ):
        split_batch({"x": torch.zeros(8, 3), "spans": [torch.zeros(3), torch.zeros(5)]}, 4)


class Batches(pl.Callback):
    def __init__(self) -> None:
        self.seen: list[int] = []
        self.trained = 0

    def on_predict_batch_end(
        self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        self.seen.append(i)

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, i: int) -> None:
        self.trained += 1


class EncodedGPT(MetricGPT):
    def pipeline_input(self, batch: Any) -> Tensor:
        return batch["input_ids"]


def _encoded(samples: list[tuple[Tensor, Tensor]]) -> BatchEncoding:
    return BatchEncoding({"input_ids": torch.stack([x for x, _ in samples]), "labels": None})


def _short_last_batches(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """pp2 x dp2 at ZeRO-3: predict over 11 samples in batches of 2 leaves dp rank 1 a last batch of 1
    (Lightning's predict sampler does not pad), fewer than the 2 micro-batches, where dp rank 0's has 2;
    over 12 it runs."""
    out: dict[str, Any] = {}
    for n in (11, 12, "encoded"):
        strategy = HybridParallelStrategy(pipeline_parallel_size=2, num_microbatches=2, zero_stage=3)
        batches = Batches()
        trainer = _trainer(strategy, world, tmp, [batches])
        # "encoded": the 12 samples as Hugging Face's collators hand them over, a BatchEncoding
        loader = (
            DataLoader(Tokens(12), batch_size=2, collate_fn=_encoded)
            if n == "encoded"
            else DataLoader(Tokens(n), batch_size=2)
        )
        try:
            predictions = trainer.predict(_module(EncodedGPT if n == "encoded" else MetricGPT), loader)
            out[n] = torch.cat([p.detach() for p in predictions])  # type: ignore[union-attr]
        except ValueError as error:
            out[n] = str(error)
        out[f"{n}/batches"] = batches.seen
        strategy.destroy_process_groups()
    # training: 10 samples over 2 dp ranks, 5 each in batches of 2: a last batch of 1, refused before the
    # first step (before: at that batch, after the epoch's other steps)
    strategy = HybridParallelStrategy(pipeline_parallel_size=2, num_microbatches=2, zero_stage=3)
    trained = Batches()
    try:
        _trainer(strategy, world, tmp, [trained]).fit(_module(), DataLoader(Tokens(10), batch_size=2))
        out["train"] = "not refused"
    except ValueError as error:
        out["train"] = str(error)
    out["train/batches"] = trained.trained
    strategy.destroy_process_groups()
    return out


def test_a_last_batch_too_small_for_the_micro_batches_is_refused_on_every_rank_first(tmp_path: Path) -> None:
    """Before, only dp rank 1's ranks raised, at their last batch, after the others' predictions; at
    ZeRO-3 their dp peers then hung in a parameter gather (Gloo: "collective mismatch"). Training keeps
    refusing a batch smaller than the micro-batches; evaluation runs it in fewer, except where ZeRO-3's
    lockstep meets dp ranks whose last batches differ."""
    results = run_distributed(_short_last_batches, 4, str(tmp_path), init_group=False, timeout=300)
    for rank, r in enumerate(results):
        message = r[11]
        assert isinstance(message, str), rank
        # a short batch runs in fewer micro-batches, but at ZeRO-3 the dp ranks' must agree in size
        assert "predict dataloader 0 ends with batches of different sizes on the data-parallel" in message
        assert "(dp rank 0: 2, dp rank 1: 1)" in message and r["11/batches"] == [], rank
        assert isinstance(r[12], Tensor) and len(r[12]) == 6 and r["12/batches"] == [0, 1, 2], rank
        assert "The training dataloader 0 ends with a batch of 1 samples" in r["train"], r["train"]
        assert "drop_last=True" in r["train"] and r["train/batches"] == 0, rank
        # before, each micro-batch computed the whole BatchEncoding and predict returned it twice
        torch.testing.assert_close(r["encoded"], r[12], msg=f"rank {rank}")
