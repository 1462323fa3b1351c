"""``precision="bf16-true"``: tensors a step creates are bf16, as under Lightning's own ``HalfPrecision``.

Lightning's ``bf16-true`` sets torch's default dtype to bf16 inside every step (and Fabric's inside every
forward, handing the outputs back in fp32). ``ParallelPrecision("bf16-true")`` did neither, so a step that
draws noise (``torch.randn`` for a GAN's latent, a diffusion model's timestep noise) met bf16 weights and
stopped: "mat1 and mat2 must have the same dtype, but got Float and BFloat16" at ZeRO 0-3, where
Lightning's ``"ddp"`` trains. Now, on 2 Gloo ranks:

* Trainer: the noise drawn in ``training_step`` is bf16 and a tensor made in ``on_train_batch_end`` fp32
  at ZeRO 0, 2 and 3; ``self.dtype`` is bf16 there, as the weights (before, float32 at ZeRO 1-3, where the
  engine casts the compute copy itself, so a step's ``x.to(self.dtype)`` failed: "mat1 and mat2 must have
  the same dtype"); ZeRO-0 (bf16 parameters updated as they are, Lightning's scheme) equals ``"ddp"``;
  ZeRO-2 (fp32 masters in the shards) ends nearer the ``32-true`` run than ``"ddp"`` does.
* Fabric: inside the module's forward the default dtype is bf16, the outputs come back fp32, and ZeRO-0
  equals Fabric's own DDP.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from lightning_par.fabric import HybridParallelStrategy as FabricHybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state

WORLD = 2


def _samples() -> tuple[Tensor, Tensor]:
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(3))
    return x, torch.tanh(x.sum(1, keepdim=True))


class Noisy(nn.Module):
    """An MLP fed its input beside noise it draws itself (a latent, a timestep embedding's noise)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.drawn: list[torch.dtype] = []

    def forward(self, x: Tensor) -> Tensor:
        noise = torch.randn(x.shape[0], 4, generator=torch.Generator().manual_seed(int(x.shape[0])))
        self.drawn.append(noise.dtype)
        return self.net(torch.cat([x, 0.1 * noise], dim=1))


class NoisyModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Noisy()
        self.after: list[torch.dtype] = []
        self.dtypes: list[torch.dtype] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        self.dtypes.append(self.dtype)  # the weights' dtype (before, float32 at ZeRO 1-3: masters)
        return F.mse_loss(self.model(x.to(self.dtype)).float(), y.float())

    def on_train_batch_end(self, *args: Any) -> None:
        self.after.append(torch.zeros(1).dtype)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TensorDataset(*_samples()), batch_size=4)


def _fit(strategy: Any, precision: str) -> dict[str, Any]:
    torch.manual_seed(0)
    module = NoisyModule()
    cpu_trainer(strategy, max_epochs=1, precision=precision).fit(module)
    drawn, after = set(module.model.drawn), set(module.after)
    out = {"drawn": drawn, "after": after, "dtypes": set(module.dtypes)}
    return out | {"state": final_state(module, strategy)}


def _fabric(rank: int, strategy: Any) -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", devices=WORLD, precision="bf16-true", strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = Noisy()
    module, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _samples()
    outputs = set()
    for step in range(4):
        mine = slice(step * 8 + rank * 4, step * 8 + rank * 4 + 4)
        out = module(x[mine])
        outputs.add(out.dtype)
        fabric.backward(F.mse_loss(out, y[mine]))
        optimizer.step()
        optimizer.zero_grad()
    if isinstance(strategy, FabricHybridParallelStrategy):
        state: dict[str, Tensor] = strategy.consolidated_state_dict()
        strategy.destroy_process_groups()
    else:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"state": state, "drawn": set(model.drawn), "outputs": outputs}


def _runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {
        "fabric/ddp": _fabric(rank, "ddp"),
        "fabric/zero0": _fabric(rank, FabricHybridParallelStrategy(zero_stage=0)),
        "ddp": _fit(DDPStrategy(), "bf16-true"),
        "ddp/32-true": _fit(DDPStrategy(), "32-true"),
    }
    for stage in (0, 2, 3):
        out[f"zero{stage}"] = _fit(HybridParallelStrategy(zero_stage=stage), "bf16-true")
    return out


def _distance(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def test_bf16_true_steps_create_bf16_tensors_as_lightning_does() -> None:
    ranks = run_distributed(_runs, WORLD, init_group=False, timeout=300)
    for r, out in enumerate(ranks):
        for key in ("ddp", "zero0", "zero2", "zero3"):
            assert out[key]["drawn"] == {torch.bfloat16}, (r, key, out[key]["drawn"])
            assert out[key]["after"] == {torch.float32}, (r, key, out[key]["after"])
            assert out[key]["dtypes"] == {torch.bfloat16}, (r, key, out[key]["dtypes"])
        for key in ("fabric/ddp", "fabric/zero0"):
            assert out[key]["drawn"] == {torch.bfloat16}, (r, key, out[key]["drawn"])
            assert out[key]["outputs"] == {torch.float32}, (r, key, out[key]["outputs"])
    out = ranks[0]  # the consolidated states land on rank 0
    for key, reference in (("zero0", "ddp"), ("fabric/zero0", "fabric/ddp")):
        for name, value in out[reference]["state"].items():
            torch.testing.assert_close(out[key]["state"][name], value, msg=f"{key}: {name}")
    fp32 = out["ddp/32-true"]["state"]
    lightning_bf16, ours = _distance(out["ddp"]["state"], fp32), _distance(out["zero2"]["state"], fp32)
    assert ours < lightning_bf16 / 2, (ours, lightning_bf16)  # fp32 masters keep small Adam updates
