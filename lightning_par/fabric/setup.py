"""The model-changing part of ``fabric.setup`` under lightning_par's Fabric strategy.

:func:`compose_module` applies the same :func:`lightning_par.compose.compose` the Trainer strategy calls
(tensor parallel, pipeline split, activation checkpointing; once per module) and records which parameter
objects it replaced: tensor-parallel slices, and under pipeline parallelism the meta placeholders of
other stages' layers. An optimizer made before ``fabric.setup`` still holds the old objects; without
state it only holds references, so :func:`follow_replaced` points it at the new ones (one with state is
refused, with the fix). Under pipeline parallelism :func:`complete_stage_groups` then gives every stage's
optimizers the same parameter groups (other stages' parameters as their placeholders), so that an
optimizer built from this stage's parameters alone numbers its state as one built from the whole model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.fabric.utilities.init import _EmptyInit
from torch import nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_par.compose import ComposeOptions, Composition, compose
from lightning_par.pipeline.steps import layers_of
from lightning_par.precision import ParallelPrecision
from lightning_par.zero.buffers import BufferSync, sync_around_forward
from lightning_par.zero.meta_build import meta_build

if TYPE_CHECKING:
    from lightning_par.fabric.strategy import HybridParallelStrategy

Replaced = dict[int, tuple[nn.Parameter, nn.Parameter]]  # id(old) -> (old, new)


def compose_module(strategy: HybridParallelStrategy, module: nn.Module) -> tuple[Composition, Replaced]:
    """Compose ``module`` for ``strategy``'s layout (meta parameters are refused below stage 3, which
    alone materialises them); return the composition and the parameters it replaced."""
    if strategy.zero_stage != 3:
        meta = [n for n, p in module.named_parameters() if p.is_meta]
        if meta:
            raise ValueError(
                f"{len(meta)} parameter(s) are on the meta device (e.g. {meta[0]!r}): only zero_stage=3"
                " materialises them; create the model with fabric.init_module() (empty_init=False) or"
                " use zero_stage=3."
            )
    before = dict(module.named_parameters())
    pp, tp, mesh = strategy.pipeline_parallel_size, strategy.tensor_parallel_size, strategy.mesh
    profile = strategy.partition_method == "profile"
    composition = compose(
        module,
        options=ComposeOptions(
            tensor_parallel_size=tp,
            tp_plan=strategy.tp_plan,
            sequence_parallel=strategy.sequence_parallel,
            pipeline_parallel_size=pp,
            virtual_stages=strategy.virtual_stages,
            partition_method=strategy.partition_method,
            activation_checkpointing=strategy.activation_checkpointing,
        ),
        tp_group=mesh.tp_group if tp > 1 else None,
        tp_rank=mesh.tp_rank,
        pp_rank=mesh.pp_rank,
        layers=(lambda: layers_of(module, strategy.pipeline_layers)) if pp > 1 else None,
        sample=getattr(module, "example_input_array", None) if profile else None,
        cut_groups=(mesh.pp_group, mesh.dp_group, mesh.tp_group),
    )
    after = dict(module.named_parameters())
    replaced = {id(p): (p, after[n]) for n, p in before.items() if n in after and after[n] is not p}
    return composition, replaced


def follow_replaced(replaced: Replaced, optimizers: list[Optimizer]) -> None:
    """Point optimizers made before ``setup_module`` at the parameters that replaced theirs (tensor-parallel
    slices, other stages' placeholders); refuse one with state."""
    for opt in optimizers:
        for group in opt.param_groups:
            for i, p in enumerate(group["params"]):
                old_new = replaced.get(id(p))
                if old_new is None or old_new[0] is not p:
                    continue
                if opt.state.get(p):
                    raise ValueError(
                        "An optimizer with state holds parameters that tensor or pipeline parallelism"
                        " replaced (by their slices, or by placeholders of other stages' layers); create the"
                        " optimizer after model = fabric.setup_module(model), from model.parameters(), or"
                        " before any optimizer step."
                    )
                group["params"][i] = old_new[1]


def complete_stage_groups(optimizers: list[Optimizer], module: nn.Module, *, pp_group: ProcessGroup) -> None:
    """Add to each param group the placeholders of the parameters the same group holds on other pipeline
    stages, each group then in the model's parameter order (collective over ``pp_group``).

    An optimizer made after ``fabric.setup_module`` must leave other stages' meta placeholders out (Fabric
    refuses meta parameters in an optimizer), so each stage's groups would list only its own parameters,
    and a full optimizer state (``save_distributed_checkpoint=False``), numbered in group order, would
    not fit an optimizer built from the whole model. An optimizer that lists every parameter already is
    left as it is."""
    names = {id(p): n for n, p in module.named_parameters()}
    order = {n: i for i, n in enumerate(names.values())}
    mine = [
        [[names[id(p)] for p in g["params"] if id(p) in names] for g in opt.param_groups]
        for opt in optimizers
    ]
    gathered: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(gathered, mine, group=pp_group)
    shapes = {tuple(len(groups) for groups in stage) for stage in gathered}
    if len(shapes) != 1:
        raise ValueError(
            "The optimizers differ across pipeline stages (optimizers and param groups per stage:"
            f" {sorted(shapes)}): build them by the same rule on every stage, e.g. one group from"
            " [p for p in model.parameters() if not p.is_meta]."
        )
    by_name = dict(module.named_parameters())
    for k, opt in enumerate(optimizers):
        for j, group in enumerate(opt.param_groups):
            have = {names.get(id(p)) for p in group["params"]}
            missing = sorted({n for stage in gathered for n in stage[k][j]} - have, key=order.__getitem__)
            if missing:
                params = [*group["params"], *(by_name[n] for n in missing)]
                group["params"] = sorted(params, key=lambda p: order.get(names.get(id(p), ""), len(order)))


def refuse_forward_before_optimizers(
    module: nn.Module, *, zero_stage: int, precision: ParallelPrecision
) -> RemovableHandle | None:
    """``"bf16-true"`` at stage 1/2 with masters: the module stays fp32 until ``setup_optimizers`` takes
    the fp32 masters from it and casts the compute copy, while inputs are cast to bf16 from the start. A
    forward in between is refused with the fix (before: torch's "mat1 and mat2 must have the same
    dtype"); the handle is removed at ``setup_optimizers``."""
    if zero_stage not in (1, 2) or precision.precision != "bf16-true" or not precision.uses_masters:
        return None

    def refuse(_module: nn.Module, _args: Any) -> None:
        raise RuntimeError(
            f"precision='bf16-true' at zero_stage={zero_stage}: the model stays fp32 until"
            " fabric.setup_optimizers() takes its fp32 master weights and casts the bf16 copy, so it"
            " cannot run a forward before that. Set the optimizers up first (fabric.setup(model,"
            " optimizer)); for inference alone use zero_stage=0 (or 3), where the model is bf16 at setup."
        )

    return module.register_forward_pre_hook(refuse)


def init_context(
    strategy: HybridParallelStrategy, *, empty_init: bool | None
) -> AbstractContextManager[None]:
    """``fabric.init_module(empty_init)``'s context: at stage 3 with ``meta_init`` and ``empty_init=True``
    parameters on the meta device (buffers stay real; the shards are materialised at setup), otherwise
    the root device, with the constructors' own initialisation skipped for ``empty_init=True`` as
    Fabric's strategies do (so code that initialises afterwards, litgpt's ``reset_parameters``, draws
    what it draws under ``"ddp"``), in the precision's init dtype."""
    if empty_init and strategy.meta_init and strategy.zero_stage == 3:
        return meta_build(
            "fabric.init_module(empty_init=True)",
            "build the model from its config and load the weights inside the same block with"
            " model.load_state_dict(...) (applied to the shards at setup), or after fabric.setup with"
            " fabric.load_raw(path, model), or build it with empty_init=False (the whole model on every"
            " rank first).",
        )
    return _on_device(strategy, empty_init=bool(empty_init))


@contextmanager
def _on_device(strategy: HybridParallelStrategy, *, empty_init: bool) -> Iterator[None]:
    with strategy.root_device, _EmptyInit(enabled=empty_init), strategy.precision.module_init_context():
        yield


def sync_buffers(strategy: HybridParallelStrategy, module: nn.Module) -> list[RemovableHandle]:
    """Buffers kept equal over the data-parallel group as DDP keeps them (a BatchNorm's statistics: before,
    each rank kept its own in a Fabric loop, which Fabric's ``"ddp"`` overwrites with the first rank's):
    :class:`BufferSync` around the module's training forwards (``zero.buffers.sync_around_forward``), one
    synchronising unless inside ``no_backward_sync``. Not under a pipeline, whose stages hold their own
    layers' buffers."""
    engine = strategy.engine
    if strategy._pipeline is not None or engine is None:
        return []
    sync = BufferSync(module, group=strategy.mesh.dp_group, enabled=strategy.broadcast_buffers)
    return sync_around_forward(module, sync, synchronising=lambda: engine.sync_enabled)
