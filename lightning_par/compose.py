"""The model-changing part of the composition, applied once per model: tensor parallel, pipeline split,
activation checkpointing (steps 3-5 of the order in ``docs/architecture.md``).

These steps rewrite the module in place (layers become tensor-parallel, other stages' layers become
meta placeholders), so running them again on the same model would slice slices. :func:`compose` records
what it applied on the module and, called again with the same layout (``fit`` then ``test``, or a
second ``Trainer`` with a fresh strategy), returns the record instead of re-applying; another layout is
refused with what the model already has. The ZeRO engine, precision and optimizers are per run and are
built by the caller after this, every time. Lightning-free: the strategy for the ``Trainer`` and a
Fabric strategy call the same function.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_par.activation_checkpointing import apply_activation_checkpointing
from lightning_par.pipeline.apply import PipelineSplit, apply_pipeline, warn_frozen_beside
from lightning_par.pipeline.partition import Cut
from lightning_par.pipeline.pieces import Piece
from lightning_par.pipeline.split_guard import guard_split_model
from lightning_par.state_guard import guard_state_dicts
from lightning_par.tensor_parallel import apply_tensor_parallel
from lightning_par.tensor_parallel.ddp_refusal import refuse_ddp
from lightning_par.tensor_parallel.layers import TP_DIM_ATTR
from lightning_par.tensor_parallel.plans import PLANS
from lightning_par.zero.units import UnitPolicy

log = logging.getLogger(__name__)
COMPOSITION_ATTR = "_lightning_par_composition"


@dataclass(frozen=True)
class ComposeOptions:
    """What shapes the model: the same options give the same model."""

    tensor_parallel_size: int = 1
    tp_plan: str | Mapping[str, str] | None = None
    sequence_parallel: bool = False
    pipeline_parallel_size: int = 1
    virtual_stages: int = 1
    partition_method: Cut = "compute"
    activation_checkpointing: bool | UnitPolicy = False

    def key(self, *, tp_rank: int, pp_rank: int) -> tuple[Any, ...]:
        plan = sorted(self.tp_plan.items()) if isinstance(self.tp_plan, Mapping) else self.tp_plan
        policy = self.activation_checkpointing
        if not isinstance(policy, bool) and policy is not None:
            policy = tuple(p if isinstance(p, str) else p.__qualname__ for p in policy)
        return (
            self.tensor_parallel_size,
            repr(plan),
            self.sequence_parallel,
            self.pipeline_parallel_size,
            self.virtual_stages,
            self.partition_method,
            repr(policy),
            tp_rank,
            pp_rank,
        )


@dataclass
class Composition:
    """What :func:`compose` applied to a model."""

    key: tuple[Any, ...]
    tensor_parallel: dict[str, str] = field(default_factory=dict)
    pipeline: PipelineSplit | None = None
    checkpointed: list[str] = field(default_factory=list)
    tp_group: ProcessGroup | None = None  # the group the tensor-parallel layers communicate over


def compose(
    module: nn.Module,
    *,
    options: ComposeOptions,
    tp_group: ProcessGroup | None,
    tp_rank: int,
    pp_rank: int,
    layers: Callable[[], Sequence[nn.Module]] | None = None,
    sample: Tensor | None = None,
    cut_groups: Sequence[ProcessGroup] = (),
) -> Composition:
    """Apply tensor parallelism (over ``tp_group``), the pipeline split (this rank's stage ``pp_rank`` of
    the ordered ``layers()``, cut the same way on every rank of ``cut_groups``: the mesh's pipeline, data-
    and tensor-parallel groups) and activation checkpointing to ``module``, once (see the module
    docstring)."""
    key = options.key(tp_rank=tp_rank, pp_rank=pp_rank)
    done: Composition | None = getattr(module, COMPOSITION_ATTR, None)
    if done is not None:
        if done.key != key:
            # what rewrote it: tensor / pipeline parallelism, or only activation checkpointing's wrappers
            rewrote = (
                "Tensor and pipeline parallelism rewrite"
                if done.key[0] > 1 or done.key[3] > 1
                else "Activation checkpointing wraps the layers of"
            )
            raise ValueError(
                "The model was already parallelised by lightning_par with another layout"
                f" ({_describe(done.key)}); now asked for {_describe(key)}. {rewrote} the model in place:"
                " build a fresh model for another layout."
            )
        if done.tp_group is not None and not _registered(done.tp_group):
            # the layers hold the group they were built with (in hooks and autograd functions too)
            raise ValueError(
                "The model's tensor-parallel layers communicate over the process group of the strategy that"
                " converted them, destroyed since (destroy_process_groups()), so they can no longer run."
                " Build a fresh model for this run (load the weights the first one saved, e.g. its"
                " consolidated_state_dict() or checkpoint), or keep the first strategy's groups alive while"
                " the converted model is in use."
            )
        return done
    composition = Composition(key=key)
    if options.tensor_parallel_size > 1:
        plan = options.tp_plan if options.tp_plan is not None else getattr(module, "tp_plan", None)
        if plan is None:
            raise ValueError(
                f"tensor_parallel_size={options.tensor_parallel_size} needs a plan: pass tp_plan (one of"
                f" {sorted(PLANS)}, or {{module pattern: style}}) to the strategy, or give the model (the"
                " LightningModule, or the module given to fabric.setup) a tp_plan attribute."
            )
        assert tp_group is not None
        composition.tp_group = tp_group
        composition.tensor_parallel = apply_tensor_parallel(
            module, group=tp_group, plan=plan, sequence_parallel=options.sequence_parallel
        )
        # a save (save_pretrained on rank 0, torch.save(pl_module.state_dict()) in a callback) would write
        # this rank's slices: refused, for good, outside the strategies' own reads (state_guard.reads_of)
        slices = "tensor-parallel slices (this rank's share of each)"
        guard_state_dicts(
            module,
            holds=lambda m: any(hasattr(p, TP_DIM_ATTR) for p in m.parameters(recurse=False)),
            reason=lambda m: slices,
            whole=lambda: slices,
        )
        refuse_ddp(module, size=options.tensor_parallel_size)  # its slices under "ddp" afterwards
        log.info(
            "lightning_par: tensor parallel over %d ranks: %d modules",
            options.tensor_parallel_size,
            len(composition.tensor_parallel),
        )
    if options.pipeline_parallel_size > 1:
        assert layers is not None
        built = layers()
        if options.sequence_parallel and any(isinstance(layer, Piece) for layer in built):
            # refused on every rank alike, before any pipeline communication (a piece that failed in its
            # forward would leave the other stages waiting)
            raise ValueError(
                "sequence_parallel=True with pipeline pieces from hf_pipeline_layers or"
                " litgpt_pipeline_layers: their blocks build the rotary tables and attention masks from"
                " the hidden states' length, which sequence parallelism splits. Use"
                " sequence_parallel=False (tensor parallelism itself works with these pieces), or write"
                " pipeline_layers() whose blocks take the full length. (The model was converted to"
                " tensor parallelism already: build it afresh for the next run.)"
            )
        composition.pipeline = apply_pipeline(
            built,
            pp_rank=pp_rank,
            pp_size=options.pipeline_parallel_size,
            virtual_stages=options.virtual_stages,
            method=options.partition_method,
            sample=sample,
            groups=cut_groups,
        )
        warn_frozen_beside(module, built)
        # the model's own forward and a submodule's save would meet other stages' placeholders: refused
        guard_split_model(module, pp_rank=pp_rank)
    if options.activation_checkpointing is not False:
        policy = None if options.activation_checkpointing is True else options.activation_checkpointing
        composition.checkpointed = apply_activation_checkpointing(module, policy=policy)
    rewritten = options.tensor_parallel_size > 1 or options.pipeline_parallel_size > 1
    if rewritten or options.activation_checkpointing is not False:
        # marked only when something was rewritten: a plain (ZeRO) layout leaves the model free to take
        # another one next (before, a tensor-parallel fit after it was refused as "already parallelised")
        setattr(module, COMPOSITION_ATTR, composition)
    return composition


def _registered(group: ProcessGroup) -> bool:
    """Whether ``group`` is still a live process group of this process (not destroyed)."""
    try:
        dist.get_rank(group)  # its size is kept on a destroyed group's object; its ranks are not
    except (ValueError, RuntimeError):
        return False
    return True


def _describe(key: tuple[Any, ...]) -> str:
    tp, plan, sp, pp, v, method, ac, _, _ = key
    return (
        f"tensor_parallel_size={tp}, tp_plan={plan}, sequence_parallel={sp}, pipeline_parallel_size={pp},"
        f" virtual_stages={v}, partition_method={method!r}, activation_checkpointing={ac}"
    )
