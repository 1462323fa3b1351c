"""``FlashCheckpoint`` snapshots carry ``ShardedEMA``'s averages, and no weight write tears a snapshot copy.

A small MLP (SGD with momentum, 2 epochs of 4 steps, validation after each epoch on the averaged weights)
with ``ShardedEMA`` and ``FlashCheckpoint(every_n_steps=2, snapshot_copy="overlap")``, the copy thread
slowed by 0.3 s so that the validation after epoch 1 starts while the step-4 snapshot is still being
copied. Reference: Lightning's ``EMAWeightAveraging`` under ``"ddp"``, uninterrupted.

* A fit of epoch 1 at ZeRO-2 and at ZeRO-3, then a fit to epoch 2 resumed from its step-4 snapshot: final
  (averaged) weights and epoch 2's validation loss equal the reference. Before, the snapshot did not hold
  the averages (the resumed average restarted from the resumed weights, with a warning), and the swap
  for validation wrote the averaged weights into the parameters while the copy thread was reading them:
  the snapshot held the averaged weights as the model's (0.02-0.1 off in a probe).
* The same snapshot resumed by one process (ZeRO-1, ``keep_global_batch=True``: the averages of both
  writers are merged and cut to the new layout): equal too.
* ``FlashCheckpoint.rollback`` at step 5 (as ``LossGuard(action="rollback")`` calls it) brings the
  averages back to the step-4 snapshot's with the weights (before, they kept the steps rolled back).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.callbacks.weight_averaging import EMAWeightAveraging
from torch import Tensor, nn

from lightning_par import HybridParallelStrategy
from lightning_par.callbacks import FlashCheckpoint, ShardedEMA
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state
from tests.probes import SlowSnapshotCopies
from tests.test_sharded_averaging import _data

DECAY, SLOW_COPY_S = 0.6, 0.3


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.validation_losses: list[Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("val", loss, sync_dist=True)
        self.validation_losses.append(loss.detach().clone())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Rollback(Callback):
    """At step 5: the averages as they are, then ``flash.rollback`` (to the step-4 snapshot) and the
    averages after it; at step 4 the averages that snapshot holds."""

    def __init__(self, flash: FlashCheckpoint, averaging: ShardedEMA) -> None:
        self.flash, self.averaging = flash, averaging
        self.seen: dict[str, Any] = {}

    def _averages(self) -> dict[str, Tensor]:
        assert self.averaging.averages is not None
        state = self.averaging.averages.state_dict()
        return {f"{n}:{lo}": t for n, lo, _, t in state["params"]} | {"n": torch.tensor(state["n_averaged"])}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 4:
            self.seen["step4"] = self._averages()
        if trainer.global_step == 5 and "rolled" not in self.seen:
            self.seen["step5"] = self._averages()
            self.seen["rolled_to"] = self.flash.rollback(trainer)
            self.seen["rolled"] = self._averages()


def _fit(
    strategy: Any,
    *,
    epochs: int,
    flash: Path | None = None,
    devices: int = 2,
    rollback: bool = False,
) -> dict[str, Any]:
    ours = isinstance(strategy, HybridParallelStrategy)
    averaging = ShardedEMA(decay=DECAY) if ours else EMAWeightAveraging(decay=DECAY)
    callbacks: list[Any] = [averaging]
    snapshots = None
    if flash is not None:
        snapshots = FlashCheckpoint(
            flash, every_n_steps=2, persist_every_n_steps=2, shm_dir=flash / "shm", keep_global_batch=True
        )
        callbacks.insert(0, snapshots)  # before the averaging callback: its update runs in the capture
    watcher = Rollback(snapshots, averaging) if rollback and snapshots is not None else None
    if watcher is not None:
        callbacks.append(watcher)
    module = Net()
    trainer = cpu_trainer(
        strategy, devices=devices, max_epochs=epochs, callbacks=callbacks, num_sanity_val_steps=0
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, _data(), _data())
    return {
        "warnings": [str(w.message) for w in caught if "ShardedWeightAveraging" in str(w.message)],
        "state": final_state(module, strategy),
        "validation": torch.stack(module.validation_losses),
        "rollback": watcher.seen if watcher is not None else None,
    }


def _two_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    base = Path(root)
    out: dict[str, Any] = {"ddp": _fit("ddp", epochs=2)}
    with SlowSnapshotCopies(SLOW_COPY_S):
        for stage in (2, 3):
            _fit(HybridParallelStrategy(zero_stage=stage), epochs=1, flash=base / f"z{stage}")
            out[f"z{stage}"] = _fit(
                HybridParallelStrategy(zero_stage=stage), epochs=2, flash=base / f"z{stage}"
            )
        _fit(HybridParallelStrategy(zero_stage=2), epochs=1, flash=base / "elastic")
        out["rollback"] = _fit(
            HybridParallelStrategy(zero_stage=2), epochs=2, flash=base / "rollback", rollback=True
        )["rollback"]
    return out


def _one_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    with SlowSnapshotCopies(SLOW_COPY_S):
        return _fit(HybridParallelStrategy(zero_stage=1), epochs=2, flash=Path(root) / "elastic", devices=1)


def test_flash_snapshots_carry_the_averages(tmp_path: Path) -> None:
    ranks = run_distributed(_two_ranks, 2, str(tmp_path), init_group=False, timeout=600)
    elastic = run_distributed(_one_rank, 1, str(tmp_path), init_group=False, timeout=300)[0]
    first = ranks[0]
    ddp = first["ddp"]
    for name, run in (("ZeRO-2", first["z2"]), ("ZeRO-3", first["z3"]), ("dp 2 -> 1", elastic)):
        assert run["warnings"] == [], (name, run["warnings"])
        for key, value in ddp["state"].items():
            torch.testing.assert_close(run["state"][key], value, msg=f"{name}: {key}")
    for out in ranks:  # epoch 2's validation (4 batches per rank), on the averaged weights
        for stage in (2, 3):
            torch.testing.assert_close(out[f"z{stage}"]["validation"][-4:], out["ddp"]["validation"][-4:])
    # one process validates all 8 batches: their mean is the two ranks' mean
    both = torch.cat([out["ddp"]["validation"][-4:] for out in ranks])
    torch.testing.assert_close(elastic["validation"][-8:].mean(), both.mean(), msg="dp 2 -> 1: validation")
    for r, out in enumerate(ranks):
        seen = out["rollback"]
        assert seen["rolled_to"] == 4, seen["rolled_to"]
        assert seen["step5"]["n"] == 5 and seen["rolled"]["n"] == 4, (seen["step5"]["n"], seen["rolled"]["n"])
        assert any(not torch.equal(v, seen["step4"][k]) for k, v in seen["step5"].items()), r
        for key, value in seen["step4"].items():
            torch.testing.assert_close(seen["rolled"][key], value, msg=f"rank {r} rolled back: {key}")


# ------------------------------------------------------------------- other writes between the steps
class HalveAfterStep4(Callback):
    """At step 4, after the snapshot: the weights as they are, then halved in place through
    ``gathered_params(writeback=True)`` (the documented way to write weights between steps)."""

    def __init__(self) -> None:
        self.before: dict[str, Tensor] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == 4 and not self.before:
            self.before = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            with trainer.strategy.gathered_params(writeback=True), torch.no_grad():  # type: ignore[attr-defined]
                for p in pl_module.parameters():
                    p.mul_(0.5)


def _snapshot_model(flash: Path, rank: int, step: int) -> dict[str, Tensor]:
    from lightning_par.callbacks.disk import DiskStore

    store = DiskStore(flash, rank=rank)
    header = next(h for h in store.headers() if h["step"] == step)
    return dict(store.load(header)["model"])


def _writes(rank: int, world: int, root: str) -> dict[str, Any]:
    from lightning.fabric import Fabric

    from lightning_par.fabric import FlashSnapshots
    from lightning_par.fabric import HybridParallelStrategy as FabricStrategy

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    trainer_flash, fabric_flash = Path(root) / "trainer", Path(root) / "fabric"
    halve = HalveAfterStep4()
    snapshots = FlashCheckpoint(
        trainer_flash, every_n_steps=2, persist_every_n_steps=2, shm_dir=trainer_flash / "shm"
    )
    strategy = HybridParallelStrategy(zero_stage=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=4,
        callbacks=[snapshots, halve],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with SlowSnapshotCopies(SLOW_COPY_S):
        trainer.fit(Net(), _data())
    strategy.destroy_process_groups()
    out["trainer"] = (halve.before, _snapshot_model(trainer_flash, rank, 4))
    # Fabric: the second snapshot (the first one's copy is made at once), then a halving written back
    ours = FabricStrategy(zero_stage=2)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=ours)
    fabric.launch()
    net = Net().net
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    shm = fabric_flash / "shm"
    with (
        FlashSnapshots(fabric, fabric_flash, persist_every_n_steps=1, shm_dir=shm) as snaps,
        SlowSnapshotCopies(SLOW_COPY_S),
    ):
        for step in (1, 2):
            x, y = next(iter(_data()))
            fabric.backward(F.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            snaps.snapshot(step, {"model": model, "optimizer": optimizer})
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        with ours.gathered_params(writeback=True), torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
    ours.destroy_process_groups()
    out["fabric"] = (before, _snapshot_model(fabric_flash, rank, 2))
    return out


def test_weight_writes_between_steps_wait_for_the_snapshot_copy(tmp_path: Path) -> None:
    """``gathered_params(writeback=True)`` right after a snapshot, its copy slowed: the snapshot holds the
    weights of its step, not the halved ones (Trainer with ``FlashCheckpoint``, Fabric with
    ``FlashSnapshots``, ZeRO-2). Before, the write could land in the snapshot."""
    for r, out in enumerate(run_distributed(_writes, 2, str(tmp_path), init_group=False, timeout=300)):
        for door in ("trainer", "fabric"):
            before, held = out[door]
            assert before, door
            for key, value in before.items():
                torch.testing.assert_close(held[key], value, msg=f"rank {r} {door}: {key}")
