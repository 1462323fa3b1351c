"""Moving a partly meta-initialised model to its device (``move_real_tensors``, what both strategies'
``model_to_device`` run at ZeRO-3 with meta init): meta parameters stay meta, real parameters and buffers
move, and so does state kept outside parameters and buffers by a module's own ``_apply`` (torchmetrics'
metric states and ``device``). Before, only parameters and buffers moved one by one, so a metric in a
LightningModule built under meta init stayed on the CPU; on the H200 the package's main job at ZeRO-3
stopped at its first validation ("Encountered different devices in metric calculation"). Here the target
device is ``meta``, the only device a CPU machine has besides the CPU (a real tensor of a module that
also holds meta parameters cannot move there: ``set_data`` refuses CPU to meta, so none is here)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchmetrics import MeanMetric

from lightning_par.zero.meta_build import move_real_tensors


class Recorder(nn.Module):
    """Keeps a tensor outside its parameters and buffers, moved in its own ``_apply``."""

    def __init__(self) -> None:
        super().__init__()
        self.kept = torch.zeros(2)

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        self.kept = fn(self.kept)
        return super()._apply(fn, recurse)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.device("meta"):
            self.meta_layer = nn.Linear(3, 3)
        self.real_layer = nn.Linear(3, 3)
        self.norm = nn.BatchNorm1d(3)
        self.block = nn.Sequential(Recorder(), nn.Linear(3, 3))
        self.metric = MeanMetric()


def test_real_tensors_and_module_state_follow_the_model() -> None:
    model = Model()
    model.metric.update(torch.tensor(2.0))
    move_real_tensors(model, torch.device("meta"))
    assert model.meta_layer.weight.is_meta
    assert model.real_layer.weight.is_meta and model.norm.running_mean.is_meta
    assert model.block[0].kept.is_meta and model.block[1].weight.is_meta
    assert model.metric.device.type == "meta" and model.metric.mean_value.is_meta


def test_a_model_without_meta_parameters_moves_whole() -> None:
    model = nn.Sequential(nn.Linear(2, 2), Recorder())
    move_real_tensors(model, torch.device("meta"))
    assert model[0].weight.is_meta and model[1].kept.is_meta


class RotaryLike(nn.Module):
    """No parameters, one buffer: built under ``torch.device("meta")`` the buffer is meta too."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)


def test_meta_buffers_stay_for_materialize_buffers() -> None:
    """A model built under ``torch.device("meta")`` has meta buffers in modules without parameters:
    they are left for ``materialize_buffers`` (``.to()`` of such a module cannot copy them). The first
    version of the fix moved them with ``.to()`` and raised "Cannot copy out of meta tensor" (in the
    Fabric meta-init test, and here)."""
    with torch.device("meta"):
        model = nn.ModuleDict({"layer": nn.Linear(2, 2), "rotary": RotaryLike()})
    move_real_tensors(model, torch.device("cpu"))
    assert model["rotary"].inv_freq.is_meta and model["layer"].weight.is_meta
