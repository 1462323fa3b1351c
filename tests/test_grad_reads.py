"""``param.grad`` read between the backward and the optimizer step, at ZeRO 1-3, on 2 Gloo ranks.

At ZeRO 1-3 the gradients are in each rank's shards and ``param.grad`` is None, so DDP code that reads
it there did nothing, silently: ``torch.nn.utils.clip_grad_norm_(self.parameters(), ...)`` in an
overridden ``configure_gradient_clipping`` clipped nothing (the MLP below, whose steps need the clip,
ended far from ``"ddp"``), and Lightning's ``grad_norm(self, 2)`` logged nothing. Now the first such read
is refused, naming the parameter and the fixes, in the Trainer and in a Fabric loop; stage 0 (where
``param.grad`` holds the averaged gradient) equals ``"ddp"`` with the same code.

What must not be refused: reads that find None under DDP too (``on_before_backward``, after the step in
``on_train_batch_end``), and the built-in clipping (``self.clip_gradients``), with gradient accumulation;
those runs equal ``"ddp"`` at ZeRO 1-3, and the watch is gone from the second step on (no torch function
mode left at the next batch's start), also after a refusal.

Under pipeline parallelism (pp2, the MLP cut in two) the same code saw this stage's gradients only, the
other stage's parameters being meta placeholders: each stage clipped by its own norm, silently. Reading a
placeholder's ``grad`` there is refused now too, in the Trainer and in a Fabric loop, while this stage's
own gradients are read freely, and the built-in clip (global over the stages) equals one process.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import grad_norm
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_par import HybridParallelStrategy
from lightning_par.fabric import HybridParallelStrategy as FabricHybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state, fit_refused

WORLD = 2


def _samples() -> tuple[Tensor, Tensor]:
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(3)) * 3
    return x, x.sum(1, keepdim=True) ** 2


class Clipped(pl.LightningModule):
    """``mode``: ``"torch_clip"`` (torch's clip over ``self.parameters()``), ``"log_norms"`` (Lightning's
    ``grad_norm``) or ``"builtin"`` (``self.clip_gradients``, reading ``.grad`` where DDP finds None)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.modes: list[int] = []  # torch function modes entered after the first optimizer step

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx > 1:  # the first optimizer step is done (accumulation 1 or 2)
            self.modes.append(torch._C._len_torch_function_stack())

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def on_before_backward(self, loss: Tensor) -> None:
        _ = [p.grad for p in self.parameters()]  # None at the first micro-batch, as under DDP

    def configure_gradient_clipping(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        stepped = [p for group in optimizer.param_groups for p in group["params"]]
        if self.mode == "torch_clip":
            torch.nn.utils.clip_grad_norm_(self.parameters(), 0.1)
        elif self.mode == "opt_clip":  # the optimizer's own parameters: this rank's fragments at ZeRO 1-3
            torch.nn.utils.clip_grad_norm_(stepped, 0.1)
        elif self.mode == "data_clip":  # the classic hand-written form, through .data
            total = sum(float(p.grad.data.norm()) ** 2 for p in stepped) ** 0.5
            for p in stepped:
                p.grad.data.mul_(min(1.0, 0.1 / total))
        elif self.mode == "dot_clip":  # a squared norm as a dot product of flattened views
            total = sum(torch.vdot(p.grad.flatten(), p.grad.flatten()) for p in stepped) ** 0.5
            for p in stepped:
                p.grad.mul_(torch.clamp(0.1 / total, max=1.0))
        elif self.mode == "opt_scale":  # element-wise: exact on fragments
            for p in stepped:
                p.grad.mul_(0.5)
            self.clip_gradients(optimizer, gradient_clip_val=0.1, gradient_clip_algorithm="norm")
        else:
            self.clip_gradients(optimizer, gradient_clip_val=0.1, gradient_clip_algorithm="norm")

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.mode == "log_norms":
            self.log_dict(grad_norm(self, norm_type=2))
        elif self.mode == "skip" and self.global_step in (0, 3):  # a step skipped: the module's own
            self.zero_grad()
        elif self.mode == "skip_opt" and self.global_step in (0, 3):  # the optimizer's
            optimizer.zero_grad()
        elif self.mode == "grad_none" and self.global_step < 2:  # DDP's way to skip a layer's update
            self.net[0].weight.grad = None
        elif self.mode == "grad_del" and self.global_step < 2:
            del self.net[2].bias.grad
        elif self.mode == "late_hist" and self.global_step >= 2:  # gradient histograms from step 2 on
            self.hist = [p.grad.clone() for p in self.parameters() if p.grad is not None]

    def on_train_batch_end(self, *args: Any) -> None:
        _ = [p.grad for p in self.parameters()]  # after the step: None under DDP too

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TensorDataset(*_samples()), batch_size=4)


class Piped(Clipped):
    """``Clipped`` cut into two pipeline stages: ``Linear, ReLU`` | ``Linear``; ``"builtin"`` also reads
    this stage's own gradients (present: no refusal)."""

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.net)

    def pipeline_loss(self, output: Tensor, batch: Any) -> Tensor:
        return F.mse_loss(output, batch[1])

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        super().on_before_optimizer_step(optimizer)
        if self.mode == "builtin":
            assert all(p.grad is not None for p in self.parameters() if not p.is_meta)


class Spare(Clipped):
    """``Clipped`` with a layer no rank uses, for ``find_unused_parameters=True``: its ``grad`` is None
    under DDP too, so reading it passes, while reads of the used layers' are still refused."""

    def __init__(self, mode: str) -> None:
        super().__init__(mode)
        self.spare = nn.Linear(2, 2)
        self.spare_reads: list[bool] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        super().on_before_optimizer_step(optimizer)
        self.spare_reads.append(self.spare.weight.grad is None)


PIPED = dict(pipeline_parallel_size=2, num_microbatches=2, partition_method=[2, 1])


class LateGradLogger(pl.Callback):
    """A user's callback logging gradient norms from the third step on."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step >= 2:
            pl_module.log("g", pl_module.net[0].weight.grad.norm())


def _fit(
    strategy: Any, mode: str, accumulate: int = 1, spare: bool = False, callbacks: Any = ()
) -> dict[str, Any]:
    torch.manual_seed(0)
    module = (Spare if spare else Piped if strategy_piped(strategy) else Clipped)(mode)
    trainer = cpu_trainer(
        strategy, max_epochs=1, accumulate_grad_batches=accumulate, callbacks=list(callbacks)
    )
    refused = fit_refused(trainer, module, strategy)
    if refused is not None:
        return {"error": refused, "modes": torch._C._len_torch_function_stack()}
    return {
        "state": final_state(module, strategy),
        "modes": module.modes,
        "spare_reads": getattr(module, "spare_reads", None),
    }


def strategy_piped(strategy: Any) -> bool:
    return getattr(strategy, "pipeline_parallel_size", 1) > 1


def _fabric(rank: int, clip: str, piped: bool = False) -> dict[str, Any]:
    options: dict[str, Any] = dict(zero_stage=2)
    if piped:  # both ranks hold a stage and take the whole batch of 8
        options = dict(PIPED, pipeline_layers=lambda module: list(module))
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=FabricHybridParallelStrategy(**options))
    fabric.launch()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = _samples()
    try:
        for step in range(4):
            if piped:
                batch = (x[step * 8 : step * 8 + 8], y[step * 8 : step * 8 + 8])
                fabric.strategy.pipeline.step(  # type: ignore[attr-defined]
                    batch, loss_fn=lambda output, micro: F.mse_loss(output, micro[1])
                )
            else:
                mine = slice(step * 8 + rank * 4, step * 8 + rank * 4 + 4)
                fabric.backward(F.mse_loss(model(x[mine]), y[mine]))
            if clip == "torch":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            elif clip == "grad_none":  # DDP's skip of one layer's update: refused at optimizer.step()
                model.module[0].weight.grad = None
                fabric.clip_gradients(model, optimizer, max_norm=0.1)
            elif clip == "optimizer":  # refused at optimizer.step(), before any update
                stepped = [p for group in optimizer.param_groups for p in group["params"]]
                torch.nn.utils.clip_grad_norm_(stepped, 0.1)
            else:
                fabric.clip_gradients(model, optimizer, max_norm=0.1)
            optimizer.step()
            optimizer.zero_grad()
        state: dict[str, Any] = {"state": fabric.strategy.consolidated_state_dict()}  # type: ignore[attr-defined]
    except RuntimeError as error:
        state = {"error": str(error)}
    finally:
        fabric.strategy.destroy_process_groups()  # type: ignore[attr-defined]
    return {**state, "modes": torch._C._len_torch_function_stack()}


def _runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {
        "fabric/torch": _fabric(rank, "torch"),
        "fabric/fabric": _fabric(rank, "fabric"),
        "fabric/optimizer": _fabric(rank, "optimizer"),
        "fabric/grad_none": _fabric(rank, "grad_none"),
        "fabric_pp/torch": _fabric(rank, "torch", piped=True),
        "fabric_pp/fabric": _fabric(rank, "fabric", piped=True),
        "pp/torch_clip/refused": _fit(HybridParallelStrategy(**PIPED), "torch_clip"),
        "pp/log_norms/refused": _fit(HybridParallelStrategy(**PIPED), "log_norms"),
        "pp/builtin": _fit(HybridParallelStrategy(**PIPED), "builtin"),
        # self.zero_grad() in on_before_optimizer_step skips the step, as in one process (before: at pp2
        # refused in the first step, and at ZeRO-1 a later one stepped the shards' gradients, 3.6e-2 off)
        "pp/skip": _fit(HybridParallelStrategy(**PIPED), "skip"),
        "pp/zero1/skip": _fit(HybridParallelStrategy(**PIPED, zero_stage=1), "skip"),
        # the optimizer's zero_grad() walks the other stage's placeholders: no read (before, refused)
        "pp/skip_opt": _fit(HybridParallelStrategy(**PIPED), "skip_opt"),
        "ddp/torch_clip": _fit(DDPStrategy(), "torch_clip"),
        "zero0/torch_clip": _fit(HybridParallelStrategy(zero_stage=0), "torch_clip"),
        "ddp/builtin": _fit(DDPStrategy(), "builtin", accumulate=2),
    }
    # a norm of the optimizer's parameters' gradients: refused at ZeRO 1-3 (before: each rank clipped its
    # fragments by its own norm, silently); element-wise changes of them equal "ddp"'s
    for stage in (1, 3):
        out[f"zero{stage}/opt_clip/norm_refused"] = _fit(HybridParallelStrategy(zero_stage=stage), "opt_clip")
    out["zero2/data_clip/norm_refused"] = _fit(HybridParallelStrategy(zero_stage=2), "data_clip")
    out["zero3/dot_clip/norm_refused"] = _fit(HybridParallelStrategy(zero_stage=3), "dot_clip")
    out["ddp/opt_scale"] = _fit(DDPStrategy(), "opt_scale")
    out["zero2/opt_scale"] = _fit(HybridParallelStrategy(zero_stage=2), "opt_scale")
    # param.grad cleared at ZeRO 1-3: refused (before: the optimizer stepped the shards regardless, a layer
    # kept for two steps by grad = None ended 0.24 off "ddp"); at ZeRO 0 it skips the update as under DDP
    out["ddp/grad_none"] = _fit(DDPStrategy(), "grad_none")
    out["zero0/grad_none"] = _fit(HybridParallelStrategy(zero_stage=0), "grad_none")
    out["zero1/grad_none/write_refused"] = _fit(HybridParallelStrategy(zero_stage=1), "grad_none")
    out["zero3/grad_del/write_refused"] = _fit(HybridParallelStrategy(zero_stage=3), "grad_del")
    # reads that find nothing after the first step, in the gradient hooks the user overrides: refused at
    # every step there (before, the watch had ended: a histogram guarded by `is not None` logged nothing, an
    # unguarded norm failed with AttributeError)
    out["zero2/late_hist/late_refused"] = _fit(HybridParallelStrategy(zero_stage=2), "late_hist")
    out["zero1/late_callback/late_refused"] = _fit(
        HybridParallelStrategy(zero_stage=1), "builtin", callbacks=[LateGradLogger()]
    )
    for stage in (1, 2, 3):
        out[f"zero{stage}/torch_clip/refused"] = _fit(HybridParallelStrategy(zero_stage=stage), "torch_clip")
        out[f"zero{stage}/builtin"] = _fit(HybridParallelStrategy(zero_stage=stage), "builtin", accumulate=2)
    out["zero2/log_norms/refused"] = _fit(HybridParallelStrategy(zero_stage=2), "log_norms")
    # find_unused_parameters: reads of used parameters refused as without it (before: not watched, and
    # the clip clipped nothing), reads of a parameter no rank used pass
    for stage in (1, 3):
        unused = HybridParallelStrategy(zero_stage=stage, find_unused_parameters=True)
        out[f"zero{stage}/unused/torch_clip/refused"] = _fit(unused, "torch_clip", spare=True)
    out["ddp/unused/spare"] = _fit(DDPStrategy(find_unused_parameters=True), "builtin", 2, spare=True)
    out["zero2/unused/spare"] = _fit(
        HybridParallelStrategy(zero_stage=2, find_unused_parameters=True), "builtin", 2, spare=True
    )
    return out


def test_grad_reads_that_find_nothing_are_refused_and_the_rest_equals_ddp() -> None:
    ranks = run_distributed(_runs, WORLD, init_group=False, timeout=300)
    for r, out in enumerate(ranks):
        for key, result in out.items():
            if (key.startswith("pp/") and key.endswith("refused")) or key == "fabric_pp/torch":
                # the first placeholder self.parameters() meets: the other stage's first weight
                other = f"{'net.' if key.startswith('pp') else ''}{2 if r == 0 else 0}.weight"
                message = result.get("error", "")
                expected = f"Pipeline parallelism: {other}.grad was read after the backward and is None"
                assert message.startswith(expected), (r, key, message)
                assert "another pipeline stage" in message and "gradient_clip_val" in message, (r, key)
                assert result["modes"] == 0, (r, key, result)
            elif key.endswith("late_refused"):
                hook = (
                    "a callback's on_before_optimizer_step"
                    if "callback" in key
                    else "on_before_optimizer_step"
                )
                message = result.get("error", "")
                assert f"ZeRO-{key[4]}: net.0.weight.grad was read after the backward and is None" in message
                assert f"(Checked in {hook}.)" in message, (r, key, message)
                assert result["modes"] == 0, (r, key, result)
            elif key.endswith("write_refused") or key == "fabric/grad_none":
                stage, name = (key[4], "net.") if key.startswith("zero") else ("2", "")
                name += "2.bias" if "del" in key else "0.weight"
                message = result.get("error", "")
                assert f"ZeRO-{stage}: {name}.grad was set to None (or deleted)" in message, (r, key, message)
                assert "requires_grad_(False)" in message and "self.zero_grad()" in message, (r, key, message)
                assert result["modes"] == 0, (r, key, result)
            elif key.endswith("norm_refused") or key == "fabric/optimizer":
                message = result.get("error", "")
                stage = key[4] if key.startswith("zero") else "2"
                assert f"ZeRO-{stage}: a norm of the optimizer's gradients was taken" in message, (r, key)
                assert "gradient_clip_val" in message and "Element-wise" in message, (r, key, message)
                assert result["modes"] == 0, (r, key, result)
            elif key.endswith("refused") or key == "fabric/torch":
                stage, name = (key[4], "net.0.weight") if key.startswith("zero") else ("2", "0.weight")
                message = result.get("error", "")
                expected = f"ZeRO-{stage}: {name}.grad was read after the backward and is None"
                assert expected in message, (r, key, result)
                assert "gradient_clip_val" in message and "strategy.grad_norm" in message, (r, key, message)
                assert result["modes"] == 0, (r, key, result)  # the watch left with the failed run
            elif key.startswith("fabric"):
                assert "error" not in result and result["modes"] == 0, (r, key, result)
            elif not key.startswith("ddp"):
                assert "error" not in result, (r, key, result)
                steps = (
                    14 if key.startswith("pp") else 6
                )  # batches after the first two: 16 at dp 1, 8 at dp 2
                # the grad watch is gone after the first step; at ZeRO-3 the hook itself runs inside
                # its placeholder-read guard (one mode: lightning_hooks.PLACEHOLDER_HOOKS)
                guards = 1 if key.startswith("zero3") else 0
                assert len(result["modes"]) == steps and set(result["modes"]) == {guards}, (
                    r,
                    key,
                    result["modes"],
                )

    out = ranks[0]  # the consolidated states land on rank 0
    torch.manual_seed(0)
    initial = Clipped("builtin").state_dict()
    for key, reference in (
        ("zero0/torch_clip", "ddp/torch_clip"),
        *((f"zero{s}/builtin", "ddp/builtin") for s in (1, 2, 3)),
        ("zero2/opt_scale", "ddp/opt_scale"),
        ("zero0/grad_none", "ddp/grad_none"),
        ("zero2/unused/spare", "ddp/unused/spare"),
    ):
        expected = out[reference]["state"]
        assert expected.keys() == out[key]["state"].keys(), key
        for name, value in expected.items():
            torch.testing.assert_close(out[key]["state"][name], value, msg=f"{key}: {name}")
            if not name.startswith("spare."):
                assert not torch.equal(value, initial[name]), (key, name)
    assert out["zero2/unused/spare"]["spare_reads"] == out["ddp/unused/spare"]["spare_reads"] == [True] * 4

    # the Fabric loop with fabric.clip_gradients against one process on both ranks' samples
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = _samples()
    for step in range(4):
        F.mse_loss(net(x[step * 8 : step * 8 + 8]), y[step * 8 : step * 8 + 8]).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.1)
        optimizer.step()
        optimizer.zero_grad()
    for name, value in net.state_dict().items():
        torch.testing.assert_close(out["fabric/fabric"]["state"][name], value, msg=f"fabric: {name}")
        torch.testing.assert_close(out["fabric_pp/fabric"]["state"][name], value, msg=f"fabric pp: {name}")

    # the Trainer at pp2 (data parallel size 1: every batch of 4 on both stages) against one process fed
    # the batches of the sampler Lightning puts in (a training loader is shuffled, seed 0)
    order = list(DistributedSampler(TensorDataset(x), num_replicas=1, rank=0, shuffle=True, seed=0))
    for key, skipped in (
        ("pp/builtin", ()),
        ("pp/skip", (0, 3)),
        ("pp/zero1/skip", (0, 3)),
        ("pp/skip_opt", (0, 3)),
    ):
        torch.manual_seed(0)
        module = Clipped("builtin")
        optimizer = module.configure_optimizers()
        for step in range(16):
            rows = order[step * 4 : step * 4 + 4]
            F.mse_loss(module.net(x[rows]), y[rows]).backward()
            if step in skipped:
                module.zero_grad()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 0.1)
            optimizer.step()
            optimizer.zero_grad()
        for name, value in module.state_dict().items():
            torch.testing.assert_close(out[key]["state"][name], value, msg=f"{key}: {name}")
