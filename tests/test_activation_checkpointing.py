"""``activation_checkpointing=True`` on a Hugging Face Llama called as users call it, on 2 Gloo ranks.

A ``training_step`` that calls ``self.model(input_ids=x)`` leaves the config's ``use_cache=True``: the
model hands each decoder layer a ``DynamicCache``. Our checkpointed layer passed it through, the
recomputation in backward appended the layer's keys and values a second time, and the backward failed
("The size of tensor a (32) must match the size of tensor b (16)"). Training without checkpointing, and
Hugging Face's own gradient checkpointing under ``"ddp"``, run. Now the wrapper calls the layer without the
cache while training with gradients on, as Hugging Face's checkpointing does.

Checked at ZeRO 0 and 3: the run with checkpointing equals the run without it (final weights and losses),
and the layers were recomputed (each MLP ran twice per step).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.testing import assert_close
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state
from tests.third_party import Tokens, llama


class CausalLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = llama(0)
        self.losses: list[float] = []
        self.mlp_calls = 0
        act = self.model.model.layers[0].mlp.act_fn
        act_forward = act.forward

        def counted(x: Tensor) -> Tensor:  # a forward hook would not see the recomputation
            self.mlp_calls += 1
            return act_forward(x)

        act.forward = counted

    def training_step(self, batch: tuple[Tensor, Tensor], index: int) -> Tensor:
        x, y = batch
        assert self.model.config.use_cache  # the default the user did not turn off
        loss = F.cross_entropy(self.model(input_ids=x).logits.flatten(0, 1), y.flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for stage in (0, 3):
        for checkpointed in (False, True):
            strategy = HybridParallelStrategy(zero_stage=stage, activation_checkpointing=checkpointed)
            module = CausalLM()
            cpu_trainer(strategy, max_steps=3).fit(module, DataLoader(Tokens(12), batch_size=2))
            out[f"{stage}/{checkpointed}"] = {
                "state": final_state(module, strategy),
                "losses": module.losses,
                "mlp_calls": module.mlp_calls,
            }
    return out


def test_checkpointed_llama_with_its_default_cache_equals_the_run_without() -> None:
    out = run_distributed(_runs, 2, init_group=False)[0]
    for stage in (0, 3):
        plain, checkpointed = out[f"{stage}/False"], out[f"{stage}/True"]
        assert plain["mlp_calls"] == 3 and checkpointed["mlp_calls"] == 6, stage  # recomputed in backward
        assert_close(checkpointed["losses"], plain["losses"], msg=f"zero{stage}")
        assert_close(checkpointed["state"], plain["state"], msg=f"zero{stage}")


def test_another_checkpointing_layout_on_a_wrapped_model_names_the_wrappers() -> None:
    """A model fitted with activation checkpointing, then given a layout without it, is refused naming
    the checkpointing wrappers (before, the message blamed tensor and pipeline parallelism, unused)."""
    from lightning_par.compose import ComposeOptions, compose

    model = llama()
    compose(model, options=ComposeOptions(activation_checkpointing=True), tp_group=None, tp_rank=0, pp_rank=0)
    try:
        compose(model, options=ComposeOptions(), tp_group=None, tp_rank=0, pp_rank=0)
        message = "not refused"
    except ValueError as exc:
        message = str(exc)
    assert "Activation checkpointing wraps the layers of the model in place" in message, message
    assert "activation_checkpointing=True" in message and "Tensor and pipeline" not in message
