"""WeightSource (lazy full-state-dict reader) and match_names against a tiny Hugging Face Llama."""

from __future__ import annotations

import re
import shutil
import struct
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn

from lightning_par.checkpoint.pretrained import HF_FILES, WeightSource, match_names
from tests.third_party import llama

Saved = tuple[dict[str, Tensor], dict[str, Path]]  # the reference state dict, the files saved from it


def _llama() -> Any:
    return llama(0)


class HParams:
    """Stands for the arbitrary objects a Lightning checkpoint pickles next to its state dict."""

    lr = 0.1


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    root = tmp_path_factory.mktemp("pretrained")
    model = _llama()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.save_pretrained(root / "hf")
    model.save_pretrained(root / "hf_sharded", max_shard_size="20KB")
    torch.save(sd, root / "sd.pt")
    torch.save({"state_dict": sd, "hyper_parameters": HParams(), "epoch": 3}, root / "lightning.ckpt")
    (root / "bin").mkdir()
    torch.save(sd, root / "bin" / "pytorch_model.bin")
    # torch.distributed.checkpoint directories as Lightning's ModelParallelStrategy (model under
    # "state_dict"), Fabric's FSDP strategies (under the user's key "model", beside an optimizer) and
    # torchtitan (the tensors at the top level, beside a train state) write them
    optimizer = {"state": {}, "param_groups": [{"lr": 0.1, "params": sorted(sd)}]}
    for name, entries in (
        ("dcp_lightning", {"state_dict": sd, "optimizer_0": optimizer}),
        ("dcp_fabric", {"model": sd, "optimizer": optimizer, "step": 3}),
        ("dcp_flat", {**sd, "train_state": {"step": 3}}),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
            dcp.save(entries, checkpoint_id=root / name, no_dist=True)
    paths = {
        "hf_dir": root / "hf",
        "safetensors_file": root / "hf" / "model.safetensors",
        "sharded_dir": root / "hf_sharded",
        "index_file": root / "hf_sharded" / "model.safetensors.index.json",
        "torch_file": root / "sd.pt",
        "lightning_ckpt": root / "lightning.ckpt",
        "bin_dir": root / "bin",
        **{name: root / name for name in ("dcp_lightning", "dcp_fabric", "dcp_flat")},
    }
    return sd, paths


FORMATS = [
    "hf_dir",
    "safetensors_file",
    "sharded_dir",
    "index_file",
    "torch_file",
    "lightning_ckpt",
    "bin_dir",
    "dcp_lightning",
    "dcp_fabric",
    "dcp_flat",
]


def _open(saved: Saved, fmt: str, prefix: str = "") -> WeightSource:
    sd, paths = saved
    return WeightSource.open(sd if fmt == "mapping" else paths[fmt], prefix=prefix)


@pytest.mark.parametrize("fmt", [*FORMATS, "mapping"])
def test_reads_every_format_like_the_state_dict(saved: Saved, fmt: str) -> None:
    sd, _ = saved
    with _open(saved, fmt) as src:
        assert sorted(src.keys()) == sorted(sd)
        for name, ref in sd.items():
            assert src.shape(name) == tuple(ref.shape)
            assert src.dtype(name) == ref.dtype
            torch.testing.assert_close(src.get(name), ref, rtol=0, atol=0)
            for dim in range(ref.dim()):
                for parts in (1, 2):
                    chunks = torch.chunk(ref, parts, dim)
                    for index in range(parts):
                        got = src.get_slice(name, dim=dim, index=index, parts=parts)
                        assert got.is_contiguous() and got.device.type == "cpu"
                        torch.testing.assert_close(got, chunks[index], rtol=0, atol=0)
        name = "model.layers.0.self_attn.q_proj.weight"
        torch.testing.assert_close(
            src.get_slice(name, dim=-1, index=3, parts=4), torch.chunk(sd[name], 4, 1)[3]
        )


@pytest.mark.parametrize("fmt", ["safetensors_file", "torch_file", "dcp_lightning", "mapping"])
def test_results_own_their_memory(saved: Saved, fmt: str) -> None:
    # safetensors and mmap'd torch files hand out views of one shared mapping; an in-place update of one
    # result must not show up in the next read
    sd, _ = saved
    name = "model.norm.weight"
    with _open(saved, fmt) as src:
        src.get(name).add_(1.0)
        src.get_slice(name, dim=0, index=0, parts=2).add_(1.0)
        torch.testing.assert_close(src.get(name), sd[name], rtol=0, atol=0)
    assert sd[name].eq(1).all()


def test_prefix_maps_the_names(saved: Saved) -> None:
    sd, _ = saved
    with _open(saved, "hf_dir", prefix="model.") as src:
        assert sorted(src.keys()) == sorted("model." + k for k in sd)
        torch.testing.assert_close(src.get("model.lm_head.weight"), sd["lm_head.weight"])
        with pytest.raises(KeyError, match=r"not in .*close names: model\.lm_head\.weight"):
            src.get("lm_head.weight")


def test_sharded_checkpoint_opens_shards_lazily(saved: Saved) -> None:
    _, paths = saved
    shards = sorted(paths["sharded_dir"].glob("model-*.safetensors"))
    assert len(shards) > 2
    with _open(saved, "sharded_dir") as src:
        assert src._handles == {}
        src.get("model.norm.weight")
        assert len(src._handles) == 1
    assert src._handles == {}


def test_closed_source_refuses_reads(saved: Saved) -> None:
    src = _open(saved, "torch_file")
    src.close()
    with pytest.raises(ValueError, match="is closed"):
        src.get("model.norm.weight")


def test_match_names_wrapper_prefix_added_and_stripped(saved: Saved) -> None:
    sd, _ = saved

    class Wrapper(nn.Module):  # a LightningModule holding self.model = LlamaForCausalLM(...)
        def __init__(self) -> None:
            super().__init__()
            self.model = _llama()

    model_keys = list(Wrapper().state_dict())
    mapping = match_names(sd, model_keys)
    assert mapping == {"model." + k: k for k in sd}
    assert list(mapping) == model_keys  # in model order
    # a wrapper's checkpoint loaded into the bare model
    assert match_names(model_keys, sd) == {k: "model." + k for k in sd}
    assert match_names(sd, sd) == {k: k for k in sd}
    assert match_names(sd, ["something.else"]) == {}


def test_match_names_peft_lora(saved: Saved) -> None:
    import peft

    sd, _ = saved
    lora = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model_sd = lora.state_dict()
    mapping = match_names(sd, model_sd)
    adapters = [k for k in model_sd if "lora_A" in k or "lora_B" in k]
    base = [k for k in model_sd if k not in adapters]
    assert len(adapters) == 2 * 2 * 2 and len(base) == len(sd)
    assert sorted(mapping) == sorted(base)
    assert sorted(mapping.values()) == sorted(sd)
    q = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert mapping[q] == "model.layers.0.self_attn.q_proj.weight"
    # and back: a PEFT model's full state dict loaded into the bare model
    back = match_names(model_sd, sd)
    assert back["model.layers.0.self_attn.q_proj.weight"] == q and len(back) == len(sd)
    with _open(saved, "sharded_dir") as src:
        for m, f in mapping.items():
            torch.testing.assert_close(src.get(f), model_sd[m], rtol=0, atol=0)


def test_match_names_peft_modules_to_save(saved: Saved) -> None:
    """``modules_to_save``: the frozen original and the trainable copy both start from the base model's
    weight (before, neither matched, and pretrained= refused the right file as another architecture)."""
    import peft

    sd, _ = saved
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    model_sd = peft.get_peft_model(_llama(), config).state_dict()
    mapping = match_names(sd, model_sd)
    head = "base_model.model.lm_head"
    assert mapping[f"{head}.original_module.weight"] == "lm_head.weight"
    assert mapping[f"{head}.modules_to_save.default.weight"] == "lm_head.weight"
    assert sorted(set(mapping.values())) == sorted(sd)


def test_check_against(saved: Saved) -> None:
    sd, _ = saved
    expected = {k: tuple(v.shape) for k, v in sd.items()}
    with _open(saved, "hf_dir") as src:
        src.check_against(expected)
        bad = dict(expected)
        del bad["lm_head.weight"]
        bad["model.layers.0.mlp.up_proj.weight"] = (32, 32)
        bad["extra.weight"] = (4,)
        with pytest.raises(ValueError) as err:
            src.check_against(bad)
        msg = str(err.value)
        assert "1 missing from the file: extra.weight" in msg
        assert "1 unexpected in the file: lm_head.weight" in msg
        assert "model.layers.0.mlp.up_proj.weight: file (64, 32) vs model (32, 32)" in msg
        assert "prefix=" in msg
        with pytest.raises(ValueError, match="missing") as err:
            src.check_against(bad, strict=False)
        assert "unexpected" not in str(err.value)
        src.check_against({k: s for k, s in expected.items() if k != "lm_head.weight"}, strict=False)
    with (
        _open(saved, "hf_dir", prefix="x.") as src,
        pytest.raises(ValueError, match=r"21 missing.*\.\.\. \(13 more"),
    ):
        src.check_against(expected)


def test_slice_errors_and_unknown_names(saved: Saved) -> None:
    with _open(saved, "safetensors_file") as src:
        with pytest.raises(ValueError, match="not divisible into 3 equal parts"):
            src.get_slice("model.norm.weight", dim=0, index=0, parts=3)
        with pytest.raises(ValueError, match="dim 1 is out of range"):
            src.get_slice("model.norm.weight", dim=1, index=0, parts=2)
        with pytest.raises(ValueError, match="index 2 of 2 parts"):
            src.get_slice("model.norm.weight", dim=0, index=2, parts=2)
        with pytest.raises(
            KeyError, match=r"'model\.norm\.weigth' is not in .*close names: model\.norm\.weight,"
        ):
            src.get("model.norm.weigth")
        with pytest.raises(KeyError, match="nothing_like_it"):
            src.shape("nothing_like_it")


def _copy(src: Path, dst: Path, edit: Callable[[bytes], bytes]) -> Path:
    dst.write_bytes(edit(src.read_bytes()))
    return dst


def test_corrupt_safetensors(saved: Saved, tmp_path: Path) -> None:
    _, paths = saved
    st = paths["safetensors_file"]
    (n,) = struct.unpack("<Q", st.read_bytes()[:8])
    truncated = _copy(st, tmp_path / "cut.safetensors", lambda b: b[:-10])
    with pytest.raises(
        ValueError, match=r"cut\.safetensors \(\d+ bytes\) is truncated or corrupt.*re-download"
    ):
        WeightSource.open(truncated)
    huge = _copy(st, tmp_path / "len.safetensors", lambda b: struct.pack("<Q", 1 << 40) + b[8:])
    with pytest.raises(ValueError, match=r"len\.safetensors .*header length says \d+ bytes"):
        WeightSource.open(huge)
    garbled = _copy(st, tmp_path / "json.safetensors", lambda b: b[:8] + b"#" * n + b[8 + n :])
    with pytest.raises(ValueError, match=r"json\.safetensors .*header is not valid"):
        WeightSource.open(garbled)
    short = _copy(st, tmp_path / "short.safetensors", lambda b: b[:5])
    with pytest.raises(ValueError, match="shorter than the 8-byte header length"):
        WeightSource.open(short)
    padded = _copy(st, tmp_path / "pad.safetensors", lambda b: b + b"\0" * 4)
    with pytest.raises(ValueError, match="trailing bytes"):
        WeightSource.open(padded)


@pytest.mark.parametrize("keep", [slice(None, -1), slice(None, -1000), slice(None, 100)])
def test_truncated_torch_file(saved: Saved, tmp_path: Path, keep: slice) -> None:
    _, paths = saved
    bad = _copy(paths["torch_file"], tmp_path / "cut.pt", lambda b: b[keep])
    with pytest.raises(ValueError, match=r"torch file .*cut\.pt \(\d+ bytes\) is truncated, corrupt"):
        WeightSource.open(bad)


def test_missing_paths_and_shards(saved: Saved, tmp_path: Path) -> None:
    _, paths = saved
    with pytest.raises(
        FileNotFoundError, match=r"no such file or directory: .*nope.*save_pretrained directory"
    ):
        WeightSource.open(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=re.escape("looked for " + ", ".join(HF_FILES))):
        WeightSource.open(tmp_path / "empty")
    broken = tmp_path / "broken"
    shutil.copytree(paths["sharded_dir"], broken)
    (broken / "model-00002-of-00006.safetensors").unlink()
    message = (
        r"1 shard file\(s\) named by .*model\.safetensors\.index\.json .*: model-00002-of-00006\.safetensors"
    )
    with pytest.raises(FileNotFoundError, match=message):
        WeightSource.open(broken)
    with pytest.raises(FileNotFoundError, match=message):
        WeightSource.open(broken / "model.safetensors.index.json")


def test_damaged_dcp_directory_names_the_fix(saved: Saved, tmp_path: Path) -> None:
    _, paths = saved
    copy = tmp_path / "dcp"
    shutil.copytree(paths["dcp_lightning"], copy)
    for piece in copy.glob("*.distcp"):
        piece.unlink()
    # the index alone opens; the first read names the problem
    with (
        WeightSource.open(copy) as src,
        pytest.raises(ValueError, match=r"model\.norm\.weight.*missing or damaged.*copy the whole"),
    ):
        src.get("model.norm.weight")
