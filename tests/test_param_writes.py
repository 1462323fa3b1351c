"""Parameters written in place between steps (outside the optimizer), on 2 Gloo ranks.

Users edit weights between steps: WGAN's critic clipping (``p.clamp_(-c, c)``), a projection after the
step, a momentum teacher updated as an EMA of the student (BYOL, MoCo, DINO, mean teacher). Under DDP the
write lands in the weights the optimizer updates. Here:

* ZeRO 1/2 in mixed precision: the write lands in the 16-bit compute copy, and the optimizer updates the
  fp32 masters. Before, the next refresh overwrote the write from the masters, silently: a critic clamped
  to 0.05 under ``bf16-mixed`` ended with weights up to 0.36, 0.31 away from ``"ddp"``. Now the masters
  take every written element before each update, before they are read for an export, and at a step
  skipped by the fp16 loss scaler (which runs no update but refreshes the parameters).
* ZeRO-3: outside a forward the parameters are placeholders (writes fail in torch). The write goes inside
  ``strategy.gathered_params(writeback=True)``, entered by every rank: the model is whole inside, and at
  the exit each rank keeps the written elements of its slice (unwritten ones keep the fp32 master's
  precision). The ranks compare checksums first: a write made on one rank only is refused, and nothing is
  written back.

Checks: a critic clamp plus an EMA teacher, in ``on_train_batch_end``, at ZeRO 0-3 in ``32-true`` equal
``"ddp"``; in ``bf16-mixed`` stages 1-3 stay within bf16 rounding of ``"ddp"`` and the clamp holds in the
export; with fp16 loss scaling a skipped step keeps the clamp. Fabric at ZeRO-3 (and ZeRO-2) in
``bf16-mixed``: one written element changes, every other element of the masters stays bitwise the same;
a write on rank 0 only is refused with the state untouched; ``writeback=False`` drops writes.
"""

from __future__ import annotations

import copy
import warnings
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.nn.utils import prune
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from lightning_par.fabric import HybridParallelStrategy as FabricHybridParallelStrategy
from lightning_par.precision import ParallelPrecision
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state

WORLD, STEPS, CLIP, POISONED = 2, 6, 0.05, 3
MOMENTUM = 0.004  # the teacher's EMA weight: steps far below a bf16 rounding of the teacher
BF16_SPACING = 2.0**-12  # between bf16 numbers near 0.05


class ClampedWithTeacher(pl.LightningModule):
    """A critic whose weights are clamped after every step, and a frozen teacher following it by EMA."""

    def __init__(self, *, whole: bool = True, poison: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)
        self.whole = whole  # write inside gathered_params(writeback=True), or to the parameters as they are
        self.poison = poison
        self.before_clamp: list[float] = []  # per step, max |w| of the student before this step's clamp

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        (x,) = batch
        with self._whole():  # entered inside a step too: the step's own update must survive it
            pass
        with torch.no_grad():
            target = self.teacher(x + 0.1)
        out = self.student(x)
        loss = -out.mean() + self.student(2 * x).pow(2).mean() + F.mse_loss(out, target)
        if self.poison and batch_idx == POISONED:
            loss = loss * float("inf")  # the fp16 scaler skips this step on every rank
        return loss

    def _whole(self) -> AbstractContextManager[None]:
        strategy = self.trainer.strategy
        if self.whole and isinstance(strategy, HybridParallelStrategy):
            return strategy.gathered_params(writeback=True)
        return nullcontext()

    def on_train_batch_end(self, *args: Any) -> None:
        with self._whole(), torch.no_grad():
            self.before_clamp.append(max(p.abs().max().item() for p in self.student.parameters()))
            for p in self.student.parameters():
                p.clamp_(-CLIP, CLIP)
            for t, s in zip(self.teacher.parameters(), self.student.parameters(), strict=True):
                t.mul_(1 - MOMENTUM).add_(s, alpha=MOMENTUM)  # s may be a 16-bit copy (whole=False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.student.parameters(), lr=0.1)


def _fit(strategy: Any, precision: str | ParallelPrecision, *, whole: bool = True) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module = ClampedWithTeacher(whole=whole, poison=isinstance(precision, ParallelPrecision))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g))
    options: dict[str, Any] = (
        {"plugins": [precision]} if isinstance(precision, ParallelPrecision) else {"precision": precision}
    )
    trainer = cpu_trainer(strategy, max_steps=STEPS, **options)
    trainer.fit(module, DataLoader(data, batch_size=4))
    state = {k: v.float() for k, v in final_state(module, strategy).items()}
    return {"state": state, "before_clamp": module.before_clamp}


def _trainer_runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {"ddp-32": _fit(DDPStrategy(), "32-true"), "ddp-bf16": _fit(DDPStrategy(), "bf16-mixed")}
    for stage in range(4):
        out[f"zero{stage}-32"] = _fit(HybridParallelStrategy(zero_stage=stage), "32-true")
    for stage in (1, 2, 3):
        out[f"zero{stage}-bf16"] = _fit(HybridParallelStrategy(zero_stage=stage), "bf16-mixed")
    for stage in (1, 2):  # the same code as under DDP: the writes go to the bf16 compute copy
        out[f"zero{stage}-bf16-plain"] = _fit(
            HybridParallelStrategy(zero_stage=stage), "bf16-mixed", whole=False
        )
    fp16 = ParallelPrecision("16-mixed", loss_scale={"init_scale": 2.0**10})
    for stage in (0, 1):
        out[f"zero{stage}-fp16"] = _fit(HybridParallelStrategy(zero_stage=stage), fp16, whole=False)
    return out


def _student_max(state: dict[str, Tensor]) -> float:
    return max(v.abs().max().item() for k, v in state.items() if k.startswith("student"))


def _split(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    student = {k: v for k, v in state.items() if k.startswith("student")}
    return student, {k: v for k, v in state.items() if k.startswith("teacher")}


def test_writes_between_steps_reach_the_weights_at_every_stage() -> None:
    out = run_distributed(_trainer_runs, WORLD, init_group=False, timeout=300)[0]
    ddp = out["ddp-32"]["state"]
    assert _student_max(ddp) <= CLIP * (1 + 1e-7)
    for stage in range(4):  # fp32: the writes land exactly as under DDP
        assert_close(out[f"zero{stage}-32"]["state"], ddp, msg=f"ZeRO-{stage}, 32-true")
    ddp_student, ddp_teacher = _split(out["ddp-bf16"]["state"])
    for stage in (1, 2, 3):  # inside gathered_params(writeback=True): the fp32 masters, whole
        student, teacher = _split(out[f"zero{stage}-bf16"]["state"])
        assert _student_max(student) <= CLIP * (1 + 1e-7), f"ZeRO-{stage}: the clamp was lost"
        assert_close(student, ddp_student, atol=2e-4, rtol=0, msg=f"ZeRO-{stage}, bf16-mixed")
        # the frozen teacher is fp32, as under DDP: its small EMA steps add up (in bf16 they round away)
        assert_close(teacher, ddp_teacher, atol=1e-5, rtol=0, msg=f"ZeRO-{stage}, teacher")
    for stage in (1, 2):  # writes to the bf16 compute copy: within its rounding
        student, teacher = _split(out[f"zero{stage}-bf16-plain"]["state"])
        assert _student_max(student) <= CLIP + BF16_SPACING, f"ZeRO-{stage}: the export lost the clamp"
        assert_close(student, ddp_student, atol=1e-3, rtol=0, msg=f"ZeRO-{stage}, bf16-mixed, plain")
        assert_close(teacher, ddp_teacher, atol=2e-5, rtol=0, msg=f"ZeRO-{stage}, teacher, plain")
    # fp16: the poisoned step is skipped; its refresh keeps the previous step's clamp
    before = out["zero1-fp16"]["before_clamp"]
    assert len(before) == STEPS + 1  # the skipped step is not counted (Lightning, as under DDP)
    assert before[POISONED] <= CLIP * (1 + 2.0**-10), before
    assert max(before) > CLIP  # the updates do move weights past the clamp
    # stage 0 keeps fp32 weights under autocast and skips the same step
    assert_close(out["zero1-fp16"]["state"], out["zero0-fp16"]["state"], atol=1e-3, rtol=0)


# ---------------------------------------------------------------------- Fabric: precision and refusals
def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _fabric_runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for stage in (2, 3):
        strategy = FabricHybridParallelStrategy(zero_stage=stage)
        fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy, precision="bf16-mixed")
        fabric.launch()
        net = _net()
        model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        fabric.backward(model(x).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        start = strategy.consolidated_state_dict()
        with strategy.gathered_params(writeback=True), torch.no_grad():
            weight = model.module[0].weight
            weight[0, 0] = 0.5  # one element, on every rank
        written = strategy.consolidated_state_dict()
        refused, after_refusal, dropped = "", written, written
        if stage == 3:  # below it the parameters are whole on every rank: the context does nothing
            try:
                with strategy.gathered_params(writeback=True), torch.no_grad():
                    if rank == 0:
                        model.module[2].bias.add_(1.0)
            except RuntimeError as err:
                refused = str(err)
            after_refusal = strategy.consolidated_state_dict()
            with strategy.gathered_params(), torch.no_grad():
                model.module[2].bias.add_(1.0)  # without writeback: dropped at the exit
            dropped = strategy.consolidated_state_dict()
        out[stage] = {
            "start": start,
            "written": written,
            "refused": refused,
            "after_refusal": after_refusal,
            "dropped": dropped,
        }
        strategy.destroy_process_groups()
    return out


def test_fabric_writes_keep_the_fp32_masters_and_refuse_one_rank_writes() -> None:
    out = run_distributed(_fabric_runs, WORLD, init_group=False, timeout=300)[0]
    for stage in (2, 3):
        run = out[stage]
        start, written = run["start"], run["written"]
        assert start["0.weight"].dtype == torch.float32
        assert written["0.weight"][0, 0].item() == 0.5
        mask = torch.ones_like(start["0.weight"], dtype=torch.bool)
        mask[0, 0] = False
        # every element nobody wrote keeps its fp32 master bitwise (not rounded through bf16)
        assert torch.equal(written["0.weight"][mask], start["0.weight"][mask])
        assert (start["0.weight"][mask] != start["0.weight"][mask].bfloat16().float()).any()
        for key in ("0.bias", "2.weight", "2.bias"):
            assert torch.equal(written[key], start[key]), (stage, key)
    run = out[3]  # a write on rank 0 only is refused before any shard changes
    assert "ranks wrote different values" in run["refused"]
    assert_close(run["after_refusal"], run["written"], rtol=0, atol=0)
    assert_close(run["dropped"], run["written"], rtol=0, atol=0)


# ------------------------------------------------------------------ replaced data: torch's prune.remove
class Pruned(pl.LightningModule):
    """Magnitude pruning by hand (torch's ``prune``), made permanent at the end of training with
    ``prune.remove``, which replaces the parameter's ``.data`` by the masked weight: at ZeRO-3 inside
    ``gathered_params(writeback=True)`` (every rank), elsewhere as under ``"ddp"``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        prune.l1_unstructured(self.net[0], "weight", amount=0.4)

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        (x,) = batch
        return self.net(x).pow(2).mean() - self.net(x).mean()

    def on_train_end(self) -> None:
        strategy = self.trainer.strategy
        ours = isinstance(strategy, HybridParallelStrategy)
        with strategy.gathered_params(writeback=True) if ours else nullcontext():
            prune.remove(self.net[0], "weight")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _pruned_runs(rank: int, world: int) -> dict[str, dict[str, Tensor]]:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 8, generator=g))
    out = {}
    for name, strategy, precision in (
        ("ddp", DDPStrategy(), "32-true"),
        ("zero1", HybridParallelStrategy(zero_stage=1), "32-true"),
        ("zero3", HybridParallelStrategy(zero_stage=3, meta_init=False), "32-true"),
        ("ddp-bf16", DDPStrategy(), "bf16-mixed"),
        ("zero2-bf16", HybridParallelStrategy(zero_stage=2), "bf16-mixed"),  # fp32 masters apart
    ):
        module = Pruned()
        cpu_trainer(strategy, max_steps=STEPS, precision=precision).fit(
            module, DataLoader(data, batch_size=4)
        )
        out[name] = {k: v.float() for k, v in final_state(module, strategy).items()}
    return out


def test_prune_remove_keeps_the_pruned_weights_at_every_stage() -> None:
    """Before, inside ``gathered_params(writeback=True)`` the replacement was dropped at the exit, silently:
    at ZeRO-3 the unpruned weight came back (0.145 off ``"ddp"``, no zeros), at ZeRO 1/2 in mixed
    precision the masters kept it too."""
    out = run_distributed(_pruned_runs, WORLD, init_group=False, timeout=300)[0]
    ddp = out["ddp"]
    assert float((ddp["net.0.weight"] == 0).float().mean()) > 0.3  # pruned and made permanent
    for name in ("zero1", "zero3"):
        assert out[name].keys() == ddp.keys(), name
        assert_close(out[name], ddp, msg=f"{name}")
    # ZeRO-2 in bf16-mixed: the replacement inside the whole fp32 copy reaches the masters (bf16 rounding
    # of the steps' compute copies apart)
    pruned, reference = out["zero2-bf16"]["net.0.weight"], out["ddp-bf16"]["net.0.weight"]
    assert torch.equal(pruned == 0, reference == 0)
    assert_close(out["zero2-bf16"], out["ddp-bf16"], atol=2e-3, rtol=2e-2)


# ------------------------------------------------- a momentum update between the forward and the backward
class Moco(pl.LightningModule):
    """MoCo's key encoder: a frozen copy of the query encoder, moved towards it by momentum inside
    ``training_step`` after the query forward and before the key forward and the backward (at ZeRO-3
    inside ``gathered_params(writeback=True)``, on every rank)."""

    def __init__(self, *, plain: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.query = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.key = copy.deepcopy(self.query).requires_grad_(False)
        self.plain = plain  # the update as under "ddp", without gathered_params

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        (x,) = batch
        q = self.query(x)
        strategy = self.trainer.strategy
        ours = isinstance(strategy, HybridParallelStrategy) and not self.plain
        with strategy.gathered_params(writeback=True) if ours else nullcontext(), torch.no_grad():
            for k, p in zip(self.key.parameters(), self.query.parameters(), strict=True):
                k.mul_(0.9).add_(p, alpha=0.1)
        with torch.no_grad():
            k = self.key(x + 0.1)
        return F.mse_loss(q, k) + q.pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.query.parameters(), lr=0.1)


def _moco_runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(2)
    data = TensorDataset(torch.randn(32, 8, generator=g))
    out: dict[str, Any] = {}
    for name, strategy, precision, plain in (
        ("ddp", DDPStrategy(), "32-true", False),
        ("zero3", HybridParallelStrategy(zero_stage=3), "32-true", False),
        (
            "zero3-units",
            HybridParallelStrategy(zero_stage=3, zero3_units=["query.0", "key.0"]),
            "32-true",
            False,
        ),
        ("ddp-bf16", DDPStrategy(), "bf16-mixed", False),
        ("zero3-bf16", HybridParallelStrategy(zero_stage=3), "bf16-mixed", False),
        ("zero3-bf16-plain", HybridParallelStrategy(zero_stage=3), "bf16-mixed", True),
    ):
        module = Moco(plain=plain)
        trainer = cpu_trainer(strategy, max_steps=STEPS, precision=precision)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, DataLoader(data, batch_size=4))
        out[name] = {k: v.float() for k, v in final_state(module, strategy).items()}
        out[f"{name}/warned"] = [
            str(w.message) for w in caught if "written in place inside" in str(w.message)
        ]
    return out


def test_a_momentum_update_inside_the_step_between_forward_and_backward() -> None:
    """Before, at ZeRO-3 the exit of ``gathered_params()`` freed the units the step's graph still held
    (the root), and the backward failed: "setStorage: ... out of bounds for storage of size 0"."""
    out = run_distributed(_moco_runs, WORLD, init_group=False, timeout=300)[0]
    for name in ("zero3", "zero3-units"):
        assert out[name].keys() == out["ddp"].keys(), name
        assert_close(out[name], out["ddp"], msg=name)
    # bf16-mixed: inside gathered_params(writeback=True) the key encoder's momentum steps reach its fp32
    # shards, as under "ddp" (the query encoder computes with bf16 copies: rounding)
    assert_close(out["zero3-bf16"], out["ddp-bf16"], atol=2e-3, rtol=2e-2)
    assert not out["zero3-bf16/warned"] and not out["zero3/warned"]
    # the same update made in the step's 16-bit gathered copy keeps bf16 precision: said, naming the fix
    (warned, *_) = out["zero3-bf16-plain/warned"]
    assert "'key.0.weight'" in warned and "gathered_params(writeback=True)" in warned, warned
