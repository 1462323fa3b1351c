"""Tensor-parallel regions made of hooks on existing modules (no wrapper: parameter names stay): where a
region's input enters (``region_input``), where sequence parallelism starts (``scatter_sequence``) or ends
before a replicated consumer (``sequence_output``), a module that stays on the sequence shards between
regions (``sequence_local``), and the gradient sum of a replicated parameter that each rank computes
only in part (:func:`sum_grad_over_group`)."""

from __future__ import annotations

import weakref
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_par.tensor_parallel.comm import copy_to, gather_seq, gather_seq_replicated, scatter_seq
from lightning_par.tensor_parallel.layers import SUMMED_ATTR


def make_region_input(module: nn.Module, *, group: ProcessGroup, sequence_parallel: bool) -> nn.Module:
    """Make ``module``'s output (a norm's) the input of a tensor-parallel region. Without sequence
    parallelism: ``copy_to`` on the output, so the partial input gradients of all the column-parallel
    layers that read it are summed by one all-reduce. With it: the module runs on this rank's sequence
    shard, its parameters' gradients (which saw only part of the tokens) are all-reduced over the group,
    and its output is all-gathered along the sequence. Hooks, not a wrapper: parameter names stay."""
    if not sequence_parallel:
        module.register_forward_hook(lambda _m, _a, out: copy_to(out, group))
        return module
    make_sequence_local(module, group=group)
    module.register_forward_hook(lambda _m, _a, out: gather_seq(out, group))
    return module


def make_sequence_output(module: nn.Module, *, group: ProcessGroup) -> nn.Module:
    """End sequence parallelism at ``module`` (a final norm) for a replicated consumer (a classification
    head, the user's loss on the hidden states): it runs on this rank's sequence shard, its parameters'
    gradients are summed over the group, and its output is all-gathered, the backward keeping this rank's
    slice of the equal output gradients (a region input's reduce-scatter would sum them)."""
    make_sequence_local(module, group=group)
    module.register_forward_hook(lambda _m, _a, out: gather_seq_replicated(out, group))
    return module


def make_sequence_local(module: nn.Module, *, group: ProcessGroup) -> nn.Module:
    """``module`` runs on this rank's sequence shard between regions (a norm applied to a row-parallel
    layer's reduce-scattered output before the residual sum, as Gemma 2 / 3's post-norms): its output
    stays a shard, its parameters' gradients, which saw only this rank's tokens, are summed over the
    group."""
    for name, _ in module.named_parameters(recurse=False):
        sum_grad_over_group(module, name, group=group)
    return module


def sum_grad_over_group(owner: nn.Module, name: str, *, group: ProcessGroup) -> None:
    """All-reduce (sum) the gradient of ``owner``'s parameter ``name`` over ``group`` as it is computed: for
    a replicated parameter whose gradient on each rank is only a partial sum (it saw a sequence shard, or
    was reached through a column-parallel slice), so that every rank then holds the full, identical one.

    The tensor hook goes, at each forward of ``owner``, on the Parameter registered as ``name`` at that
    time, if it requires grad and has none yet. So a frozen parameter (a PEFT model's norms, an inactive
    adapter) gets it once unfrozen, and a parameter replaced after this call (materialised from the meta
    device by ZeRO-3's meta init, filled from pretrained weights) gets it too, where a hook put on the
    object at hand would stay on the discarded one. ``owner`` lists ``name`` in ``SUMMED_ATTR``: the
    zero-bubble split keeps such a layer's weight gradient in its backward, since a deferred product
    (:mod:`lightning_par.pipeline.weight_grad`) would skip the hook."""
    hooked: dict[int, weakref.ref[Tensor]] = {}  # by id, checked by identity (a tensor's == is elementwise)

    def pre_hook(module: nn.Module, _args: Any) -> None:
        param = module._parameters.get(name)
        if param is None or not param.requires_grad:
            return
        seen = hooked.get(id(param))
        if seen is None or seen() is not param:
            param.register_hook(lambda g: _all_reduce_grad(g, group))
            hooked[id(param)] = weakref.ref(param)

    owner.register_forward_pre_hook(pre_hook)
    owner.__dict__.setdefault(SUMMED_ATTR, set()).add(name)


def make_scatter_sequence(module: nn.Module, *, group: ProcessGroup, at_input: bool = False) -> nn.Module:
    """Keep this rank's slice of ``module``'s output along the sequence: sequence parallelism starts here
    (the backward all-gathers). ``at_input``: slice its input instead (the first positional argument, or
    ``hidden_states=``), for models that derive positions and attention masks from the length of the
    embedding's output (Hugging Face decoders: SP then starts at the first decoder layer)."""

    def scatter(out: Tensor) -> Tensor:
        t = dist.get_world_size(group)
        if out.shape[1] % t != 0:
            raise ValueError(
                f"Sequence parallelism splits the sequence over tensor_parallel_size={t} ranks, but the"
                f" sequence length is {out.shape[1]}; use a length divisible by {t} (pad batches to a"
                f" multiple: Hugging Face's collators take pad_to_multiple_of={t}). A model converted with"
                " sequence_parallel=True runs such lengths only (token-by-token generation with a KV cache"
                " included): generate with its consolidated weights (consolidated_state_dict()) in a model"
                " without sequence parallelism."
            )
        return scatter_seq(out, group)

    def scatter_input(
        _m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            return (scatter(args[0]), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), Tensor):
            return args, {**kwargs, "hidden_states": scatter(kwargs["hidden_states"])}
        raise ValueError(
            f"scatter_sequence_input on {type(module).__name__}: it was called without a positional input"
            " or hidden_states=, so there is no sequence to split."
        )

    if at_input:
        module.register_forward_pre_hook(scatter_input, with_kwargs=True)
    else:
        module.register_forward_hook(lambda _m, _a, out: scatter(out))
    return module


def _all_reduce_grad(grad: Tensor, group: ProcessGroup) -> Tensor:
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad
