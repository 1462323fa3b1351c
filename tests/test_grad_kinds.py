"""Gradients and parameters of unusual kinds, on 2 Gloo ranks: sparse gradients
(``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``), trainable parameters of two dtypes,
lazy parameters.

Recommender-style models keep their big tables sparse: backward gives each table a sparse COO gradient
holding only the looked-up rows. Torch's DDP (Lightning's ``"ddp"``) all-reduces such gradients as they
are; our gradient buckets are dense, so a sparse gradient is made dense when it is folded into its bucket
(rows not looked up are zero) and the optimizer sees that dense gradient. For SGD and Adagrad the dense
update equals the sparse one, so every ZeRO stage must end where ``"ddp"`` ends.

* A model with a sparse ``Embedding`` and a sparse ``EmbeddingBag`` (sum) beside a dense head, Adagrad,
  two micro-batches per step, trained by Lightning's ``"ddp"`` and by ZeRO 0, 1, 2 (both gradient
  policies: transient buckets per pass, and one persistent buffer) and 3: the final weights equal
  ``"ddp"``'s at fp32 tolerance. Before, stage 0 failed in the first backward ("Cannot access data
  pointer of Tensor that doesn't have storage") and stages 2 and 3 with "copy_() between dense and sparse
  Tensors is not implemented".
* ``torch.optim.SparseAdam``, which needs sparse gradients, is refused at setup with a ``TypeError``
  naming the alternatives, before any step (before: a ``RuntimeError`` from inside the first step at
  stage 0).
* Fabric at ZeRO-3: a loop over the global batches split between the ranks equals the same loop in one
  process.
* A trainable float64 parameter beside float32 ones (``"ddp"`` buckets by dtype; our buckets, shards and
  units are one flat tensor of one dtype) is refused at setup at stages 0 and 3 with a ``TypeError``
  naming it and the fixes, before any step. Before, stages 0-2 stopped with a message blaming the
  precision plugin, and stage 3 silently packed the float64 parameter into a float32 unit (the forward
  then failed on a dtype mismatch).
* A lazy module (``nn.LazyLinear``) not run before fit is refused at setup at stages 0 and 3, naming its
  parameters and the fix (one forward on a sample batch in ``__init__``); before, torch's errors about
  uninitialised parameters came from inside the engine's setup.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from lightning_par.fabric import HybridParallelStrategy as FabricHybridParallelStrategy
from lightning_par.precision import ParallelPrecision
from tests.distributed import run_distributed
from tests.fits import cpu_trainer

WORLD, MICRO, N, ACCUMULATE, SEED = 2, 4, 64, 2, 3
ITEMS, USERS, DIM, BAG = 40, 30, 8, 3
State = dict[str, Tensor]
Batch = tuple[Tensor, Tensor, Tensor]


class Recommender(pl.LightningModule):
    """Item embedding and user bag (both sparse) concatenated into a dense regression head."""

    def __init__(self, optimizer: type[torch.optim.Optimizer] = torch.optim.Adagrad) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.items = nn.Embedding(ITEMS, DIM, sparse=True)
        self.users = nn.EmbeddingBag(USERS, DIM, mode="sum", sparse=True)
        self.head = nn.Linear(2 * DIM, 1)
        self.optimizer_class = optimizer

    def forward(self, items: Tensor, users: Tensor) -> Tensor:
        return self.head(torch.cat([self.items(items), self.users(users)], dim=-1)).squeeze(-1)

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        items, users, y = batch
        return F.mse_loss(self(items, users), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer_class(self.parameters(), lr=0.1)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(SEED)
    return TensorDataset(
        torch.randint(0, ITEMS, (N,), generator=g),
        torch.randint(0, USERS, (N, BAG), generator=g),
        torch.randn(N, generator=g),
    )


def _trainer(strategy: Any) -> pl.Trainer:
    return cpu_trainer(strategy, max_epochs=1, accumulate_grad_batches=ACCUMULATE)


def _fit(strategy: Any) -> State:
    module = Recommender()
    _trainer(strategy).fit(module, DataLoader(_data(), batch_size=MICRO))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _sparse_adam() -> dict[str, Any]:
    module = Recommender(torch.optim.SparseAdam)
    trainer = _trainer(HybridParallelStrategy(zero_stage=0))
    with pytest.raises(TypeError) as info:
        trainer.fit(module, DataLoader(_data(), batch_size=MICRO))
    return {"message": str(info.value), "steps": trainer.global_step}


class Scaled(Recommender):
    """A trainable float64 scale on the head's input (a user's high-precision parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(2 * DIM, dtype=torch.float64))

    def forward(self, items: Tensor, users: Tensor) -> Tensor:
        h = torch.cat([self.items(items), self.users(users)], dim=-1)
        return self.head((h.double() * self.scale).float()).squeeze(-1)


def _two_dtypes(stage: int) -> dict[str, Any]:
    module = Scaled()
    trainer = _trainer(HybridParallelStrategy(zero_stage=stage))
    with pytest.raises(TypeError) as info:
        trainer.fit(module, DataLoader(_data(), batch_size=MICRO))
    return {"message": str(info.value), "steps": trainer.global_step, "dtype": module.scale.dtype}


class Lazy(Recommender):
    """A lazy head (``nn.LazyLinear``), never run before fit."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.LazyLinear(1)


def _lazy(stage: int) -> dict[str, Any]:
    trainer = _trainer(HybridParallelStrategy(zero_stage=stage))
    with pytest.raises(ValueError) as info:
        trainer.fit(Lazy(), DataLoader(_data(), batch_size=MICRO))
    return {"message": str(info.value), "steps": trainer.global_step}


def _global_batch(step: int) -> Batch:
    items, users, y = _data().tensors
    index = torch.arange(step * WORLD * MICRO, (step + 1) * WORLD * MICRO)
    return items[index], users[index], y[index]


def _loop(model: Recommender, optimizer: torch.optim.Optimizer, backward: Any, steps: int) -> None:
    for step in range(steps):
        backward(step)
        optimizer.step()
        optimizer.zero_grad()


def _fabric(rank: int) -> State:
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=FabricHybridParallelStrategy(zero_stage=3))
    fabric.launch()
    model = Recommender()
    module, optimizer = fabric.setup(model, torch.optim.Adagrad(model.parameters(), lr=0.1))
    mine = slice(rank * MICRO, (rank + 1) * MICRO)

    def backward(step: int) -> None:
        items, users, y = _global_batch(step)
        fabric.backward(F.mse_loss(module(items[mine], users[mine]), y[mine]))

    try:
        _loop(model, optimizer, backward, N // (WORLD * MICRO))
        return fabric.strategy.consolidated_state_dict()  # type: ignore[attr-defined, no-any-return]
    finally:
        fabric.strategy.destroy_process_groups()  # type: ignore[attr-defined]  # loop after loop


def _runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    hp = HybridParallelStrategy
    out: dict[str, Any] = {"ddp": _fit("ddp")}
    strategies = {
        "zero0": hp(zero_stage=0),
        "zero1": hp(zero_stage=1),
        "zero2": hp(zero_stage=2),  # transient buckets every pass
        "zero2_boundary": hp(zero_stage=2, grad_sync="boundary"),
        "zero3": hp(zero_stage=3),
    }
    for name, strategy in strategies.items():
        out[name] = _fit(strategy)
        strategy.destroy_process_groups()
    out["sparse_adam"] = _sparse_adam()
    out["two_dtypes"] = [_two_dtypes(stage) for stage in (0, 3)]
    out["lazy"] = [_lazy(stage) for stage in (0, 3)]
    out["fabric_zero3"] = _fabric(rank)
    return out


def test_sparse_gradients_equal_ddp_two_dtypes_and_lazy_parameters_are_refused() -> None:
    ranks = run_distributed(_runs, WORLD, init_group=False, timeout=300)

    # Fabric's reference: the same loop in one process over the whole global batches
    model = Recommender()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)

    def backward(step: int) -> None:
        items, users, y = _global_batch(step)
        F.mse_loss(model(items, users), y).backward()

    _loop(model, optimizer, backward, N // (WORLD * MICRO))
    one_process = model.state_dict()
    initial = Recommender().state_dict()

    for out in ranks:
        reference = out["ddp"]
        for name in ("zero0", "zero1", "zero2", "zero2_boundary", "zero3"):
            assert out[name].keys() == reference.keys()
            for key, value in reference.items():
                torch.testing.assert_close(
                    out[name][key], value, msg=lambda m, n=name, k=key: f"{n} {k}: {m}"
                )
        # training moved the tables (the comparison is not between two untouched copies)
        assert (reference["items.weight"] - initial["items.weight"]).abs().max() > 0.05
        assert (reference["users.weight"] - initial["users.weight"]).abs().max() > 0.05
        refused = out["sparse_adam"]
        assert refused["steps"] == 0
        assert "SparseAdam needs sparse gradients" in refused["message"]
        assert "Adagrad" in refused["message"]
        for refused in out["two_dtypes"]:
            assert refused["steps"] == 0
            assert refused["dtype"] == torch.float64  # the user's parameter is left as it was
            assert "torch.float64: scale (1)" in refused["message"]
            assert "model.to(dtype)" in refused["message"]
        for refused in out["lazy"]:
            assert refused["steps"] == 0
            assert "not initialised yet (lazy modules: head.weight, head.bias)" in refused["message"]
    fabric = ranks[0]["fabric_zero3"]  # the whole state, gathered on rank 0
    assert fabric.keys() == one_process.keys()
    for key, value in one_process.items():
        torch.testing.assert_close(fabric[key], value, msg=lambda m, k=key: f"fabric {k}: {m}")


def test_a_complex_parameter_beside_real_ones_is_told_how_to_train_as_real_pairs() -> None:
    """A cast to one dtype cannot join complex and real parameters: the message names the real-pair
    form instead (torch.view_as_real), and only then."""
    from lightning_par.build import check_params

    mixed = nn.Linear(2, 2)
    mixed.phase = nn.Parameter(torch.ones(3, dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"torch\.complex64: phase.*torch\.view_as_real"):
        check_params(mixed)
    # in bf16 with masters too: the real pairs fix both (master_weights=False would meet this refusal next)
    with pytest.raises(TypeError, match=r"torch\.complex64: phase.*torch\.view_as_real"):
        check_params(mixed, compute_dtype=torch.bfloat16)
    with pytest.raises(TypeError) as info:
        check_params(Scaled())
    assert "view_as_real" not in str(info.value) and "cast the model to one" in str(info.value)
    check_params(nn.Linear(2, 2).to(torch.complex64))  # one dtype, complex: trains (equal to "ddp")


class _Spectral(pl.LightningModule):
    """A learnable complex filter on the rfft of the input (an FNO-style layer): every parameter complex."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(3, dtype=torch.complex64))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (x,) = batch
        return torch.fft.irfft(torch.fft.rfft(x) * self.w, n=4).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            TensorDataset(torch.randn(8, 4, generator=torch.Generator().manual_seed(1))), batch_size=4
        )


def _complex_fits(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    strategy = HybridParallelStrategy(zero_stage=1)
    try:
        cpu_trainer(strategy, precision="bf16-mixed", max_steps=1).fit(_Spectral())
        out["refused"] = ""
    except TypeError as error:
        out["refused"] = str(error)
    strategy.destroy_process_groups()
    plugin = ParallelPrecision("bf16-mixed", master_weights=False)
    strategy = HybridParallelStrategy(zero_stage=1)
    model = _Spectral()
    cpu_trainer(strategy, plugins=[plugin], max_steps=2).fit(model)
    out["dtype"], out["steps"] = model.w.dtype, model.trainer.global_step
    strategy.destroy_process_groups()
    return out


def test_complex_parameters_with_bf16_compute_copies_are_refused() -> None:
    """In bf16-mixed with fp32 masters (ZeRO 1-3) the compute copy of a complex parameter was a real bf16
    tensor: the imaginary part dropped, the first loss already off "ddp" (a probe: 3.185 against 3.403),
    silently. Refused at setup, naming master_weights=False, with which the fit runs. (On 2 forked ranks:
    a run in the test process itself would leave Gloo's threads behind for later forks.)"""
    for out in run_distributed(_complex_fits, 2, init_group=False):
        assert "Complex parameters (w)" in out["refused"], out
        assert "drops the imaginary part" in out["refused"] and "master_weights=False" in out["refused"], out
        assert out["dtype"] == torch.complex64 and out["steps"] == 2, out
