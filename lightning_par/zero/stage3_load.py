"""``load_state_dict`` on a module whose parameters ZeRO-3 shards: each rank writes its own shard.

Between uses a sharded parameter is a placeholder (one element, expanded to the parameter's shape), so
torch's ``load_state_dict`` could not copy into it ("more than one element of the written-to tensor
refers to a single memory location"): a user's ``self.model.load_state_dict(weights)`` in a Lightning
hook or a Fabric loop failed at ZeRO-3, where ``"ddp"`` loads. Every rank holds the whole value in the
state dict it passes, so no communication is needed: a load pre-hook on each module that owns sharded
parameters takes their entries out of the state dict, checks the shape, and copies the elements of this
rank's pieces into its shard (the fp32 master for trainable parameters; cast on copy). A unit gathered
at that moment is freed first, so its next use gathers the new values. The module's post-hook then drops
those keys from ``missing_keys``, so ``strict`` loading reports what torch would: the keys the state dict
lacks, and the unexpected ones. Every rank must load the same values, as under ``"ddp"``. The optimizer
state is left as it is, as by torch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import is_tensor_like
from torch.utils.hooks import RemovableHandle

from lightning_par.owned_hooks import for_owner
from lightning_par.zero.unit import Unit

# id(parameter) -> (its unit, this rank's pieces of it: (first element, end element, shard view))
Pieces = dict[int, tuple[Unit, list[tuple[int, int, Tensor]]]]


def _pieces(units: list[Unit], rank: int) -> Pieces:
    out: Pieces = {}
    for unit in units:
        for part in unit.parts:
            by_name = dict(zip(part.names, part.params, strict=True))
            for p in part.params:
                out.setdefault(id(p), (unit, []))
            for name, lo, hi, view in part.fragments(rank):
                out[id(by_name[name])][1].append((lo, hi, view))
    return out


def load_into_shards(root: nn.Module, units: list[Unit], rank: int) -> list[RemovableHandle]:
    """Register the load hooks of the module docstring on every module under ``root`` that owns
    parameters of ``units``; the handles remove them."""
    pieces = _pieces(units, rank)
    handles: list[RemovableHandle] = []
    for module in root.modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) in pieces]
        if own:
            taken: list[str] = []
            # a copy of the module (an EMA) loads into its own parameters, as torch does
            pre, post = for_owner(module, _pre_hook(own, pieces, taken)), for_owner(module, _post_hook(taken))
            handles.append(module.register_load_state_dict_pre_hook(pre))
            handles.append(module.register_load_state_dict_post_hook(post))
    return handles


def _pre_hook(own: list[tuple[str, nn.Parameter]], pieces: Pieces, taken: list[str]) -> Any:
    @torch.no_grad()
    def hook(
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        for name, param in own:
            key = prefix + name
            if key not in state_dict:
                continue  # torch reports it missing
            value = state_dict.pop(key)
            taken.append(key)
            if not isinstance(value, Tensor) and is_tensor_like(value):
                # a tensor read on first use (Lightning's lazy_load, which litgpt's load_checkpoint calls):
                # any torch op reads it, through its __torch_function__ (before, "size mismatch")
                value = torch.reshape(value, tuple(value.shape))
            if not isinstance(value, Tensor) or value.shape != param.shape:
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {shape} from checkpoint, the"
                    f" shape in current model is {tuple(param.shape)}."
                )
                continue
            unit, mine = pieces[id(param)]
            unit.free()  # a whole copy would keep the old values until its next gather
            flat = value.reshape(-1)
            for lo, hi, view in mine:
                view.copy_(flat[lo:hi])

    return hook


def _post_hook(taken: list[str]) -> Any:
    def hook(module: nn.Module, incompatible_keys: Any) -> None:
        for key in taken:
            if key in incompatible_keys.missing_keys:
                incompatible_keys.missing_keys.remove(key)
        taken.clear()

    return hook
