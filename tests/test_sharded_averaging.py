"""``ShardedEMA`` (Lightning's ``EMAWeightAveraging`` contract, each rank averaging what it owns) against
Lightning's own ``EMAWeightAveraging`` under ``"ddp"`` on 2 Gloo ranks, and against one process under
tensor and pipeline parallelism and in Fabric loops.

* A model with BatchNorm (Linear without bias, BatchNorm1d, ReLU, Linear; SGD with momentum), 2 epochs of
  4 steps, validation after each epoch (run on the averaged weights): at ZeRO 0-3 in ``32-true`` the
  final weights and averaged BatchNorm statistics and every validation loss equal ``"ddp"``'s. The
  integer ``num_batches_tracked`` is the one difference: Lightning "averages" it (its EMA of a counter,
  truncated to an integer), ours keeps the count. At ZeRO 1-3 each rank averages only its fragments:
  the ranks' averages together hold each trainable element once. With manual optimization at ZeRO-3
  (the root unit stays gathered between steps) the validation losses equal ``"ddp"``'s too: a swap
  frees gathered units.
* ``bf16-mixed`` with BatchNorm at ZeRO 1-3 (separate fp32 masters, norms computed in fp32): before, the
  backward failed ("mixed dtype (CPU): expect parameter to have scalar type of Float"), because the fp32
  norm swapped the parameters' storage for the call and the graph met the 16-bit storage again. Now the
  EMA's final weights are as near the ``32-true`` run as ``"ddp"``'s own ``bf16-mixed`` run.
* Checkpoints: a ``ModelCheckpoint`` after epoch 1, resumed for epoch 2, ends equal to the uninterrupted
  ``"ddp"`` run, from our sharded checkpoints (ZeRO-2 into ZeRO-2 and into ZeRO-3, ZeRO-3 into ZeRO-3),
  from our single file (ZeRO-0) and from Lightning's own ``"ddp"`` file into ZeRO-3; ``consolidate()`` of
  a sharded one, and ZeRO-3's single file (``save_distributed_checkpoint=False``), have Lightning's
  layout (the averaged model as ``state_dict``, ``current_model_state``, ``averaging_state``) with
  Lightning's values. Saved after ``fit`` (``trainer.save_checkpoint``; the model holds the averages)
  and resumed, ZeRO 0, 2 and 3 end as ``"ddp"`` does so, and our file and the consolidated per-rank files
  have Lightning's layout. ``FlashCheckpoint`` snapshots every 2 steps change nothing (resumed from:
  ``tests/test_flash_averages.py``).
* A Hugging Face Llama at tp 2 with ZeRO-1 equals one process with ``EMAWeightAveraging``.
* A Hugging Face ResNet in 2 pipeline stages with ZeRO-1 equals one process with ``EMAWeightAveraging``.
* The core alone: averages follow their fragments when ZeRO-2 rebuilds its buckets; Fabric's
  ``strategy.weight_averages()`` at ZeRO 0/2/3 equals one process's EMA, also saved with ``fabric.save``
  and loaded at another stage.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint, WeightAveraging
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.optim.swa_utils import get_ema_multi_avg_fn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_par import HybridParallelStrategy
from lightning_par.averaging import WeightAverages, ema_rule
from lightning_par.callbacks import FlashCheckpoint, ShardedEMA, ShardedWeightAveraging
from lightning_par.checkpoint import consolidate
from lightning_par.fabric import FlashSnapshots
from lightning_par.fabric import HybridParallelStrategy as FabricHybridParallelStrategy
from lightning_par.zero.engine import apply_zero
from tests.distributed import run_distributed
from tests.fits import final_state
from tests.probes import SlowSnapshotCopies
from tests.test_batchnorm import SEED, Images, ResNetModule
from tests.test_pp_batchnorm import BATCH, M, N, PipelinedResNet
from tests.test_pp_trainer import _trainer
from tests.third_party import llama

WORLD, DECAY, SLOW_COPY_S = 2, 0.6, 0.3
State = dict[str, Tensor]


class BatchNormNet(pl.LightningModule):
    def __init__(self, *, manual: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = not manual
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1)
        )
        self.validation_losses: list[Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        optimizer.step()  # type: ignore[union-attr]
        return None

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("val", loss, sync_dist=True)
        if not self.trainer.sanity_checking:
            self.validation_losses.append(loss.detach().float().clone())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    return DataLoader(
        TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)), batch_size=4
    )


def _fit(
    strategy: Any,
    *,
    epochs: int = 2,
    precision: str = "32-true",
    save_to: Path | None = None,
    ckpt_path: str | None = None,
    manual: bool = False,
    flash: Path | None = None,
    save_after: Path | None = None,
) -> dict[str, Any]:
    ours = isinstance(strategy, HybridParallelStrategy)
    averaging = ShardedEMA(decay=DECAY) if ours else EMAWeightAveraging(decay=DECAY)
    callbacks: list[Any] = [averaging]
    if save_to is not None:
        callbacks.append(ModelCheckpoint(dirpath=save_to, every_n_epochs=1, save_top_k=-1))
    if flash is not None:  # a snapshot every 2 steps (persisted), resumed by the next fit on the same path
        callbacks.append(
            FlashCheckpoint(flash, every_n_steps=2, persist_every_n_steps=2, shm_dir=flash / "shm")
        )
    module = BatchNormNet(manual=manual)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_epochs=epochs,
        precision=precision,  # type: ignore[arg-type]
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=save_to is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=1,  # averages made before ZeRO 1/2 rebuild their buckets at the first backward
    )
    held = 0
    if ours:  # the elements this rank averages, seen at the end of training
        original = averaging.on_train_end

        def count(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            nonlocal held
            assert averaging.averages is not None
            held = sum(t.numel() for *_, t in averaging.averages.targets())
            original(trainer, pl_module)

        averaging.on_train_end = count  # type: ignore[method-assign]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, _data(), _data(), ckpt_path=ckpt_path)
        if save_after is not None:  # after fit: the model holds the averaged weights
            trainer.save_checkpoint(save_after)
    return {
        "warnings": [str(w.message) for w in caught if "ShardedWeightAveraging" in str(w.message)],
        "state": final_state(module, strategy),
        "validation": torch.stack(module.validation_losses),
        "held": held,
    }


def _runs(rank: int, world: int, root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {
        "ddp": _fit(DDPStrategy()),
        "ddp_bf16": _fit(DDPStrategy(), precision="bf16-mixed"),
    }
    for stage in (0, 1, 2, 3):
        out[f"z{stage}"] = _fit(HybridParallelStrategy(zero_stage=stage))
    # manual optimization: ZeRO-3 keeps the root unit gathered between steps, which a swap must free
    out["ddp_manual"] = _fit(DDPStrategy(), manual=True)
    out["z3_manual"] = _fit(HybridParallelStrategy(zero_stage=3), manual=True)
    for stage in (1, 2, 3):
        out[f"z{stage}_bf16"] = _fit(HybridParallelStrategy(zero_stage=stage), precision="bf16-mixed")
    # checkpoints after epoch 1, resumed for epoch 2
    saved = Path(root)
    _fit(DDPStrategy(), epochs=1, save_to=saved / "ddp")
    for stage in (0, 2, 3):
        _fit(HybridParallelStrategy(zero_stage=stage), epochs=1, save_to=saved / f"z{stage}")
    one_file = HybridParallelStrategy(zero_stage=3, save_distributed_checkpoint=False)
    _fit(one_file, epochs=1, save_to=saved / "z3_file")  # gathered to rank 0 (collective)
    first = "epoch=0-step=4.ckpt"
    # flash snapshots under way change nothing (resumed ones: tests/test_flash_averages.py)
    out["z2_flash"] = _fit(HybridParallelStrategy(zero_stage=2), flash=saved / "flash")
    for name, stage, source in (
        ("z0_from_z0", 0, "z0"),
        ("z2_from_z2", 2, "z2"),
        ("z3_from_z2", 3, "z2"),
        ("z3_from_z3", 3, "z3"),
        ("z3_from_ddp", 3, "ddp"),
    ):
        out[name] = _fit(HybridParallelStrategy(zero_stage=stage), ckpt_path=str(saved / source / first))
    # saved after fit (the model holds the averages then) and resumed: before, our checkpoints dropped the
    # update count and the resumed fit restarted its average (0.04 off Lightning's, "saved without this
    # callback" warned)
    for name, make in (
        ("ddp", DDPStrategy),
        ("z0", lambda: HybridParallelStrategy(zero_stage=0)),  # one file
        ("z2", lambda: HybridParallelStrategy(zero_stage=2)),  # per-rank files, read before setup
        ("z3", lambda: HybridParallelStrategy(zero_stage=3)),  # per-rank files, read after setup
    ):
        _fit(make(), epochs=1, save_after=saved / f"{name}_end.ckpt")
        out[f"{name}_after_fit"] = _fit(make(), ckpt_path=str(saved / f"{name}_end.ckpt"))
    if rank == 0:
        out["lightning_end"] = torch.load(saved / "ddp_end.ckpt", weights_only=False)
        out["z0_end"] = torch.load(saved / "z0_end.ckpt", weights_only=False)
        out["z3_end"] = consolidate(saved / "z3_end.ckpt")
        out["lightning_file"] = torch.load(saved / "ddp" / first, weights_only=False)
        out["consolidated"] = consolidate(saved / "z3" / first)
        out["z0_file"] = torch.load(saved / "z0" / first, weights_only=False)
        out["z3_file"] = torch.load(saved / "z3_file" / first, weights_only=False)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("sharded_ema"))
    return run_distributed(_runs, WORLD, root, init_group=False, timeout=900)


def _floats(state: State) -> State:
    return {k: v for k, v in state.items() if v.is_floating_point()}


def _assert_floats_equal(actual: State, expected: State, what: str) -> None:
    assert set(actual) == set(expected), what
    torch.testing.assert_close(_floats(actual), _floats(expected), msg=lambda m: f"{what}: {m}")


def test_sharded_ema_equals_lightning_ema_at_every_stage(runs: list[dict[str, Any]]) -> None:
    """ZeRO 0-3 in ``32-true`` (and ZeRO-3 with manual optimization): final weights, averaged BatchNorm
    statistics and the validation losses (on the averaged weights) equal Lightning's
    ``EMAWeightAveraging`` under ``"ddp"``; the counter is the true count; at ZeRO 1-3 the ranks' averages
    hold each trainable element once between them."""
    r = runs[0]
    ddp = r["ddp"]
    trainable = sum(v.numel() for k, v in ddp["state"].items() if k.endswith(("weight", "bias")))
    for stage in (0, 1, 2, 3):
        ours = r[f"z{stage}"]
        _assert_floats_equal(ours["state"], ddp["state"], f"ZeRO-{stage}")
        torch.testing.assert_close(ours["validation"], ddp["validation"])
        assert ours["state"]["net.1.num_batches_tracked"].item() == 8  # 8 training batches on each rank
        held = [runs[k][f"z{stage}"]["held"] for k in range(WORLD)]
        if stage == 0:
            assert held == [trainable, trainable]
        else:
            assert sum(held) == trainable and max(held) < trainable, (stage, held)
    manual = r["z3_manual"]
    _assert_floats_equal(manual["state"], r["ddp_manual"]["state"], "ZeRO-3, manual optimization")
    torch.testing.assert_close(manual["validation"], r["ddp_manual"]["validation"])
    # the average did something: the model without it ends elsewhere
    assert not torch.allclose(r["z3"]["validation"][-1], r["z3_from_z3"]["validation"][0])


def test_sharded_ema_in_bf16_mixed_with_batchnorm(runs: list[dict[str, Any]]) -> None:
    """``bf16-mixed`` with BatchNorm trains at ZeRO 1-3 (its backward failed before) and the EMA ends as
    near the ``32-true`` run as Lightning's ``"ddp"`` in ``bf16-mixed`` does; the stages agree."""
    r = runs[0]
    exact = _floats(r["ddp"]["state"])
    ddp_error = max((r["ddp_bf16"]["state"][k] - v).abs().max().item() for k, v in exact.items())
    assert ddp_error > 0
    for stage in (1, 2, 3):
        state = r[f"z{stage}_bf16"]["state"]
        error = max((state[k] - v).abs().max().item() for k, v in exact.items())
        assert error <= 2 * ddp_error, (stage, error, ddp_error)
        _assert_floats_equal(state, r["z1_bf16"]["state"], f"bf16 ZeRO-{stage} against ZeRO-1")


def test_sharded_ema_checkpoints_resume_and_consolidate(runs: list[dict[str, Any]]) -> None:
    """Saved after epoch 1 and resumed: every path ends at the uninterrupted ``"ddp"`` run's weights and
    validation loss; ``consolidate()`` and our single file have Lightning's checkpoint layout and values."""
    r = runs[0]
    ddp = r["ddp"]
    for name in ("z0_from_z0", "z2_from_z2", "z3_from_z2", "z3_from_z3", "z3_from_ddp"):
        _assert_floats_equal(r[name]["state"], ddp["state"], name)
        resumed = r[name]["validation"]  # epoch 2's batches
        torch.testing.assert_close(resumed, ddp["validation"][-len(resumed) :], msg=name)
    _assert_floats_equal(r["z2_flash"]["state"], ddp["state"], "ZeRO-2 with flash snapshots")
    assert r["z2_flash"]["warnings"] == []
    lightning = r["lightning_file"]
    for name in ("consolidated", "z0_file", "z3_file"):
        ours = r[name]
        _assert_floats_equal(ours["state_dict"], lightning["state_dict"], f"{name} state_dict (averaged)")
        _assert_floats_equal(
            ours["current_model_state"], lightning["current_model_state"], f"{name} current_model_state"
        )
        assert (
            int(ours["averaging_state"]["n_averaged"]) == int(lightning["averaging_state"]["n_averaged"]) == 4
        )
        # the average is not the current model
        assert not torch.equal(
            ours["state_dict"]["net.3.weight"], ours["current_model_state"]["net.3.weight"]
        )
    # saved after fit and resumed: as Lightning's callback does (its averages go on from the count)
    for name in ("z0_after_fit", "z2_after_fit", "z3_after_fit"):
        _assert_floats_equal(r[name]["state"], r["ddp_after_fit"]["state"], name)
        assert r[name]["warnings"] == [], (name, r[name]["warnings"])
    lightning = r["lightning_end"]
    for name in ("z0_end", "z3_end"):  # our file, and the per-rank files consolidated
        ours = r[name]
        for key in ("state_dict", "current_model_state"):
            _assert_floats_equal(ours[key], lightning[key], f"{name} (saved after fit): {key}")
        assert (
            int(ours["averaging_state"]["n_averaged"]) == int(lightning["averaging_state"]["n_averaged"]) == 4
        )


# ---------------------------------------------------------------------------------------- tensor parallel
def _token_ids() -> Tensor:
    return torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(3))


class Llama(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = llama()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TensorDataset(_token_ids()), batch_size=4)


def _llama_fit(
    strategy: Any,
    devices: int,
    *,
    epochs: int = 1,
    save: str | None = None,
    resume: str | None = None,
    multi: bool = False,
) -> State:
    """``epochs`` epochs of 4 AdamW steps with the EMA callback (``multi``: the weight-averaging callback
    with torch's in-place ``get_ema_multi_avg_fn``); ``save``: a ``ModelCheckpoint`` there at the epoch's
    end (inside fit: the averages are in it); ``resume``: ``fit(ckpt_path=resume)``."""
    module = Llama()
    ours = isinstance(strategy, HybridParallelStrategy)
    callbacks: list[pl.Callback] = [ShardedEMA(decay=DECAY) if ours else EMAWeightAveraging(decay=DECAY)]
    if multi:
        multi_avg_fn = get_ema_multi_avg_fn(DECAY)
        callbacks = [
            ShardedWeightAveraging(multi_avg_fn=multi_avg_fn)
            if ours
            else WeightAveraging(multi_avg_fn=multi_avg_fn)
        ]
    if save is not None:
        callbacks.append(ModelCheckpoint(dirpath=save, filename="first"))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=save is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(module, ckpt_path=resume)
    return final_state(module, strategy)


def _tp_runs(rank: int, world: int, root: str) -> dict[str, State]:
    torch.set_num_threads(1)

    def strategy() -> HybridParallelStrategy:
        return HybridParallelStrategy(zero_stage=1, tensor_parallel_size=world, tp_plan="llama")

    out = {"one": _llama_fit(strategy(), world), "two": _llama_fit(strategy(), world, epochs=2)}
    _llama_fit(strategy(), world, save=root)
    out["resumed"] = _llama_fit(strategy(), world, epochs=2, resume=str(Path(root) / "first.ckpt"))
    out["multi"] = _llama_fit(strategy(), world, multi=True)
    return out


def test_sharded_ema_under_tensor_parallelism_equals_one_process(tmp_path: Path) -> None:
    """A Llama at tp 2 with ZeRO-1 (each rank averaging its slices) equals one process with Lightning's
    ``EMAWeightAveraging``, 4 AdamW steps; a second epoch resumed from a checkpoint of the first (written
    inside fit, with the averages) equals the uninterrupted 2 epochs. Before, that resume read the
    averages before tensor parallelism had cut the model: each rank took the first elements of the whole
    tensors (0.09 off after the second epoch)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ranks = run_distributed(_tp_runs, WORLD, str(tmp_path), init_group=False, timeout=600)
    reference = _llama_fit("auto", 1)
    _assert_floats_equal(ranks[0]["one"], reference, "tp 2")
    _assert_floats_equal(ranks[0]["resumed"], ranks[0]["two"], "tp 2 resumed")
    # torch's in-place multi-tensor form, as Lightning's WeightAveraging takes it (before: a TypeError)
    _assert_floats_equal(ranks[0]["multi"], _llama_fit("auto", 1, multi=True), "tp 2 multi_avg_fn")
    plain = Llama()
    assert not torch.allclose(reference["model.lm_head.weight"], plain.model.lm_head.weight)
    assert not torch.allclose(ranks[0]["two"]["model.lm_head.weight"], reference["model.lm_head.weight"])


# ---------------------------------------------------------------------------------------- the core, moved
def _moved_averages(rank: int, world: int) -> dict[str, Any]:
    """ZeRO-2 in a plain loop: averages kept across a rebuild of the buckets (a checkpoint's order)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    engine = apply_zero(model, group=dist.group.WORLD, stage=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.shard_optimizers([optimizer])
    averages = WeightAverages(model, engine, group=dist.group.WORLD, rule=ema_rule(0.5))
    whole = {n: p.detach().clone() for n, p in model.named_parameters()}  # the unsharded average
    keys = []
    for step in range(4):
        averages.update()
        current = {n: p.detach() for n, p in model.named_parameters()}
        whole = {n: v if step == 0 else 0.5 * v + 0.5 * current[n] for n, v in whole.items()}
        if step == 1:  # a checkpoint's bucket order: each rank now owns other elements
            keys.append([k[:3] for k in averages.targets()])
            engine.freeze_order(["0.bias", "1.weight", "0.weight", "1.bias"])
            keys.append([k[:3] for k in averages.targets()])
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
        with engine.forward_context():
            loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        engine.after_step()
    averages.copy_to_targets()
    return {
        "model": {n: p.detach().clone() for n, p in model.named_parameters()},
        "whole": whole,
        "keys": keys,
    }


def test_averages_follow_their_fragments_when_the_buckets_are_rebuilt() -> None:
    """``WeightAverages`` over a ZeRO-2 engine: the fragments move when the bucket order changes (the
    ranks' keys differ before and after), the averages move with them (one all-reduce per parameter), and
    the model then takes exactly the average an unsharded copy computed."""
    ranks = run_distributed(_moved_averages, WORLD)
    assert any(r["keys"][0] != r["keys"][1] for r in ranks)
    for r in ranks:
        torch.testing.assert_close(r["model"], r["whole"])


# ---------------------------------------------------------------------------------------- Fabric
def _samples() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(40, 8, generator=g), torch.randn(40, 1, generator=g)


def _fabric_loop(rank: int, world: int, tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    x, y = _samples()

    def setup(stage: int) -> tuple[Any, Any, Any, Any, Any]:
        strategy = FabricHybridParallelStrategy(zero_stage=stage)
        fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
        fabric.launch()
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
        return fabric, strategy, model, optimizer, strategy.weight_averages(decay=DECAY)

    def step(fabric: Any, model: Any, optimizer: Any, averages: Any, k: int) -> None:
        mine = slice(k * 8 + rank * 4, k * 8 + rank * 4 + 4)
        fabric.backward(F.mse_loss(model(x[mine]), y[mine]))
        optimizer.step()
        optimizer.zero_grad()
        averages.update()

    for stage in (0, 2, 3):
        fabric, strategy, model, optimizer, averages = setup(stage)
        for k in range(4):
            step(fabric, model, optimizer, averages, k)
            if k == 1:  # saved after 2 steps: a sharded directory at ZeRO-2, one file at ZeRO-0
                state = {"model": model, "optimizer": optimizer, "ema": averages}
                fabric.save(os.path.join(tmp, f"zero{stage}"), state)
        with torch.no_grad():
            with averages.swapped():
                averaged_loss = F.mse_loss(model(x[32:]), y[32:])
            current_loss = F.mse_loss(model(x[32:]), y[32:])
        current = strategy.consolidated_state_dict()
        averages.copy_to_targets()
        out[f"zero{stage}"] = {
            "averaged_loss": averaged_loss,
            "current_loss": current_loss,
            "current": current,
            "averaged": strategy.consolidated_state_dict(),
        }
        strategy.destroy_process_groups()
    for saved, stage in (("zero2", 3), ("zero0", 2)):  # resumed at another stage for the last 2 steps
        fabric, strategy, model, optimizer, averages = setup(stage)
        fabric.load(os.path.join(tmp, saved), {"model": model, "optimizer": optimizer, "ema": averages})
        for k in (2, 3):
            step(fabric, model, optimizer, averages, k)
        averages.copy_to_targets()
        out[f"{saved}_into_zero{stage}"] = strategy.consolidated_state_dict()
        strategy.destroy_process_groups()
    # FlashSnapshots (same layout): a snapshot after 2 steps, restored by a fresh loop for the last 2
    starts = []
    for attempt in range(2):
        fabric, strategy, model, optimizer, averages = setup(2)
        state = {"model": model, "optimizer": optimizer, "ema": averages}
        flash = os.path.join(tmp, "flash")
        with FlashSnapshots(
            fabric, flash, persist_every_n_steps=1, shm_dir=os.path.join(flash, "shm")
        ) as snaps:
            start = snaps.restore(state) or 0
            starts.append(start)
            for k in range(start, 2 if attempt == 0 else 4):
                step(fabric, model, optimizer, averages, k)
                if attempt == 0:
                    with SlowSnapshotCopies(SLOW_COPY_S):
                        snaps.snapshot(k + 1, state)
                        if k == 1:  # its copy (late: the first snapshot's is made at once) meets a swap
                            with torch.no_grad(), averages.swapped():
                                model(x[32:])
                                time.sleep(2 * SLOW_COPY_S)  # an evaluation longer than the copy's delay
        if attempt == 1:
            averages.copy_to_targets()
            out["flash_zero2"] = strategy.consolidated_state_dict()
        strategy.destroy_process_groups()
    out["flash_starts"] = starts
    return out


def test_fabric_weight_averages_equal_one_process(tmp_path: Path) -> None:
    """A Fabric loop at ZeRO 0, 2 and 3 with ``strategy.weight_averages(decay=...)``: the loss evaluated
    inside ``swapped()`` is the averaged model's, the model's own weights come back after it, and after
    ``copy_to_targets()`` the model equals one process's EMA over both ranks' samples. Saved with
    ``fabric.save`` after 2 steps (ZeRO-2: a sharded directory; ZeRO-0: one file) and loaded at another
    stage (ZeRO-3, ZeRO-2) for the last 2 steps, the averages end where the uninterrupted run's do; so
    they do restored from a ``FlashSnapshots`` snapshot at ZeRO-2 (``state_dict()``, same layout), taken
    just before an evaluation inside ``swapped()`` while its copy is slowed down (the swap waits for the
    copy: before, the snapshot could hold the averaged weights as the model's)."""
    ranks = run_distributed(_fabric_loop, WORLD, str(tmp_path), init_group=False, timeout=600)
    # the ZeRO-2 directory consolidated into fabric.save's one-file layout: the ZeRO-0 file's entries
    # (before, the Trainer's layout, without the averages)
    consolidated = consolidate(tmp_path / "zero2")
    single = torch.load(tmp_path / "zero0", weights_only=False)
    assert set(consolidated) == set(single)
    torch.testing.assert_close(consolidated["model"], single["model"])
    torch.testing.assert_close(consolidated["ema"], single["ema"])  # state_dict and n_averaged
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = _samples()
    ema: State = {}
    for step in range(4):
        F.mse_loss(net(x[step * 8 : step * 8 + 8]), y[step * 8 : step * 8 + 8]).backward()
        optimizer.step()
        optimizer.zero_grad()
        now = {k: v.detach().clone() for k, v in net.state_dict().items()}
        ema = now if not ema else {k: DECAY * ema[k] + (1 - DECAY) * now[k] for k in now}
    current = {k: v.detach().clone() for k, v in net.state_dict().items()}
    with torch.no_grad():
        current_loss = F.mse_loss(net(x[32:]), y[32:])
        net.load_state_dict(ema)
        averaged_loss = F.mse_loss(net(x[32:]), y[32:])
    assert not torch.allclose(averaged_loss, current_loss)
    for key in ("zero2_into_zero3", "zero0_into_zero2", "flash_zero2"):
        torch.testing.assert_close(ranks[0][key], ema, msg=key)
    assert ranks[0]["flash_starts"] == [0, 2]
    for stage in (0, 2, 3):
        for r in ranks:
            got = r[f"zero{stage}"]
            torch.testing.assert_close(got["averaged_loss"], averaged_loss)
            torch.testing.assert_close(got["current_loss"], current_loss)
        got = ranks[0][f"zero{stage}"]
        torch.testing.assert_close(got["current"], current)
        torch.testing.assert_close(got["averaged"], ema)


# ---------------------------------------------------------------------------------------- pipeline
def _pipelined(rank: int, world: int, tmp: str) -> State:
    pl.seed_everything(SEED)
    module = PipelinedResNet()
    strategy = HybridParallelStrategy(
        pipeline_parallel_size=2, num_microbatches=M, pipeline_schedule="1f1b", zero_stage=1
    )
    _trainer(strategy, 2, tmp, [ShardedEMA(decay=0.5)]).fit(module, DataLoader(Images(N), batch_size=BATCH))
    return strategy.consolidated_state_dict()  # collective; the full state on rank 0


def test_sharded_ema_under_pipeline_parallelism_equals_one_process(tmp_path: Path) -> None:
    """A Hugging Face ResNet (BatchNorm) cut into 2 pipeline stages with ZeRO-1, each stage averaging its
    own layers and statistics, equals one process with Lightning's ``EMAWeightAveraging`` fed the same
    micro-batches (the pipeline tests' reference); the counters keep their counts."""
    state = run_distributed(_pipelined, 2, str(tmp_path), init_group=False, timeout=600)[0]
    pl.seed_everything(SEED)
    module = ResNetModule()
    trainer = _trainer(
        "auto", 1, str(tmp_path / "ref"), [EMAWeightAveraging(decay=0.5)], accumulate_grad_batches=M
    )
    order = list(DistributedSampler(Images(N), num_replicas=1, rank=0, shuffle=True, seed=SEED))
    micro = [order[i : i + BATCH // M] for i in range(0, N, BATCH // M)]
    trainer.fit(module, DataLoader(Images(N), batch_sampler=micro))
    reference = {k: v.detach().clone() for k, v in module.state_dict().items()}
    _assert_floats_equal(state, reference, "pp 2")
    counters = [v.item() for k, v in state.items() if k.endswith("num_batches_tracked")]
    assert counters and set(counters) == {N // (BATCH // M)}  # every micro-batch counted


def test_averaging_rule_forms_equal_torchs_averaged_model() -> None:
    """``multi_avg_fn`` (grouped by device and dtype, as torch's ``AveragedModel`` calls it) and ``avg_fn``
    equal ``AveragedModel`` over four updates of a model with fp32 and bf16 parameters; two forms at once
    are refused by name."""
    from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn

    from lightning_par.averaging import averaging_rule

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2).to(torch.bfloat16))
    for kind in ("multi", "avg_fn", "swa"):
        options: dict[str, Any] = {
            "multi": {"multi_avg_fn": get_ema_multi_avg_fn(0.6)},
            "avg_fn": {"avg_fn": get_ema_avg_fn(0.6)},
            "swa": {},
        }[kind]
        reference = AveragedModel(model, use_buffers=False, **options)
        rule = averaging_rule(**options)
        averages = [p.detach().clone() for p in model.parameters()]
        for n in range(4):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p))
            reference.update_parameters(model)
            currents = [p.detach() for p in model.parameters()]
            if n == 0:
                averages = [c.clone() for c in currents]
            else:
                rule(averages, currents, n)
        for ours, theirs in zip(averages, reference.module.parameters(), strict=True):
            # SWA: torch's lerp weight is a tensor, ours a float: one ulp apart at most
            exact = {"rtol": 0.0, "atol": 0.0} if kind != "swa" else {}
            torch.testing.assert_close(ours, theirs.detach(), **exact, msg=lambda m, k=kind: f"{k}: {m}")
    with pytest.raises(ValueError, match="not decay and multi_avg_fn"):
        averaging_rule(decay=0.9, multi_avg_fn=get_ema_multi_avg_fn(0.9))
