"""The user's checkpoint hooks editing ``checkpoint["state_dict"]``, against Lightning's ``"ddp"``.

``on_save_checkpoint`` writes its own value for the LM head (as a user saving post-processed weights);
``on_load_checkpoint`` renames the keys of a model whose attribute was renamed since, or zeroes / drops an
entry. Under ``"ddp"`` what the hook leaves is what is saved and loaded. Before, our checkpoints lost the
edits, silently: the per-rank records (ZeRO-3, tensor-parallel pieces) and the fp32 masters (ZeRO 1/2 in
mixed precision) overrode them, and a rename was refused before the hook ran (with
``strict_loading=False``: the optimizer's moments were dropped, 0.016 off ``"ddp"`` after an epoch).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import final_state
from tests.third_party import Tokens, llama

HEAD = "model.lm_head.weight"


class Hooked(pl.LightningModule):
    """A tiny Llama under ``attr``, SGD with momentum (state to restore); ``save_edit`` zeroes the head in
    saved checkpoints, ``load_edit`` is ``"rename"`` (``old.*`` -> ``model.*``), ``"zero"``, ``"drop"``
    or ``"read"`` (reads a weight's entry)."""

    def __init__(
        self,
        *,
        attr: str = "model",
        save_edit: bool | str = False,
        load_edit: str | None = None,
        new_head: bool = False,
    ) -> None:
        super().__init__()
        setattr(self, attr, llama(0))
        self.head_shape = getattr(self, attr).lm_head.weight.shape  # whole, before any tp slicing
        if new_head:  # a fine-tune's own head in place of the saved one (not trained here)
            getattr(self, attr).lm_head = nn.Identity()
            self.cls = nn.Linear(4, 4)
        self.attr, self.save_edit, self.load_edit = attr, save_edit, load_edit
        self.strict_loading = load_edit not in ("drop", "filter", "rename_loose", "extra")

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = getattr(self, self.attr)(input_ids=x, use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["state_dict"]
        if self.save_edit == "scale":  # reads entries, on every rank as under "ddp"
            if not all(bool(torch.isfinite(v).all()) for v in state.values()):
                raise ValueError("refusing to save non-finite weights")
            checkpoint["state_dict"] = state = {k: v.detach().cpu() for k, v in state.items()}
            state[HEAD] = state[HEAD] * 0.5
        elif self.save_edit:
            state[f"{self.attr}.lm_head.weight"] = torch.zeros(self.head_shape)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["state_dict"]
        if self.load_edit in ("rename", "rename_loose"):
            for key in [k for k in state if k.startswith("old.")]:
                state["model." + key[len("old.") :]] = state.pop(key)
        elif self.load_edit == "extra":  # an entry of its own, in place
            state["extra"] = torch.zeros(1)
        elif self.load_edit == "filter":  # a new dict without the head
            checkpoint["state_dict"] = {k: v for k, v in state.items() if "lm_head" not in k}
        elif self.load_edit == "zero":
            state[HEAD] = torch.zeros_like(state[HEAD])
        elif self.load_edit == "drop":
            del state[HEAD]
        elif self.load_edit == "read":
            self.read = state["model.model.norm.weight"]


class Unhooked(Hooked):
    """``Hooked`` without a load hook (Lightning's own, which does nothing)."""

    on_load_checkpoint = pl.LightningModule.on_load_checkpoint  # type: ignore[assignment]


def _strategy(name: str) -> Any:
    if name == "ddp":
        return "ddp"
    if name.startswith("tp2"):  # "tp2-file": whole files, gathered on rank 0
        return HybridParallelStrategy(
            tensor_parallel_size=2, tp_plan="llama", save_distributed_checkpoint=name == "tp2"
        )
    return HybridParallelStrategy(zero_stage=int(name[4]))  # "zero1", "zero1-bf16", "zero3"


def _fit(name: str, tmp: str, module: Hooked, *, epochs: int, ckpt: str | None = None) -> dict[str, Tensor]:
    """Fit ``module`` for ``epochs`` (from ``ckpt``), saving the last checkpoint under ``tmp/name``; the
    whole final state (rank 0)."""
    strategy = _strategy(name)
    dp = 1 if name.startswith("tp2") else 2
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        precision="bf16-mixed" if name.endswith("bf16") else "32-true",
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=os.path.join(tmp, name), save_last=True, save_top_k=0)],
        default_root_dir=tmp,
    )
    trainer.fit(module, DataLoader(Tokens(8), batch_size=4 // dp), ckpt_path=ckpt)
    return {k: v.float() for k, v in final_state(module, strategy).items()}


def _job(rank: int, world: int, tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    # the reference: "ddp" saves a file under attribute "old" with the save hook's head, then resumes it
    # under "model" through the renaming hook for a second epoch
    _fit("ddp", tmp, Hooked(attr="old", save_edit=True), epochs=1)
    ddp_file = os.path.join(tmp, "ddp", "last.ckpt")
    out["ddp"] = _fit("ddp", tmp, Hooked(load_edit="rename"), epochs=2, ckpt=ddp_file)
    # ZeRO-1 writes a directory whose state_dict holds the parameters: the same save and rename
    _fit("zero1", tmp, Hooked(attr="old", save_edit=True), epochs=1)
    own = os.path.join(tmp, "zero1", "last.ckpt")
    out["zero1"] = _fit("zero1", tmp, Hooked(load_edit="rename"), epochs=2, ckpt=own)
    # ZeRO-3 and tp2 resume the "ddp" file through the rename (checked after the hook, not before)
    for name in ("zero3", "tp2"):
        out[name] = _fit(name, tmp, Hooked(load_edit="rename"), epochs=2, ckpt=ddp_file)
    # their own directories, in pieces: the save hook's head is what resumes (no training after)
    for name in ("zero3", "tp2", "zero1-bf16"):
        _fit(name, tmp, Hooked(save_edit=True), epochs=1)
        out[f"{name}/saved"] = _fit(name, tmp, Hooked(), epochs=1, ckpt=os.path.join(tmp, name, "last.ckpt"))
    # ZeRO-1 in bf16-mixed: the load hook's zeroed or dropped head over the fp32 masters
    bf16 = os.path.join(tmp, "zero1-bf16", "last.ckpt")
    for edit in ("zero", "drop"):
        out[f"bf16/{edit}"] = _fit("zero1-bf16", tmp, Hooked(load_edit=edit), epochs=1, ckpt=bf16)
    # a directory in pieces: its hooks see no parameters, so a rename cannot happen (refused naming why,
    # strict or not: before, non-strict loaded nothing, silently) and a filter by a new dict leaves them
    # loading as saved (warned)
    _fit("zero3", os.path.join(tmp, "old"), Hooked(attr="old"), epochs=1)
    old = os.path.join(tmp, "old", "zero3", "last.ckpt")
    for edit in ("rename", "rename_loose"):
        try:
            _fit("zero3", tmp, Hooked(load_edit=edit), epochs=1, ckpt=old)
            out[edit] = "no error"
        except ValueError as error:
            out[edit] = str(error)
    # the same directory of other names, loaded by a module without a load hook: refused without the hook
    # note (before, it told of on_load_checkpoint, which the module does not have)
    try:
        _fit("zero3", tmp, Unhooked(), epochs=1, ckpt=old)
        out["unhooked"] = "no error"
    except ValueError as error:
        out["unhooked"] = str(error)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zero3_dir = os.path.join(tmp, "zero3", "last.ckpt")
        out["filter"] = _fit("zero3", tmp, Hooked(load_edit="filter"), epochs=1, ckpt=zero3_dir)
    out["filter_warned"] = [str(w.message) for w in caught if "on_load_checkpoint replaced" in str(w.message)]
    # a non-strict fine-tune with a new head and a hook adding an entry: the body loads (before the
    # review, refused as a rename the hook could not apply)
    fine_tune = Hooked(load_edit="extra", new_head=True)
    out["fine_tune"] = _fit("zero3", tmp, fine_tune, epochs=1, ckpt=zero3_dir)
    # whole files gathered on rank 0: the other rank's save hook reads and rescales the head's entry too
    # (before, it got {} there: KeyError on rank 1, rank 0 went on alone)
    for name in ("ddp", "tp2-file"):
        _fit(name, os.path.join(tmp, "scale"), Hooked(save_edit="scale"), epochs=1)
        saved = torch.load(os.path.join(tmp, "scale", name, "last.ckpt"), weights_only=False)
        out[f"scale/{name}"] = saved["state_dict"]
    # a hook reading a weight of a directory in pieces is told why it is not there
    try:
        _fit("zero3", tmp, Hooked(load_edit="read"), epochs=1, ckpt=os.path.join(tmp, "zero3", "last.ckpt"))
        out["read"] = "no error"
    except KeyError as error:
        out["read"] = str(error)
    return out


def test_checkpoint_hooks_edits_of_the_state_dict_are_saved_and_loaded_as_under_ddp(tmp_path: Any) -> None:
    got = run_distributed(_job, 2, str(tmp_path), init_group=False, timeout=400)[0]
    ref = got["ddp"]
    assert set(ref) and all(k.startswith("model.") for k in ref)
    for name, tol in (("zero1", 0.0), ("zero3", 0.0), ("tp2", 2e-5)):
        assert set(got[name]) == set(ref), name
        for key, value in ref.items():
            torch.testing.assert_close(got[name][key], value, atol=tol, rtol=tol, msg=f"{name} {key}")
    fresh = llama(0).lm_head.weight.detach()
    for name in ("zero3", "tp2", "zero1-bf16"):
        # before: the trained head, from the records
        assert torch.equal(got[f"{name}/saved"][HEAD], torch.zeros_like(fresh)), name
    assert torch.equal(got["bf16/zero"][HEAD], torch.zeros_like(fresh))
    torch.testing.assert_close(got["bf16/drop"][HEAD], fresh)  # kept its own (fresh) value, as "ddp"
    other = "model.model.norm.weight"
    assert not torch.equal(got["bf16/drop"][other], llama(0).model.norm.weight), "the rest loaded"
    assert "on_load_checkpoint sees no parameters here" in got["rename"], got["rename"]
    assert "None of the checkpoint's" in got["rename_loose"], got["rename_loose"]
    assert "on_load_checkpoint sees no parameters here" in got["rename_loose"], got["rename_loose"]
    assert got["unhooked"].startswith("The checkpoint does not match the model"), got["unhooked"]
    assert "on_load_checkpoint" not in got["unhooked"], got["unhooked"]
    # the head the save hook wrote was visible and dropped: fresh, as under "ddp"; the rest from the pieces
    torch.testing.assert_close(got["filter"][HEAD], fresh)
    assert not torch.equal(got["filter"][other], llama(0).model.norm.weight)
    assert got["filter_warned"] and "it did not see load from the pieces as saved" in got["filter_warned"][0]
    body = {k: v for k, v in got["zero3/saved"].items() if k != HEAD}
    assert set(got["fine_tune"]) == set(body) | {"cls.weight", "cls.bias"}
    for key, value in body.items():
        torch.testing.assert_close(got["fine_tune"][key], value, rtol=0, atol=0, msg=key)
    read = got["read"]
    assert "per-rank pieces" in read and "save_distributed_checkpoint=False" in read, read
    scaled, ref_scaled = got["scale/tp2-file"], got["scale/ddp"]
    assert set(scaled) == set(ref_scaled)
    for key, value in ref_scaled.items():
        torch.testing.assert_close(scaled[key].float(), value.float(), atol=2e-5, rtol=2e-5, msg=key)


@pytest.mark.parametrize("edit", ["read", "del", "pop"])
def test_partial_state_dict_names_the_fix_for_parameters(edit: str) -> None:
    """A hook reading or removing a parameter's entry of a directory in pieces (before: del and pop
    raised a bare KeyError); a key that is no parameter's stays a plain KeyError."""
    from lightning_par.checkpoint.hook_edits import PartialStateDict

    state = PartialStateDict({"buf": torch.zeros(1)}, elsewhere=frozenset({HEAD}))
    act = {"read": lambda k: state[k], "del": lambda k: state.__delitem__(k), "pop": state.pop}[edit]
    with pytest.raises(KeyError, match="per-rank pieces"):
        act(HEAD)
    with pytest.raises(KeyError) as other:
        act("nothing")
    assert "per-rank pieces" not in str(other.value)
    assert state.pop(HEAD, None) is None and state.pop("buf") is not None and not state


@pytest.mark.parametrize("edit", ["rename", "zero", "drop"])
def test_hook_edits_are_found_by_identity_and_version(edit: str) -> None:
    from lightning_par.checkpoint.hook_edits import StateSnapshot

    state = {"old.w": torch.ones(2), "old.b": torch.ones(1), "buf": torch.zeros(1)}
    snapshot = StateSnapshot(state)
    if edit == "rename":
        state = {("new" + k[3:] if k.startswith("old") else k): v for k, v in state.items()}
        state["buf"].add_(1)  # written in place
    elif edit == "zero":
        state["old.w"] = torch.zeros(2)
    else:
        del state["old.w"]
    edits = snapshot.edits(state)
    if edit == "rename":
        assert dict(edits.renamed) == {"old.w": "new.w", "old.b": "new.b"} and edits.written == {"buf"}
        assert edits.records({"old.w": 1, "old.b": 2, "buf": 3}) == {"new.w": 1, "new.b": 2, "buf": 3}
    elif edit == "zero":
        assert edits.written == {"old.w"} and not edits.removed and not edits.renamed
    else:
        assert edits.removed == {"old.w"} and not edits.written
        assert edits.to_meta() == {"written": [], "removed": ["old.w"]}


def test_in_place_writes_into_the_other_ranks_zeros_are_explained() -> None:
    """With whole files a rank other than 0 hands the save hooks expanded zeros (rank_zero_view); a hook
    writing in place into one, or into its ``.cpu()`` (the same view), is told why and what to do (before:
    torch's bare "single memory location" error on that rank alone). The wrapper goes at restore."""
    from lightning_par import lightning_hooks
    from lightning_par.checkpoint.hook_edits import ZERO_VIEWS, rank_zero_view

    class InPlace(pl.LightningModule):
        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            copy = {k: v.detach().cpu() for k, v in checkpoint["state_dict"].items()}
            copy[HEAD].mul_(0.5)

    whole = {HEAD: torch.ones(3, 2), "b": torch.ones(2)}
    # rank 1's view: rank 0 broadcasts the shapes and dtypes
    seen = rank_zero_view({}, is_global_zero=False, broadcast=lambda _: _described(whole))
    assert {k: (v.shape, float(v.sum())) for k, v in seen.items()} == {
        HEAD: (torch.Size([3, 2]), 0.0),
        "b": (torch.Size([2]), 0.0),
    }
    module = InPlace()
    names = lightning_hooks.explain_zero_views(module, why=ZERO_VIEWS)
    with pytest.raises(RuntimeError, match="clone first"):
        module.on_save_checkpoint({"state_dict": seen})
    lightning_hooks.restore(module, names)
    assert "on_save_checkpoint" not in vars(module)
    with pytest.raises(RuntimeError, match="single memory location"):
        module.on_save_checkpoint({"state_dict": seen})


def _described(state: dict[str, Tensor]) -> dict[str, Any]:
    """What rank 0 broadcasts in rank_zero_view: each tensor's shape and dtype."""
    from lightning_par.checkpoint.hook_edits import _Shape

    return {k: _Shape(tuple(v.shape), v.dtype) for k, v in state.items()}
