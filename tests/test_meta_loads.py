"""Weights loaded inside ``configure_model()`` under meta init (ZeRO-3), on 2 Gloo ranks, with a Hugging
Face Llama: ``model.load_state_dict(torch.load(...))`` (and with ``assign=True``), ``param.data.copy_(x)``
for every parameter, and PEFT's ``PeftModel.from_pretrained(base, adapter_dir)``.

Under meta init the parameters ``configure_model()`` creates are meta tensors, and a load into them kept
nothing: the engine initialised them afresh, silently (the Llama 0.13 from its file, a LoRA adapter 0.33
from its file, measured). Now the strategy records such loads and writes them into the shards as it
writes ``pretrained=`` weights. Checked: at ZeRO-3 dp 2 and at ZeRO-3 x tp 2 the consolidated weights
are the file's exactly, and two SGD steps from them equal ``"ddp"`` loading the same file on a real
model; the adapters of ``PeftModel.from_pretrained`` are the saved ones; transformers' ``from_pretrained``
with ``use_kernels=False`` gives the file's weights. Refused with the fix: transformers' ``from_pretrained``
with its default hub kernels inside ``configure_model()`` (it cannot fit them to meta tensors; before,
its own error named an "Unsupported device type 'meta'" only), and a load in ``configure_model()``
together with ``pretrained=``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state, fit_refused
from tests.third_party import LoraLlama, Tokens, add_lora, llama


class LoadsInConfigure(LoraLlama):
    """``configure_model()`` builds the model, then loads weights into it the way the user's code does."""

    def __init__(self, root: str, how: str) -> None:
        super().__init__(lr=0.5, lora=False)
        self.root, self.how = root, how

    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self.how == "adapters":
            from peft import PeftModel

            self.model = PeftModel.from_pretrained(llama(0), self.root, is_trainable=True)
        elif self.how in ("from_pretrained", "from_pretrained_no_kernels"):
            import transformers

            # transformers 5 ends by fitting hub kernels to the (meta) device unless told not to
            kernels = {"use_kernels": False} if self.how == "from_pretrained_no_kernels" else {}
            self.model = transformers.LlamaForCausalLM.from_pretrained(self.root, **kernels)
        else:
            model = llama(5)  # other initial weights: the file's replace them
            state = torch.load(Path(self.root) / "llama.pt")
            if self.how == "data_copy":  # the classic way to put pretrained vectors into a layer
                with torch.no_grad():
                    for name, param in model.named_parameters():
                        param.data.copy_(state[name])
            else:
                model.load_state_dict(state, assign=self.how == "assign")
            self.model = model

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"])


def _fit(strategy: Any, root: str, how: str, steps: int) -> dict[str, Tensor]:
    module = LoadsInConfigure(root, how)
    with warnings.catch_warnings():
        # torch's "copying ... to a meta parameter ..., which is a no-op" would be wrong here: not shown
        warnings.filterwarnings("error", message=r"for .*: copying from a non-meta parameter")
        cpu_trainer(strategy, max_steps=steps).fit(module, DataLoader(Tokens(8), batch_size=2))
    return final_state(module, strategy)


def _runs(rank: int, world: int, root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {
        "ddp_0": _fit("ddp", root, "load", 0),
        "ddp_2": _fit("ddp", root, "load", 2),
        "z3_0": _fit(HybridParallelStrategy(zero_stage=3), root, "load", 0),
        "z3_2": _fit(HybridParallelStrategy(zero_stage=3), root, "load", 2),
        "z3_assign": _fit(HybridParallelStrategy(zero_stage=3), root, "assign", 0),
        "z3_data_copy": _fit(HybridParallelStrategy(zero_stage=3), root, "data_copy", 0),
        "z3_tp2": _fit(
            HybridParallelStrategy(zero_stage=3, tensor_parallel_size=2, tp_plan="llama"), root, "load", 0
        ),
        "z3_adapters": _fit(
            HybridParallelStrategy(zero_stage=3), str(Path(root) / "adapters"), "adapters", 0
        ),
        "z3_from_pretrained": _fit(
            HybridParallelStrategy(zero_stage=3), str(Path(root) / "hf"), "from_pretrained_no_kernels", 0
        ),
    }
    for name, strategy, how in (
        ("from_pretrained", HybridParallelStrategy(zero_stage=3), "from_pretrained"),
        ("both", HybridParallelStrategy(zero_stage=3, pretrained=Path(root) / "llama.pt"), "load"),
    ):
        module = LoadsInConfigure(str(Path(root) / "hf") if how == "from_pretrained" else root, how)
        trainer = cpu_trainer(strategy, max_steps=1)
        try:
            out[name] = fit_refused(trainer, module, strategy)
        except ValueError as error:
            strategy.destroy_process_groups()
            out[name] = str(error)
    return out


def test_weights_loaded_in_configure_model_reach_the_shards(tmp_path: Path) -> None:
    source = llama(0)
    torch.save(source.state_dict(), tmp_path / "llama.pt")
    source.save_pretrained(tmp_path / "hf")
    adapters = add_lora(llama(0))
    adapters.save_pretrained(tmp_path / "adapters")
    saved_adapters = {k: v.clone() for k, v in adapters.state_dict().items() if "lora_" in k}
    ranks = run_distributed(_runs, 2, str(tmp_path), init_group=False, timeout=600)
    first = ranks[0]
    file = {"model." + k: v for k, v in source.state_dict().items()}
    for name in ("ddp_0", "z3_0", "z3_assign", "z3_data_copy", "z3_tp2", "z3_from_pretrained"):
        assert first[name].keys() == file.keys(), name
        for key, value in file.items():
            torch.testing.assert_close(first[name][key], value, rtol=0, atol=0, msg=f"{name}: {key}")
    for key, value in first["ddp_2"].items():
        torch.testing.assert_close(first["z3_2"][key], value, msg=f"2 steps: {key}")
    got = first["z3_adapters"]
    assert len(saved_adapters) == 16
    for key, value in saved_adapters.items():
        torch.testing.assert_close(got["model." + key], value, rtol=0, atol=0, msg=f"adapters: {key}")
    for r, out in enumerate(ranks):
        assert "Unsupported device type 'meta'" in out["from_pretrained"], (r, out["from_pretrained"])
        assert "pretrained=PATH" in out["from_pretrained"] and "meta_init=False" in out["from_pretrained"]
        assert "use_kernels=False" in out["from_pretrained"], out["from_pretrained"]
        assert "loaded values into" in out["both"] and "give the weights one way" in out["both"], out["both"]
