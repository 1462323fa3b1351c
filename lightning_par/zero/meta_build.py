"""Building a model on the meta device for ZeRO-3's meta init, and moving a partly-meta model.

:func:`params_on_meta` is the context the strategy runs ``configure_model()`` in: parameters are created
on the meta device, buffers on the CPU, because buffers are small and often computed in ``__init__``
(rotary frequencies, masks) where no ``reset_parameters()`` could recreate them. Writes into the meta
parameters (and values loaded into them) are recorded, to be replayed when :mod:`.meta_init`
materialises them one unit at a time. :func:`meta_build` is the same context for user code, with its
failures on meta tensors raised again naming the fixes.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_par.zero.meta_copies import copy_owner, mark_copy, mark_owner
from lightning_par.zero.meta_loads import MetaLoads
from lightning_par.zero.meta_replay import stamp_built
from lightning_par.zero.meta_writes import WriteRecorder, inherit_writes, visible_init_functions


def target_device(module: nn.Module, *, default: torch.device | None = None) -> torch.device:
    """The device of the first real parameter or buffer (``default``, else the CPU, if everything is on
    the meta device)."""
    for t in (*module.parameters(), *module.buffers()):
        if not t.is_meta:
            return t.device
    return default if default is not None else torch.device("cpu")


def move_real_tensors(module: nn.Module, device: torch.device) -> None:
    """Move ``module``'s real parameters and buffers to ``device``; meta ones (meta init, other pipeline
    stages' layers) stay, to be materialised by the engine or by pretrained weights.

    Every submodule without meta parameters or buffers moves with ``.to(device)``, so modules that keep
    tensors outside parameters and buffers and move them in their own ``_apply`` (torchmetrics' metric
    states, the metric's ``device``) follow the model; only modules holding meta tensors themselves
    have their real tensors moved one by one (meta buffers, of a model built under
    ``torch.device("meta")``, are computed on the device afterwards: ``materialize_buffers``)."""
    if not any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        module.to(device)
        return
    with torch.no_grad():
        for t in (*module._parameters.values(), *module._buffers.values()):
            if t is not None and not t.is_meta:
                t.data = t.data.to(device)
    for child in module.children():
        move_real_tensors(child, device)


@contextmanager
def params_on_meta(loads: MetaLoads | None = None) -> Iterator[None]:
    """Create parameters on the meta device and buffers where they would be anyway (see the module
    docstring). ``nn.Module.register_parameter`` and ``nn.Parameter.__deepcopy__`` are wrapped for the
    duration only. Writes into the meta parameters are recorded on them, to be replayed when they are
    materialised (:mod:`lightning_par.zero.meta_writes`); with ``loads``, values loaded into them (a
    whole ``copy_`` from a real tensor, a real parameter replacing one the module already has:
    ``load_state_dict(..., assign=True)``) are recorded there instead (:mod:`lightning_par.zero.meta_loads`);
    a deep copy of a parameter keeps both."""
    original = nn.Module.register_parameter
    recorder = WriteRecorder(loads.record if loads is not None else None)
    built: list[nn.Parameter] = []

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        replaced = module._parameters.get(name) if "_parameters" in module.__dict__ else None
        original(module, name, param)
        if param is not None:
            built.append(param)  # its placeholder, for the stamp at the block's end
        if param is not None and not param.is_meta:
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)  # attributes such as a tensor-parallel mark
            module._parameters[name] = meta
            built[-1] = meta
            if replaced is not None:  # an assignment of values: recorded as their copy into the parameter
                recorder.record(torch.Tensor.copy_, (meta, param), {}, meta)
            else:  # created with values: nn.Parameter(torch.ones(d)), nn.Embedding.from_pretrained(vectors)
                recorder.created(meta, param)
        if param is not None:
            mark_owner(built[-1], module)  # its creator, the first to register it (meta_copies)

    deepcopy = nn.Parameter.__deepcopy__

    def copied(param: nn.Parameter, memo: dict[int, Any]) -> nn.Parameter:
        copy = deepcopy(param, memo)
        if param.is_meta:  # a module cloned after its init (nn.TransformerEncoder's layers): the same
            inherit_writes(param, copy)
            mark_copy(param, copy)  # drawn as its source (meta_copies)
            copy_owner(param, copy, memo)
            if loads is not None:
                loads.copied(param, copy)
        return copy

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    nn.Parameter.__deepcopy__ = copied  # type: ignore[method-assign,assignment]
    try:
        with recorder, visible_init_functions(recorder), warnings.catch_warnings():
            # torch's "copying ... to a meta parameter ..., which is a no-op": not so here (recorded)
            warnings.filterwarnings("ignore", message=r"for .*: copying from a non-meta parameter")
            yield
        stamp_built(built)  # a write after the block is refused at materialisation (it would be lost)
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
        nn.Parameter.__deepcopy__ = deepcopy  # type: ignore[method-assign]


@contextmanager
def meta_build(where: str, fixes: str, loads: MetaLoads | None = None) -> Iterator[None]:
    """:func:`params_on_meta` for user code building a model (``where`` names it), with its failures
    from code that cannot run on meta tensors raised again naming the cause and ``fixes`` (transformers'
    ``from_pretrained`` fails in its last step, "Unsupported device type 'meta'", and loads with
    ``use_kernels=False``)."""
    try:
        with params_on_meta(loads):
            yield
    except Exception as error:
        if "meta" not in str(error):
            raise
        # transformers 5 ends from_pretrained by fitting hub kernels to the model's device, which fails on
        # meta tensors after the weights are read (and recorded: loads into meta parameters are kept)
        kernels = (
            " transformers' from_pretrained itself works here with use_kernels=False: the weights it reads"
            " are kept and written into the shards at setup (each rank holds them on the host until then)."
            if "Unsupported device type 'meta'" in str(error)
            else ""
        )
        raise RuntimeError(
            f"{where} failed while ZeRO-3 creates the parameters on the meta device (meta_init):"
            f" {type(error).__name__}: {error}.{kernels} Code that needs real weights there (reading"
            f" parameter values) cannot run on meta tensors: {fixes}"
        ) from error


MODULE_OWN = frozenset(vars(nn.Module()))  # torch's own attributes of every module (hooks, tables)


def refuse_hidden_meta(root: nn.Module) -> None:
    """Refuse modules on the meta device that ``root`` holds outside its module tree: a reference model
    kept in a plain list (``self._ref = [copy.deepcopy(self.policy)]``) or set with ``object.__setattr__``
    to hide it from the optimizer and checkpoints. Only the tree is materialised, so such a module stayed
    on the meta device and its first forward failed in torch ("Tensor on device meta is not on the
    expected device"). Attributes of the tree's modules are looked at, and lists, tuples and dicts in
    them one level deep."""
    tree = {id(m) for m in root.modules()}
    own = {id(t) for t in (*root.parameters(), *root.buffers())}  # wrappers of the tree's own pass
    hidden: list[str] = []
    for path, module in root.named_modules():
        for attr, value in vars(module).items():
            if attr in MODULE_OWN or attr.startswith("_lp_"):  # ours: a tp layer's full-size source
                continue
            items = (
                value.items()
                if isinstance(value, dict)
                else enumerate(value)
                if isinstance(value, list | tuple)
                else [(None, value)]
            )
            for key, item in items:
                meta = isinstance(item, nn.Module) and id(item) not in tree and _on_meta(item, own)
                if meta:
                    where = f"{path}.{attr}" if path else attr
                    hidden.append(where if key is None else f"{where}[{key!r}]")
    if hidden:
        raise ValueError(
            f"{hidden[:4]} hold modules built on the meta device outside the model's module tree (a plain"
            " list or dict, or object.__setattr__), which ZeRO-3's meta init does not materialise. Make"
            " them submodules (a frozen reference: requires_grad_(False), then it is sharded and stays as"
            " built), build them in __init__ (on a real device), or pass meta_init=False."
        )


def _on_meta(module: nn.Module, own: set[int]) -> bool:
    """``module`` holds a meta tensor that is not one of ``own`` (the model's)."""
    return any(t.is_meta and id(t) not in own for t in (*module.parameters(), *module.buffers()))
