"""Buffers of a model built wholly on the meta device, computed as on a real device.

``params_on_meta()`` (the strategies' ``configure_model()`` context, and Fabric's
``init_module(empty_init=True)``) keeps buffers real: they are small and often computed in ``__init__``.
A model the user builds under ``torch.device("meta")`` (the FSDP2 / torchtitan idiom) has meta buffers
too, rotary frequencies and BatchNorm statistics among them, which nothing else fills (the engine's
first copy of one would fail in torch: "Cannot copy out of meta tensor; no data!").

:func:`materialize_buffers` gives each meta buffer storage on the device and runs the initialisers that
compute buffers on a real device: the module's ``reset_parameters()`` (BatchNorm resets its statistics
there) when the module holds no real parameter it would overwrite, then, inside a Hugging Face model,
that model's ``_init_weights`` (transformers 5 recomputes rotary frequencies and BatchNorm statistics
there). A buffer is accepted only if it comes out the same from two runs that start it from different
fills (0 and 1), so a buffer no initialiser sets, or sets only in part, is refused by name with the fix,
whatever its dtype. Buffers are replicated, so every rank computes the same values; the random state is
seeded per module and restored after (:mod:`lightning_par.zero.meta_init`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_par.zero.hf_init import Initialiser, hf_initialisers, replay
from lightning_par.zero.init_seeds import module_seed, own_rng
from lightning_par.zero.units import REMOTE_ATTR


def materialize_buffers(root: nn.Module, *, device: torch.device) -> list[str]:
    """Replace ``root``'s meta buffers by real ones on ``device`` holding the values their modules'
    initialisers compute (module docstring); returns their names. Raises a ``ValueError`` naming the
    buffers no initialiser sets, and leaves them on the meta device."""
    found = [
        (module_name, m, name, b)
        for module_name, m in root.named_modules()
        for name, b in m._buffers.items()
        if b is not None and b.is_meta and not getattr(b, REMOTE_ATTR, False)  # not another stage's
    ]
    if not found:
        return []
    owners: dict[int, tuple[str, nn.Module]] = {}
    for module_name, m, _, _ in found:
        owners.setdefault(id(m), (module_name, m))
    # the owners' own Hugging Face calls only: a parent's init writes parameters, meta here or left alone
    meta_ids = {id(b) for _, _, _, b in found}
    calls = [c for c in hf_initialisers(root, set(), buffers=meta_ids) if id(c[1]) in owners]
    runs = [_run(found, owners, calls, fill, device) for fill in (0, 1)]
    unset = [
        f"{module_name}.{name}" if module_name else name
        for (module_name, _, name, _), first, second in zip(found, *runs, strict=True)
        if not torch.equal(first, second)
    ]
    if unset:
        for _, m, name, meta in found:  # as it was
            m._buffers[name] = meta
        raise ValueError(
            f"Buffers {unset} are on the meta device and no initialiser sets them (their modules'"
            " reset_parameters(), or a Hugging Face model's _init_weights). A buffer computed from a"
            " parameter while the model is built (torch.nn.utils.spectral_norm's _u and _v) is on meta"
            " even in configure_model() or Fabric's init_module(empty_init=True): pass meta_init=False to"
            " the strategy, which builds the model on the real device. A model built under"
            " torch.device('meta'): build it in configure_model() or under init_module(empty_init=True),"
            " which keep the buffers computed in __init__ real, or on a real device."
        )
    return [f"{module_name}.{name}" if module_name else name for module_name, _, name, _ in found]


def _run(
    found: list[tuple[str, nn.Module, str, Tensor]],
    owners: dict[int, tuple[str, nn.Module]],
    calls: list[tuple[str, nn.Module, Initialiser]],
    fill: int,
    device: torch.device,
) -> list[Tensor]:
    """One pass: every meta buffer filled with ``fill``, then the initialisers (each module's under a
    seed of its path; buffers' inits rarely draw); returns the buffers."""
    for _, m, name, meta in found:
        m._buffers[name] = torch.full(meta.shape, fill, dtype=meta.dtype, device=device)
    with own_rng(device) as reseed, torch.no_grad():
        for module_name, m in owners.values():
            reset = getattr(m, "reset_parameters", None)
            if callable(reset) and all(p.is_meta for p in m.parameters(recurse=False)):
                reseed(module_seed(0, module_name))
                reset()
        replay(calls, set(), reseed=lambda path: reseed(module_seed(0, path)))
    out = [m._buffers[name] for _, m, name, _ in found]
    return [b for b in out if b is not None]  # none is: each was just set
