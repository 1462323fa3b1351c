"""Lightning's ``grad_norm(module, norm_type)`` for any layout, shared by the Trainer's and Fabric's
strategies (``strategy.grad_norm``).

Contract
--------
The result has Lightning's keys (``grad_{p}_norm{sep}<name>`` per parameter, names relative to
``module``, and ``grad_{p}_norm_total``) and the values of a one-process run on the same gradients, on
every rank alike. Lightning's own function reads ``param.grad`` of this rank: at ZeRO 1-3 None (the
gradients live in the shards), under tensor parallelism this rank's slice, under pipeline parallelism this
stage's parameters only. Here each element is counted once: ZeRO fragments summed over the dp group,
tensor-parallel slices over the tp group (replicated parameters on tp rank 0 only), stages over the pp
group (a weight tied across stages on its first stage). Every rank must call it (up to three small
all-reduces and one host read, :func:`~lightning_par.grad_norm.param_grad_norms`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_par.grad_norm import param_grad_norms
from lightning_par.mesh import ParallelMesh
from lightning_par.pipeline.apply import NORM_SKIP_ATTR
from lightning_par.tensor_parallel.layers import TP_DIM_ATTR
from lightning_par.zero.engine_api import Engine

__all__ = ["layout_grad_norms"]


def layout_grad_norms(
    root: nn.Module,
    module: nn.Module | None = None,
    *,
    engine: Engine | None,
    mesh: ParallelMesh,
    device: torch.device,
    norm_type: float | str = 2.0,
    group_separator: str = "/",
) -> dict[str, Tensor | float]:
    """The gradient norms of ``module``'s parameters (default: ``root``, the model the strategy set up),
    named relative to it (module docstring)."""
    from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

    p = float(norm_type)
    if p <= 0:
        raise ValueError(f"norm_type must be a positive number or 'inf', got {norm_type!r}.")
    module = module if module is not None else root
    sharded = engine.sharded_state if engine is not None else None
    if sharded is None and mesh.tp_size == 1 and mesh.pp_size == 1:
        # every param.grad is the whole, averaged gradient (ZeRO-0 over data parallelism)
        return dict(lightning_grad_norm(module, p, group_separator))
    prefix = next((n + "." for n, m in root.named_modules() if m is module), None)
    if prefix is None:
        raise ValueError("grad_norm(module): the module is not part of the model the strategy set up.")
    prefix = "" if prefix == "." else prefix
    names = [n for n, q in root.named_parameters() if q.requires_grad and n.startswith(prefix)]
    # (name, gradient piece, the tensor carrying the parallelism marks)
    held: list[tuple[str, Tensor | None, Tensor]]
    if sharded is None:  # whole gradients, alike on every dp rank (other stages' placeholders: none)
        held = [(n, q.grad, q) for n, q in root.named_parameters() if not q.is_meta]
    else:  # this rank's dp fragments
        held = [(n, master.grad, master) for n, _, _, master in sharded.fragment_table()]
    pieces = [
        (name, grad)
        for name, grad, marks in held
        if grad is not None
        and name.startswith(prefix)
        and not getattr(marks, NORM_SKIP_ATTR, False)
        and (mesh.tp_rank == 0 or hasattr(marks, TP_DIM_ATTR))
    ]
    groups = [mesh.tp_group, mesh.pp_group, *([mesh.dp_group] if sharded is not None else [])]
    norms = param_grad_norms(pieces, names, groups=groups, norm_type=p, device=device)
    out: dict[str, Tensor | float] = {
        f"grad_{p}_norm{group_separator}{n[len(prefix) :]}": v for n, v in norms.items()
    }
    if norms:
        out[f"grad_{p}_norm_total"] = torch.stack(list(norms.values())).norm(p)
    return out
