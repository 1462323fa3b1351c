"""A model that still holds ZeRO-3's placeholders from a run an exception stopped (or that kept it
sharded, ``unshard_on_teardown=False``), refused before a new run computes with them.

When a fit fails, the ZeRO-3 engine cannot gather the parameters back (the other ranks may not join), so
the module keeps its placeholders: tensors of the parameters' shapes expanded from one NaN (or zero)
element (:func:`lightning_par.zero.unit.build_part`); rank 0 is warned. A new ``Trainer`` or Fabric
given that module again trained and evaluated on NaN, silently. A placeholder is recognised by its
storage: one element behind every position (every stride zero, at least one dimension), which no
trained parameter has. The strategy notes them at setup and refuses them when its first loop
starts, unless a checkpoint was loaded in between (``fit(ckpt_path=...)``, whose load comes after setup,
or a ``FlashCheckpoint`` snapshot found at setup): the engine then wrote each rank's shard from it.
"""

from __future__ import annotations

from torch import nn
from torch.nn.parameter import is_lazy


def placeholder_names(module: nn.Module) -> list[str]:
    """The names of ``module``'s parameters that are ZeRO-3 placeholders (module docstring)."""
    return [
        name
        for name, p in module.named_parameters()
        if not is_lazy(p) and not p.is_meta and p.dim() > 0 and all(s == 0 for s in p.stride())
    ]


def refuse_left_placeholders(names: list[str], *, total: int, kept: bool = False) -> None:
    """Raise ``ValueError`` naming ``names`` (placeholders nothing loaded into), of ``total`` parameters;
    ``kept``: the strategy refusing them still holds the shards of the run that left them."""
    if names and kept:
        raise ValueError(
            f"{len(names)} of the model's {total} parameters (e.g. {names[:3]}) hold ZeRO-3's placeholders:"
            " this strategy's last fit kept the model sharded (unshard_on_teardown=False), and its weights"
            " are in that fit's shards, which a new run here would replace. Read them first with"
            " trainer.strategy.consolidated_state_dict() (or trainer.save_checkpoint) and run on a model"
            " built from them, or fit with unshard_on_teardown=True (the default) to evaluate after the"
            " fit. Nothing was changed."
        )
    if names:
        raise ValueError(
            f"{len(names)} of the model's {total} parameters (e.g. {names[:3]}) hold ZeRO-3's placeholders:"
            " an earlier run on this model stopped with an exception before the parameters could be gathered"
            " back (or kept them sharded: unshard_on_teardown=False), and nothing loads into them now."
            " Resume from a checkpoint (trainer.fit(model, ckpt_path=...): the last one written holds the"
            " trained weights), or rebuild the model, before fitting or evaluating it again."
        )


__all__ = ["placeholder_names", "refuse_left_placeholders"]
