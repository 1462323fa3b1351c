"""Gradients with respect to inputs inside a step, at ZeRO-3 (against Lightning's ``"ddp"``) and under tensor
parallelism (against one process), on 2 Gloo ranks.

Three kinds of user code call ``torch.autograd.grad`` on a step's inputs before the step's backward:

* a physics-informed network (PINN) whose loss holds the Laplacian of its output with respect to its
  inputs: two ``create_graph=True`` passes, then the backward runs through the graph they built; its
  ``validation_step`` computes the same residual under ``torch.enable_grad()``;
* adversarial training (FGSM): the input gradient of the loss, no graph, then a step on the perturbed
  batch;
* a WGAN with gradient penalty (manual optimization, two optimizers): the critic's input gradient at
  interpolated samples, with a graph, in the critic's loss.

At ZeRO-3 every one of them failed before: the input-gradient pass ended the gradient window (the units
reduced zeros, then "8 parameter(s) got no gradient"), and once that was skipped, the backward through a
``create_graph`` pass's graph met weights whose gathered storage had been freed ("requiring a storage size
of 1024 are out of bounds for storage of size 0"); a unit holding frozen weights failed in torch's
multi-gradient hook on a leaf input ("A leaf node was passed to _will_engine_execute_node"). ZeRO 0-2
were right already (ZeRO-2 is checked here too). Now the final weights and the logged validation
residual equal ``"ddp"``'s, with the whole model one unit and with a unit per block, and no unit stays
gathered after a step: ``live_units`` is 0 at every ``on_train_batch_end`` and
``on_validation_batch_end`` (the GAN's manual optimization keeps its root unit between steps). A
Fabric loop training the PINN at ZeRO-3 equals one process training on both ranks' samples (its input
gradients taken through the module itself: Fabric's wrapper refuses a pass it did not start when the
strategy or the precision overrides ``backward``, as Lightning's own mixed precision and DeepSpeed do).

Under tensor parallelism a Hugging Face Llama trained on its loss plus a penalty on the loss's
input-embedding gradient equals one process (second test).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from lightning_par.fabric import HybridParallelStrategy as FabricHybridParallelStrategy
from lightning_par.tensor_parallel import vocab_parallel_cross_entropy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state
from tests.third_party import llama

WORLD, MICRO = 2, 4
State = dict[str, Tensor]


class Block(nn.Module):
    """A residual block; ``features`` is frozen in the PINN (random features, as a LoRA base is frozen)."""

    def __init__(self, *, frozen: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.features = nn.Linear(16, 16)
        self.features.requires_grad_(not frozen)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.fc(x)) + 0.1 * torch.sin(self.features(x))


def _mlp(*, frozen: bool) -> nn.Module:
    blocks = [Block(frozen=frozen), Block(frozen=frozen)]
    return nn.Sequential(nn.Linear(2, 16), nn.Tanh(), *blocks, nn.Linear(16, 1))


def _samples(n: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=g) * 2 - 1
    return x, torch.sin(3 * x[:, :1]) * x[:, 1:]


def _laplacian(net: nn.Module, x: Tensor, *, create_graph: bool) -> tuple[Tensor, Tensor]:
    """``u(x)`` and ``u_xx + u_yy``: the second derivatives run through the first one's graph."""
    x = x.detach().requires_grad_(True)
    u = net(x)
    (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
    second = [
        torch.autograd.grad(du[:, i].sum(), x, create_graph=create_graph, retain_graph=True)[0][:, i]
        for i in range(2)
    ]
    return u, second[0] + second[1]


def _pinn_loss(net: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    u, lap = _laplacian(net, x, create_graph=True)
    return F.mse_loss(u, y) + 0.01 * (lap + x.sum(1)).pow(2).mean()


class Pinn(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp(frozen=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return _pinn_loss(self, *batch)  # the whole model one unit: its forward gets the leaf input

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        with torch.enable_grad():
            _, lap = _laplacian(self, x, create_graph=False)
        self.log("val_residual", (lap + x.sum(1)).pow(2).mean(), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TensorDataset(*_samples(64, 1)), batch_size=MICRO)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TensorDataset(*_samples(16, 2)), batch_size=MICRO)


class Adversarial(Pinn):
    """FGSM: a step on the batch moved along the sign of the loss's input gradient (no graph kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp(frozen=False)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        x = x.detach().requires_grad_(True)
        (gx,) = torch.autograd.grad(F.mse_loss(self.net(x), y), x)
        return F.mse_loss(self.net((x + 0.1 * gx.sign()).detach()), y)


class GradientPenaltyGan(pl.LightningModule):
    """WGAN-GP: the critic's loss holds ``(|d critic / d x| - 1)^2`` at interpolated samples."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 2))
        self.critic = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), Block(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real = batch[0]
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        z = torch.randn(real.shape[0], 2, generator=torch.Generator().manual_seed(batch_idx))
        eps = torch.rand(real.shape[0], 1, generator=torch.Generator().manual_seed(100 + batch_idx))
        fake = self.generator(z).detach()
        between = (eps * real + (1 - eps) * fake).requires_grad_(True)
        (g,) = torch.autograd.grad(self.critic(between).sum(), between, create_graph=True)
        penalty = (g.norm(dim=1) - 1).pow(2).mean()
        opt_d.zero_grad()
        self.manual_backward(self.critic(fake).mean() - self.critic(real).mean() + 10 * penalty)
        opt_d.step()
        opt_g.zero_grad()
        self.manual_backward(-self.critic(self.generator(z)).mean())
        opt_g.step()

    def configure_optimizers(self) -> Any:
        return [
            torch.optim.Adam(self.generator.parameters(), lr=1e-3, betas=(0.5, 0.9)),
            torch.optim.Adam(self.critic.parameters(), lr=1e-3, betas=(0.5, 0.9)),
        ]

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TensorDataset(*_samples(64, 3)), batch_size=MICRO)


class LiveUnits(pl.Callback):
    """ZeRO-3's gathered unit bytes after every training and validation batch."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.seen.append(trainer.strategy.memory_report()["live_units"])  # type: ignore[attr-defined]

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.seen.append(trainer.strategy.memory_report()["live_units"])  # type: ignore[attr-defined]


def _fit(module_class: type[pl.LightningModule], strategy: Any) -> tuple[State, float, list[int]]:
    torch.manual_seed(0)
    module = module_class()
    live = LiveUnits()
    callbacks = [live] if isinstance(strategy, HybridParallelStrategy) else []
    trainer = cpu_trainer(strategy, max_epochs=2, num_sanity_val_steps=0, callbacks=callbacks)
    trainer.fit(module)
    residual = float(trainer.callback_metrics.get("val_residual", torch.tensor(float("nan"))))
    return final_state(module, strategy), residual, live.seen


def _root_numel(module: nn.Module) -> int:
    in_blocks = {id(p) for m in module.modules() if isinstance(m, Block) for p in m.parameters()}
    return sum(p.numel() for p in module.parameters() if id(p) not in in_blocks)


def _fabric_pinn(rank: int) -> State:
    strategy = FabricHybridParallelStrategy(zero_stage=3, zero3_units=[Block])
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    net = _mlp(frozen=True)
    trainable = [p for p in net.parameters() if p.requires_grad]
    module, optimizer = fabric.setup(net, torch.optim.Adam(trainable, lr=1e-2))
    x, y = _samples(32, 4)
    try:
        for step in range(4):
            mine = slice(step * 8 + rank * MICRO, step * 8 + (rank + 1) * MICRO)
            # Fabric's wrapper refuses every backward pass through its outputs but fabric.backward's when
            # the strategy or precision overrides backward (ours, Lightning's DeepSpeed, any mixed
            # precision): torch.autograd.grad goes through the module itself
            fabric.backward(_pinn_loss(module.module, x[mine], y[mine]))
            optimizer.step()
            optimizer.zero_grad()
        state: State = fabric.strategy.consolidated_state_dict()  # type: ignore[attr-defined]
        return state
    finally:
        fabric.strategy.destroy_process_groups()  # type: ignore[attr-defined]


def _runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {"fabric": _fabric_pinn(rank)}
    for name, module_class, options in (
        ("pinn", Pinn, {}),
        ("fgsm", Adversarial, {}),
        ("gan", GradientPenaltyGan, {"find_unused_parameters": True}),
    ):
        out[f"{name}/ddp"] = _fit(module_class, DDPStrategy(**options))
        for stage, units in ((3, [Block]), (3, None), (2, None)):
            if units is None and name != "pinn":
                continue
            strategy = HybridParallelStrategy(zero_stage=stage, zero3_units=units, **options)
            out[f"{name}/zero{stage}/{'blocks' if units else 'whole'}"] = _fit(module_class, strategy)
    return out


def test_input_gradients_inside_steps_at_zero3_equal_ddp() -> None:
    ranks = run_distributed(_runs, WORLD, init_group=False, timeout=600)
    out = ranks[0]  # the consolidated states land on rank 0
    for key in [k for k in out if "/zero" in k]:
        reference, ref_residual, _ = out[key.split("/")[0] + "/ddp"]
        state, residual, live = out[key]
        assert state.keys() == reference.keys(), key
        for name, value in reference.items():
            torch.testing.assert_close(state[name], value, msg=f"{key}: {name}")
        if key.startswith("pinn"):
            torch.testing.assert_close(residual, ref_residual, msg=key)
        # nothing left gathered after a step; manual optimization (the GAN) keeps the root unit (what no
        # block holds) between steps, as it did before: its steps end with no backward to come
        root = 0 if key.startswith(("pinn", "fgsm")) else 4 * (_root_numel(GradientPenaltyGan()) + WORLD)
        assert len(live) >= 16 and max(live) <= root, (key, live)

    # the Fabric loop against one process on both ranks' samples (equal micro-batches: the ranks' mean)
    torch.manual_seed(0)
    net = _mlp(frozen=True)
    initial = {k: v.clone() for k, v in net.state_dict().items()}
    optimizer = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    x, y = _samples(32, 4)
    for step in range(4):
        window = slice(step * 8, step * 8 + 8)
        _pinn_loss(net, x[window], y[window]).backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, value in net.state_dict().items():
        torch.testing.assert_close(out["fabric"][name], value, msg=f"fabric: {name}")
    assert not torch.equal(net.state_dict()["2.fc.weight"], initial["2.fc.weight"])


# ------------------------------------------------------------------------------------------- tensor parallel
def _token_ids() -> Tensor:
    return torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(5))


def _penalised_lm_loss(model: nn.Module, ids: Tensor) -> Tensor:
    """A causal LM's loss plus the squared norm of its gradient with respect to the input embeddings."""
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    loss = model(inputs_embeds=embeds, labels=ids).loss
    (g,) = torch.autograd.grad(loss, embeds, create_graph=True)
    return loss + 1e-3 * g.pow(2).sum()


class PenalisedLlama(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = llama()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return _penalised_lm_loss(self.model, batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TensorDataset(_token_ids()), batch_size=4)


def _tp_runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for stage, sp in ((0, False), (3, False), (1, True)):
        module = PenalisedLlama()
        strategy = HybridParallelStrategy(
            zero_stage=stage,
            tensor_parallel_size=world,
            tp_plan="llama",
            sequence_parallel=sp,
            find_unused_parameters=True,  # the embedding gets no gradient: its output is detached
        )
        cpu_trainer(strategy, devices=world, max_epochs=1, use_distributed_sampler=False).fit(module)
        out[f"zero{stage}{'-sp' if sp else ''}"] = final_state(module, strategy)
    group = dist.new_group(list(range(world)))
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    loss = vocab_parallel_cross_entropy(logits, torch.arange(6) % 16, group=group)
    try:
        torch.autograd.grad(loss, logits, create_graph=True)
        out["vocab_ce"] = "no error"
    except RuntimeError as error:
        out["vocab_ce"] = str(error)
    dist.destroy_process_group(group)
    return out


def test_input_gradients_through_tensor_parallel_layers_equal_one_process() -> None:
    """A Llama at tp 2 trained on its loss plus a penalty on the loss's input-embedding gradient, at
    ZeRO-0, ZeRO-3 and ZeRO-1 with sequence parallelism, equals one process. Before, the second backward
    took the tensor-parallel all-reduces recorded in the first for identities (2.2e-5 from one process,
    where the penalty's whole effect on the weights is 5.0e-5), and failed under sequence parallelism ("A
    view was created in no_grad mode and is being modified inplace"). ``vocab_parallel_cross_entropy``,
    whose backward has no second derivative, refuses such a pass by name."""
    ranks = run_distributed(_tp_runs, WORLD, timeout=600)
    model = llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ids = _token_ids()
    for step in range(2):
        _penalised_lm_loss(model, ids[step * 4 : (step + 1) * 4]).backward()
        optimizer.step()
        optimizer.zero_grad()
    reference = {f"model.{k}": v for k, v in model.state_dict().items()}
    for key in ("zero0", "zero3", "zero1-sp"):
        state = ranks[0][key]
        assert state.keys() == reference.keys(), key
        for name, value in reference.items():
            torch.testing.assert_close(state[name], value, msg=f"{key}: {name}")
    for out in ranks:
        assert "vocab_parallel_cross_entropy has no second derivative" in out["vocab_ce"], out["vocab_ce"]
