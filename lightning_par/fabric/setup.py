"""The model-changing part of ``fabric.setup`` under lightning_par's Fabric strategy.

:func:`compose_module` applies the same :func:`lightning_par.compose.compose` the Trainer strategy calls
(tensor parallel, pipeline split, activation checkpointing; once per module) and records which parameter
objects it replaced: tensor-parallel slices, and under pipeline parallelism the meta placeholders of
other stages' layers. An optimizer made before ``fabric.setup`` still holds the old objects; without
state it only holds references, so :func:`follow_replaced` points it at the new ones (one with state is
refused, with the fix).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.optim import Optimizer

from lightning_par.compose import ComposeOptions, Composition, compose
from lightning_par.pipeline.steps import layers_of

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
