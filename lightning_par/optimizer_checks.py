"""Which optimizers each kind of sharding can run, checked at setup.

ZeRO stages 1-3 hand the optimizer this rank's slice of every parameter; tensor parallelism hands it
this rank's rows or columns of each sharded weight. Both are exact only for an *element-wise* update:
element ``i`` of the new parameter depends on element ``i`` of the parameter, its gradient and its
state alone (SGD, Adam and their kin). An optimizer that reads a whole tensor (Adafactor's row and
column statistics, Muon's orthogonalisation, LAMB's trust ratio, LBFGS's dot products over the
flattened gradient) computes something else on a slice, silently: on a tensor-parallel GPT, Muon's
losses left the one-process run by 1e-3 within 8 steps, where SGD stays within 2e-7.

Pipeline parallelism gives each stage whole parameters, so any optimizer computes the right update
there, except those whose ``step()`` re-evaluates the loss through a closure (LBFGS): the schedule runs
each step's forwards and backwards itself, once, across the stages.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping, Sequence

import torch
from torch.optim import Optimizer

from lightning_par.tensor_parallel.layers import TP_DIM_ATTR

# Optimizers whose update is element-wise, hence exact on any slice of a parameter.
ELEMENTWISE_OPTIMIZERS: tuple[type[Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.ASGD,
)

# Optimizers that change meaning on a slice of a parameter, refused even with allow_untested_optimizer.
_WHOLE_TENSOR: dict[type[Optimizer], str] = {
    torch.optim.LBFGS: "it keeps a history of whole flattened gradients and re-evaluates the loss (closure)",
    torch.optim.Adafactor: "it factors each matrix's second moment into row and column statistics",
    torch.optim.SparseAdam: "it needs sparse gradients, which the flat gradient buffers are not",
}
if hasattr(torch.optim, "Muon"):
    _WHOLE_TENSOR[torch.optim.Muon] = "it orthogonalises each whole weight matrix"

# The same, recognised by a class name (the whole lower-cased name of any class in the optimizer's MRO)
# for the optimizers of other packages that allow_untested_optimizer would let through.
_WHOLE_TENSOR_NAMES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), reason)
    for pattern, reason in (
        (r".*adafactor.*", "it factors each matrix's second moment into row and column statistics"),
        (r"came(\d+bit)?|sm3", "its second moments are factored or shared over a whole tensor's covers"),
        (r"(fused|paged)?(lamb|lars)(\d+bit)?|larc", "its trust ratio divides whole parameters' norms"),
        (r".*novograd.*", "it keeps one second moment per whole layer (the norm of its gradient)"),
        (r".*shampoo.*|soap(\d+bit)?|kron|psgd.*", "it preconditions each whole weight matrix"),
        (r"galore.*", "it projects each whole weight matrix's gradient onto a low-rank subspace"),
        (r".*muon.*", "it orthogonalises each whole weight matrix"),
        (r"adam_?mini", "it shares one second moment per block of whole parameters"),
        (r"prodigy.*|dadapt.*", "its step size comes from dot products over every parameter, whole"),
        (
            r"adamp|sgdp|stableadamw|fromage|nero|mars|ranger21",
            "its update uses whole tensors' norms or means",
        ),
    )
)

_ZERO = "ZeRO stages 1-3"


def _name(optimizer: Optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def _needs_closure(optimizer: Optimizer) -> bool:
    closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def _whole_tensor_reason(optimizer: Optimizer) -> str | None:
    """Why ``optimizer`` cannot run on slices of parameters, if we know it cannot."""
    for cls, reason in _WHOLE_TENSOR.items():
        if isinstance(optimizer, cls):
            return reason
    for cls in type(optimizer).__mro__:
        for pattern, reason in _WHOLE_TENSOR_NAMES:
            if pattern.fullmatch(cls.__name__.lower()):
                return reason
    if _needs_closure(optimizer):
        return "its step() requires a closure (it re-evaluates the loss on the whole model)"
    return None


def check_shardable(
    optimizer: Optimizer, *, allow_untested: bool = False, sharding: str = _ZERO, fix: str = "zero_stage=0"
) -> None:
    """Raise a ``TypeError`` naming the optimizer if its update is not known to be element-wise.

    ``sharding`` names what slices the parameters (in the message), ``fix`` the setting that avoids it.
    With ``allow_untested`` (DeepSpeed's ``zero_allow_untested_optimizer``), optimizers outside
    :data:`ELEMENTWISE_OPTIMIZERS` are accepted on the user's word that their update is element-wise (a
    user's own Lion, or an optimizer from another package); those known to need whole tensors (LBFGS,
    Adafactor, SparseAdam, Muon, other packages' optimizers whose class name is one of those of
    :data:`_WHOLE_TENSOR_NAMES` (Adafactor, CAME, SM3, LAMB, LARS, NovoGrad, Shampoo, SOAP, Kron, GaLore,
    Adam-mini, Prodigy, D-Adaptation, AdamP, StableAdamW, ...), or any whose ``step()`` requires a closure)
    are refused even then."""
    name = _name(optimizer)
    reason = _whole_tensor_reason(optimizer)
    if reason is not None:
        raise TypeError(
            f"{sharding} cannot shard {name}: {reason}, so on this rank's slice of each parameter it"
            " would compute something else (allow_untested_optimizer does not change that). Use an"
            f" element-wise optimizer, or {fix}."
        )
    if type(optimizer) in ELEMENTWISE_OPTIMIZERS or allow_untested:
        return
    names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    raise TypeError(
        f"{sharding} cannot shard {name}: its update is not known to be element-wise (optimizers that"
        " use whole-tensor statistics, such as LBFGS, LAMB or Adafactor, change meaning on a slice)."
        f" Element-wise optimizers that shard exactly: {names}. Use one of them, pass"
        " allow_untested_optimizer=True if every update of an element depends only on that element's"
        f" parameter, gradient and state (e.g. Lion), or use {fix}."
    )


def check_layout_optimizers(
    optimizers: Sequence[Optimizer],
    *,
    pipeline: bool,
    allow_untested: bool = False,
    names: Mapping[int, str] | None = None,
) -> None:
    """Refuse, before any step, an optimizer the model's tensor or pipeline layout would silently
    change: one holding a tensor-parallel slice must pass :func:`check_shardable`; under pipeline
    parallelism none may require a closure; ``SparseAdam`` never runs (the gradient buckets are dense).
    (ZeRO's own check runs when the engine shards them.)
    ``names``: ``id(parameter) -> name``, to name a sliced parameter in the message."""
    for optimizer in optimizers:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        sliced = next((p for p in params if hasattr(p, TP_DIM_ATTR)), None)
        if sliced is not None:
            which = (names or {}).get(id(sliced), "a parameter")
            check_shardable(
                optimizer,
                allow_untested=allow_untested,
                sharding=f"Tensor parallelism ({which} {tuple(sliced.shape)} is this rank's slice)",
                fix="tensor_parallel_size=1",
            )
        if isinstance(optimizer, torch.optim.SparseAdam):
            raise TypeError(
                "torch.optim.SparseAdam needs sparse gradients, and this strategy reduces every gradient"
                " in dense flat buckets (a sparse embedding's gradient is made dense, rows not looked up"
                " zero). Use torch.optim.Adagrad or SGD (their dense update equals the sparse one) or Adam"
                " (its moments then decay on every row, not only the looked-up ones)."
            )
        if pipeline and _needs_closure(optimizer):
            raise TypeError(
                f"Pipeline parallelism cannot run {_name(optimizer)}: its step() re-evaluates the loss"
                " through a closure, and under pipeline parallelism the schedule runs each step's"
                " forwards and backwards once, across the stages. Use an optimizer without a closure,"
                " or pipeline_parallel_size=1."
            )
