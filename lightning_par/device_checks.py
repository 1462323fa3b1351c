"""Setup-time checks that the process-group backend, the devices and the optimizer kernels fit together.

Each check runs before any process group or optimizer state exists, so a wrong combination fails at
once, on every rank, with the problem and the fix, instead of deep inside the first collective.

Backends. Every tensor the mechanisms hand to a collective lives on the strategy's root device (the
communication device). NCCL moves CUDA tensors only; Gloo moves CPU tensors (and a few collectives on
CUDA tensors through host copies, with no reduce-scatter). So:

* a CPU run uses ``"gloo"``; ``"nccl"`` there is refused;
* a CUDA run uses ``"cpu:gloo,cuda:nccl"`` by default: NCCL for every tensor of the training step, Gloo
  for the CPU-side objects that must travel outside it (object broadcasts, checkpoint records); plain
  ``"nccl"`` is accepted; a Gloo-only group is refused.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import nn
from torch.optim import Optimizer

CUDA_DEFAULT_BACKEND = "cpu:gloo,cuda:nccl"

# torch optimizers with a fused implementation (their constructor takes ``fused``)
FUSED_OPTIMIZERS: tuple[type[Optimizer], ...] = tuple(
    cls
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
    if "fused" in inspect.signature(cls.__init__).parameters
)


def _backend_for(backend: str, device_type: str) -> str | None:
    """The backend a (possibly multi-device, ``"cpu:gloo,cuda:nccl"``) string names for ``device_type``."""
    if ":" not in backend:
        return backend.lower()
    for entry in backend.split(","):
        dev, _, name = entry.strip().partition(":")
        if dev.lower() == device_type:
            return name.lower()
    return None


def resolve_backend(requested: str | None, device: torch.device) -> str:
    """The process-group backend for a run whose root device is ``device`` (see the module docstring);
    raises ``ValueError`` naming the fix for a backend that cannot move that device's tensors."""
    if requested is None:
        if device.type == "cuda":
            return CUDA_DEFAULT_BACKEND
        if device.type == "cpu":
            return "gloo"
        raise ValueError(
            f"No default process-group backend for {device.type!r} devices; pass process_group_backend="
            " (the backend of your accelerator's collective library)."
        )
    for_device = _backend_for(requested, device.type)
    if "nccl" in requested.lower() and not torch.cuda.is_available():
        raise ValueError(
            f"process_group_backend={requested!r} needs CUDA, and this machine has no CUDA device (the"
            f" run is on {device.type!r}); use process_group_backend='gloo' or leave it unset."
        )
    if device.type == "cpu" and for_device != "gloo":
        raise ValueError(
            f"process_group_backend={requested!r} cannot move CPU tensors, and this run's tensors are on the"
            " CPU; use 'gloo' or leave it unset."
        )
    if device.type == "cuda" and for_device != "nccl":
        raise ValueError(
            f"process_group_backend={requested!r} gives CUDA tensors to {for_device or 'no backend'}:"
            " the training step's collectives (reduce-scatter, all-gather, p2p) need NCCL on CUDA. Use"
            f" {CUDA_DEFAULT_BACKEND!r} (the default: NCCL for the step, Gloo for CPU-side objects) or"
            " 'nccl', or train on the CPU with 'gloo'."
        )
    return requested


def check_optimizer_kernels(optimizers: Sequence[Optimizer], *, device: torch.device) -> None:
    """Refuse ``fused=True`` where no fused kernel will run: an optimizer class without a fused
    implementation (torch has them for Adam, AdamW, SGD and Adagrad), or a device without fused kernels.
    ``fused``/``foreach`` otherwise pass through unchanged to the optimizers the ZeRO engines rebuild over
    their shards."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    for k, opt in enumerate(optimizers):
        if not opt.defaults.get("fused"):
            continue
        name = f"{type(opt).__module__}.{type(opt).__qualname__}"
        if not isinstance(opt, FUSED_OPTIMIZERS):
            raise ValueError(
                f"Optimizer {k} ({name}) was given fused=True, but it has no fused kernel (torch has them"
                f" for {', '.join(c.__name__ for c in FUSED_OPTIMIZERS)}); drop fused=True, use"
                " foreach=True, or one of those optimizers."
            )
        if device.type not in _get_fused_kernels_supported_devices():
            raise ValueError(
                f"Optimizer {k} ({name}) was given fused=True, and fused kernels do not exist for"
                f" {device.type!r} devices; drop fused=True or use foreach=True."
            )


def refuse_sync_batchnorm_on_cpu(
    module: nn.Module, *, device: torch.device, converting: bool, fix: str
) -> None:
    """Refuse to train ``nn.SyncBatchNorm`` layers on CPU before anything is built: torch's SyncBatchNorm
    synchronises in training on accelerators only, so the first training forward would fail after
    setup and the sanity check had run (torch's DDP refuses them at construction, so Lightning's and
    Fabric's ``"ddp"`` fail at setup). ``converting``: the BatchNorm layers are about to be converted
    (``Trainer(sync_batchnorm=True)``). Evaluation runs are not checked: there SyncBatchNorm normalises
    with its running statistics, as BatchNorm does."""
    if device.type != "cpu":
        return
    kinds = nn.modules.batchnorm._BatchNorm if converting else nn.SyncBatchNorm
    name = next((n or "<root>" for n, m in module.named_modules() if isinstance(m, kinds)), None)
    if name is not None:
        raise ValueError(
            f"SyncBatchNorm trains on GPUs only (torch's SyncBatchNorm refuses CPU tensors in training), and"
            f" this run is on CPU ({name!r} would be one): {fix}"
        )
