"""Checkpoint paths and files that are not what the run needs, named before anything loads (each found by a
probe of bad input; 2 Gloo ranks, one job).

* A directory that holds no checkpoint of a known kind (a run pointed at its ``checkpoints/`` folder):
  ``fit(ckpt_path=...)`` at ZeRO-2 and ``fabric.load`` said ``IsADirectoryError``; the Hydra command
  failed so after every rank had started. Now refused naming the checkpoints the folder holds.
* A legacy (pre-zip) torch file: torch's memory-mapped load refused it telling the user to re-save it
  with the zip format; now it is read as Lightning reads it, and resumes as the zip file does.
* A plain Lightning checkpoint (``"ddp"``'s) of a model of another size: before, ZeRO-1 failed with a bare
  ``KeyError`` and ZeRO-3 blamed the optimizer ("An optimizer param group holds 19 parameters in the
  checkpoint and 27 in the model"); a wider one raised torch's size mismatch. Now refused as our own
  formats are, naming the missing parameters and shapes and the fix.
* ``fabric.load`` of a Trainer's file: named as such, with the way to load its weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from omegaconf import OmegaConf
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.fabric import HybridParallelStrategy as FabricHybridParallelStrategy
from lightning_par.train_checks import ConfigError, check_ckpt_override
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state
from tests.third_party import LLAMA, Tokens, hf_model


class SizedLlama(pl.LightningModule):
    def __init__(self, **config: Any) -> None:
        super().__init__()
        self.model = hf_model("LlamaForCausalLM", "LlamaConfig", **(LLAMA | config))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(strategy: Any, *, steps: int, ckpt_path: Path | None = None, **config: Any) -> SizedLlama:
    torch.manual_seed(0)
    module = SizedLlama(**config)
    trainer = cpu_trainer(strategy, max_steps=steps, limit_val_batches=0)
    trainer.fit(module, DataLoader(Tokens(16), batch_size=2), ckpt_path=ckpt_path)
    return module


def _refused(strategy: Any, ckpt_path: Path, **config: Any) -> str:
    with pytest.raises(ValueError) as info:
        _fit(strategy, steps=4, ckpt_path=ckpt_path, **config)
    if isinstance(strategy, HybridParallelStrategy):
        strategy.destroy_process_groups()
    return str(info.value)


def _job(rank: int, world: int, root: str) -> dict[str, Any]:
    tmp = Path(root)
    out: dict[str, Any] = {}
    ddp = _fit("ddp", steps=2)
    saved = tmp / "ddp.ckpt"
    ddp.trainer.save_checkpoint(saved)
    folder = tmp / "checkpoints"
    if rank == 0:
        folder.mkdir()
        (folder / "empty").mkdir()
        (folder / "epoch=0-step=2.ckpt").write_bytes(saved.read_bytes())
        # the same checkpoint in torch's legacy (non-zip) format
        torch.save(
            torch.load(saved, weights_only=False), tmp / "legacy.ckpt", _use_new_zipfile_serialization=False
        )
    torch.distributed.barrier()
    out["folder"] = _refused(HybridParallelStrategy(zero_stage=2), folder)
    out["empty"] = _refused(HybridParallelStrategy(zero_stage=2), folder / "empty")
    for name, path in (("zip", saved), ("legacy", tmp / "legacy.ckpt")):
        strategy = HybridParallelStrategy(zero_stage=2)
        out[name] = final_state(_fit(strategy, steps=4, ckpt_path=path), strategy)
    # a model of another size (one layer more; wider) from "ddp"'s file
    out["deeper_z3"] = _refused(
        HybridParallelStrategy(zero_stage=3, meta_init=False), saved, num_hidden_layers=3
    )
    out["deeper_z1"] = _refused(HybridParallelStrategy(zero_stage=1), saved, num_hidden_layers=3)
    out["wider_z2"] = _refused(HybridParallelStrategy(zero_stage=2), saved, intermediate_size=96)
    # ZeRO-3 writes a directory; a single file saved later under its name (save_distributed_checkpoint=False
    # in the same dirpath) is swapped in (before, fsspec moved it inside the directory: lost, silently)
    sharded = HybridParallelStrategy(zero_stage=3, meta_init=False)
    first = _fit(sharded, steps=2)
    target, link = tmp / "last.ckpt", tmp / "link.ckpt"
    first.trainer.save_checkpoint(target)
    single = HybridParallelStrategy(zero_stage=3, meta_init=False, save_distributed_checkpoint=False)
    _fit(single, steps=4).trainer.save_checkpoint(target)
    single.destroy_process_groups()
    out["file_over_dir"] = target.is_file() and torch.load(target, weights_only=False)["global_step"]
    # a link to a checkpoint directory (ModelCheckpoint(save_last="link")) is removed, not its target's tree
    first.trainer.save_checkpoint(tmp / "dir.ckpt")
    if rank == 0:
        link.symlink_to(tmp / "dir.ckpt")
    torch.distributed.barrier()
    sharded.remove_checkpoint(link)
    torch.distributed.barrier()
    out["link"] = (link.is_symlink(), (tmp / "dir.ckpt" / "meta.pt").is_file())
    # a directory cannot go to another fsspec filesystem (before, a local folder named "memory:")
    with pytest.raises(ValueError) as remote:
        first.trainer.save_checkpoint("memory://bucket/run.ckpt")
    out["remote"] = (str(remote.value), Path("memory:").exists())
    sharded.destroy_process_groups()
    # Fabric, the folder
    strategy = FabricHybridParallelStrategy(zero_stage=2)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    raw = SizedLlama().model
    model, optimizer = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=0.1))
    with pytest.raises(ValueError) as fabric_folder:
        fabric.load(folder, {"model": model, "optimizer": optimizer})
    out["fabric"] = str(fabric_folder.value)
    # a Trainer's file, whose weights sit under "state_dict" with the LightningModule's prefix (before:
    # "The checkpoint's state_dict lacks [every name]", as if the model differed)
    with pytest.raises(ValueError) as trainer_file:
        fabric.load(saved, {"model": model, "optimizer": optimizer})
    out["fabric_trainer_file"] = str(trainer_file.value)
    strategy.destroy_process_groups()
    return out


def test_checkpoint_paths_and_files_that_do_not_fit_are_named(tmp_path: Path) -> None:
    r = run_distributed(_job, 2, str(tmp_path), init_group=False, timeout=400)[0]
    assert "is a directory, not a checkpoint" in r["folder"] and "It holds epoch=0-step=2.ckpt" in r["folder"]
    assert "None is in it" in r["empty"]
    assert "is a directory, not a checkpoint" in r["fabric"] and "epoch=0-step=2.ckpt" in r["fabric"]
    assert "is a Lightning Trainer checkpoint" in r["fabric_trainer_file"]
    assert "fabric.load_raw(path, model)" in r["fabric_trainer_file"]
    torch.testing.assert_close(r["legacy"], r["zip"], rtol=0, atol=0)
    for name in ("deeper_z3", "deeper_z1"):
        assert "does not match the model (missing in the checkpoint: ['model.model.layers.2." in r[name], r[
            name
        ]
        assert "strict_loading = False" in r[name]
    assert (
        "different shapes" in r["wider_z2"] and "model.model.layers.0.mlp.down_proj.weight" in r["wider_z2"]
    )
    assert r["file_over_dir"] == 4 and r["link"] == (False, True), (r["file_over_dir"], r["link"])
    message, local_folder = r["remote"]
    assert "go to a local or mounted path only" in message and "save_distributed_checkpoint=False" in message
    assert not local_folder
    # the command line refuses the folder before any process starts
    (tmp_path / "runs").mkdir()
    with pytest.raises(ConfigError) as info:
        check_ckpt_override(OmegaConf.create({"ckpt_path": str(tmp_path / "runs")}))
    assert info.value.group == "ckpt_path" and "is a directory, not a checkpoint" in info.value.message
