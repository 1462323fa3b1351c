"""Hugging Face's ``generate()`` on a model trained under ZeRO-3, called where users call it: in
``validation_step``, in ``on_validation_epoch_end`` and in a callback's ``on_validation_end`` (outside
any step: the model's own code calls the embedding and the head without the LightningModule's forward,
so the strategy's step context does not gather them), and after ``fit``. At ZeRO-3 and at tp2 x ZeRO-3
(its KV cache holding the local heads), each greedy generation equals the one of the single-process
model at the weights the run ended with. Before, the two hooks generated from the root unit's NaN
placeholders: token 0 after the prompt, silently.

Generation that ends sooner on one rank (its prompt meets the end-of-sequence token at the first new
token, the other rank's never): at ZeRO-3 every rank must still run as many forwards, each gathering the
units. Hugging Face's ``generate()`` does so (``synced_gpus``) for models it knows are sharded; the
engine marks them while it runs. Each rank's generations in ``validation_step`` equal ``"ddp"``'s, and
the mark is gone after the run. Before, the next gathers failed (Gloo: connection reset).

Generation on rank 0 only (a callback sampling for the logger), inside ``strategy.gathered_params()``
entered by every rank: equal to the one-process model, under the Trainer and in a Fabric loop, and
nothing stays gathered after it. Without it the other ranks are not there to gather with rank 0."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.fabric import HybridParallelStrategy as FabricStrategy
from tests.distributed import run_distributed
from tests.third_party import Tokens, llama

PROMPT = torch.tensor([[5, 9, 3, 7], [1, 2, 3, 4]])


def _generate(model: Any) -> Tensor:
    return model.generate(PROMPT, max_new_tokens=5, do_sample=False, pad_token_id=0).cpu()


class Generating(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model: Any = None
        self.generated: dict[str, Tensor] = {}

    def configure_model(self) -> None:
        if self.model is None:
            self.model = llama(seed=0)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.model(input_ids=x).logits.flatten(0, 1), y.flatten())

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        if batch_idx == 0:
            self.generated["validation_step"] = _generate(self.model)

    def on_validation_epoch_end(self) -> None:
        self.generated["on_validation_epoch_end"] = _generate(self.model)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class Sampler(pl.Callback):
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.generated["callback"] = _generate(pl_module.model)  # type: ignore[operator]
        # gathered for the calls only: nothing stays gathered after them
        self.live_units = trainer.strategy.engine.memory_bytes()["live_units"]  # type: ignore[attr-defined]


def _runs(rank: int, world: int) -> dict[str, Any]:
    out = {}
    layouts = {"zero3": {}, "tp2_zero3": {"tensor_parallel_size": 2, "tp_plan": "llama"}}
    for name, kw in layouts.items():
        pl.seed_everything(0)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=HybridParallelStrategy(zero_stage=3, **kw),  # type: ignore[arg-type]
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[Sampler()],
        )
        module, sampler = Generating(), trainer.callbacks[0]
        trainer.fit(module, DataLoader(Tokens(8), batch_size=4), DataLoader(Tokens(4), batch_size=2))
        state = trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]
        generated = dict(module.generated)
        generated["after_fit"] = _generate(module.model)
        trainer.strategy.destroy_process_groups()  # type: ignore[attr-defined]
        prefix = "model."  # the LightningModule's attribute
        assert sampler.live_units == 0  # type: ignore[attr-defined]
        out[name] = {
            "generated": generated,
            "state": {k.removeprefix(prefix): v.clone() for k, v in state.items()},
        }
    return out


def test_generate_inside_and_outside_steps_at_zero3_equals_one_process() -> None:
    runs = run_distributed(_runs, 2, init_group=False)
    torch.set_num_threads(1)
    start = _generate(llama(seed=0))
    for name in ("zero3", "tp2_zero3"):
        reference = llama(seed=0)
        reference.load_state_dict(runs[0][name]["state"])  # the weights the run ended with
        want = _generate(reference)
        assert not torch.equal(want, start)  # training changed what it generates
        for rank, run in enumerate(runs):
            generated = run[name]["generated"]
            assert generated.keys() == {"validation_step", "on_validation_epoch_end", "callback", "after_fit"}
            for where, got in generated.items():
                assert torch.equal(got, want), (name, rank, where, got.tolist(), want.tolist())


class EndsEarly(pl.LightningModule):
    """Generates from this rank's prompt with ``eos`` as end-of-sequence token."""

    def __init__(self, eos: int) -> None:
        super().__init__()
        self.model = llama(seed=0)
        self.eos = eos
        self.generated: list[Tensor] = []
        self.marked_in_step = False

    def validation_step(self, batch: tuple[Tensor], batch_idx: int) -> None:
        self.marked_in_step = getattr(self.model, "_is_fsdp_managed_module", False)
        out = self.model.generate(
            batch[0], max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=self.eos
        )
        self.generated.append(out.cpu())


def _ends_early(rank: int, world: int, eos: int, zero3: bool) -> dict[str, Any]:
    module = EndsEarly(eos)
    strategy = HybridParallelStrategy(zero_stage=3, meta_init=False) if zero3 else "ddp"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    prompt = PROMPT[rank : rank + 1]
    trainer.validate(module, DataLoader([(prompt,), (prompt,)], batch_size=None), verbose=False)
    return {
        "generated": module.generated,
        "marked_in_step": module.marked_in_step,
        "marked_after": "_is_fsdp_managed_module" in module.model.__dict__,
    }


def test_generation_ending_sooner_on_one_rank_at_zero3_equals_ddp() -> None:
    torch.set_num_threads(1)
    eos = int(_generate(llama(seed=0))[0, PROMPT.shape[1]])  # rank 0's first new token
    ddp = run_distributed(_ends_early, 2, eos, False, init_group=False)
    ours = run_distributed(_ends_early, 2, eos, True, init_group=False)
    lengths = [r["generated"][0].shape[1] - PROMPT.shape[1] for r in ddp]
    assert lengths == [1, 6], lengths  # rank 0 stops at once, rank 1 runs its 6 tokens
    for rank, (got, want) in enumerate(zip(ours, ddp, strict=True)):
        assert len(got["generated"]) == len(want["generated"]) == 2
        for g, w in zip(got["generated"], want["generated"], strict=True):
            assert torch.equal(g, w), (rank, g.tolist(), w.tolist())
        assert got["marked_in_step"] and not got["marked_after"], rank  # gone with the engine


class RankZeroSampler(pl.Callback):
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy: Any = trainer.strategy
        with strategy.gathered_params():
            if trainer.is_global_zero:
                self.generated = _generate(pl_module.model)  # type: ignore[operator]
        self.live_units = strategy.engine.memory_bytes()["live_units"]


def _rank_zero(rank: int, world: int) -> dict[str, Any]:
    sampler = RankZeroSampler()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=HybridParallelStrategy(zero_stage=3, meta_init=False),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[sampler],
    )
    trainer.validate(EndsEarly(eos=-1), DataLoader([(PROMPT[:1],)], batch_size=None), verbose=False)
    trainer.strategy.destroy_process_groups()  # type: ignore[attr-defined]
    fabric = Fabric(accelerator="cpu", devices=world, strategy=FabricStrategy(zero_stage=3))
    fabric.launch()
    model = fabric.setup(llama(seed=0))
    with fabric.strategy.gathered_params():  # type: ignore[attr-defined]
        fabric_generated = _generate(model) if rank == 0 else None
    return {
        "trainer": getattr(sampler, "generated", None),
        "live_units": sampler.live_units,
        "fabric": fabric_generated,
        "fabric_live_units": fabric.strategy.engine.memory_bytes()["live_units"],  # type: ignore[attr-defined]
    }


def test_generation_on_rank_zero_only_inside_gathered_params() -> None:
    torch.set_num_threads(1)
    want = _generate(llama(seed=0))
    runs = run_distributed(_rank_zero, 2, init_group=False)
    for key in ("trainer", "fabric"):
        assert torch.equal(runs[0][key], want), (key, runs[0][key].tolist(), want.tolist())
        assert runs[1][key] is None, key
    for run in runs:
        assert run["live_units"] == run["fabric_live_units"] == 0
