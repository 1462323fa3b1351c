"""A tensor-parallel model handed to torch's ``DistributedDataParallel`` afterwards, refused by name.

After a fit under tensor parallelism the model stays in slices (each rank holds its share of each split
layer's weights). Given then to Lightning's or Fabric's ``"ddp"`` (a ``trainer.test`` by a default
Trainer), DDP broadcast rank 0's slices over the other ranks' (at the wrap, or through Lightning's
``_sync_module_states`` for an evaluation) and fed the tp ranks different batches: the model was
damaged for good and the metrics were wrong, without a word. DDP and Lightning read the module's
``_ddp_params_and_buffers_to_ignore`` first, as a collection of names; :func:`refuse_ddp` sets it to an
object whose iteration raises, naming the ways out, where the user has not set one.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

__all__ = ["refuse_ddp"]

_ATTR = "_ddp_params_and_buffers_to_ignore"


class _RefuseDDP:
    """Iterated by DDP's constructor or Lightning's ``_sync_module_states``: raises (see the module)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self) -> Iterator[str]:
        raise RuntimeError(
            f"This model was converted to tensor parallelism by lightning_par (tensor_parallel_size="
            f"{self.size}): its split layers hold this rank's slices of their weights. Torch's"
            " DistributedDataParallel (Lightning's or Fabric's 'ddp') would copy rank 0's slices over the"
            " other ranks' and give the tp ranks different batches. Run it with lightning_par's"
            f" HybridParallelStrategy(tensor_parallel_size={self.size}, ...) again, or load"
            " strategy.consolidated_state_dict() (collective; the full state on rank 0) into a freshly"
            " built model for another strategy."
        )


def refuse_ddp(module: nn.Module, *, size: int) -> None:
    """Make DDP (and Lightning's DDP strategy) refuse ``module``, converted to tensor parallelism over
    ``size`` ranks; a collection of the user's own under that name is left alone."""
    if not hasattr(module, _ATTR):
        setattr(module, _ATTR, _RefuseDDP(size))
