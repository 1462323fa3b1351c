"""Parameters written in place inside a forward at ZeRO-3, on 2 Gloo ranks, against Lightning's ``"ddp"``.

Some forwards write their own weights: ``nn.Embedding(max_norm=...)`` renormalises the rows it looks up,
a cosine classifier normalises its weight before use, a frozen statistic (a running centre, a codebook)
moves by an EMA, written through the parameter or through ``param.data``. Under DDP the write stays in
the module. At ZeRO-3 the parameters are views of a gathered buffer while their unit computes; before,
freeing the unit pointed them back at their placeholders and the write was gone, silently: a frozen centre
updated in forward stayed 0.0 where ``"ddp"`` reached 0.344, a renormalised weight ended 0.59 away, an
``Embedding(max_norm=1.0)`` 3.4 away. Now a unit's writes go into this rank's shard when its forward ends,
when it is freed, and before an optimizer update (a root kept whole through a manual-optimization step);
a write still pending after an update is refused (absorbing it would undo the update).

Every rank sees the same batches here (no distributed sampler), so the writes are the same on every rank
and ``"ddp"``'s replicas stay equal: the reference is exact. Checked at ZeRO-3 (fp32, default units and
root): the final weights and the frozen parameters equal ``"ddp"``; in ``bf16-mixed`` they stay within
bf16 rounding of ``"ddp"`` and the written values hold; manual optimization accumulating over two
batches and writing a root parameter before and after ``opt.step()`` equals ``"ddp"`` (with accumulation
the first step's watches once stranded a torch function mode and failed the fit at teardown); the
engine refuses a write made after an update.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from lightning_par.zero.stage3 import Stage3Engine
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state


class Block(nn.Module):
    """A cosine-classifier-like block: its weight normalised through ``.data`` in forward, and a frozen
    centre moved by an EMA of the batch (the same on every rank here)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.centre = nn.Parameter(torch.zeros(8), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            with torch.no_grad():
                self.fc.weight.data.copy_(F.normalize(self.fc.weight.data, dim=1))
                self.centre.mul_(0.9).add_(0.1 * x.mean(0))
        return torch.tanh(self.fc(x - self.centre))


class Writer(pl.LightningModule):
    """Root parameters written in forward (a max-norm embedding, a frozen counter), blocks as units."""

    def __init__(self, *, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8, max_norm=1.0)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 1)
        self.scale = nn.Parameter(torch.ones(()))
        self.seen = nn.Parameter(torch.zeros(()), requires_grad=False)
        self.manual = manual
        self.automatic_optimization = not manual

    def forward(self, tokens: Tensor) -> Tensor:
        with torch.no_grad():
            self.seen.add_(1.0)
        h = self.embed(tokens).mean(1) * 3.0
        for block in self.blocks:
            h = block(h)
        return self.head(h).squeeze(-1) * self.scale

    def training_step(self, batch: tuple[Tensor, Tensor], index: int) -> Tensor | None:
        tokens, y = batch
        loss = F.mse_loss(self(tokens), y)
        if not self.manual:
            return loss
        opt = self.optimizers()
        self.manual_backward(loss / 2)
        if index % 2 == 0:  # accumulation: the first step's backward arms the first-step watches
            return None
        with torch.no_grad():
            self.scale.clamp_(max=0.97)  # before the update: the optimizer steps from the clamped value
        opt.step()  # type: ignore[union-attr]
        opt.zero_grad()  # type: ignore[union-attr]
        with torch.no_grad():
            self.scale.mul_(0.99)  # after it: kept until the next gather of the root
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def _loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    tokens, y = torch.randint(0, 16, (24, 5), generator=g), torch.randn(24, generator=g)
    return DataLoader(TensorDataset(tokens, y), batch_size=6)


def _fit(strategy: Any, *, manual: bool = False, precision: str = "32-true") -> dict[str, Tensor]:
    module = Writer(manual=manual)
    trainer = cpu_trainer(strategy, max_epochs=1, precision=precision, use_distributed_sampler=False)
    trainer.fit(module, _loader())
    return {k: v.float() for k, v in final_state(module, strategy).items()}


def _late_write_refused(rank: int, world: int) -> str:
    if not dist.is_initialized():  # the fits before leave Lightning's default group in place
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Writer()
    engine = Stage3Engine(model, group=dist.group.WORLD)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.shard_optimizers([opt])
    with engine.forward_context():
        model(torch.zeros(2, 5, dtype=torch.long)).sum().backward()
        opt.step()
        with torch.no_grad():
            model.scale.add_(1.0)  # after the update, before the engine re-gathers: would undo it
        try:
            engine.after_step()
        except RuntimeError as error:
            message = str(error)
        else:
            message = "not refused"
    engine.remove()
    # a module replaced inside gathered_params() without writeback (PEFT's merge_and_unload() replaces
    # its LoRA layers): the gathered values it wrote are dropped at the exit, so that is refused
    engine = Stage3Engine(model, group=dist.group.WORLD)
    try:
        with engine.gathered():
            model.head = nn.Linear(8, 1)
        replaced = "not refused"
    except RuntimeError as error:
        replaced = str(error)
    engine.remove()
    return message + "\n" + replaced


def _kept_bits(rank: int, world: int) -> dict[str, dict[str, bool]]:
    """One forward (training mode, no gradients) of an engine gathering in a lower precision than its
    fp32 shards: which shard pieces changed bitwise. A 16-bit compute copy (``compute_dtype``) is compared
    with the shard's cast, so only written elements reach the fp32 masters; a 16-bit gather of fp32
    weights (``gather_dtype``) is not the shard's copy at all, so only writes through the parameters
    (version counters) are taken, not the rounded rest."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    out = {}
    for name, options in (
        ("compute_bf16", {"compute_dtype": torch.bfloat16, "frozen_dtype": torch.float32}),
        ("gather_bf16", {"gather_dtype": torch.bfloat16}),
    ):
        torch.manual_seed(0)
        model = Writer()
        engine = Stage3Engine(model, group=dist.group.WORLD, **options)
        before = {(n, lo): view.clone() for n, lo, _, view in engine.shard_table()}
        with torch.no_grad(), engine.forward_context():
            model(torch.arange(10).reshape(2, 5))
        table = engine.shard_table()
        out[name] = {n: not torch.equal(view, before[(n, lo)]) for n, lo, _, view in table if view.numel()}
        engine.remove()
    return out


def _runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for precision in ("32-true", "bf16-mixed"):
        out[f"ddp/{precision}"] = _fit(DDPStrategy(), precision=precision)
        out[f"zero3/{precision}"] = _fit(HybridParallelStrategy(zero_stage=3), precision=precision)
    out["ddp/manual"] = _fit(DDPStrategy(), manual=True)
    out["zero3/manual"] = _fit(HybridParallelStrategy(zero_stage=3), manual=True)
    out["modes left"] = torch._C._len_torch_function_stack()
    out["late"] = _late_write_refused(rank, world)
    out["bits"] = _kept_bits(rank, world)
    return out


def test_forward_writes_at_zero3_equal_ddp() -> None:
    both = run_distributed(_runs, 2, init_group=False)
    out = both[0]
    ddp, ours = out["ddp/32-true"], out["zero3/32-true"]
    start = Writer().state_dict()
    # the writes happened: 4 steps counted, centres and embedding rows moved, normalised rows
    assert ddp["seen"].item() == 4.0 and ddp["blocks.0.centre"].abs().max() > 0.05
    assert (ddp["embed.weight"] - start["embed.weight"]).abs().max() > 0.1
    assert_close(ours, ddp)
    bf16, bf16_ddp = out["zero3/bf16-mixed"], out["ddp/bf16-mixed"]
    assert bf16["seen"].item() == 4.0
    assert_close(bf16, bf16_ddp, atol=3e-2, rtol=0)
    # the manual step's clamp (before the update) and decay (after it, the last one at teardown) hold
    assert out["ddp/manual"]["scale"].item() < 0.97
    assert_close(out["zero3/manual"], out["ddp/manual"])
    # a manual step that accumulates: the first-step watches left torch's mode stack (before, the reads
    # guard was stranded there and refused teardown's module.cpu())
    assert out["modes left"] == 0
    assert "written in place while gathered" in out["late"] and "'scale'" in out["late"]
    assert "parameters changed inside gathered_params()" in out["late"] and "writeback=True" in out["late"]
    bits: dict[str, dict[str, bool]] = {}  # per parameter: did any rank's shard piece change
    for rank_out in both:
        for case, changed in rank_out["bits"].items():
            for name, flag in changed.items():
                bits.setdefault(case, {})[name] = bits.get(case, {}).get(name, False) or flag
    # a 16-bit compute copy: the written pieces change, the untouched masters keep every bit
    assert bits["compute_bf16"]["seen"] and bits["compute_bf16"]["blocks.0.centre"]
    assert bits["compute_bf16"]["blocks.0.fc.weight"] and bits["compute_bf16"]["embed.weight"]
    assert not bits["compute_bf16"]["head.weight"] and not bits["compute_bf16"]["blocks.1.fc.bias"]
    # a 16-bit gather: writes through the parameters are kept, the gather's rounding is not
    assert bits["gather_bf16"]["seen"] and bits["gather_bf16"]["blocks.0.centre"]
    assert not bits["gather_bf16"]["head.weight"] and not bits["gather_bf16"]["blocks.1.fc.bias"]
