"""A model split into pipeline stages refuses whole-model calls and saves by name, and Lightning's
``ModelSummary`` (on by default) no longer runs the split model's forward on ``example_input_array``.

Before: a pp2 fit with an example input (what ``partition_method="profile"`` needs) and the Trainer's
default summary failed at fit start with torch's "Tensor on device meta is not on the expected device cpu";
after the fit, ``model.generate(...)`` failed the same way, ``model.save_pretrained(dir)`` raised "Cannot
copy out of meta tensor" and ``torch.save(model.state_dict())`` (also of the whole LightningModule) wrote
the other stages' placeholders, silently. The test fits a Hugging Face Llama at pp2 with the profiled cut
and the summary on, compares its weights with a one-process loop over the same batches, checks the
refusals, and that the documented way out (``consolidated_state_dict()`` into an unsplit model; or a copy
whose placeholders were replaced by ``load_state_dict(assign=True)``) generates the one-process model's
tokens."""

from __future__ import annotations

import copy
import io
import tempfile
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.pipeline import hf_pipeline_layers
from tests.distributed import run_distributed
from tests.third_party import Tokens, llama, replay_order

N, BATCH, STEPS, LR = 8, 4, 2, 0.1
PROMPT = torch.tensor([[1, 2, 3]])


class SplitLlama(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = llama(0)
        self._layers: list[Any] = []
        self.example_input_array = torch.tensor([[1, 2, 3, 4]])
        self.seen: dict[str, Any] = {}

    def on_fit_start(self) -> None:  # the user's own hooks see the example input (the summary does not)
        self.seen["on_fit_start"] = self.example_input_array

    def on_train_start(self) -> None:
        self.seen["on_train_start"] = self.example_input_array

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids).logits

    def pipeline_layers(self) -> list[Any]:
        if not self._layers:
            self._layers = hf_pipeline_layers(self.model)
        return self._layers

    def pipeline_loss(self, out: Tensor, batch: Any) -> Tensor:
        return F.cross_entropy(out.flatten(0, 1), batch[1].flatten())

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:  # not run under the pipeline
        raise AssertionError("training_step runs under pipeline parallelism")

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:  # not run under the pipeline
        raise AssertionError("validation_step runs under pipeline parallelism")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class PropertyLlama(SplitLlama):
    """The example input as a read-only property (nanoGPT-style modules compute it from their config)."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        self.model = llama(0)
        self._layers = []
        self.seen = {}

    @property  # type: ignore[override]
    def example_input_array(self) -> Tensor:
        return torch.tensor([[1, 2, 3, 4]])


class GraphLogger(CSVLogger):
    """What ``TensorBoardLogger(log_graph=True)`` does at the start of every trainer function: trace the
    module's forward on its example input (tensorboard is not a test dependency)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self._log_graph = True

    @rank_zero_only
    def log_graph(self, model: Any, input_array: Any = None) -> None:
        model(model.example_input_array if input_array is None else input_array)


def _error(call: Any) -> str:
    try:
        call()
    except RuntimeError as error:
        return str(error)
    return "no error"


def _generate(model: torch.nn.Module) -> list[int]:
    return model.generate(PROMPT, max_new_tokens=3, do_sample=False, pad_token_id=0)[0].tolist()  # type: ignore[operator]


def _job(rank: int, world: int, root: str) -> dict[str, Any]:
    pl.seed_everything(0)
    module = SplitLlama()
    example = module.example_input_array
    strategy = HybridParallelStrategy(
        pipeline_parallel_size=2, num_microbatches=2, partition_method="profile"
    )
    # the user's own instance attribute on the summary callback survives the run (before, deleted)
    summary, calls = ModelSummary(), []
    inner = summary.on_fit_start
    summary.on_fit_start = lambda *a: (calls.append(1), inner(*a))  # type: ignore[method-assign,assignment,func-returns-value]
    mine = summary.on_fit_start
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=GraphLogger(root),
        enable_checkpointing=False, enable_progress_bar=False, callbacks=[summary],
    )  # fmt: skip
    trainer.fit(module, DataLoader(Tokens(N), batch_size=BATCH))
    # the graph logger at validate too (Lightning logs the graph at every trainer function's start)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validated = trainer.validate(module, DataLoader(Tokens(N), batch_size=BATCH), verbose=False)
    graph_skipped = any("log_graph is skipped" in str(w.message) for w in caught)
    out: dict[str, Any] = {
        "example_back": module.example_input_array is example,
        "hooks_saw": {hook: value is example for hook, value in module.seen.items()},
        "user_hook": (vars(summary).get("on_fit_start") is mine, len(calls)),
        "validated": validated[0]["val_loss"],
        "graph_skipped": graph_skipped,
        "generate": _error(lambda: _generate(module.model)),
        "forward": _error(lambda: module(PROMPT)),
        "save_pretrained": _error(lambda: module.model.save_pretrained(f"{root}/r{rank}")),
        "state_dict": _error(lambda: module.model.state_dict()),
        "root_state_dict": _error(lambda: module.state_dict()),  # torch.save(pl_module.state_dict())
        "pickled": _error(lambda: torch.save(module.model, io.BytesIO())),
    }
    state = strategy.consolidated_state_dict()  # collective: the documented way out
    strategy.destroy_process_groups()
    # a read-only example property cannot be hidden: the summary is skipped, with a warning, and the fit runs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other = pl.Trainer(
            accelerator="cpu", devices=world, max_steps=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, strategy=HybridParallelStrategy(
                pipeline_parallel_size=2, num_microbatches=2, partition_method="profile"
            ),
        )  # fmt: skip
        other.fit(PropertyLlama(), DataLoader(Tokens(N), batch_size=BATCH))
        other.strategy.destroy_process_groups()  # type: ignore[attr-defined]
    out["property_warned"] = any("model summary is skipped" in str(w.message) for w in caught)
    if rank == 0:
        weights = {k[len("model.") :]: v for k, v in state.items()}
        out["weights"] = weights
        fresh = llama(0)
        fresh.load_state_dict(weights)
        out["fresh_tokens"] = _generate(fresh)
        # a copy of the split model whose placeholders were replaced runs and saves
        whole = copy.deepcopy(module.model)
        whole.load_state_dict(weights, assign=True)
        out["copy_tokens"] = _generate(whole)
        out["copy_saved"] = sorted(whole.state_dict()) == sorted(weights)
    return out


def _reference() -> tuple[dict[str, Tensor], list[int], float]:
    """One process, the model's own forward over the batches Lightning's sampler gave the pp ranks; the
    trained weights, their greedy tokens and the validation loss (the mean of equal batches' means)."""
    model = llama(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = Tokens(N)
    for indices in replay_order(N, dp=1, micro=BATCH, epochs=1, seed=0)[:STEPS]:
        ids = torch.stack([data[i][0] for i in indices])
        labels = torch.stack([data[i][1] for i in indices])
        loss = F.cross_entropy(model(input_ids=ids).logits.flatten(0, 1), labels.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        ids, labels = (torch.stack(t) for t in zip(*(data[i] for i in range(N)), strict=True))
        val_loss = float(F.cross_entropy(model(input_ids=ids).logits.flatten(0, 1), labels.flatten()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, _generate(model), val_loss


def test_split_model_refuses_whole_calls_and_summary_runs() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_job, 2, root, init_group=False, timeout=300)
    weights, tokens, val_loss = _reference()
    for rank, out in enumerate(results):
        assert out["example_back"], f"rank {rank}: example_input_array not put back after fit"
        assert out["hooks_saw"] == {"on_fit_start": True, "on_train_start": True}, out["hooks_saw"]
        assert out["user_hook"] == (True, 1), out["user_hook"]
        assert out["validated"] == pytest.approx(val_loss, rel=1e-5), (out["validated"], val_loss)
        for what in ("generate", "forward"):
            assert f"called on pipeline stage {rank}" in out[what], (what, out[what])
            assert "consolidated_state_dict()" in out[what], out[what]
        assert f"pickled (torch.save(model), pickle.dumps) on pipeline stage {rank}" in out["pickled"]
        assert "consolidated_state_dict()" in out["pickled"], out["pickled"]
        assert "state_dict() of the whole model (SplitLlama)" in out["root_state_dict"], out[
            "root_state_dict"
        ]
        for what in ("save_pretrained", "state_dict", "root_state_dict"):
            assert "placeholders of layers that live on other pipeline stages" in out[what], out[what]
            assert "consolidated_state_dict()" in out[what], out[what]
    first = results[0]
    assert first["property_warned"] and first["graph_skipped"]  # warned on rank 0
    assert sorted(first["weights"]) == sorted(weights)
    for name, value in weights.items():
        torch.testing.assert_close(first["weights"][name], value, msg=lambda m, n=name: f"{n}: {m}")
    assert first["fresh_tokens"] == tokens
    assert first["copy_tokens"] == tokens
    assert first["copy_saved"]
