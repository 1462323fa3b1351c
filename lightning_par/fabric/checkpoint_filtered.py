"""``fabric.save(path, state, filter={key: keep(name, value)})`` under lightning_par's Fabric strategy:
one torch file on global rank 0 whose module entry holds the consolidated state dict's entries the filter
accepts (litgpt saves its LoRA weights so), as Fabric's own strategies write it. Read it back with
``fabric.load_raw`` or ``fabric.load(..., strict=False)`` like any full file (:mod:`.checkpoint`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_par.fabric.checkpoint import consolidated, is_stateful, split_state

if TYPE_CHECKING:
    from lightning_par.fabric.strategy import HybridParallelStrategy


def save_filtered(
    strategy: HybridParallelStrategy,
    path: Path,
    state: Mapping[str, Any],
    keep: Mapping[str, Callable[[str, Any], bool]],
) -> None:
    """``fabric.save(path, state, filter={key: keep(name, value)})``, as Fabric's strategies do it for a
    module: one torch file on rank 0 whose module entry is the whole state dict's entries ``keep``
    accepts (litgpt saves its LoRA weights so); other entries as they are. Collective (the module's
    state is consolidated); filters are for the module's entry only, optimizers cannot be filtered."""
    module_key, opt_keys = split_state(strategy, state)
    wrong = [k for k in keep if k != module_key]
    if wrong or opt_keys:
        raise TypeError(
            f"fabric.save(..., filter=...) with lightning_par's Fabric strategy filters the model's entry"
            f" only and saves no optimizer (asked: filter keys {sorted(keep)}, optimizers {opt_keys});"
            " save the optimizers with a second fabric.save without filter."
        )
    whole = consolidated(strategy) if module_key is not None else {}
    if strategy.is_global_zero:
        content: dict[str, Any] = {}
        for k, v in state.items():
            if k == module_key:
                kept = keep.get(k)
                content[k] = {n: t for n, t in whole.items() if kept is None or kept(n, t)}
            else:
                content[k] = v.state_dict() if is_stateful(v) else v
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(content, path)
    strategy.barrier()
