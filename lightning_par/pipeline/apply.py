"""Turning a model's ordered layers into this rank's pipeline chunks.

:func:`apply_pipeline` cuts ``layers`` into ``p * v`` contiguous pieces (:mod:`.partition`), keeps the
pieces of virtual stages ``c * p + s`` (chunks ``c = 0..v-1`` of pipeline rank ``s``) as
``nn.Sequential`` chunks, and releases the others: their parameters become meta-device placeholders
marked ``_lp_remote`` (with the ``requires_grad`` they had, so the user's ``configure_optimizers()``
builds the same groups on every stage), which cost no memory, get no gradient, and no engine touches;
their buffers become meta tensors too, so the only real copy of a layer's buffers (BatchNorm's running
statistics) is the stage's that updates them, and exports and checkpoints take it from there. Modules
outside the layers, and modules a kept layer shares, stay as they are.

A parameter shared by layers on different pipeline ranks (a tied embedding and LM head) stays real on
each of them; its copies are kept equal by summing their gradients over the ranks that hold it
(:class:`TiedGradients`, one all-reduce per tied parameter and step, after the step's backwards and
before the data-parallel reduction: inside a backward it would deadlock, since the stages finish their
backwards at different times), and all but the first copy are marked ``_lp_norm_skip`` so a global
gradient norm counts it once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_par.pipeline.partition import Cut, cut
from lightning_par.tensor_parallel.layers import TP_DIM_ATTR
from lightning_par.tensor_parallel.slices import SEGMENTS_ATTR
from lightning_par.zero.units import REMOTE_ATTR

NORM_SKIP_ATTR = "_lp_norm_skip"


@dataclass
class PipelineSplit:
    chunks: list[nn.Module]
    pieces: list[tuple[int, int]]
    local: set[int] = field(default_factory=set)  # ids of parameters kept on this rank


def apply_pipeline(
    layers: Sequence[nn.Module],
    *,
    pp_rank: int,
    pp_size: int,
    virtual_stages: int = 1,
    method: Cut = "compute",
    sample: Tensor | None = None,
    groups: Sequence[ProcessGroup] = (),
) -> PipelineSplit:
    """This rank's chunks; the parameters of every other layer are released (see the module docstring).
    ``groups``: the process groups over which the cut is agreed (:func:`.partition.cut`): the mesh's
    pipeline, data- and tensor-parallel groups."""
    pieces = cut(layers, method, pieces=pp_size * virtual_stages, sample=sample, groups=groups)
    mine = [c * pp_size + pp_rank for c in range(virtual_stages)]
    chunks: list[nn.Module] = [nn.Sequential(*layers[slice(*pieces[g])]) for g in mine]
    local = {id(p) for chunk in chunks for p in chunk.parameters()}
    local_buffers = {id(b) for chunk in chunks for b in chunk.buffers()}
    kept = {i for g in mine for i in range(*pieces[g])}
    for index, layer in enumerate(layers):
        if index in kept:
            continue
        for module in layer.modules():
            for name, b in list(module._buffers.items()):
                # another stage's statistics (BatchNorm's running mean): a stale copy here would be
                # exported or checkpointed in place of the owner's
                if b is not None and id(b) not in local_buffers and not b.is_meta:
                    module._buffers[name] = torch.empty_like(b, device="meta")
                    setattr(module._buffers[name], REMOTE_ATTR, True)  # not one to materialise
            for name, p in list(module._parameters.items()):
                if p is not None and id(p) not in local:
                    # requires_grad as it was: the user's configure_optimizers() sees the same model on
                    # every stage, so optimizer groups (and checkpoints of them) agree across stages
                    placeholder = nn.Parameter(
                        torch.empty_like(p, device="meta"), requires_grad=p.requires_grad
                    )
                    setattr(placeholder, REMOTE_ATTR, True)
                    # full shapes (checkpoints) are known on every stage
                    for attr in (TP_DIM_ATTR, SEGMENTS_ATTR):
                        if hasattr(p, attr):
                            setattr(placeholder, attr, getattr(p, attr))
                    module._parameters[name] = placeholder
    return PipelineSplit(chunks=chunks, pieces=pieces, local=local)


def warn_frozen_beside(root: nn.Module, layers: Sequence[nn.Module]) -> None:
    """Warn (on global rank 0) about frozen parameters of ``root`` outside every pipeline layer: a copy of
    the model for an EMA or a teacher, made in ``__init__``. The pipeline runs its layers only, and on
    each rank the layers of other stages are meta placeholders, so code pairing such a copy with the
    model's parameters (an EMA update) fails in torch with a bare meta-device error. Trainable ones need
    no warning: they get no gradient, which the engines refuse by name."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    inside = {id(p) for layer in layers for p in layer.parameters()}
    beside = [n for n, p in root.named_parameters() if id(p) not in inside and not p.requires_grad]
    if beside:
        warnings.warn(
            f"Pipeline parallelism: {len(beside)} frozen parameter(s) lie outside the pipeline's layers"
            f" ({beside[:4]}{' ...' if len(beside) > 4 else ''}), a copy of the model for an EMA or a"
            " teacher? The pipeline runs its layers only, and each rank holds its own stage's layers (the"
            " other stages' parameters are meta-device placeholders there), so an update pairing this copy"
            " with the model's parameters fails with torch's 'Tensor on device meta' error. For an EMA of"
            " the weights use lightning_par.callbacks.ShardedEMA, which averages each stage's own layers;"
            " otherwise keep such a module off the model.",
            stacklevel=2,
        )


class TiedGradients:
    """Sums the gradient of each parameter held by several pipeline ranks over those ranks.

    Built collectively by every rank of the world: ``pp_groups`` lists the global ranks of every pipeline
    group (the same pattern of tied stages in each); ``names`` are this rank's local parameter names.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        local: set[int],
        pp_group: ProcessGroup,
        pp_groups: Sequence[Sequence[int]],
    ) -> None:
        names = {n for n, p in module.named_parameters() if id(p) in local}
        gathered: list[set[str]] = [set() for _ in range(dist.get_world_size(pp_group))]
        dist.all_gather_object(gathered, names, group=pp_group)
        holders: dict[str, tuple[int, ...]] = {}
        for name in sorted(set().union(*gathered)):
            stages = tuple(s for s, have in enumerate(gathered) if name in have)
            if len(stages) > 1:
                holders[name] = stages
        # (owning module, attribute name, group): the parameter is looked up at every exchange, since an
        # engine that materialises meta parameters (ZeRO-3 meta init) replaces the parameter objects
        self.entries: list[tuple[nn.Module, str, ProcessGroup]] = []
        by_name = dict(module.named_parameters())
        my_stage = dist.get_rank(pp_group)
        patterns = sorted(set(holders.values()))
        # every rank creates every group (new_group is collective), in the same order
        for stages in patterns:
            group_of_mine = None
            for ranks in pp_groups:
                g = dist.new_group([ranks[s] for s in stages])
                if my_stage in stages and dist.get_rank() in ranks:
                    group_of_mine = g
            for name, held in holders.items():
                if held == stages and group_of_mine is not None:
                    param = by_name[name]
                    owner, _, attr = name.rpartition(".")
                    self.entries.append((module.get_submodule(owner), attr, group_of_mine))
                    if my_stage != stages[0]:  # a replacement copies the attribute (meta_init)
                        setattr(param, NORM_SKIP_ATTR, True)

    @torch.no_grad()
    def exchange(self, grad_of: Callable[[nn.Parameter], Tensor | None] | None = None) -> None:
        """Sum each tied parameter's accumulated gradient over the ranks that hold it (call after the
        pipeline step's backwards and before the data-parallel reduction). ``grad_of`` gives where the
        gradient is accumulated (the engine's buffer, in the dtype it is reduced in); default
        ``param.grad``."""
        for owner, attr, group in self.entries:
            param = owner._parameters[attr]
            assert param is not None
            if not param.requires_grad:  # frozen (alike on every holder: one model, frozen before the cut)
                continue
            grad = grad_of(param) if grad_of is not None else param.grad
            if grad is None:
                if grad_of is not None:
                    raise RuntimeError("The engine keeps no gradient for a tied parameter (this is a bug).")
                grad = param.grad = torch.zeros_like(param)
            dist.all_reduce(grad, group=group)

    def destroy(self) -> None:
        """Destroy the groups built for the tied parameters (every rank, at the same point; see
        :meth:`lightning_par.mesh.ParallelMesh.destroy`)."""
        for group in {id(g): g for _, _, g in self.entries}.values():
            dist.destroy_process_group(group)
        self.entries = []

    def __len__(self) -> int:
        return len(self.entries)
