"""Large-model initialisation for ZeRO-3: meta-device parameters materialised one unit at a time.

A model built on the meta device has shapes but no storage. Each unit in turn gets real storage, is
filled from pretrained weights where a source has them, otherwise initialised as on a real device (its
modules' own ``reset_parameters()``, then, inside a Hugging Face model, that model's ``_init_weights``:
:mod:`lightning_par.zero.hf_init`), is sliced into shards, and is released, so no rank ever holds more
than one unit in full. Each initialiser runs under its own seed
(:func:`~lightning_par.zero.init_seeds.module_seed` of the run's seed and the module's path): a
module's initial values depend on nothing else, not on the unit it falls in, the pipeline stage that
holds it or the world size, so every rank that holds a copy draws the same values and any layout starts
from the same model. A tensor-parallel layer is initialised as the
full-size layer it replaced, then sliced (:mod:`lightning_par.zero.tp_init`), so its slices are parts of
one matrix.
Trainable and frozen parameters are materialised alike. PEFT LoRA layers (modules with
``reset_lora_parameters``) get their adapters re-initialised the way PEFT's default does (A as
``nn.Linear``, B zero), so an adapter starts as the identity. :func:`materialize_model` does the same
for the whole model in one process: the unsharded twin used to check that a sharded init equals the
full init sliced.

The model is built on the meta device under :func:`~lightning_par.zero.meta_build.params_on_meta`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from lightning_par.tensor_parallel.family import HEAD_TABLE_ATTR
from lightning_par.tensor_parallel.layers import TP_DIM_ATTR
from lightning_par.zero.hf_init import hf_initialisers, others_on_meta, replay
from lightning_par.zero.init_seeds import module_seed, own_rng
from lightning_par.zero.meta_copies import copy_seed_paths, creators_last, seed_path
from lightning_par.zero.meta_replay import (
    forget_writes,
    pending_writes,
    refuse_writes_after_build,
    replay_writes,
    writes_after_load,
)
from lightning_par.zero.peft_init import reset_lora
from lightning_par.zero.tp_init import parallel_layers, release_sources, slice_of, sources_in_place
from lightning_par.zero.units import REMOTE_ATTR, UnitPolicy, plan_units

# A parameter's values from a pretrained source (None: not in the source, initialise it).
ValuesFn = Callable[[str], Tensor | None]


def materialize_unit(
    root: nn.Module,
    params: Sequence[nn.Parameter],
    *,
    seed: int,
    device: torch.device,
    names: Sequence[str] | None = None,
    values: ValuesFn | None = None,
    copies: Mapping[str, str] | None = None,
) -> list[nn.Parameter]:
    """Replace meta ``params`` by real ones on ``device`` (everywhere they are registered, so ties hold).

    With ``values`` (and ``names``, the parameters' names), a parameter whose values the source has is
    filled from it; the others are initialised as on a real device: their modules' ``reset_parameters()``,
    then, inside a Hugging Face model, the model's own ``_init_weights`` (:mod:`lightning_par.zero.hf_init`),
    then PEFT's adapter init, each module's under :func:`module_seed` of ``seed``. A tensor-parallel layer
    is initialised as the full-size layer it replaced and sliced (:mod:`lightning_par.zero.tp_init`). The
    same values on every rank and for any layout, so a sharded init equals the full init sliced (see
    :func:`materialize_model`). A module whose parameters are all loaded needs no initialiser; one that
    must be initialised and has none is named in a ``ValueError`` before anything is replaced, as are
    tensor-parallel slices to initialise without a full-size layer to draw them from, and a parameter its
    initialisers left unset (filled with NaN until then) in one after. Returns the new parameters in the
    order of ``params``. ``copies`` (:func:`~lightning_par.zero.meta_copies.copy_seed_paths` of ``root``,
    taken before any unit was materialised) draws deep copies under their sources' seeds."""
    wanted = {id(p): p for p in params if p.is_meta}
    name_of = dict(zip(map(id, params), names, strict=True)) if names is not None else {}
    label = _labels(root, wanted, name_of)
    loaded: dict[int, Tensor] = {}
    if values is not None:
        for pid in wanted:
            value = values(name_of[pid]) if pid in name_of else None
            if value is not None:
                loaded[pid] = value
    for pid, value in loaded.items():
        if tuple(value.shape) != tuple(wanted[pid].shape):
            raise ValueError(
                f"Pretrained weight {name_of[pid]!r} has shape {tuple(value.shape)}, the model's parameter"
                f" {tuple(wanted[pid].shape)}."
            )
    todo = {pid for pid in wanted if pid not in loaded}
    rewritten = [  # loaded as slices: the writes made after the load would need the full tensor
        label.get(id(p), attr)
        for s in parallel_layers(root, set(loaded))
        for attr, p in s.layer._parameters.items()
        if p is not None and id(p) in loaded and writes_after_load(s.source._parameters.get(attr))
    ]
    if rewritten:
        raise ValueError(
            f"configure_model() loaded {rewritten} and then wrote into them (an init after the load); under"
            " tensor parallelism ZeRO-3 loads them as slices and cannot replay such writes: make the write"
            " before the load, or give the final weights as pretrained=... ."
        )
    swaps = parallel_layers(root, todo)
    swapped = {id(p) for s in swaps for p in s.layer.parameters(recurse=False)}
    unsourced = [label[pid] for pid in wanted if pid in todo - swapped and hasattr(wanted[pid], TP_DIM_ATTR)]
    tables = [label[pid] for pid in wanted if pid in todo and getattr(wanted[pid], HEAD_TABLE_ATTR, False)]
    if tables:  # before the message below, whose advice (a plan applied on the meta device) does not fit
        raise ValueError(
            f"{tables} are per-head bias tables (T5's relative_attention_bias) cut by heads under tensor"
            " parallelism from the meta device, and no full-size table is kept to draw them as slices of"
            " one matrix (each tp rank would draw the same columns). Pass pretrained=... (the checkpoint's"
            " table is cut as it loads), or build the model on a real device: the strategy's meta_init=False."
        )
    if unsourced:  # an initialiser would draw the same slice on every tp rank, not slices of one matrix
        raise ValueError(
            f"Parameters {unsourced} are tensor-parallel slices on the meta device that no pretrained"
            " weights fill and no full-size layer was kept for (their layers were not converted by a"
            " tp_plan from layers on the meta device), so ZeRO-3 cannot draw them as slices of one matrix;"
            " apply the tp_plan to the model built on the meta device, pass pretrained=..., or build the"
            " model on a real device."
        )
    if not swaps:
        fresh = _materialize(root, wanted, loaded, label, seed=seed, device=device, copies=copies)
        release_sources(root, {id(p) for p in fresh.values()})  # parallel layers filled from pretrained
        return [fresh.get(id(p), p) for p in params]
    # the parallel layers' parameters: their sources' full-size ones initialised in their place, sliced
    with sources_in_place(swaps):
        full = {id(p): p for s in swaps for p in s.source.parameters(recurse=False) if p.is_meta}
        drawn_from = {  # a parallel layer's parameter to initialise -> its source's full-size one
            id(p): id(s.source._parameters[attr])
            for s in swaps
            for attr, p in s.layer._parameters.items()
            if p is not None and id(p) in todo and id(s.source._parameters[attr]) in full
        }
        outer = {pid: p for pid, p in wanted.items() if pid not in swapped}
        label |= _labels(root, full, {})
        fresh = _materialize(root, outer | full, loaded, label, seed=seed, device=device, copies=copies)
        parts = {
            id(p): (
                slice_of(s.layer, attr, fresh[drawn_from[id(p)]])
                if id(p) in drawn_from
                else loaded[id(p)].to(device=device, dtype=p.dtype)
            )
            for s in swaps
            for attr, p in s.layer._parameters.items()
            if p is not None and id(p) in wanted
        }
    fresh |= _replace(root, {pid: wanted[pid] for pid in parts}, parts)
    release_sources(root, {id(p) for p in fresh.values()})
    return [fresh.get(id(p), p) for p in params]


def _labels(root: nn.Module, wanted: dict[int, nn.Parameter], name_of: dict[int, str]) -> dict[int, str]:
    """Names for messages: the given ones, else the first module path that registers the parameter."""
    label = dict(name_of)
    for module_name, m in root.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            if p is not None and id(p) in wanted:
                label.setdefault(id(p), f"{module_name}.{attr}" if module_name else attr)
    return label


def _replace(
    root: nn.Module, old: dict[int, nn.Parameter], data: dict[int, Tensor]
) -> dict[int, nn.Parameter]:
    """Register ``data[id]`` as a Parameter in place of ``old[id]`` everywhere in ``root``; the new ones
    keep the old ones' ``requires_grad`` and attributes (a tensor-parallel mark, a pipeline flag)."""
    fresh: dict[int, nn.Parameter] = {}
    for pid, p in old.items():
        new = nn.Parameter(data[pid], requires_grad=p.requires_grad)
        new.__dict__.update(p.__dict__)
        fresh[pid] = new
    for m in root.modules():
        for attr, registered in m._parameters.items():
            if registered is not None and id(registered) in fresh:
                m._parameters[attr] = fresh[id(registered)]
    return fresh


def _materialize(
    root: nn.Module,
    wanted: dict[int, nn.Parameter],
    loaded: dict[int, Tensor],
    label: dict[int, str],
    *,
    seed: int,
    device: torch.device,
    copies: Mapping[str, str] | None,
) -> dict[int, nn.Parameter]:
    """:func:`materialize_unit` for ``wanted`` (id -> meta parameter) with no tensor-parallel layer left
    to swap: ``loaded`` values copied, the others initialised; returns the new parameters by old id."""

    def seeded(path: str) -> int:  # a deep copy draws under its source's seed (meta_copies)
        return module_seed(seed, seed_path(copies, path) if copies else path)

    owners: list[tuple[str, nn.Module, set[int]]] = []  # (name, module, ids of the meta params it holds)
    for module_name, m in root.named_modules(remove_duplicate=False):
        held = {id(p) for p in m._parameters.values() if p is not None and id(p) in wanted}
        if held and all(m is not o for _, o, _ in owners):
            owners.append((module_name, m, held))
    ordered = [pid for pid in wanted if pid not in loaded]  # to initialise, in the order given
    todo = set(ordered)
    hf_calls = hf_initialisers(root, todo)
    by_model = {id(m) for _, m, _ in hf_calls}
    to_init = creators_last([(module_name, m) for module_name, m, held in owners if held - loaded.keys()])
    # what the model's construction wrote into them beyond the initialisers run below (meta_writes)
    pending = pending_writes([(label[pid], p) for pid, p in wanted.items()], loaded=set(loaded))
    written = {id(p) for _, p, _ in pending}
    for module_name, m in to_init:  # checked before anything is replaced
        if id(m) not in by_model and not callable(getattr(m, "reset_parameters", None)):
            missing = [
                attr
                for attr, p in m._parameters.items()
                if p is not None and id(p) not in loaded and id(p) not in written
            ]
            if not missing:  # its construction initialised them (e.g. nn.MultiheadAttention): replayed
                continue
            parametrized = (
                " (a torch parametrization's originals: weight_norm, spectral_norm and the like compute"
                " them from the weight when the model is built, which meta init cannot replay)"
                if type(m).__name__ == "ParametrizationList"
                else ""
            )
            raise ValueError(
                f"Module {module_name or '<root>'!r} ({type(m).__name__}) holds meta-device parameters"
                f" {missing}{parametrized} that no pretrained weights fill, but it has no"
                " reset_parameters(), so ZeRO-3 cannot initialise its shard; pass meta_init=False to the"
                " strategy (configure_model() then builds the model on the real device and each rank keeps"
                " its shard), give the module a reset_parameters(), or load its weights (pretrained=...)."
            )
    data: dict[int, Tensor] = {}
    for pid, old in wanted.items():
        data[pid] = torch.empty(old.shape, dtype=old.dtype, device=device)
        if pid in todo and data[pid].is_floating_point():
            data[pid].fill_(float("nan"))  # a value no initialiser leaves: an unset parameter shows
    fresh = _replace(root, wanted, data)
    forget_writes(list(fresh.values()))
    for pid in todo:  # transformers' init functions skip tensors flagged as initialised
        fresh[pid].__dict__.pop("_is_hf_initialized", None)
    unit_ids = {id(p) for p in fresh.values()}
    with own_rng(device) as reseed, torch.no_grad():
        for module_name, m in to_init:  # as the layers' constructors do on a real device
            if callable(reset := getattr(m, "reset_parameters", None)):
                reseed(seeded(module_name))
                # a module also holding parameters of other units (a weight tied across units: its bias
                # lives in a unit sharded already) resets those into meta stand-ins, not placeholders
                with others_on_meta(m, unit_ids):
                    reset()
        initialised = {id(fresh[pid]) for pid in todo}
        # then a Hugging Face model's post_init()
        replay(hf_calls, initialised, reseed=lambda path: reseed(seeded(path)))
        reset_lora(root, initialised, reseed=lambda path: reseed(seeded(path)))
        # then what the user's code did after them
        initial = [entry for entry in pending if id(entry[1]) not in loaded]
        replay_writes(initial, fresh, reseed=lambda name: reseed(seeded(name)))
    _check_set([(label[pid], fresh[pid]) for pid in ordered])
    with torch.no_grad():
        for pid, value in loaded.items():
            if pid in fresh:
                fresh[pid].copy_(value)
    after_load = [entry for entry in pending if id(entry[1]) in loaded]
    if after_load:  # writes made after configure_model() loaded the parameter (a head re-initialised)
        with own_rng(device) as reseed:
            replay_writes(after_load, fresh, reseed=lambda name: reseed(seeded(name)))
    return fresh


def _check_set(initialised: Sequence[tuple[str, Tensor]]) -> None:
    """Refuse parameters still holding the NaN they were created with (one host read, at setup)."""
    floating = [(name, p) for name, p in initialised if p.is_floating_point()]
    if not floating:
        return
    unset = torch.stack([p.isnan().any() for _, p in floating]).tolist()
    names = [name for (name, _), bad in zip(floating, unset, strict=True) if bad]
    if any(".parametrizations." in name for name in names):
        # the model's init writes the computed weight (Wav2Vec2's positional conv under weight_norm), which
        # a parametrization turns into its originals on a real device; on the meta device nothing reaches them
        raise ValueError(
            f"Parameters {names} are the originals of a torch parametrization (weight_norm, spectral_norm"
            " and the like), which a model's initialiser sets by writing the computed weight; built on the"
            " meta device (ZeRO-3's meta init) that write never reaches them. Pass meta_init=False to the"
            " strategy (configure_model() then builds the model on the real device and each rank keeps its"
            " shard), or load them (pretrained=...)."
        )
    if names:
        raise ValueError(
            f"Parameters {names} were left unset by their modules' initialisers (reset_parameters(), or"
            " a Hugging Face model's _init_weights), so ZeRO-3 cannot initialise them from the meta"
            " device; give the module a reset_parameters() that sets them, load them (pretrained=...),"
            " or create the model on a real device (meta_init=False; needed where the init reads other"
            " weights, as PEFT's DoRA magnitudes do)."
        )


def materialize_model(
    root: nn.Module,
    *,
    units: UnitPolicy = None,
    seed: int,
    device: torch.device,
    values: ValuesFn | None = None,
) -> None:
    """Unsharded twin of stage-3 initialisation: unit by unit, the same seeds, the whole model."""
    refuse_writes_after_build(root)
    plan = [entry for entry in plan_units(root, units).units if entry[2]]
    copies = copy_seed_paths(root)
    for _, _, named in plan:
        params = [p for _, p in named]
        if any(p.is_meta for p in params):
            names = [n for n, _ in named]
            materialize_unit(
                root, params, seed=seed, device=device, names=names, values=values, copies=copies
            )


def materialize_local(root: nn.Module, *, device: torch.device, values: ValuesFn | None, seed: int) -> int:
    """Below ZeRO-3 (no shards): materialise every meta parameter of ``root`` this rank holds (not the
    placeholders of other pipeline stages) on ``device``, from ``values`` or ``reset_parameters()``;
    returns how many. Meta parameters without ``values`` to fill them are refused."""
    local = [(n, p) for n, p in root.named_parameters() if p.is_meta and not getattr(p, REMOTE_ATTR, False)]
    if not local:
        return 0
    refuse_writes_after_build(root)
    if values is None:
        raise ValueError(
            "The model has meta-device parameters, which only zero_stage=3 materialises (shard by shard) or"
            " pretrained weights fill; create the model on a real device, use zero_stage=3, or pass"
            " pretrained=... ."
        )
    names = [n for n, _ in local]
    params = [p for _, p in local]
    copies = copy_seed_paths(root)
    materialize_unit(root, params, seed=seed, device=device, names=names, values=values, copies=copies)
    return len(local)
