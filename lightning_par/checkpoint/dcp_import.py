"""Reading the sharded checkpoints of Lightning's FSDP strategies, so a run moves to our strategy.

Lightning's ``ModelParallelStrategy`` (FSDP2 / DTensor) and ``FSDPStrategy(state_dict_type="sharded")``
write a directory in ``torch.distributed.checkpoint`` (DCP) format::

    <path>/.metadata        DCP's index: every entry's global shape, dtype and where its pieces lie
    <path>/__<r>_0.distcp   rank r's pieces
    <path>/meta.pt          rank 0: the rest of Lightning's checkpoint dict (loops, callbacks, schedulers)

The DCP entries are the model's state dict (``"state_dict"`` from ``ModelParallelStrategy``, ``"model"``
from ``FSDPStrategy``) and one ``"optimizer_<k>"`` per optimizer in torch's distributed layout: state
keyed by parameter name (``{"state": {name: {...}}, "param_groups": [{..., "params": [name, ...]}]}``).

:func:`read_dcp_checkpoint` turns such a directory into an ordinary Lightning checkpoint dict: whole
tensors (each rank reads every piece, without a process group, as torch's own ``dcp_to_torch_save``
does: each rank then holds the full state in host memory, where a single file is memory-mapped and
read only where a rank's slices lie; consolidating once to a file is the way for states too large for
that), optimizer states in torch's format (parameters numbered in group order), and the
parameter names of each group recorded in our layout metadata (``lightning_par["optimizers"]``), so
loading ties optimizer state to parameters by name at any ZeRO stage, tensor- or pipeline-parallel
layout. :func:`read_dcp_entries` gives the entries of a directory Fabric's FSDP strategies saved (the
user's keys; ``fabric.load`` converts the optimizer entries with :func:`torch_optimizer_format`), and
:class:`DCPWeights` the model's tensors one at a time, for ``pretrained=`` (also torchtitan's layout, the
tensors at the top level). The reverse way needs nothing new: a sharded checkpoint of ours,
consolidated to one file (``lightning-par-consolidate``), is an ordinary Lightning file that
``ModelParallelStrategy`` resumes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from lightning_par.checkpoint.sharded import DCP_INDEX, META_FILE, METADATA_KEY

MODEL_ENTRIES = ("state_dict", "model")  # ModelParallelStrategy's name, FSDPStrategy's name
_OPTIMIZER_ENTRY = re.compile(r"optimizer_(\d+)")


def is_dcp_checkpoint(path: str | os.PathLike[str]) -> bool:
    """``path`` is a directory written by ``torch.distributed.checkpoint`` (it has DCP's index)."""
    p = Path(path)
    return p.is_dir() and (p / DCP_INDEX).is_file()


def _cause(error: BaseException) -> str:
    """The first underlying failure of DCP's ``CheckpointException`` (whose text is every rank's traceback),
    else the error itself, in one line."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))  # (exception, its stack) in torch 2.x
        error = first[0] if isinstance(first, tuple) and first else getattr(first, "exception", first)
    return f"{type(error).__name__}: {error}".splitlines()[0]


def _load(path: Path, keys: set[str] | None, what: str) -> dict[str, Any]:
    """DCP entries of ``path`` (all, or the flattened ``keys``) as whole tensors and plain objects, nested
    as saved; ``what`` (``""``, or ``"'name' from "``) names the read in the error."""
    state: dict[str, Any] = {}
    try:
        _load_state_dict(
            state,
            storage_reader=FileSystemReader(path),
            planner=_EmptyStateDictLoadPlanner(keys=keys),
            no_dist=True,
        )
    except (Exception, CheckpointException) as error:  # DCP's is a BaseException, raised for lost pieces
        raise ValueError(
            f"Could not read {what}the torch.distributed.checkpoint directory {path}: {_cause(error)}."
            " A piece file (__<rank>_0.distcp) is missing or damaged; copy the whole directory again, or"
            " resume from an earlier checkpoint."
        ) from error
    return state


def torch_optimizer_format(state: Any, entry: str) -> tuple[dict[str, Any], list[list[str]]]:
    """A name-keyed optimizer state dict (torch's distributed layout) in torch's own format, parameters
    numbered in group order, and each group's parameter names; ``entry`` names it in errors."""
    if not isinstance(state, dict) or not isinstance(state.get("param_groups"), list):
        raise ValueError(f"Entry {entry!r} is not an optimizer state dict (no 'state' and 'param_groups').")
    groups, names, index = [], [], 0
    for group in state["param_groups"]:
        params = [str(name) for name in group["params"]]
        groups.append(
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": list(range(index, index + len(params))),
            }
        )
        index += len(params)
        names.append(params)
    ids = {name: i for i, name in enumerate(n for group in names for n in group)}
    states = state.get("state", {})
    unknown = sorted(set(states) - set(ids))
    if unknown:
        raise ValueError(
            f"Entry {entry!r} holds optimizer state for {unknown[:4]}, which no param group lists."
        )
    return {"state": {ids[n]: s for n, s in states.items()}, "param_groups": groups}, names


def torch_optimizer_states(entries: Mapping[str, Any], keys: list[str]) -> tuple[list[Any], dict[str, Any]]:
    """The optimizer ``entries[k]`` of each of ``keys`` in torch's format, and our layout metadata naming
    each one's parameters by group (loads tie state to parameters by these names)."""
    converted = [torch_optimizer_format(entries[k], k) for k in keys]
    meta = {"format": "dcp", "optimizers": [{"param_names": names} for _, names in converted]}
    return [state for state, _ in converted], meta


def read_dcp_entries(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A DCP directory's entries, whole, with the keys of its ``meta.pt`` beside them (what Fabric's
    ``ModelParallelStrategy`` / ``FSDPStrategy`` save puts there: everything that is not a module or an
    optimizer)."""
    p = Path(path)
    entries = _load(p, None, "")
    if (p / META_FILE).is_file():
        try:
            extras = torch.load(p / META_FILE, map_location="cpu", weights_only=False)
        except Exception as error:
            raise ValueError(
                f"Could not read {p / META_FILE} (the checkpoint's state beside the model and optimizers):"
                f" {error}. Copy the whole checkpoint directory again, or resume from an earlier one."
            ) from error
        entries.update({k: v for k, v in extras.items() if k not in entries})
    return entries


class DCPWeights(Mapping[str, Tensor]):
    """The model's tensors in a DCP directory, read one at a time (each read loads only that tensor's
    pieces), for :class:`~lightning_par.checkpoint.pretrained.WeightSource`. Which entries are the model's:
    the ``"state_dict"`` or ``"model"`` entry of Lightning's and Fabric's FSDP strategies, else the
    tensors at the top level (torchtitan's layout); optimizer state and other entries are left out."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            metadata = FileSystemReader(self.path).read_metadata()
        except Exception as error:
            raise ValueError(
                f"Could not read the index of the torch.distributed.checkpoint directory {self.path}:"
                f" {_cause(error)}. Copy the whole directory again."
            ) from error
        where = metadata.planner_data or {}
        tensors: dict[str, tuple[tuple[Any, ...], TensorStorageMetadata]] = {
            k: (tuple(where.get(k, (k,))), v)
            for k, v in metadata.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)
        }
        chosen: dict[str, tuple[Any, ...]] = {}
        for entry in MODEL_ENTRIES:  # Lightning's / Fabric's nesting: (entry, parameter name)
            chosen = {k: p for k, (p, _) in tensors.items() if len(p) == 2 and p[0] == entry}
            if chosen:
                break
        if not chosen:  # flat: one tensor per top-level key
            chosen = {k: p for k, (p, _) in tensors.items() if len(p) == 1}
        self._keys = {str(p[-1]): (k, p) for k, p in chosen.items()}
        self.meta = {
            name: (tuple(tensors[k][1].size), tensors[k][1].properties.dtype)
            for name, (k, _) in self._keys.items()
        }

    def __getitem__(self, name: str) -> Tensor:
        key, path = self._keys[name]
        value: Any = _load(self.path, {key}, f"{name!r} from ")
        for step in path:
            value = value[step]
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def read_dcp_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A Lightning checkpoint dict from a DCP directory of Lightning's FSDP strategies (see the module
    docstring); ``lightning_par["optimizers"][k]["param_names"]`` names optimizer ``k``'s parameters.

    Raises:
        ValueError: no model entry, an unreadable piece or ``meta.pt``; the message names the fix.
    """
    entries = read_dcp_entries(path)
    model_key = next((k for k in MODEL_ENTRIES if isinstance(entries.get(k), dict)), None)
    if model_key is None:
        raise ValueError(
            f"{path} is a torch.distributed.checkpoint directory without a model entry (found"
            f" {sorted(entries)[:8]}; Lightning's Trainer with an FSDP strategy writes 'state_dict' or"
            " 'model'). A directory written by Fabric loads with fabric.load(path, state)."
        )
    numbered = [(int(m.group(1)), k) for k in entries if (m := _OPTIMIZER_ENTRY.fullmatch(k)) is not None]
    optimizer_keys = [k for _, k in sorted(numbered)]
    checkpoint = {k: v for k, v in entries.items() if k != model_key and k not in optimizer_keys}
    checkpoint["state_dict"] = entries[model_key]
    states, checkpoint[METADATA_KEY] = torch_optimizer_states(entries, optimizer_keys)
    if states:
        checkpoint["optimizer_states"] = states
    return checkpoint
