"""Pretrained weights (a full state dict on disk) into a parallelised model, slice by slice.

:func:`plan_pretrained` matches the model's parameter and persistent-buffer names against a
:class:`~lightning_par.checkpoint.pretrained.WeightSource` (exact names, a common prefix added or
stripped, PEFT's ``.base_layer.``) and checks everything before a single value is written: shapes are
compared with the model's *full* shapes (tensor-parallel parameters count at their unsharded size), file
entries that match nothing are refused (``strict``), and frozen parameters the file lacks are refused
(nothing would ever set them). Trainable parameters the file lacks (a LoRA adapter, a new head) are
initialised as usual, and named in a warning.

The plan then hands out values one parameter at a time, already cut to this rank's tensor-parallel slice
(:meth:`PretrainedPlan.value`), so ZeRO-3's meta-device initialisation fills each unit straight from the
file (:mod:`lightning_par.zero.meta_init`) and a rank never holds more than its result plus one tensor;
:meth:`PretrainedPlan.load_local` copies into parameters and buffers that already exist on this rank.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_par.checkpoint.pretrained import WeightSource, match_names
from lightning_par.state_guard import reads_of
from lightning_par.tensor_parallel.layers import TP_DIM_ATTR
from lightning_par.tensor_parallel.slices import piece, segments_by_name
from lightning_par.zero.units import REMOTE_ATTR

PretrainedSource = str | os.PathLike[str] | Mapping[str, Tensor]
LOADED_ATTR = "_lightning_par_pretrained_loaded"  # on the model: its pretrained weights are in
_LIST = 8


@dataclass
class PretrainedPlan:
    source: WeightSource
    names: dict[str, str]  # model name (full, as in the unsharded model) -> name in the source
    tp_rank: int
    tp_size: int
    dims: dict[str, int]  # tensor-parallel dimension of sharded parameters
    segments: dict[str, list[int]]  # a fused projection's segments (tensor_parallel.slices)

    def value(self, name: str) -> Tensor | None:
        """The values of model parameter or buffer ``name`` for this rank (its tensor-parallel slice), or
        None when the source does not have it."""
        file_name = self.names.get(name)
        if file_name is None:
            return None
        dim = self.dims.get(name)
        if dim is None or self.tp_size == 1:
            return self.source.get(file_name)
        if name in self.segments:  # one block of each segment: read whole, then cut
            full = self.source.get(file_name)
            cut = piece(full, dim=dim, rank=self.tp_rank, size=self.tp_size, segments=self.segments[name])
            return cut.clone()
        return self.source.get_slice(file_name, dim=dim, index=self.tp_rank, parts=self.tp_size)

    @torch.no_grad()
    def load_local(self, module: nn.Module) -> int:
        """Copy the source's values into this rank's real (non-meta) parameters and buffers; returns how
        many tensors were written."""
        count = 0
        targets = [*module.named_parameters(), *module.named_buffers()]
        for name, tensor in targets:
            if tensor.is_meta:
                continue
            value = self.value(name)
            if value is not None:
                tensor.copy_(value.to(tensor.dtype))
                count += 1
        return count

    def close(self) -> None:
        self.source.close()


def _expected(module: nn.Module, tp_size: int) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """Full shapes of the parameters and persistent buffers, and the tp dimension of sharded ones."""
    shapes: dict[str, tuple[int, ...]] = {}
    dims: dict[str, int] = {}
    for name, p in module.named_parameters():
        shape = list(p.shape)
        if tp_size > 1 and hasattr(p, TP_DIM_ATTR):
            dim = int(getattr(p, TP_DIM_ATTR))
            shape[dim] *= tp_size
            dims[name] = dim
        shapes[name] = tuple(shape)
    with reads_of(module)():  # the names only: the slices and placeholders are not read
        persistent = set(module.state_dict(keep_vars=True))
    for name, b in module.named_buffers():
        if name in persistent:
            shapes[name] = tuple(b.shape)
    return shapes, dims


def _hf_converted_types(module: nn.Module) -> list[str]:
    """The ``model_type`` of each Hugging Face model inside ``module`` whose checkpoints transformers
    converts on load (transformers 5's conversion mapping: renames, experts fused from per-expert
    tensors); empty without transformers or such a model."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import extract_weight_conversions_for_model
    except ImportError:  # transformers absent, or before 5 (no conversion on load)
        return []
    found: list[str] = []
    for sub in module.modules():
        if isinstance(sub, PreTrainedModel) and extract_weight_conversions_for_model(sub):
            kind = str(sub.config.model_type)
            if kind not in found:
                found.append(kind)
    return found


def plan_pretrained(
    module: nn.Module,
    source: PretrainedSource,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    strict: bool = True,
    partial: bool = False,
) -> PretrainedPlan:
    """Open ``source`` and check it against ``module`` (see the module docstring); raises a
    ``ValueError`` listing every mismatch before anything is written. ``partial``: ``source`` holds what
    the user's ``configure_model()`` loaded, the rest is initialised as without it (no parameter is
    required, none is warned about)."""
    weights = WeightSource.open(source)
    try:
        shapes, dims = _expected(module, tp_size)
        # a tied parameter's other names (GPT-2's lm_head.weight, the embedding's): a state dict holds an
        # entry for each, and either one may carry the weight
        first = {id(p): n for n, p in module.named_parameters()}
        aliases = {
            n: first[id(p)] for n, p in module.named_parameters(remove_duplicate=False) if first[id(p)] != n
        }
        matched = match_names(weights.keys(), [*shapes, *aliases])
        names = {m: f for m, f in matched.items() if m in shapes}
        for alias, f in matched.items():
            if alias in aliases:
                names.setdefault(aliases[alias], f)
        problems = []
        reshaped = [
            f"{m}: file {weights.shape(f)} vs model {shapes[m]}"
            for m, f in sorted(names.items())
            if tuple(weights.shape(f)) != shapes[m]
        ]
        if reshaped:
            problems.append(f"{len(reshaped)} of other shapes: {reshaped[:_LIST]}")
        unexpected = sorted(set(weights.keys()) - set(matched.values()))
        if unexpected and strict:
            problems.append(f"{len(unexpected)} in the file match no model name: {unexpected[:_LIST]}")
        params = dict(module.named_parameters())
        frozen_missing = sorted(
            n
            for n, p in params.items()
            if n not in names and not p.requires_grad and not _remote(p) and not partial
        )
        if frozen_missing:
            problems.append(
                f"{len(frozen_missing)} frozen parameters are not in the file (nothing would set them):"
                f" {frozen_missing[:_LIST]}"
            )
        new = sorted(n for n, p in params.items() if n not in names and p.requires_grad and not _remote(p))
        if problems and new:  # the other side of a renamed or misplaced entry
            problems.append(
                f"{len(new)} trainable parameters are not in the file (they would be initialised):"
                f" {new[:_LIST]}"
            )
        if problems:
            converted = _hf_converted_types(module)
            hint = (
                f" transformers converts {' and '.join(converted)} checkpoints while loading them (their"
                " stored names and layout differ from the modules', e.g. one tensor per expert where the"
                " model fuses them), and pretrained= reads the file as stored: build the model with"
                " from_pretrained(dir, use_kernels=False) inside configure_model() instead (its weights"
                " are kept under meta init)."
                if converted
                else ""
            )
            raise ValueError(
                f"The pretrained weights {_label(source)} do not fit the model: " + "; ".join(problems) + "."
                " Load the weights of this architecture, pass the right file, or (for extra entries in"
                " the file) pretrained_strict=False." + hint
            )
        if new and not partial:
            warnings.warn(
                f"{len(new)} trainable parameters are not in the pretrained weights and are initialised"
                f" instead: {new[:_LIST]}",
                stacklevel=2,
            )
    except BaseException:
        weights.close()
        raise
    segments = segments_by_name([(n, p) for n, p in module.named_parameters() if n in dims])
    return PretrainedPlan(
        source=weights, names=names, tp_rank=tp_rank, tp_size=tp_size, dims=dims, segments=segments
    )


def load_pretrained_once(
    module: nn.Module,
    source: PretrainedSource,
    *,
    tp_rank: int,
    tp_size: int,
    strict: bool,
    partial: bool = False,
) -> PretrainedPlan | None:
    """Check ``source`` against the (composed) ``module`` and copy it into every real parameter and
    buffer; return the plan, whose :meth:`~PretrainedPlan.value` fills the meta parameters still to be
    materialised (the caller closes it). A model that got its weights in an earlier setup (``fit`` then
    ``test``) has trained since: it is left alone (None)."""
    pending = any(p.is_meta and not _remote(p) for p in module.parameters())
    if getattr(module, LOADED_ATTR, False) and not pending:
        return None
    plan = plan_pretrained(module, source, tp_rank=tp_rank, tp_size=tp_size, strict=strict, partial=partial)
    try:
        plan.load_local(module)
    except BaseException:
        plan.close()
        raise
    setattr(module, LOADED_ATTR, True)
    return plan


def _remote(p: nn.Parameter) -> bool:
    return bool(getattr(p, REMOTE_ATTR, False))


def _label(source: PretrainedSource) -> str:
    return "(in memory)" if isinstance(source, Mapping) else repr(os.fspath(source))
