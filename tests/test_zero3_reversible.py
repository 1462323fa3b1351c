"""ZeRO-3 and reversible layers, on 2 Gloo ranks, against Lightning's ``DDPStrategy(static_graph=True)``.

A reversible residual net (RevNet, Reformer) runs its blocks in a custom autograd Function: the forward
under no_grad, and a backward that recomputes each block's pieces by calling its submodules. At ZeRO-3
those calls found the block's unit sharded (NaN placeholders), and the run trained to NaN from its second
step without a word (found by a probe on Hugging Face's Reformer). The first step's backward is now
watched as its forward is: the call is refused naming the module, its unit and the fix, and the fix
(units around every module the backward calls, ``zero3_units=[nn.Linear]`` here) equals the reference, as
ZeRO-1 does with the default units.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state


class Block(nn.Module):
    """``y1 = x1 + tanh(f(x2)); y2 = x2 + tanh(g(y1))``: invertible, so backward needs no activations."""

    def __init__(self) -> None:
        super().__init__()
        self.f, self.g = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x1: Tensor, x2: Tensor) -> tuple[Tensor, Tensor]:
        y1 = x1 + torch.tanh(self.f(x2))
        return y1, x2 + torch.tanh(self.g(y1))


class Reversible(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x1: Tensor, x2: Tensor, blocks: nn.ModuleList) -> tuple[Tensor, Tensor]:
        for block in blocks:
            x1, x2 = block(x1, x2)
        ctx.blocks = blocks
        ctx.save_for_backward(x1.detach(), x2.detach())
        return x1, x2

    @staticmethod
    def backward(ctx: Any, dy1: Tensor, dy2: Tensor) -> tuple[Tensor, Tensor, None]:
        y1, y2 = ctx.saved_tensors
        for block in reversed(ctx.blocks):
            with torch.enable_grad():  # invert the block, recomputing g and f with its own submodules
                y1 = y1.detach().requires_grad_()
                gy1 = torch.tanh(block.g(y1))
                torch.autograd.backward(gy1, dy2, inputs=[y1, *block.g.parameters()])
                x2 = (y2 - gy1).detach().requires_grad_()
                dy1 = dy1 + y1.grad
                fx2 = torch.tanh(block.f(x2))
                torch.autograd.backward(fx2, dy1, inputs=[x2, *block.f.parameters()])
                x1 = y1.detach() - fx2.detach()
                dy2 = dy2 + x2.grad
            y1, y2 = x1, x2.detach()
        return dy1, dy2, None


class RevNet(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(4, 16), nn.Linear(16, 1)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.losses: list[Tensor] = []

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        h = self.inp(batch)
        y1, y2 = Reversible.apply(h[:, :8], h[:, 8:], self.blocks)
        loss = self.out(torch.cat([y1, y2], -1)).pow(2).mean()
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(strategy: Any) -> tuple[list[Tensor], dict[str, Tensor]]:
    module = RevNet()
    data = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    cpu_trainer(strategy, max_steps=3).fit(module, DataLoader(data, batch_size=4))
    return module.losses, final_state(module, strategy)


def _job(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"ddp": _fit(DDPStrategy(static_graph=True))}
    out["zero1"] = _fit(HybridParallelStrategy(zero_stage=1))
    out["zero3_linear_units"] = _fit(HybridParallelStrategy(zero_stage=3, zero3_units=[nn.Linear]))
    with pytest.raises(RuntimeError, match="was called in a backward pass") as refused:
        _fit(HybridParallelStrategy(zero_stage=3))
    out["refused"] = str(refused.value)
    return out


def test_zero3_refuses_reversible_recomputation_outside_units_and_its_fix_equals_ddp() -> None:
    for rank, out in enumerate(run_distributed(_job, 2, init_group=False)):
        ref_losses, ref = out["ddp"]
        assert len(ref_losses) == 3 and all(torch.isfinite(loss) for loss in ref_losses)
        for name in ("zero1", "zero3_linear_units"):
            losses, state = out[name]
            torch.testing.assert_close(
                torch.stack(losses), torch.stack(ref_losses), msg=f"rank {rank} {name}"
            )
            if rank == 0:  # the whole state on rank 0
                for key, value in ref.items():
                    torch.testing.assert_close(state[key], value, msg=f"{name}: {key}")
        message = out["refused"]
        assert "'blocks.1.g'" in message and "unit 'blocks.1'" in message and "zero3_units" in message, (
            message
        )
