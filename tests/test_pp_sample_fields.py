"""Per-sample fields that are not tensors under pipeline parallelism: a string label, which
``default_collate`` turns into a list of strings, must be cut into micro-batches with the rows it
belongs to. A pp2 fit whose loss weighs each sample by its label, and a validation accuracy read from
the labels, equal one process running the module's own steps (before, every micro-batch got the whole
list: the accuracy paired other samples' labels, 0.28 against 0.22, and the weighted loss failed with a
bare shape error)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_par import HybridParallelStrategy
from lightning_par.pipeline.lightning import micro_weights, split_batch
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state

# 29 samples in batches of 8: the last batch of 5 is cut into micro-batches of 3 and 2
N, BATCH = 29, 8


class Labelled(Dataset[dict[str, Any]]):
    def __init__(self) -> None:
        self.x = torch.randn(N, 8, generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "label": "pos" if self.x[i, :3].sum() > 0 else "neg"}


def _targets(labels: list[str]) -> tuple[Tensor, Tensor]:
    """Class indices and per-sample weights (positives count twice) read from the strings."""
    target = torch.tensor([int(label == "pos") for label in labels])
    return target, 1.0 + target.float()


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))

    def _loss(self, out: Tensor, labels: list[str]) -> Tensor:
        target, weight = _targets(labels)  # a size mismatch if the labels were not cut with the rows
        return (weight * F.cross_entropy(out, target, reduction="none")).mean()

    def _acc(self, out: Tensor, labels: list[str]) -> Tensor:
        return (out.argmax(-1) == _targets(labels)[0]).float().mean()

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.net)

    def pipeline_input(self, batch: dict[str, Any]) -> Tensor:
        return batch["x"]

    def pipeline_loss(self, out: Tensor, batch: dict[str, Any]) -> Tensor:
        return self._loss(out, batch["label"])

    def pipeline_eval(self, out: Tensor, batch: dict[str, Any]) -> dict[str, Tensor]:
        return {"acc": self._acc(out, batch["label"])}

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss = self._loss(self.net(batch["x"]), batch["label"])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.log("val_acc", self._acc(self.net(batch["x"]), batch["label"]), batch_size=len(batch["label"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.seen.append(float(trainer.callback_metrics["train_loss"]))


def _order() -> list[list[int]]:
    """The batches of two epochs as Lightning's sampler shuffles them at dp 1 (seed 0), last ones ragged."""
    batches = []
    for epoch in range(2):
        sampler = DistributedSampler(range(N), num_replicas=1, rank=0, shuffle=True)  # type: ignore[arg-type]
        sampler.set_epoch(epoch)
        perm = list(sampler)
        batches += [perm[i : i + BATCH] for i in range(0, N, BATCH)]
    return batches


def _strategy(world: int, partition: list[int]) -> Any:
    """pp2 with two micro-batches over ``world`` ranks; one process (``"auto"``) at world 1."""
    if world == 1:
        return "auto"
    return HybridParallelStrategy(pipeline_parallel_size=2, num_microbatches=2, partition_method=partition)


def _run(world: int) -> dict[str, Any]:
    strategy = _strategy(world, [2, 1])
    losses = Losses()
    epochs = 2 if world > 1 else 1  # the reference's one epoch replays the two
    trainer = cpu_trainer(strategy, devices=world, max_epochs=epochs, callbacks=[losses])
    module = Classifier()
    if world > 1:
        trainer.fit(module, DataLoader(Labelled(), batch_size=BATCH))
    else:
        trainer.fit(module, DataLoader(Labelled(), batch_sampler=_order()))
    loader = DataLoader(Labelled(), batch_size=BATCH)
    (metrics,) = trainer.validate(module, loader, verbose=False)
    return {"losses": losses.seen, "acc": metrics["val_acc"], "state": final_state(module, strategy)}


def _job(rank: int, world: int, run: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    torch.set_num_threads(1)
    return run(world)


def test_string_labels_are_cut_with_their_rows() -> None:
    batch = {"x": torch.arange(5), "label": ["a", "b", "c", "d", "e"], "tags": ("train", "eval")}
    micro = split_batch(batch, 2)
    assert [mb["label"] for mb in micro] == [["a", "b", "c"], ["d", "e"]]  # tensor_split's ranges
    assert all(mb["tags"] == ("train", "eval") for mb in micro)  # another length: whole in each
    assert micro_weights(micro) == [1.2, 0.8]
    assert [mb[1] for mb in split_batch((torch.zeros(4, 2), [1, 2, None, 4]), 2)] == [[1, 2], [None, 4]]
    # a tuple is a collate's constants, whole in each micro-batch even when as long as the batch
    assert all(mb["norm"] == (0.5, 2.0) for mb in split_batch({"x": torch.zeros(2), "norm": (0.5, 2.0)}, 2))

    ref = _run(1)
    results = run_distributed(_job, 2, _run, init_group=False, timeout=300)
    for rank, got in enumerate(results):
        assert len(got["losses"]) == len(ref["losses"]) == 8, rank
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6), rank
        assert got["acc"] == pytest.approx(ref["acc"], abs=1e-6), rank
    assert set(results[0]["state"]) == set(ref["state"])
    for key, value in ref["state"].items():
        torch.testing.assert_close(results[0]["state"][key], value, msg=key)


class Boxes(Dataset[tuple[Tensor, dict[str, Tensor]]]):
    """Images with a different number of boxes each, as a detection dataset gives them."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(16, 8, generator=g)
        self.boxes = [torch.rand(1 + i % 4, 4, generator=g) for i in range(16)]

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[Tensor, dict[str, Tensor]]:
        return self.x[i], {"boxes": self.boxes[i]}


class Target(NamedTuple):
    boxes: Tensor
    labels: Tensor


def _collate(items: list[tuple[Tensor, dict[str, Tensor]]]) -> tuple[Tensor, list[dict[str, Tensor]]]:
    return torch.stack([x for x, _ in items]), [t for _, t in items]


class Detector(pl.LightningModule):
    """Four box slots per image; each image's loss reads only its own boxes (a list of per-image dicts)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Unflatten(1, (4, 4)))

    def _loss(self, out: Tensor, targets: list[dict[str, Tensor]]) -> Tensor:
        assert len(targets) == len(out)  # before: every target, each with a share of its boxes
        per_image = [
            (o[: len(t["boxes"])] - t["boxes"]).pow(2).mean() for o, t in zip(out, targets, strict=True)
        ]
        return torch.stack(per_image).mean()

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.net)

    def pipeline_input(self, batch: Any) -> Tensor:
        return batch[0]

    def pipeline_loss(self, out: Tensor, batch: Any) -> Tensor:
        return self._loss(out, batch[1])

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(self.net(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _detect(world: int) -> dict[str, Any]:
    strategy = _strategy(world, [2, 2])
    losses = Losses()
    trainer = cpu_trainer(
        strategy, devices=world, max_epochs=1, callbacks=[losses], use_distributed_sampler=False
    )
    module = Detector()
    trainer.fit(module, DataLoader(Boxes(), batch_size=4, collate_fn=_collate))
    return {"losses": losses.seen, "state": final_state(module, strategy)}


def test_per_image_target_dicts_are_cut_with_their_images() -> None:
    images, targets = _collate([Boxes()[i] for i in range(5)])
    micro = split_batch((images, targets), 2)
    assert [[len(t["boxes"]) for t in mb[1]] for mb in micro] == [[1, 2, 3], [4, 1]]  # whole, by image
    assert micro_weights(micro) == [1.2, 0.8]
    assert micro_weights(split_batch((targets, images), 2)) == [1.2, 0.8]  # weighed by the images
    # torchvision's collate (tuple(zip(*batch))) gives a tuple of dicts: cut by image too
    cut = split_batch((images, tuple(targets)), 2)
    assert [[len(t["boxes"]) for t in mb[1]] for mb in cut] == [[1, 2, 3], [4, 1]]
    assert all(isinstance(mb[1], tuple) for mb in cut)
    # a list of two loaders' batches (the batch itself) is never taken for records, at batch size 2 too
    two = [{"x": images[:2], "targets": targets[:2]}, {"x": images[2:4]}]
    cut = split_batch(two, 2)
    assert [[len(t["boxes"]) for t in mb[0]["targets"]] for mb in cut] == [[1], [2]]
    assert [mb[1]["x"].shape[0] for mb in cut] == [1, 1]
    # per-sample lists of plain values (word ids, tags) go with their rows
    tags = [["a"], ["a", "b"], ["c"], [1, 2, 3], []]
    assert [mb["tags"] for mb in split_batch({"x": images, "tags": tags}, 2)] == [tags[:3], tags[3:]]
    # COCO's per-image lists of annotation dicts (a box's 4 coordinates in a list as long as the batch),
    # one image without any, and named-tuple records: cut by image, their insides whole (before, the
    # coordinates were cut and a pp2 fit ran 0.04 off one process, or failed on a shape)
    coco = tuple([{"bbox": [1.0, 2.0, 3.0, 4.0], "id": k} for k in range(n)] for n in (1, 0, 2, 3))
    assert [mb[1] for mb in split_batch((images[:4], coco), 2)] == [coco[:2], coco[2:]]
    records = [Target(t["boxes"], t["boxes"][:, 0]) for t in targets]
    cut = split_batch({"x": images, "targets": records}, 2)
    assert [[len(t.boxes) for t in mb["targets"]] for mb in cut] == [[1, 2, 3], [4, 1]]
    assert micro_weights(cut) == [1.2, 0.8]
    ref = _detect(1)
    results = run_distributed(_job, 2, _detect, init_group=False, timeout=300)
    for rank, got in enumerate(results):
        assert len(got["losses"]) == len(ref["losses"]) == 4, rank
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6), rank
    for key, value in ref["state"].items():
        torch.testing.assert_close(results[0]["state"][key], value, msg=key)
