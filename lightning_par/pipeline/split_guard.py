"""Refuse whole-model calls and saves of a model split into pipeline stages.

Why
---
After :func:`~lightning_par.pipeline.apply.apply_pipeline` each rank holds its own stage's layers; the
parameters of the other stages' layers are meta-device placeholders. The pipeline runs the stage's layers
one by one and never calls the modules that contain them (the LightningModule, a Hugging Face model's
``forward`` or ``generate``), but a user's code does: ``self.model.generate(...)`` in
``on_validation_epoch_end`` failed deep inside the model with torch's "Tensor on device meta is not on the
expected device cpu", and ``pl_module.model.save_pretrained(dir)`` or ``torch.save(model.state_dict())``
wrote the placeholders (an incomplete file, silently, or "Cannot copy out of meta tensor" after writing the
config).

How
---
:func:`guard_split_model` puts two hooks on each module of ``root`` whose subtree holds a placeholder:

* a forward pre-hook that refuses the call, naming the module, a placeholder and the fixes;
* a ``state_dict`` pre-hook (through :func:`~lightning_par.state_guard.guard_state_dicts`, on the modules
  holding placeholders directly) that refuses a traversal started below ``root``; the strategies' own
  traversals start at ``root`` (checkpoints, ``consolidated_state_dict()``) and pass.

Both look again at each call whether the module still holds a placeholder, so a copy whose placeholders
were replaced by whole weights (``load_state_dict(..., assign=True)`` of the consolidated state) runs and
saves. The hooks stay with the model, as the split itself does: it is not undone after ``fit``. The
pipeline's own calls (its chunks of this stage's layers) never reach a hooked module.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_par.state_guard import guard_state_dicts
from lightning_par.zero.units import REMOTE_ATTR

__all__ = ["guard_split_model"]

_FIXES = (
    "The pipeline runs the model: the Trainer's fit / validate / test / predict through pipeline_loss,"
    " pipeline_eval and pipeline_predict, a Fabric loop through fabric.strategy.pipeline.step / evaluate /"
    " predict. For generation or any other whole-model call, call strategy.consolidated_state_dict() on"
    " every rank (collective; the full state lands on rank 0) and load it into an unsplit copy of the model"
    " (e.g. on rank 0 pl_module.model.save_pretrained(dir, state_dict={k.removeprefix('model.'): v for k, v"
    " in full.items()}), its keys stripped of the LightningModule's attribute prefix, then from_pretrained)."
)


def _remote_name(module: nn.Module, *, recurse: bool) -> str | None:
    """The name of one placeholder ``module`` holds (directly or, with ``recurse``, below), or None."""
    for name, p in module.named_parameters(recurse=recurse):
        if getattr(p, REMOTE_ATTR, False):
            return name
    for name, b in module.named_buffers(recurse=recurse):
        if getattr(b, REMOTE_ATTR, False):
            return name
    return None


_PLACEHOLDERS = (
    "meta-device placeholders of layers that live on other pipeline stages (each rank holds its own stage's"
    " layers)"
)


def guard_split_model(root: nn.Module, *, pp_rank: int) -> list[RemovableHandle]:
    """Hook the modules of ``root`` that hold other stages' placeholders (see the module docstring);
    ``pp_rank``: this rank's pipeline stage, for the message."""
    tensors = [*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)]
    # the modules above a placeholder, by name: every prefix of its dotted name ("" is root)
    above = {""}
    for name, t in tensors:
        if getattr(t, REMOTE_ATTR, False):
            parts = name.split(".")[:-1]
            above.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    handles: list[RemovableHandle] = []
    hooked: set[int] = set()  # a module under two names (shared) is hooked once
    for name, module in root.named_modules(remove_duplicate=False):
        if name in above and id(module) not in hooked and _remote_name(module, recurse=True) is not None:
            hooked.add(id(module))
            refuse = _RefuseCall(name or type(module).__name__, pp_rank)
            handles.append(module.register_forward_pre_hook(refuse))
    handles += guard_state_dicts(
        root,
        holds=lambda m: _remote_name(m, recurse=False) is not None,
        reason=lambda m: _PLACEHOLDERS if _remote_name(m, recurse=False) is not None else None,
        # the whole model's state dict (torch.save(pl_module.state_dict()) in a callback) too, outside the
        # strategies' own reads, until whole weights replace the placeholders
        whole=lambda: _PLACEHOLDERS if _remote_name(root, recurse=True) is not None else None,
    )
    return handles


class _RefuseCall:
    """The forward pre-hook of a module holding other stages' layers: a call refused naming the fixes.
    Pickled with its module (``torch.save(model)``), it refuses too: the pickle would hold meta
    placeholders (before, "Can't pickle local object"); ``copy.deepcopy`` keeps it, as a function."""

    def __init__(self, name: str, pp_rank: int) -> None:
        self.name, self.pp_rank = name, pp_rank

    def __call__(self, module: nn.Module, _args: Any) -> None:
        remote = _remote_name(module, recurse=True)
        if remote is not None:
            raise RuntimeError(
                f"{self.name!r} ({type(module).__name__}) was called on pipeline stage {self.pp_rank},"
                " which holds only its own stage's layers: the other stages' layers in it"
                f" ({remote!r} among them) are meta-device placeholders here, so the call would fail in"
                " torch or compute nothing useful (a forward, generate(), a summary's example input). "
                + _FIXES
            )

    def __deepcopy__(self, memo: dict[int, Any]) -> _RefuseCall:
        return self

    def __reduce__(self) -> Any:
        raise RuntimeError(
            f"{self.name!r} was pickled (torch.save(model), pickle.dumps) on pipeline stage {self.pp_rank},"
            " which holds only its own stage's layers (the others are meta-device placeholders), so the"
            f" pickle would not hold the model. {_FIXES}"
        )
