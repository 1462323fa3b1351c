"""Logged sums and torchmetrics under tensor parallelism count each sample once, on 4 Gloo ranks (tp2 x dp2).

The two ranks of a tensor-parallel group run the same samples. Before, ``self.log(..., reduce_fx="sum",
sync_dist=True)`` and torchmetrics objects reduced over the whole world, so each sample counted twice: at
tp2 on 2 ranks a logged sample count of 8 came out 16, a ``SumMetric`` doubled and a ``CatMetric`` held
each value twice (means were right only because identical copies leave them unchanged). Now they reduce
over the data-parallel group (``lightning_par/data_reduce.py``). Checked on a Hugging Face Llama against
the same model in one process over all the samples:

* Trainer ``validate`` at tp2 x dp2 (ZeRO-1 and ZeRO-3): a logged sum and mean, torchmetrics
  ``SumMetric``, ``CatMetric`` and ``MeanSquaredError`` logged through ``self.log``; a metric deep-copied
  during the run shares its group, a pickled one gathers over the world, and after the run the metrics
  are as they were; ``reduce_boolean_decision`` still takes every rank's vote;
* Fabric at tp2 x dp2: a ``SumMetric`` inside the module set up, computed after two batches;
* metrics read after the run (Lightning tears the strategy down before ``on_fit_end``, the ``teardown``
  hooks and the user's code after ``validate``) and metrics made in a hook, kept in a plain dict: before,
  both gathered over the world and doubled; the ``dist_sync_fn`` now goes with the process groups;
* metrics in nested containers (a ``MetricCollection`` in a dict, a metric two dicts deep), one made
  inside the first step, at a second dataloader's first batch or at a later batch (a dict filled by
  ``setdefault``), one held in a dataclass, and one kept by a user's callback (made in ``__init__`` or
  at its first batch): before, each doubled;
  ``self.all_gather`` of the world (each sample TP times) warns once on rank 0, naming the user's line,
  and not with the dp group;
* pp2 x dp2: a sample count updated in ``on_train_batch_end``, which every stage runs (before, counted
  once per stage), and one updated in ``pipeline_eval``, on the last stage only.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from lightning_par.fabric import HybridParallelStrategy as FabricStrategy
from lightning_par.pipeline import hf_pipeline_layers
from tests.distributed import run_distributed
from tests.fits import cpu_trainer
from tests.third_party import LLAMA, llama

WORLD, TP, N, BATCH, SEQ = 4, 2, 8, 2, 16


def _ids() -> Tensor:
    return torch.randint(0, LLAMA["vocab_size"], (N, SEQ), generator=torch.Generator().manual_seed(3))


def _sample_losses(model: nn.Module, ids: Tensor) -> Tensor:
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="none").view(ids.shape).mean(1)


class Scored(pl.LightningModule):
    """A user's evaluation: a per-sample loss summed, averaged and kept, by ``self.log`` and torchmetrics."""

    def __init__(self) -> None:
        super().__init__()
        self.model = llama(seed=0)
        self.total = torchmetrics.SumMetric()
        self.values = torchmetrics.CatMetric()
        self.mse = torchmetrics.MeanSquaredError()
        self.after = torchmetrics.SumMetric()  # read after validate
        self.late: dict[str, torchmetrics.Metric] = {}  # made in a hook, in a plain dict
        # nested containers: a collection in a dict, a metric two dicts deep (before, not found: doubled)
        self.nested = {"val": {"sum": torchmetrics.SumMetric()}}
        self.collections = {"val": torchmetrics.MetricCollection({"sum": torchmetrics.SumMetric()})}
        self.seen: dict[str, Any] = {}

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        (ids,) = batch
        losses = _sample_losses(self.model, ids)
        self.total.update(losses)
        self.values.update(losses)
        self.mse.update(losses, torch.zeros_like(losses))
        self.after.update(losses)
        self.late["sum"].update(losses)
        self.nested["val"]["sum"].update(losses)
        self.collections["val"].update(losses)
        if not hasattr(self, "lazy"):  # made in the first step (before, found only at the next loop run)
            self.lazy = torchmetrics.SumMetric().to(self.device)
        self.lazy.update(losses)
        self.last_losses = losses  # for the user's callback
        if batch_idx == 0:  # the world's gather holds each sample TP times: warned, on rank 0
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                gathered = self.all_gather(losses)
                self.all_gather(losses, group=self.trainer.strategy.mesh.dp_group)  # type: ignore[attr-defined]
            self.seen["gathered"] = gathered.shape[0]
            # named at the user's line (this file), so each calling line warns once
            self.seen["gather_warned"] = [
                (str(w.message), w.filename) for w in caught if "all_gather" in str(w.message)
            ]
        n = ids.shape[0]
        self.log("samples", float(n), reduce_fx="sum", sync_dist=True, batch_size=n)
        self.log("loss_mean", losses.mean(), sync_dist=True, batch_size=n)
        self.log("total", self.total)
        self.log("mse", self.mse)

    def on_validation_start(self) -> None:
        # a metric copied during the run shares the group; a pickled one gathers over the world
        self.seen["copy_shares"] = copy.deepcopy(self.total).dist_sync_fn is self.total.dist_sync_fn
        self.seen["pickled"] = pickle.loads(pickle.dumps(self.total)).dist_sync_fn.group

    def on_validation_epoch_start(self) -> None:
        self.late["sum"] = torchmetrics.SumMetric().to(self.device)

    def on_validation_epoch_end(self) -> None:
        self.seen["values"] = self.values.compute()
        self.values.reset()
        self.seen["late"] = self.late["sum"].compute()
        self.seen["nested"] = self.nested["val"]["sum"].compute()
        self.seen["collection"] = self.collections["val"].compute()["sum"]
        self.seen["lazy"] = self.lazy.compute()
        self.seen["copy"] = copy.deepcopy(self.total)  # kept by the user past the run


class CountingCallback(pl.Callback):
    """A user's callback keeping its own metric (before, not found: each sample counted TP times)."""

    def __init__(self) -> None:
        self.total = torchmetrics.SumMetric()
        self.value: Tensor | None = None

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.total.to(pl_module.device).update(pl_module.last_losses)  # type: ignore[arg-type]

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.value = self.total.compute()


@dataclass
class Counts:
    """A user's record holding a metric (a dataclass attribute of the module)."""

    seen: torchmetrics.SumMetric


class PerLoader(pl.LightningModule):
    """Two validation dataloaders, a count per dataloader made at its first batch (before, the second
    dataloader's counted each sample TP times in the first validation) and one held in a dataclass."""

    def __init__(self) -> None:
        super().__init__()
        self.model = llama(seed=0)
        self.per_loader: dict[int, torchmetrics.SumMetric] = {}
        self.counts = Counts(seen=torchmetrics.SumMetric())
        self.by_batch: dict[str, torchmetrics.SumMetric] = {}
        self.outputs: list[Tensor] = []
        self.read: dict[str, float] = {}

    def validation_step(self, batch: list[Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        n = torch.tensor(float(batch[0].shape[0]), device=self.device)
        self.per_loader.setdefault(dataloader_idx, torchmetrics.SumMetric().to(self.device)).update(n)
        self.counts.seen.update(n)
        # made at a later batch of a loader (before, found by no scan: doubled), beside a list of outputs
        key = f"{dataloader_idx}:{'first' if batch_idx == 0 else 'later'}"
        self.by_batch.setdefault(key, torchmetrics.SumMetric().to(self.device)).update(n)
        self.outputs.append(n)

    def on_validation_epoch_end(self) -> None:
        self.read = {f"loader{k}": float(m.compute()) for k, m in self.per_loader.items()}
        self.read["dataclass"] = float(self.counts.seen.compute())
        self.read |= {k: float(m.compute()) for k, m in self.by_batch.items()}


class LazyCallback(pl.Callback):
    """A callback making its metric at its first batch, when the device is known (before, not found by a
    scan until the next loop run: doubled in the first one)."""

    def __init__(self) -> None:
        self.total: torchmetrics.SumMetric | None = None
        self.value = 0.0

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if args[3] != 1:  # the second loader's samples: made after its first-batch scan, no scan follows
            return
        if self.total is None:
            self.total = torchmetrics.SumMetric().to(pl_module.device)
        self.total.update(torch.tensor(float(args[1][0].shape[0]), device=pl_module.device))

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.total is not None
        self.value = float(self.total.compute())


def _trainer_runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    loader = DataLoader(TensorDataset(_ids()), batch_size=BATCH)
    for stage in (1, 3):
        module, counting = Scored(), CountingCallback()
        strategy = HybridParallelStrategy(zero_stage=stage, tensor_parallel_size=TP, tp_plan="llama")
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=strategy,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            callbacks=[counting],
        )
        (logged,) = trainer.validate(module, loader, verbose=False)
        module.seen["callback"] = counting.value
        kept = module.seen.pop("copy")
        out[f"zero{stage}"] = {**logged, **module.seen, "after": module.after.compute()}
        out[f"zero{stage}_votes"] = [
            strategy.reduce_boolean_decision(rank == 0, all=False),
            strategy.reduce_boolean_decision(rank != world - 1, all=True),
            strategy.reduce_boolean_decision(True, all=True),
        ]
        strategy.destroy_process_groups()
        metrics = (module.total, module.values, module.mse, module.after, module.late["sum"])
        out[f"zero{stage}_restored"] = [m.dist_sync_fn for m in metrics]
        # the copy syncs as a plain metric now, over the world (before, over the destroyed dp group)
        kept.update(torch.ones(1))
        out[f"zero{stage}_copy"] = kept.compute()
    module, loader = PerLoader(), DataLoader(TensorDataset(_ids()), batch_size=BATCH)
    strategy = HybridParallelStrategy(zero_stage=1, tensor_parallel_size=TP, tp_plan="llama")
    lazy = LazyCallback()
    trainer = cpu_trainer(strategy, devices=world, callbacks=[lazy])
    trainer.validate(module, [loader, loader], verbose=False)
    out["per_loader"] = module.read | {"lazy_callback": lazy.value}
    strategy.destroy_process_groups()
    out["fabric"] = _fabric_run(rank, world)
    out["pp"] = _pipelined_run(world)
    return out


class Pipelined(pl.LightningModule):
    """Under pp2: a sample count in a hook every stage runs, one in ``pipeline_eval`` (the last stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = llama(seed=0)
        self._layers: list[nn.Module] = []
        self.trained = torchmetrics.SumMetric()
        self.evaluated = torchmetrics.SumMetric()
        self.seen: dict[str, Any] = {}

    def pipeline_layers(self) -> list[nn.Module]:
        self._layers = self._layers or hf_pipeline_layers(self.model)
        return self._layers

    def pipeline_loss(self, logits: Tensor, batch: list[Tensor]) -> Tensor:
        (ids,) = batch
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:  # Lightning asks for one
        return self.pipeline_loss(self.model(input_ids=batch[0]).logits, batch)

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        self.pipeline_eval(self.model(input_ids=batch[0]).logits, batch)

    def pipeline_eval(self, logits: Tensor, batch: list[Tensor]) -> dict[str, Tensor]:
        self.evaluated.update(torch.tensor(float(batch[0].shape[0])))
        return {"n": torch.tensor(float(batch[0].shape[0]))}

    def on_train_batch_end(self, outputs: Any, batch: list[Tensor], batch_idx: int) -> None:
        self.trained.update(torch.tensor(float(batch[0].shape[0])))

    def on_train_epoch_end(self) -> None:
        self.seen["trained"] = self.trained.compute()

    def on_validation_epoch_end(self) -> None:
        self.seen["evaluated"] = self.evaluated.compute()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _pipelined_run(world: int) -> dict[str, Any]:
    module = Pipelined()
    strategy = HybridParallelStrategy(pipeline_parallel_size=2, num_microbatches=2)
    trainer = cpu_trainer(strategy, devices=world, max_epochs=1, num_sanity_val_steps=0)
    loader = DataLoader(TensorDataset(_ids()), batch_size=BATCH)
    trainer.fit(module, loader, loader)
    out = {**module.seen, "after": module.trained.compute()}
    strategy.destroy_process_groups()
    return out


class Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = llama(seed=0)
        self.total = torchmetrics.SumMetric()


def _fabric_run(rank: int, world: int) -> Tensor:
    strategy = FabricStrategy(zero_stage=0, tensor_parallel_size=TP, tp_plan="llama")
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = fabric.setup(Wrapped())
    mesh = strategy.mesh
    ids = _ids()[mesh.dp_rank :: mesh.dp_size]  # this data-parallel rank's samples, as the sampler gives
    with torch.no_grad():
        for batch in ids.split(BATCH):
            model.total.update(_sample_losses(model.model, batch))
    return model.total.compute()


def test_logged_sums_and_metrics_count_each_sample_once_under_tensor_parallelism() -> None:
    torch.set_num_threads(1)
    with torch.no_grad():
        losses = _sample_losses(llama(seed=0), _ids())
    results = run_distributed(_trainer_runs, WORLD, init_group=False)
    for rank, got in enumerate(results):
        for stage in ("zero1", "zero3"):
            run = got[stage]
            assert run["samples"] == N, (rank, stage, run["samples"])  # 16 before
            torch.testing.assert_close(run["loss_mean"], float(losses.mean()), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(run["total"], float(losses.sum()), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(run["mse"], float((losses**2).mean()), rtol=1e-5, atol=1e-5)
            assert run["values"].shape == (N,), (rank, stage)  # each value twice before
            kept = run["values"].sort().values
            torch.testing.assert_close(kept, losses.sort().values, rtol=1e-5, atol=1e-6)
            assert run["copy_shares"] and run["pickled"] is None, (rank, stage)
            assert got[f"{stage}_restored"] == [None] * 5, (rank, stage)  # with the groups
            # each of the world's 4 ranks added one; the world holds each sample TP times
            torch.testing.assert_close(got[f"{stage}_copy"], TP * losses.sum() + WORLD, rtol=1e-5, atol=1e-5)
            assert got[f"{stage}_votes"] == [True, False, True], (rank, stage)
        torch.testing.assert_close(got["fabric"], losses.sum(), rtol=1e-5, atol=1e-5)
        for stage in ("zero1", "zero3"):
            run = got[stage]
            # read after the run (16.6 before: doubled) and made in a hook (doubled too)
            torch.testing.assert_close(run["after"], losses.sum(), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(run["late"], losses.sum(), rtol=1e-5, atol=1e-5)
            for where in ("nested", "collection", "lazy", "callback"):  # each doubled before
                torch.testing.assert_close(run[where], losses.sum(), rtol=1e-5, atol=1e-5, msg=where)
            # the world's gather stacks the 4 ranks' batches: each sample TP times
            assert run["gathered"] == WORLD, (rank, stage, run["gathered"])
            warned = run["gather_warned"]
            assert len(warned) == (1 if rank == 0 else 0), (rank, stage, warned)
            assert all("group=strategy.mesh.dp_group" in w and f == __file__ for w, f in warned), warned
        # both loaders count in the dataclass; each loader's first and later batches half of its samples
        wanted = {"loader0": N, "loader1": N, "dataclass": 2 * N}
        wanted |= {f"{i}:{when}": N // 2 for i in (0, 1) for when in ("first", "later")}
        wanted["lazy_callback"] = N  # the second loader's samples
        assert got["per_loader"] == wanted, (rank, got["per_loader"])
        # each sample once under pp2 x dp2 (before, the hook's count was 2N: once per stage)
        assert got["pp"] == {"trained": N, "evaluated": N, "after": N}, (rank, got["pp"])
