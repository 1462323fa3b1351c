"""Moving a run between Lightning's ``ModelParallelStrategy`` (torch FSDP2) and ours through checkpoints, on
2 Gloo ranks, with a Hugging Face Llama trained by AdamW.

Lightning's FSDP strategies write ``torch.distributed.checkpoint`` (DCP) directories: the model's state
dict and each optimizer's state keyed by parameter name, beside a ``meta.pt`` with the loops and
callbacks. ``trainer.fit(ckpt_path=<that directory>)`` under ``HybridParallelStrategy`` resumes it at
ZeRO 0, 2 and 3; ``lightning-par-consolidate`` turns it into one Lightning file (resumed at ZeRO 0 with
its optimizer's parameters listed in another order: state follows the names). The other way, one of
our sharded checkpoints consolidated to a file resumes under ``ModelParallelStrategy``.

Reference: ``ModelParallelStrategy`` trained for 2 epochs without interruption (its checkpoint after
epoch 1 is the one resumed). Checked: final weights (``assert_close``) and the optimizer's step count.
Before this test a DCP directory was taken for one of ours (both have ``meta.pt``) and
refused as an incomplete checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.checkpoint import METADATA_KEY, consolidate
from tests.distributed import run_distributed
from tests.third_party import LoraLlama, Tokens

WORLD, EPOCHS = 2, 2  # 8 samples, 2 per rank and step: 2 steps per epoch


class ShardedLlama(LoraLlama):
    """The same module under FSDP2, as a ``ModelParallelStrategy`` user writes it."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        super().configure_model()
        assert self.model is not None
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def _fit(strategy: Any, module: pl.LightningModule, root: Path, *, epochs: int, ckpt: Any = None) -> Any:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_epochs=epochs,
        default_root_dir=root,
        callbacks=[ModelCheckpoint(dirpath=root / "ckpt", filename="{epoch}", save_top_k=-1)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(Tokens(8), batch_size=2), ckpt_path=ckpt)
    return trainer


def _steps(trainer: pl.Trainer) -> set[float]:
    return {float(s["step"]) for s in trainer.optimizers[0].state.values()}


def _fsdp_state(module: pl.LightningModule) -> dict[str, Tensor]:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.clone() for k, v in get_model_state_dict(module, options=options).items()}


def _ours(trainer: pl.Trainer) -> dict[str, Tensor]:
    strategy = trainer.strategy
    assert isinstance(strategy, HybridParallelStrategy)
    state = {k: v.clone() for k, v in strategy.consolidated_state_dict().items()}
    strategy.destroy_process_groups()
    return state


def _listed_backwards(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The same checkpoint as if the optimizer had been given the parameters in reverse order (a
    ``configure_optimizers`` that lists them so): numbered backwards, with the names recorded in that
    order. Loaded by position the state would land on the wrong parameters."""
    state = checkpoint["optimizer_states"][0]
    names = checkpoint[METADATA_KEY]["optimizers"][0]["param_names"]
    last = len(state["param_groups"][0]["params"]) - 1
    state["state"] = {last - i: s for i, s in state["state"].items()}
    names[0] = names[0][::-1]
    return checkpoint


def _runs(rank: int, world: int, root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    base = Path(root)
    out: dict[str, Any] = {}
    # the reference: FSDP2 through Lightning, 2 epochs, a DCP checkpoint after each
    trainer = _fit(
        ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1),
        ShardedLlama(lora=False),
        base / "fsdp",
        epochs=EPOCHS,
    )
    out["fsdp"] = _fsdp_state(trainer.lightning_module)
    out["fsdp_steps"] = _steps(trainer)
    dcp_dir = base / "fsdp" / "ckpt" / "epoch=0.ckpt"
    out["dcp_files"] = sorted(os.listdir(dcp_dir))
    # FSDP2's checkpoint resumed by ours: the directory at ZeRO 2 and 3, consolidated to one file at 0
    converted = base / "fsdp.ckpt"
    if rank == 0:
        torch.save(_listed_backwards(consolidate(dcp_dir)), converted)
    for stage in (0, 2, 3):
        strategy = HybridParallelStrategy(zero_stage=stage)
        source = converted if stage == 0 else dcp_dir
        trainer = _fit(strategy, LoraLlama(lora=False), base / f"z{stage}", epochs=EPOCHS, ckpt=source)
        out[f"z{stage}_steps"] = _steps(trainer)
        out[f"z{stage}"] = _ours(trainer)
    # ours back to FSDP2: a ZeRO-3 checkpoint of epoch 1, consolidated to one file
    strategy = HybridParallelStrategy(zero_stage=3, meta_init=False)  # the module's own initial weights
    trainer = _fit(strategy, LoraLlama(lora=False), base / "ours", epochs=1)
    strategy.destroy_process_groups()
    single = base / "ours.ckpt"
    if rank == 0:
        torch.save(consolidate(base / "ours" / "ckpt" / "epoch=0.ckpt"), single)

    # (rank 1 reads it after ModelParallelStrategy's setup, which waits for rank 0)
    trainer = _fit(
        ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1),
        ShardedLlama(lora=False),
        base / "back",
        epochs=EPOCHS,
        ckpt=single,
    )
    out["back"] = _fsdp_state(trainer.lightning_module)
    out["back_steps"] = _steps(trainer)
    return out


def test_fsdp_checkpoints_resume_under_ours_and_back(tmp_path: Path) -> None:
    ranks = run_distributed(_runs, WORLD, str(tmp_path), init_group=False, timeout=300)
    steps = {float(EPOCHS * 2)}
    first = ranks[0]
    assert {".metadata", "meta.pt"} <= set(first["dcp_files"]), first["dcp_files"]
    reference = first["fsdp"]
    assert first["fsdp_steps"] == steps
    for r, out in enumerate(ranks):
        for key in ("z0", "z2", "z3"):
            assert out[f"{key}_steps"] == steps, f"rank {r} {key}: steps {out[key + '_steps']}"
        assert out["back_steps"] == steps, f"rank {r}: FSDP2 resumed from ours: steps {out['back_steps']}"
    # whole states on rank 0 (FSDP2's full state dict with cpu_offload, and our consolidation, land there)
    assert len(reference) == 21, sorted(reference)
    for key in ("z0", "z2", "z3", "back"):
        assert first[key].keys() == reference.keys(), key
        for name, value in reference.items():
            torch.testing.assert_close(first[key][name], value, msg=f"{key}: {name}")


# ---------------------------------------------------------------------------------------------- Fabric
def _fabric_steps(fabric: Any, model: Any, optimizer: Any, steps: range) -> None:
    """A plain Fabric loop on this rank's half of fixed token batches."""
    data = torch.randint(0, 64, (4, 2 * WORLD, 17), generator=torch.Generator().manual_seed(5))
    rank = fabric.global_rank
    for step in steps:
        batch = data[step, 2 * rank : 2 * rank + 2]
        logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def _fabric_runs(rank: int, world: int, root: str) -> dict[str, Any]:
    """``fabric.save`` under Fabric's ``ModelParallelStrategy`` after 2 of 4 steps; ``fabric.load`` of that
    directory under our Fabric strategy at ZeRO 1 and 3, then the last 2 steps."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel
    from torch.distributed.fsdp import fully_shard

    from lightning_par.fabric import HybridParallelStrategy as FabricHybrid
    from tests.third_party import llama

    torch.set_num_threads(1)
    directory = str(Path(root) / "fabric_fsdp")

    def shard(model: Any, mesh: Any) -> Any:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["data_parallel"])
        return fully_shard(model, mesh=mesh["data_parallel"])

    out: dict[str, Any] = {}
    strategy: Any = FabricModelParallel(shard, data_parallel_size=WORLD, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(llama())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    _fabric_steps(fabric, model, optimizer, range(2))
    fabric.save(directory, {"model": model, "optimizer": optimizer, "step": 2})
    _fabric_steps(fabric, model, optimizer, range(2, 4))
    out["fsdp"] = _fsdp_state(model)
    for stage in (1, 3):
        ours = FabricHybrid(zero_stage=stage)
        fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=ours)
        fabric.launch()
        with fabric.init_module(empty_init=True):
            net = llama(seed=1)  # other initial weights: the checkpoint's must replace them
        model = fabric.setup_module(net)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
        state = {"model": model, "optimizer": optimizer, "step": 0}
        rest = fabric.load(directory, state)
        out[f"z{stage}_loaded"] = (state["step"], rest)
        _fabric_steps(fabric, model, optimizer, range(2, 4))
        full = ours.consolidated_state_dict()
        out[f"z{stage}"] = {k: v.clone() for k, v in full.items()}
        ours.destroy_process_groups()
    return out


def test_fabric_fsdp_checkpoint_loads_under_ours(tmp_path: Path) -> None:
    ranks = run_distributed(_fabric_runs, WORLD, str(tmp_path), init_group=False, timeout=300)
    first = ranks[0]
    reference = first["fsdp"]
    assert len(reference) > 10, sorted(reference)
    for r, out in enumerate(ranks):
        for stage in (1, 3):
            assert out[f"z{stage}_loaded"] == (2, {}), f"rank {r} ZeRO-{stage}: {out[f'z{stage}_loaded']}"
    for stage in (1, 3):
        assert first[f"z{stage}"].keys() == reference.keys(), stage
        for name, value in reference.items():
            torch.testing.assert_close(first[f"z{stage}"][name], value, msg=f"Fabric ZeRO-{stage}: {name}")


# ------------------------------------------------------------------------------------- format and errors
def _dcp_directory(path: Path, *, model_entry: str = "state_dict") -> tuple[Any, Any]:
    """A DCP checkpoint in the layout of Lightning's FSDP strategies, written by one process: a Llama after
    one AdamW step (two param groups, so numbering across groups matters), state keyed by name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from tests.third_party import llama

    model = llama()
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    rest = [p for n, p in model.named_parameters() if "norm" in n]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
    model(input_ids=torch.arange(8).view(1, 8)).logits.sum().backward()
    optimizer.step()
    entries = {model_entry: model.state_dict(), "optimizer_0": get_optimizer_state_dict(model, optimizer)}
    dcp.save(entries, checkpoint_id=path, no_dist=True)
    torch.save({"epoch": 3, "global_step": 7, "hyper_parameters": {"lr": 1e-2}}, path / "meta.pt")
    return model, optimizer


def test_dcp_directory_reads_as_a_lightning_checkpoint(tmp_path: Path) -> None:
    from lightning_par.checkpoint.consolidate_cli import main

    directory = tmp_path / "fsdp.ckpt"
    model, optimizer = _dcp_directory(directory, model_entry="model")  # FSDPStrategy's entry name
    checkpoint = consolidate(directory)
    assert (checkpoint["epoch"], checkpoint["global_step"], checkpoint["hyper_parameters"]) == (
        3,
        7,
        {"lr": 1e-2},
    )
    torch.testing.assert_close(checkpoint["state_dict"], model.state_dict())
    # the optimizer state is torch's own state_dict() of the same optimizer, numbered in group order
    torch.testing.assert_close(checkpoint["optimizer_states"], [optimizer.state_dict()])
    names = [
        [n for n, p in model.named_parameters() if any(p is q for q in g["params"])]
        for g in optimizer.param_groups
    ]
    assert checkpoint[METADATA_KEY]["optimizers"] == [{"param_names": names}]
    # the command-line tool takes the directory too
    assert main([str(directory), str(tmp_path / "one.ckpt")]) == 0
    written = torch.load(tmp_path / "one.ckpt", weights_only=False)
    torch.testing.assert_close(written["optimizer_states"], [optimizer.state_dict()])


def test_damaged_dcp_directories_are_refused_with_the_fix(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from lightning_par.checkpoint.dcp_import import read_dcp_checkpoint

    directory = tmp_path / "fsdp.ckpt"
    _dcp_directory(directory)
    for piece in directory.glob("*.distcp"):
        piece.unlink()
    with pytest.raises(ValueError, match=r"__0_0.distcp.*missing or damaged.*copy the whole directory again"):
        read_dcp_checkpoint(directory)
    other = tmp_path / "fabric.ckpt"
    dcp.save({"weights": {"w": torch.ones(2)}}, checkpoint_id=other, no_dist=True)
    with pytest.raises(ValueError, match=r"without a model entry.*fabric.load"):
        read_dcp_checkpoint(other)
