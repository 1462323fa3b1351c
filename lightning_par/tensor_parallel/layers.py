"""Tensor-parallel layers (Megatron-LM style) over an explicit tensor-parallel group of size ``t``.

* :class:`ColumnParallelLinear` ``Y = X A^T + b`` with ``A`` split by output rows: rank ``r`` holds
  ``A_r`` (``out/t`` rows) and computes ``Y_r``; input enters with ``copy_to`` (gradients of the
  replicated input are summed in backward). ``gather_output`` all-gathers ``Y`` (full output).
* :class:`RowParallelLinear` ``Y = X A^T + b`` with ``A`` split by input columns: rank ``r`` holds
  ``A_r`` (``in/t`` columns) and the matching slice ``X_r`` of a column-parallel output, computes the
  partial sum ``X_r A_r^T`` and leaves with ``reduce_from`` (all-reduce); ``b`` is added once, after.
* :class:`VocabParallelEmbedding`: rows ``[r V/t, (r+1) V/t)`` of the table; ids outside give zeros and
  the all-reduce of the partial lookups is the full embedding.
* :func:`~lightning_par.tensor_parallel.vocab_loss.vocab_parallel_cross_entropy`: the loss of the
  vocab-sharded logits such an embedding's tied head gives, without gathering them.

With ``sequence_parallel`` the regions between tensor-parallel layers are split along the sequence
(dim 1): a column-parallel layer receives the sequence already gathered by the preceding norm (see
:func:`make_region_input`; no ``copy_to``), a row-parallel layer leaves with a reduce-scatter along
the sequence, and parameters used on sequence shards (norm weights, row-parallel biases) get their
partial gradients all-reduced over the group.

Sharded parameters carry ``_lp_tp_dim`` (0: rows, 1: columns): the dimension along which the full
tensor is the concatenation of the ranks' pieces, used by checkpoints and gradient norms; a fused
projection's rows (litgpt's ``qkv``) also carry their segments (:mod:`lightning_par.tensor_parallel.slices`).
A layer converted from one on the meta device (a model built for ZeRO-3's meta init) keeps that layer,
storage-less, as ``_lp_tp_source``: the full-size layer :mod:`lightning_par.zero.tp_init` initialises in
its place and slices, so that the ranks' slices are parts of one matrix.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, SupportsIndex

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_par.tensor_parallel.comm import (
    copy_to,
    gather_last,
    reduce_from,
    reduce_scatter_seq,
)
from lightning_par.tensor_parallel.own_weights import check_own, refuse_derived
from lightning_par.tensor_parallel.slices import SEGMENTS_ATTR, piece

TP_DIM_ATTR = "_lp_tp_dim"
SOURCE_ATTR = "_lp_tp_source"
SUMMED_ATTR = "_lp_grad_summed"  # names of a module's parameters whose gradients a hook sums


def _mark(param: nn.Parameter, dim: int) -> nn.Parameter:
    setattr(param, TP_DIM_ATTR, dim)
    return param


_HOOK_TABLES = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)


def _inherit(new: nn.Module, old: nn.Module) -> None:
    """What the sharded layer ``new`` takes over from ``old``, the layer it replaces. It trains what the
    original trained: a frozen weight (a LoRA base layer, a frozen embedding) stays frozen, weight and
    bias each as they were (fresh Parameters would require grad). It runs the forward and backward hooks
    registered on the original (Hugging Face's ``enable_input_require_grads`` hooks the input embedding,
    which reentrant checkpointing needs under a frozen base): the two share the hook tables, so a handle
    given out for the original still removes its hook. A meta-device ``old`` is kept as ``new``'s source
    (module docstring): in ``__dict__``, so it is no submodule, moves with no ``.to()`` and holds no
    storage."""
    for pname, p in new.named_parameters(recurse=False):
        before = getattr(old, pname, None)
        if isinstance(before, torch.Tensor):
            p.requires_grad_(before.requires_grad)
    for table in _HOOK_TABLES:
        shared = getattr(old, table)
        shared.update(getattr(new, table))
        setattr(new, table, shared)
    new._is_full_backward_hook = old._is_full_backward_hook
    if any(p.is_meta for p in old.parameters(recurse=False)):
        new.__dict__[SOURCE_ATTR] = old


def _divide(n: int, t: int, what: str, fix: str) -> int:
    if n % t != 0:
        raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={t}; {fix}")
    return n // t


class _GroupLayer(nn.Module):
    """A layer that communicates over ``self.group``. A deep copy (an EMA or teacher model made with
    ``copy.deepcopy`` after the conversion) communicates over the same group: a process group cannot be
    copied, and the copy's slices are this rank's, so its peers are the same ranks."""

    group: ProcessGroup

    def __deepcopy__(self, memo: dict[int, Any]) -> _GroupLayer:
        memo[id(self.group)] = self.group
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items()})
        # torch's Parameter copy drops its Python attributes: the slices keep their marks (which dimension
        # is cut, the fused segments), so a copy is checkpointed and consolidated as the original
        for name, param in self._parameters.items():
            twin = new._parameters.get(name)
            if param is not None and twin is not None:
                for attr, value in vars(param).items():
                    if attr.startswith("_lp_"):
                        setattr(twin, attr, value)
        return new

    def __copy__(self) -> _GroupLayer:
        # a shallow copy shares everything, as copy.copy of any module does (and pickles nothing)
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        # what a pickle would hold, this rank's slices and a process group, loads nowhere else: refused
        # naming the whole-weight exports (before, "Can't pickle local object '_refuse.<locals>.hook'")
        raise RuntimeError(
            f"A tensor-parallel {type(self).__name__} cannot be pickled (torch.save(model), pickle, sending"
            " the model to another process): it holds this rank's slices of its weights and communicates over"
            " the tensor-parallel process group, so the pickle would load nowhere else. Save whole weights"
            " instead: strategy.consolidated_state_dict() on every rank (trainer.strategy or fabric.strategy;"
            " the full state lands on rank 0) loaded into a model built without tensor parallelism, or a"
            " checkpoint (trainer.save_checkpoint / fabric.save). copy.deepcopy (an EMA or teacher copy)"
            " works."
        )


class ColumnParallelLinear(_GroupLayer):
    """``nn.Linear`` split by output features (see the module docstring)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group: ProcessGroup,
        bias: bool = True,
        gather_output: bool = False,
        copy_input: bool = True,
        name: str = "",
    ) -> None:
        super().__init__()
        self.group = group
        t = dist.get_world_size(group)
        self.in_features, self.out_features = in_features, out_features
        self.local_out = _divide(
            out_features,
            t,
            f"{name or 'ColumnParallelLinear'}.out_features",
            "choose sizes divisible by the tensor-parallel size (for a vocabulary: pad it to a multiple).",
        )
        self.gather_output = gather_output
        self.copy_input = copy_input
        self.weight = _mark(nn.Parameter(torch.empty(self.local_out, in_features)), 0)
        self.bias = _mark(nn.Parameter(torch.zeros(self.local_out)), 0) if bias else None

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        group: ProcessGroup,
        name: str = "",
        segments: Sequence[int] | None = None,
        **kw: Any,
    ) -> ColumnParallelLinear:
        """The column-parallel layer holding this rank's rows of ``linear``: block ``r`` of ``t``, or with
        ``segments`` (a fused projection's full segment sizes, see :mod:`~.slices`) block ``r`` of each."""
        refuse_derived(linear, name=name)
        with torch.device(linear.weight.device):  # a meta (not yet loaded) weight gives a meta slice
            layer = cls(
                linear.in_features,
                linear.out_features,
                group=group,
                bias=linear.bias is not None,
                name=name,
                **kw,
            )
        r, t = dist.get_rank(group), dist.get_world_size(group)

        def rows(full: Tensor) -> Tensor:
            return piece(full.detach(), dim=0, rank=r, size=t, segments=segments, what=name).clone()

        with torch.no_grad():
            layer.weight.data = rows(linear.weight)
            if linear.bias is not None and layer.bias is not None:
                layer.bias.data = rows(linear.bias)
        if segments is not None:
            for p in (layer.weight, layer.bias):
                if p is not None:
                    setattr(p, SEGMENTS_ATTR, tuple(segments))
        _inherit(layer, linear)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        check_own(self)
        x = copy_to(x, self.group) if self.copy_input else x
        y = F.linear(x, self.weight, self.bias)
        return gather_last(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        t = dist.get_world_size(self.group)
        return f"in={self.in_features}, out={self.out_features} ({self.local_out} per rank of {t})"


class RowParallelLinear(_GroupLayer):
    """``nn.Linear`` split by input features; the input is the matching column-parallel slice."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group: ProcessGroup,
        bias: bool = True,
        sequence_parallel: bool = False,
        name: str = "",
    ) -> None:
        super().__init__()
        self.group = group
        t = dist.get_world_size(group)
        self.in_features, self.out_features = in_features, out_features
        self.local_in = _divide(
            in_features,
            t,
            f"{name or 'RowParallelLinear'}.in_features",
            "choose sizes divisible by the tensor-parallel size.",
        )
        self.sequence_parallel = sequence_parallel
        self.weight = _mark(nn.Parameter(torch.empty(out_features, self.local_in)), 1)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None  # replicated

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, group: ProcessGroup, name: str = "", **kw: Any
    ) -> RowParallelLinear:
        refuse_derived(linear, name=name)
        with torch.device(linear.weight.device):  # a meta (not yet loaded) weight gives a meta slice
            layer = cls(
                linear.in_features,
                linear.out_features,
                group=group,
                bias=linear.bias is not None,
                name=name,
                **kw,
            )
        r = dist.get_rank(group)
        with torch.no_grad():
            layer.weight.data = linear.weight.detach()[
                :, r * layer.local_in : (r + 1) * layer.local_in
            ].clone()
            if linear.bias is not None and layer.bias is not None:
                layer.bias.data = linear.bias.detach().clone()
        _inherit(layer, linear)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        check_own(self)
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_seq(partial, self.group)
            bias = None if self.bias is None else copy_to(self.bias, self.group)
        else:
            y = reduce_from(partial, self.group)
            bias = self.bias
        return y if bias is None else y + bias

    def extra_repr(self) -> str:
        t = dist.get_world_size(self.group)
        return f"in={self.in_features} ({self.local_in} per rank of {t}), out={self.out_features}"


class VocabParallelEmbedding(_GroupLayer):
    """``nn.Embedding`` whose table rows (the vocabulary) are split over the group. ``padding_idx`` (a
    global id, as ``nn.Embedding``'s) gets no gradient on the rank holding its row, as unsharded."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group: ProcessGroup,
        name: str = "",
        padding_idx: int | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        t = dist.get_world_size(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        local = _divide(
            num_embeddings,
            t,
            f"{name or 'VocabParallelEmbedding'}.num_embeddings",
            f"pad the vocabulary to a multiple of {t} (e.g. {-(-num_embeddings // t) * t}).",
        )
        self.start = dist.get_rank(group) * local
        self.end = self.start + local
        self.padding_idx = padding_idx
        self._local_padding_idx: int | None = None  # this rank's row of padding_idx, if it holds it
        if padding_idx is not None and self.start <= padding_idx < self.end:
            self._local_padding_idx = padding_idx - self.start
        self.weight = _mark(nn.Parameter(torch.empty(local, embedding_dim)), 0)
        # a scaled word embedding's factor (Gemma's sqrt(hidden_size)), applied to the looked-up rows
        self.register_buffer("embed_scale", None, persistent=False)

    @classmethod
    def from_embedding(
        cls, emb: nn.Embedding, *, group: ProcessGroup, name: str = "", scale: Tensor | None = None
    ) -> VocabParallelEmbedding:
        """The sharded ``emb``; ``scale``: the ``embed_scale`` buffer of a scaled word embedding, whose
        forward multiplies the lookup by it (kept as this layer's buffer, so it moves and casts alike)."""
        refuse_derived(emb, name=name)
        unsupported = {
            "max_norm": emb.max_norm is not None,
            "scale_grad_by_freq": emb.scale_grad_by_freq,
            "sparse": emb.sparse,
        }
        if any(unsupported.values()):
            raise ValueError(
                f"{name or 'The embedding'} uses {[k for k, v in unsupported.items() if v]}, which need the"
                " whole vocabulary on one rank; leave it out of the tp_plan (it then stays replicated)."
            )
        with torch.device(emb.weight.device):
            layer = cls(
                emb.num_embeddings, emb.embedding_dim, group=group, name=name, padding_idx=emb.padding_idx
            )
        with torch.no_grad():
            layer.weight.data = emb.weight.detach()[layer.start : layer.end].clone()
        if scale is not None:
            layer.embed_scale = scale
        _inherit(layer, emb)
        return layer

    def forward(self, ids: Tensor) -> Tensor:
        check_own(self)
        # an id outside the table is on no rank's shard: without this its row would be zeros, silently,
        # where nn.Embedding raises; asserted on the device (no host read: CUDA's kernel assert, as there)
        inside = ((ids >= 0) & (ids < self.num_embeddings)).all()
        torch._assert_async(
            inside,
            f"VocabParallelEmbedding: an id outside [0, {self.num_embeddings}), where nn.Embedding raises"
            " IndexError: index out of range; check the ids (a hash's bucket count, -100 or -1 labels passed"
            " as ids)",
        )
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, padding_idx=self._local_padding_idx)
        out = reduce_from(out.masked_fill(outside.unsqueeze(-1), 0.0), self.group)
        scale = self.embed_scale
        if isinstance(scale, Tensor):  # as the scaled embedding's forward: in the weight's dtype
            out = out * scale.to(self.weight.dtype)
        return out
