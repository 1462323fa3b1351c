"""Logging gradient norms from ``on_before_optimizer_step`` at ZeRO 1-3, on 2 Gloo ranks.

Lightning's documented recipe is ``self.log_dict(grad_norm(self, norm_type=2))`` in
``on_before_optimizer_step``. At ZeRO 1-3 the gradients live in each rank's shards and ``param.grad`` is
None, so that function returns ``{}`` and nothing is logged. ``trainer.strategy.grad_norm(module,
norm_type)`` gives the same dictionary from the shards (a parameter's pieces may lie on both ranks).

Checked against Lightning's ``grad_norm`` under ``"ddp"`` in the same processes, at every optimizer step
of a run with a frozen layer (left out, as Lightning leaves out parameters without a gradient): the keys,
every parameter's norm and the total, for the 2-norm and the inf-norm, of the whole LightningModule and of
one submodule (names relative to it), at stages 1, 2 and 3.

Under tensor parallelism Lightning's function gives each rank's slice norms, and under pipeline
parallelism the norms of the rank's own stage only (before, ``strategy.grad_norm`` handed those on at
ZeRO-0 and refused at ZeRO 1-3). Checked against Lightning's ``grad_norm`` in one process fed the same
batches (each dp rank's rows given by hand): tp2 (the first layer column-parallel, the frozen one
row-parallel, the head replicated) at stages 0 and 1, pp2 at stages 0 and 2, on 2 ranks; and dp2 x tp2 at
stage 2 and dp2 x pp2 at stage 3 on 4 ranks, where the dp ranks' fragments, the tp slices and the stages
all add up; and Hugging Face's GPT-2 at pp2 (ZeRO-1), whose tied embedding and LM head sit on different
stages, their summed gradient counted once.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.pytorch.utilities import grad_norm
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_par import HybridParallelStrategy
from lightning_par.fabric import HybridParallelStrategy as FabricStrategy
from lightning_par.pipeline import hf_pipeline_layers
from tests.distributed import run_distributed
from tests.third_party import GPT2, Tokens, hf_model

WORLD, STEPS = 2, 3


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 24), nn.ReLU(), nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 1))
        self.net[2].requires_grad_(False)  # frozen: no gradient, no entry
        self.records: list[dict[str, float]] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.net)

    def pipeline_loss(self, output: Tensor, batch: tuple[Tensor, Tensor]) -> Tensor:
        return F.mse_loss(output, batch[1])

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        strategy: Any = self.trainer.strategy
        norms = strategy.grad_norm if isinstance(strategy, HybridParallelStrategy) else grad_norm
        record: dict[str, float] = {}
        for target, tag in ((self, "all"), (self.net[4], "head")):
            for p in (2, "inf"):
                for key, value in norms(target, norm_type=p).items():
                    record[f"{tag}:{key}"] = float(value)
        self.records.append(record)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


class TiedGPT2(pl.LightningModule):
    """Hugging Face's GPT-2 (embedding and LM head tied) behind the pipeline protocol: under pp2 the tied
    weight has a copy on each end stage, whose summed gradient must be counted once."""

    def __init__(self) -> None:
        super().__init__()
        no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.model = hf_model("GPT2LMHeadModel", "GPT2Config", seed=0, **GPT2, **no_dropout)
        self._layers: list[nn.Module] | None = None
        self.records: list[dict[str, float]] = []

    def pipeline_layers(self) -> list[nn.Module]:
        if self._layers is None:
            self._layers = hf_pipeline_layers(self.model)
        return self._layers

    def pipeline_input(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        return batch[0]

    def pipeline_loss(self, logits: Tensor, batch: tuple[Tensor, Tensor]) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.pipeline_loss(self.model(input_ids=batch[0]).logits, batch)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        strategy: Any = self.trainer.strategy
        norms = strategy.grad_norm if isinstance(strategy, HybridParallelStrategy) else grad_norm
        self.records.append({k: float(v) for k, v in norms(self, norm_type=2).items()})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


# the first layer's rows and the frozen layer's columns are tp slices; the head is replicated
TP_PLAN = {"net.0": "colwise", "net.2": "rowwise"}


def _fit(
    strategy: Any, devices: int = WORLD, rows: list[list[int]] | None = None, gpt2: bool = False
) -> list[dict[str, float]]:
    """Fit for ``STEPS`` steps. ``rows``: this rank's batches (Lightning's sampler left out, as
    ``use_distributed_sampler=False``); by default shuffled batches of 8 and Lightning's sampler."""
    pl.seed_everything(7)
    module: Net | TiedGPT2 = TiedGPT2() if gpt2 else Net()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 8, generator=g)
    data: Dataset[Any] = Tokens(64) if gpt2 else TensorDataset(x, x.sum(1, keepdim=True).sin())
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        use_distributed_sampler=rows is None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = (
        DataLoader(data, batch_size=8, shuffle=True) if rows is None else DataLoader(data, batch_sampler=rows)
    )
    trainer.fit(module, loader)
    return module.records


def _blocks(dp: int, dp_rank: int) -> list[list[int]]:
    """Batches of 8 rows per dp rank; at each step the dp ranks' rows are one contiguous block."""
    return [[k * 8 * dp + dp_rank * 8 + j for j in range(8)] for k in range(STEPS)]


class Forward(Net):
    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def _fabric(rank: int, strategy: Any) -> list[dict[str, float]]:
    """A Fabric loop logging the norms between ``fabric.backward`` and ``optimizer.step()``: the strategy's
    ``grad_norm`` (of the whole model and of one submodule, through Fabric's wrapper), Lightning's
    ``grad_norm`` under Fabric's ``"ddp"``."""
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    module = Forward()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
    records = []
    for step in range(STEPS):
        rows = slice(step * 16 + rank * 8, step * 16 + rank * 8 + 8)
        fabric.backward(F.mse_loss(model(x[rows]), x[rows].sum(1, keepdim=True).sin()))
        if isinstance(strategy, FabricStrategy):
            norms = {**fabric.strategy.grad_norm(model), **fabric.strategy.grad_norm(module.net[4], 1.0)}
        else:
            norms = {**grad_norm(model.module, 2.0), **grad_norm(model.module.net[4], 1.0)}
        records.append({k: float(v) for k, v in norms.items()})
        optimizer.step()
        optimizer.zero_grad()
    if isinstance(strategy, FabricStrategy):
        strategy.destroy_process_groups()
    return records


def _runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    hp = HybridParallelStrategy
    return {
        "ddp": _fit("ddp"),
        "s1": _fit(hp(zero_stage=1)),
        "s2": _fit(hp(zero_stage=2)),
        "s3": _fit(hp(zero_stage=3, meta_init=False)),
        "fabric_ddp": _fabric(rank, "ddp"),
        "fabric_s2": _fabric(rank, FabricStrategy(zero_stage=2)),
        "fabric_s3": _fabric(rank, FabricStrategy(zero_stage=3, meta_init=False)),
    }


def test_grad_norm_from_shards_equals_lightning_grad_norm_under_ddp() -> None:
    ranks = run_distributed(_runs, WORLD, init_group=False, timeout=300)
    ddp = ranks[0]["ddp"]
    assert len(ddp) == STEPS
    assert "all:grad_2.0_norm/net.0.weight" in ddp[0] and "head:grad_inf_norm/weight" in ddp[0], sorted(
        ddp[0]
    )
    assert not any("net.2." in k for k in ddp[0]), "the frozen layer has an entry"
    for r, out in enumerate(ranks):
        # Fabric: the strategy's grad_norm (before, the Trainer's only) equals Lightning's under "ddp"
        assert (
            "grad_1.0_norm/weight" in out["fabric_ddp"][0] and "grad_2.0_norm_total" in out["fabric_ddp"][0]
        )
        for key in ("fabric_s2", "fabric_s3"):
            _assert_records(out[key], out["fabric_ddp"], f"{r} {key}")
        for key in ("s1", "s2", "s3"):
            assert len(out[key]) == STEPS, (r, key)
            for step, (ours, theirs) in enumerate(zip(out[key], out["ddp"], strict=True)):
                assert set(ours) == set(theirs), (r, key, step, sorted(set(ours) ^ set(theirs)))
                for name, value in theirs.items():
                    torch.testing.assert_close(
                        ours[name], value, rtol=1e-5, atol=1e-7, msg=f"{r} {key} {name}"
                    )


def _layouts(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    hp = HybridParallelStrategy
    if world == 2:  # dp 1: every rank sees every row
        cases = {
            "tp2_s0": hp(tensor_parallel_size=2, tp_plan=TP_PLAN),
            "tp2_s1": hp(zero_stage=1, tensor_parallel_size=2, tp_plan=TP_PLAN),
            "pp2_s0": hp(pipeline_parallel_size=2),
            "pp2_s2": hp(zero_stage=2, pipeline_parallel_size=2),
        }
        out = {name: _fit(strategy, world, _blocks(1, 0)) for name, strategy in cases.items()}
        out["gpt2_pp2_s1"] = _fit(hp(zero_stage=1, pipeline_parallel_size=2), world, _blocks(1, 0), gpt2=True)
        return out
    # rank = pp_rank * dp * tp + dp_rank * tp + tp_rank (lightning_par.mesh)
    return {
        "dp2_tp2_s2": _fit(
            hp(zero_stage=2, tensor_parallel_size=2, tp_plan=TP_PLAN), world, _blocks(2, rank // 2)
        ),
        "dp2_pp2_s3": _fit(
            hp(zero_stage=3, meta_init=False, pipeline_parallel_size=2), world, _blocks(2, rank % 2)
        ),
    }


def _assert_records(ours: list[dict[str, float]], theirs: list[dict[str, float]], what: str) -> None:
    assert len(ours) == len(theirs) == STEPS, what
    for step, (got, want) in enumerate(zip(ours, theirs, strict=True)):
        assert set(got) == set(want), (what, step, sorted(set(got) ^ set(want)))
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-7, msg=f"{what} {step} {name}")


def test_grad_norm_under_tensor_and_pipeline_parallelism_equals_one_process() -> None:
    one = _fit("auto", 1, _blocks(1, 0))
    two = _fit("auto", 1, [a + b for a, b in zip(_blocks(2, 0), _blocks(2, 1), strict=True)])
    assert "all:grad_2.0_norm/net.0.weight" in one[0] and "head:grad_inf_norm/bias" in one[0], sorted(one[0])
    assert not any("net.2." in k for k in one[0]), "the frozen layer has an entry"
    tied = _fit("auto", 1, _blocks(1, 0), gpt2=True)
    assert "grad_2.0_norm/model.transformer.wte.weight" in tied[0], sorted(tied[0])
    for world, ref in ((2, one), (4, two)):
        for r, out in enumerate(run_distributed(_layouts, world, init_group=False, timeout=300)):
            for key, records in out.items():
                _assert_records(records, tied if key.startswith("gpt2") else ref, f"rank {r} {key}")
