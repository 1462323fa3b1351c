"""The ranks of one tensor- or pipeline-parallel group must read the same batch (``batch_agreement.py``).

Data split by the global rank instead of the data-parallel rank (an ``IterableDataset`` sharded by
``torch.distributed.get_rank()``, as streaming datasets do) fed each rank of a tp or pp group other
samples, and nothing failed: at pp2 the last stage paired the first stage's inputs with other targets.
Now the first batch of each loop is compared over the tp and pp groups and a difference is refused on
every rank, naming the fix. On 2 Gloo ranks: at pp2 the training stream split by global rank is
refused, and so is a validation stream split so; the same stream split by the strategy's
``distributed_sampler_kwargs`` trains equal to one process on its samples; at tp2 x ZeRO-1 (where no
other check sees it) a Llama's token stream split by global rank is refused; in Fabric, a tp2 module's
first forward with per-rank inputs and a pp2 ``pipeline.step`` with per-rank batches are refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from transformers import BatchEncoding

from lightning_par import HybridParallelStrategy
from lightning_par.batch_agreement import batch_fingerprint
from lightning_par.fabric import HybridParallelStrategy as FabricStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state
from tests.third_party import LoraLlama, Tokens, llama

WORLD, N, BATCH, STEPS = 2, 32, 4, 6
PIPED = dict(pipeline_parallel_size=2, num_microbatches=2, partition_method=[2, 1])


def samples() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 8, generator=g)
    return x, x.sum(1, keepdim=True).tanh()


class Stream(IterableDataset[tuple[Tensor, Tensor]]):
    """Samples ``rank, rank + world, ...`` of ``data`` for ``(rank, world) = split()``, asked when the
    iteration starts (as a streaming dataset asks the process group)."""

    def __init__(self, data: tuple[Tensor, ...], split: Callable[[], tuple[int, int]]) -> None:
        self.data, self.split = data, split

    def __iter__(self) -> Iterator[tuple[Tensor, ...]]:
        rank, world = self.split()
        for i in range(rank, len(self.data[0]), world):
            yield tuple(d[i] for d in self.data)


def by_global_rank() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def by_data_parallel_rank(trainer: pl.Trainer) -> Callable[[], tuple[int, int]]:
    def split() -> tuple[int, int]:
        kwargs = trainer.strategy.distributed_sampler_kwargs
        assert kwargs is not None
        return kwargs["rank"], kwargs["num_replicas"]

    return split


class Piped(pl.LightningModule):
    """An MLP cut into two stages (``Linear, Tanh`` | ``Linear``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.net)

    def pipeline_loss(self, output: Tensor, batch: Any) -> Tensor:
        return F.mse_loss(output, batch[1])

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:  # unpipelined; the pipeline's above
        return F.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class PipedVal(Piped):
    """``Piped`` with a validation stream split by the global rank."""

    def val_dataloader(self) -> Any:
        return DataLoader(Stream(samples(), by_global_rank), batch_size=BATCH)


class Augmented(Piped):
    """``Piped`` with dropout in its first stage only, and a noise augmentation drawn from torch's global
    generator after the batch reaches the device (a Lightning hook on the main process)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 1))
        self.seen: list[float] = []

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y = batch
        noisy = x + 0.1 * torch.randn_like(x)
        self.seen.append(float(noisy.sum()))
        return noisy, y


def _augmented() -> list[float]:
    """pp2 with the stages' global generators used by other layers (dropout on one side): before, the
    stages' augmented batches differed from the second step on, silently (the batch check compares a
    loop's first batch only)."""
    strategy = HybridParallelStrategy(**(PIPED | {"partition_method": [3, 1]}))
    module = Augmented()
    cpu_trainer(strategy, max_steps=STEPS, limit_val_batches=0).fit(
        module, DataLoader(TensorDataset(*samples()), batch_size=BATCH)
    )
    strategy.destroy_process_groups()
    return module.seen


def _fit(strategy: HybridParallelStrategy, trainer: pl.Trainer, module: Any, loader: Any) -> dict[str, Any]:
    try:
        trainer.fit(module, loader)
    except RuntimeError as error:
        strategy.destroy_process_groups()
        return {"error": str(error)}
    return {"state": final_state(module, strategy)}


def _piped(split: str, val: bool = False) -> dict[str, Any]:
    strategy = HybridParallelStrategy(**PIPED)
    trainer = cpu_trainer(
        strategy, max_epochs=1, max_steps=STEPS, num_sanity_val_steps=1, limit_val_batches=1
    )
    chosen = by_global_rank if split == "global" else by_data_parallel_rank(trainer)
    loader = DataLoader(Stream(samples(), chosen), batch_size=BATCH)
    return _fit(strategy, trainer, PipedVal() if val else Piped(), loader)


def _llama_tp() -> dict[str, Any]:
    strategy = HybridParallelStrategy(zero_stage=1, tensor_parallel_size=2, tp_plan="llama")
    tokens = Tokens(8)
    loader = DataLoader(Stream((tokens.data[:, :-1], tokens.data[:, 1:]), by_global_rank), batch_size=2)
    return _fit(strategy, cpu_trainer(strategy, max_steps=2), LoraLlama(lora=False), loader)


def _fabric(rank: int, world: int, pipelined: bool) -> str | None:
    options = dict(PIPED, pipeline_layers=lambda m: list(m)) if pipelined else {}
    strategy = FabricStrategy(
        **options,  # type: ignore[arg-type]
        **({} if pipelined else dict(tensor_parallel_size=2, tp_plan="llama")),
    )
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    x, y = samples()
    mine = slice(rank * BATCH, rank * BATCH + BATCH)  # each rank its own samples: wrong for tp / pp
    try:
        if pipelined:
            net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
            fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
            strategy.pipeline.step((x[mine], y[mine]), loss_fn=lambda out, micro: F.mse_loss(out, micro[1]))
        else:
            model = fabric.setup(llama(0))
            ids = Tokens(8).data[mine, :-1]
            model(input_ids=ids, use_cache=False)
        error = None
    except RuntimeError as refused:
        error = str(refused)
    strategy.destroy_process_groups()
    return error


def _runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {
        "pp/global": _piped("global"),
        "pp/val_global": _piped("dp", val=True),
        "pp/dp": _piped("dp"),
        "tp/global": _llama_tp(),
        "fabric_tp": _fabric(rank, world, pipelined=False),
        "fabric_pp": _fabric(rank, world, pipelined=True),
        "pp/augmented": _augmented(),
    }


def test_ranks_of_a_model_parallel_group_must_read_the_same_batch() -> None:
    results = run_distributed(_runs, WORLD, init_group=False, timeout=300)
    fix = "trainer.strategy.distributed_sampler_kwargs"
    augmented = [out["pp/augmented"] for out in results]
    assert len(augmented[0]) == STEPS and augmented[0] == augmented[1], augmented  # one batch per step
    for rank, out in enumerate(results):
        for key, kind, loop in (
            ("pp/global", "pipeline", "training"),
            ("pp/val_global", "pipeline", "validation"),
            ("tp/global", "tensor-parallel", "training"),
        ):
            message = out[key].get("error", "")
            expected = f"The ranks of one {kind} group were given different {loop} batches"
            assert message.startswith(expected) and "[1] differs from that of rank 0" in message, (rank, key)
            assert fix in message, (rank, key, message)
        for key, kind, loop in (
            ("fabric_tp", "tensor-parallel", "forward"),
            ("fabric_pp", "pipeline", "training"),
        ):
            message = out[key] or ""
            assert message.startswith(f"The ranks of one {kind} group were given different {loop}"), (
                rank,
                key,
            )
    # split by the data-parallel rank (1 at pp2): both stages read every sample, equal to one process
    torch.manual_seed(0)
    reference = Piped()
    optimizer = reference.configure_optimizers()
    x, y = samples()
    for step in range(STEPS):
        rows = slice(step * BATCH, step * BATCH + BATCH)
        F.mse_loss(reference.net(x[rows]), y[rows]).backward()
        optimizer.step()
        optimizer.zero_grad()
    state = results[0]["pp/dp"]["state"]
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, msg=name)


@dataclasses.dataclass
class Pair:
    x: Tensor
    y: Tensor


def test_batch_fingerprint_tells_batches_apart() -> None:
    cpu = torch.device("cpu")
    x, y = samples()
    batch = {"x": x[:4], "y": y[:4], "tag": "a"}
    same = batch_fingerprint({"x": x[:4].clone(), "y": y[:4].clone(), "tag": "b"}, device=cpu)
    torch.testing.assert_close(batch_fingerprint(batch, device=cpu), same, rtol=0, atol=0)
    for other in (
        {"x": x[4:8], "y": y[:4]},  # other samples
        {"x": x[:4].flip(0), "y": y[:4]},  # the same samples in another order
        {"x": x[:4].reshape(16, 2), "y": y[:4]},  # another shape
        {"x": x[:4]},  # a tensor fewer
    ):
        assert not torch.equal(batch_fingerprint(other, device=cpu), batch_fingerprint(batch, device=cpu))
    # Hugging Face's BatchEncoding (a UserDict, a leaf to torch's pytree) and dataclasses are looked into:
    # before, such batches had no tensors to compare and any two agreed
    encoded = BatchEncoding({"x": x[:4], "y": y[:4]})
    torch.testing.assert_close(batch_fingerprint(encoded, device=cpu), same, rtol=0, atol=0)
    assert not torch.equal(
        batch_fingerprint(BatchEncoding({"x": x[4:8], "y": y[:4]}), device=cpu),
        batch_fingerprint(encoded, device=cpu),
    )
    assert not torch.equal(
        batch_fingerprint(Pair(x[:4], y[:4]), device=cpu), batch_fingerprint(Pair(x[4:8], y[:4]), device=cpu)
    )
    # sparse and nested tensors count by their indices and values / components (before, the fingerprint's
    # reshape failed in torch: "reshape is not implemented for sparse tensors", at tp's first batch)
    dense, bumped = x[:4], x[:4].clone()
    bumped[0, 0] += 1
    for layout in (Tensor.to_sparse, Tensor.to_sparse_csr, _nested):
        same = batch_fingerprint({"x": layout(dense.clone())}, device=cpu)
        torch.testing.assert_close(batch_fingerprint({"x": layout(dense)}, device=cpu), same, rtol=0, atol=0)
        assert not torch.equal(batch_fingerprint({"x": layout(bumped)}, device=cpu), same), layout


def _nested(x: Tensor) -> Tensor:
    return torch.nested.nested_tensor([row[: 2 + i] for i, row in enumerate(x)], layout=torch.jagged)
