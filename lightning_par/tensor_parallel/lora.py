"""LoRA-wrapped linears (PEFT's ``lora.Linear``, recognised by duck typing) under the plan's styles.

A LoRA-wrapped linear keeps its frozen ``base_layer`` (``W``: ``out x in``, bias ``b``) and, per adapter
``a``, ``lora_A[a]`` (``A``: ``r x in``), ``lora_B[a]`` (``B``: ``out x r``) and ``scaling[a]`` (``s``)::

    y = W x + b + s B A drop(x)

The wrapper object stays (PEFT's forward, ``merge``, ``set_adapter``, ``save_pretrained`` keep working);
its ``base_layer`` and the ``lora_A[a]`` / ``lora_B[a]`` entries are replaced by modules whose parameter
is still called ``weight``, so parameter names (``...q_proj.lora_A.default.weight``) stay PEFT's. With
``t`` the tensor-parallel size, ``r`` this rank, ``dy`` the output gradient:

``colwise`` / ``colwise_gather`` (output split): ``W_r`` and ``B_r`` are the same ``out/t`` rows, ``A``
    is replicated. ``y_r = W_r x + b_r + s B_r (A x)``. Backward: ``dB_r = s dy_r h^T`` (``h = A x``) is
    already this rank's slice; ``dh_r = s B_r^T dy_r`` is only rank ``r``'s share of ``dh = Σ_r dh_r``, so
    ``dA = Σ_r dh_r x^T`` is all-reduced by a hook on ``A``'s weight, and the input gradient ``A^T dh_r``
    is partial as well: the region's ``copy_to`` (the norm before it) sums it, or, outside a region, a
    ``copy_to`` on ``A``'s input (a forward pre-hook, so the name stays).
``rowwise`` (input split; ``x_r`` is the column-parallel shard): ``W_r`` and ``A_r`` are the same
    ``in/t`` columns, ``B`` is replicated. ``h = Σ_r A_r x_r`` is all-reduced (``A`` becomes a
    :class:`RowParallelLinear` without bias) and is full and replicated, so ``y = W x + b + s B h`` and
    ``dB = s dy h^T`` is the same on every rank, ``dA_r = dh x_r^T`` is this rank's slice. With sequence
    parallelism the base output is reduce-scattered along the sequence; ``h`` is too (``A`` is a
    sequence-parallel :class:`RowParallelLinear`), so ``B`` sees only this rank's tokens and its weight
    gradient is all-reduced.

PEFT's ``modules_to_save`` wrapper (a trained copy of a whole layer beside its frozen original, e.g. the
LM head or the embedding) is kept as well: the original and every adapter's copy get the plan's style,
as the layer alone would (:func:`saved_copies`).

Refused (``ValueError``), because the sharded layer would not compute the same function: DoRA (its
magnitude needs the norms of the full ``W + s B A``), ``lora_bias``, other LoRA variants, merged
adapters, ``fan_in_fan_out``, and LoRA on an embedding. Dropout > 0 is allowed; as for any dropout under
tensor parallelism its masks are not those the unsharded model would draw (the ``rowwise`` one masks
each rank's input shard separately). Add adapters before applying tensor parallelism: one added later
is an unsharded ``nn.Linear`` that does not fit the sharded base layer.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_par.tensor_parallel.comm import copy_to
from lightning_par.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from lightning_par.tensor_parallel.regions import sum_grad_over_group

PARALLEL_TYPES: tuple[type[nn.Module], ...] = (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)


def _lora_dicts(module: nn.Module) -> tuple[nn.ModuleDict, nn.ModuleDict]:
    lora_a, lora_b = module.lora_A, module.lora_B
    assert isinstance(lora_a, nn.ModuleDict) and isinstance(lora_b, nn.ModuleDict)  # is_lora_wrapper
    return lora_a, lora_b


def is_lora_wrapper(module: nn.Module) -> bool:
    """A PEFT-style LoRA layer: a ``base_layer`` module plus ``lora_A`` / ``lora_B`` ModuleDicts (duck
    typing: peft is not a dependency of this package)."""
    return (
        isinstance(getattr(module, "base_layer", None), nn.Module)
        and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
        and isinstance(getattr(module, "lora_B", None), nn.ModuleDict)
    )


def saved_copies(module: nn.Module) -> dict[str, nn.Module] | None:
    """PEFT's ``modules_to_save`` wrapper (duck typing: ``original_module`` and a ``modules_to_save``
    ModuleDict): ``{path inside the wrapper: layer}`` of the frozen original and each adapter's trained
    copy, which a plan style shards alike, the wrapper kept; None for any other module."""
    original, copies = getattr(module, "original_module", None), getattr(module, "modules_to_save", None)
    if not isinstance(original, nn.Module) or not isinstance(copies, nn.ModuleDict):
        return None
    return {"original_module": original} | {f"modules_to_save.{k}": m for k, m in copies.items()}


def _adapter_flag(module: nn.Module, attr: str, adapter: str) -> bool:
    value = getattr(module, attr, None)
    return bool(value.get(adapter, False)) if isinstance(value, dict) else False


def check_lora(module: nn.Module, *, name: str, style: str) -> None:
    """Raise a ``ValueError`` naming ``name`` and the reason if the LoRA wrapper ``module`` cannot be
    converted to ``style`` exactly. Called for every target before any module is converted."""
    base = module.base_layer
    if style == "vocab":
        raise ValueError(
            f"tp_plan style 'vocab' on {name!r}: LoRA on an embedding is not supported under tensor"
            " parallelism; leave the embedding out of the LoRA target_modules."
        )
    if style not in ("colwise", "colwise_gather", "rowwise"):
        return  # hooks on the wrapper (region_input, scatter_sequence) do not touch its layers
    if isinstance(base, PARALLEL_TYPES):
        raise ValueError(
            f"{name!r} is already tensor-parallel (its base_layer is {type(base).__name__}); a model is"
            " converted once: build a fresh model for another layout."
        )
    if not isinstance(base, nn.Linear):
        raise ValueError(
            f"tp_plan style {style!r} needs an nn.Linear, but the LoRA layer {name!r} wraps"
            f" {type(base).__name__}."
        )
    if getattr(module, "merged", False) or getattr(module, "merged_adapters", None):
        raise ValueError(
            f"{name!r}: its LoRA adapter is merged into the base weight; unmerge it (unmerge_adapter())"
            " before applying tensor parallelism, so base and adapter are sharded separately."
        )
    if getattr(module, "fan_in_fan_out", False):
        raise ValueError(f"{name!r}: LoRA with fan_in_fan_out=True is not supported under tensor parallelism")
    variants: Any = getattr(module, "lora_variant", None) or {}
    magnitudes = getattr(module, "lora_magnitude_vector", None)
    lora_a, lora_b = _lora_dicts(module)
    for adapter, a_layer in lora_a.items():
        where = f"{name!r} (adapter {adapter!r})"
        if _adapter_flag(module, "use_dora", adapter) or (
            isinstance(magnitudes, nn.ModuleDict) and adapter in magnitudes
        ):
            raise ValueError(
                f"{where} uses DoRA (use_dora=True): its magnitude rescales by the column norms of the"
                " full W + s B A, which no rank holds; tensor parallelism supports plain LoRA only."
            )
        b_layer = dict(lora_b.items()).get(adapter)  # nn.ModuleDict has no .get
        if _adapter_flag(module, "lora_bias", adapter) or getattr(b_layer, "bias", None) is not None:
            raise ValueError(
                f"{where} uses lora_bias=True, which tensor parallelism does not support (lora_bias=False)."
            )
        if adapter in variants:
            raise ValueError(
                f"{where} is the LoRA variant {type(variants[adapter]).__name__}, whose forward is not"
                " plain B A x; tensor parallelism supports plain LoRA only."
            )
        ok = (
            isinstance(a_layer, nn.Linear)
            and isinstance(b_layer, nn.Linear)
            and a_layer.bias is None
            and a_layer.in_features == base.in_features
            and b_layer.out_features == base.out_features
            and a_layer.out_features == b_layer.in_features
        )
        if not ok:
            raise ValueError(
                f"{where}: lora_A / lora_B are not nn.Linear({base.in_features}, r, bias=False) /"
                f" nn.Linear(r, {base.out_features}), so the layer is not plain LoRA."
            )


def _copy_input(group: ProcessGroup) -> Any:
    def pre_hook(_m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x: Tensor = args[0]
        return (copy_to(x, group), *args[1:])

    return pre_hook


def convert_lora_linear(
    module: nn.Module, *, name: str, style: str, group: ProcessGroup, sequence_parallel: bool, in_region: bool
) -> nn.Module:
    """Shard the LoRA wrapper ``module`` in place for ``style`` (see the module docstring for the math)
    and return it. ``in_region``: its input is a region input (``copy_to`` or the SP gather applied)."""
    check_lora(module, name=name, style=style)
    base = module.base_layer
    assert isinstance(base, nn.Linear)  # check_lora
    lora_a, lora_b = _lora_dicts(module)
    if style == "rowwise":
        module.base_layer = RowParallelLinear.from_linear(
            base, group=group, name=f"{name}.base_layer", sequence_parallel=sequence_parallel
        )
        for adapter in list(lora_a.keys()):
            a_layer = lora_a[adapter]
            assert isinstance(a_layer, nn.Linear)
            # h = Σ_r A_r x_r: all-reduced (or, with SP, reduce-scattered like the base output)
            lora_a[adapter] = RowParallelLinear.from_linear(
                a_layer,
                group=group,
                name=f"{name}.lora_A.{adapter}",
                sequence_parallel=sequence_parallel,
            )
            if sequence_parallel:
                # B saw only this rank's tokens: its weight gradient is a partial sum over the sequence
                b_layer = lora_b[adapter]
                assert isinstance(b_layer, nn.Linear)
                sum_grad_over_group(b_layer, "weight", group=group)
        return module
    gather = style == "colwise_gather"
    module.base_layer = ColumnParallelLinear.from_linear(
        base, group=group, name=f"{name}.base_layer", gather_output=gather, copy_input=not in_region
    )
    for adapter in list(lora_a.keys()):
        b_layer = lora_b[adapter]
        assert isinstance(b_layer, nn.Linear)
        # B_r: the same output rows as the base shard, reading the replicated h = A x
        lora_b[adapter] = ColumnParallelLinear.from_linear(
            b_layer, group=group, name=f"{name}.lora_B.{adapter}", gather_output=gather, copy_input=False
        )
        a_layer = lora_a[adapter]
        assert isinstance(a_layer, nn.Linear)
        # dA on rank r is Σ over its own B_r rows only: sum the partial gradients over the group
        sum_grad_over_group(a_layer, "weight", group=group)
        if not in_region:
            # the input gradient A^T dh_r is partial too; no region copy_to sums it, so copy_to here
            a_layer.register_forward_pre_hook(_copy_input(group))
    return module
