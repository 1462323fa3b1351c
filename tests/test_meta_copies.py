"""Deep copies made while ZeRO-3 builds the model on the meta device start equal to their source.

A DPO reference copied from the policy in ``configure_model()`` drew other initial values than the policy
(each module's seed is its path's): policy and reference started 0.11 apart and the first DPO loss was not
ln 2, silently. Now a copy nothing was written into is drawn under its source's seed
(:mod:`lightning_par.zero.meta_copies`): equal to it, as on a real device; a copy re-initialised after it
was made keeps its own draw. Checked on the unsharded twin (``materialize_model``) against torch's own
semantics, and in a 2-rank Trainer and Fabric run at ZeRO-3 against the twin; at ZeRO-3 with tp2 (the
copies' layers replaced by sharded ones before the draw; before, their slices drew apart: a frozen
copy's embedding 4.25 off its source) policy and reference start equal too.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.fabric import HybridParallelStrategy as FabricStrategy
from lightning_par.zero.meta_build import params_on_meta
from lightning_par.zero.meta_init import materialize_model
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state
from tests.third_party import Tokens, llama


class Pair(nn.Module):
    """A policy, its reference copy, a copy whose head is re-initialised after copying, and torch's
    encoder (its layers are clones of one layer) beside ``nn.Transformer``'s (re-initialised clones)."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = llama(0)
        self.ref = copy.deepcopy(self.policy).requires_grad_(False)
        self.probe = copy.deepcopy(self.policy)
        nn.init.normal_(self.probe.lm_head.weight)  # written after the copy: its own draw
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(8, 2, 16), 2, enable_nested_tensor=False
        )
        self.ref2 = copy.deepcopy(self.ref)  # a copy of a copy
        self.encoder_copy = copy.deepcopy(self.encoder)  # its clone layers are copies of copies
        self.transformer = nn.Transformer(8, 2, 2, 1, 16)


class Lm(nn.Module):
    def __init__(self, *, tie: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)  # N(0, 1)
        self.head = nn.Linear(32, 64, bias=False)  # uniform, std 1 / sqrt(3 * 32)
        if tie:
            self.head.weight = self.emb.weight


class Ties(nn.Module):
    """Weights tied either way (the creator's draw is due), a copy of a tied model, a copy tied after."""

    def __init__(self) -> None:
        super().__init__()
        self.tied = Lm(tie=True)
        self.reverse = Lm(tie=False)
        self.reverse.emb.weight = self.reverse.head.weight
        self.copy = copy.deepcopy(self.tied)
        self.untied = Lm(tie=False)
        self.later = copy.deepcopy(self.untied)
        self.later.head.weight = self.later.emb.weight


def _check_ties(ties: Ties) -> None:
    assert ties.tied.head.weight.std() > 0.5 and ties.reverse.emb.weight.std() < 0.3
    assert ties.copy.head.weight is ties.copy.emb.weight and _equal(ties.copy, ties.tied)
    assert torch.equal(ties.later.emb.weight, ties.untied.emb.weight) and ties.later.head.weight.std() > 0.5


def _equal(a: nn.Module, b: nn.Module) -> bool:
    return all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def test_a_copy_is_drawn_as_its_source_unless_written_since() -> None:
    with params_on_meta():
        pair = Pair()
    materialize_model(pair, seed=5, device=torch.device("cpu"))
    assert _equal(pair.ref, pair.policy) and _equal(pair.ref2, pair.policy)
    assert _equal(pair.encoder_copy, pair.encoder)
    probe, policy = dict(pair.probe.named_parameters()), dict(pair.policy.named_parameters())
    assert not torch.equal(probe["lm_head.weight"], policy["lm_head.weight"])
    for name, value in probe.items():
        if name != "lm_head.weight":
            torch.testing.assert_close(value, policy[name], rtol=0, atol=0, msg=name)
    assert _equal(pair.encoder.layers[0], pair.encoder.layers[1])  # torch's clones are equal too
    real = Pair()  # torch on a real device, for the relations above
    assert _equal(real.ref, real.policy) and _equal(real.encoder.layers[0], real.encoder.layers[1])
    assert _equal(real.ref2, real.policy) and _equal(real.encoder_copy, real.encoder)
    # a tied weight holds its creator's draw (before, the later module's: head.weight = emb.weight was
    # drawn uniform, std 0.10, where torch's embedding gives N(0, 1)); copies keep the ties and values
    with params_on_meta():
        ties = Ties()
    materialize_model(ties, seed=5, device=torch.device("cpu"))
    _check_ties(ties)
    _check_ties(Ties())  # torch's own
    layers = pair.transformer.encoder.layers  # clones re-initialised after cloning: apart, as torch's
    assert not torch.equal(layers[0].linear1.weight, layers[1].linear1.weight)
    assert not torch.equal(
        real.transformer.encoder.layers[0].linear1.weight, real.transformer.encoder.layers[1].linear1.weight
    )


class Dpo(pl.LightningModule):
    """A policy and a frozen reference copied from it in ``configure_model()``."""

    def __init__(self) -> None:
        super().__init__()
        self.policy: nn.Module | None = None
        self.ref: nn.Module | None = None
        self.start: dict[str, Tensor] = {}

    def configure_model(self) -> None:
        if self.policy is None:
            self.policy = llama(0)
            self.ref = copy.deepcopy(self.policy).requires_grad_(False).eval()

    records_start = True

    def on_fit_start(self) -> None:
        if not self.records_start:
            return
        with self.trainer.strategy.gathered_params():  # type: ignore[attr-defined]
            self.start = {k: v.detach().clone() for k, v in self.state_dict().items()}

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        assert self.policy is not None and self.ref is not None
        ids, _ = batch
        with torch.no_grad():
            reference = self.ref(input_ids=ids).logits.log_softmax(-1)
        policy = self.policy(input_ids=ids).logits.log_softmax(-1)
        return (policy - reference).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Hidden(Dpo):
    """The reference kept in a plain list, out of the optimizer's and the checkpoint's sight."""

    def configure_model(self) -> None:
        if self.policy is None:
            self.policy = llama(0)
            self._ref = [copy.deepcopy(self.policy).requires_grad_(False)]


class Sliced(Dpo):
    """Read at its end (no steps) through the consolidated state: its parameters are tp slices, so its
    start is not recorded at fit start."""

    records_start = False


def _job(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    strategy = HybridParallelStrategy(zero_stage=3)
    try:  # refused at setup (before, torch's "Tensor on device meta is not on the expected device")
        cpu_trainer(strategy, max_steps=1).fit(Hidden(), DataLoader(Tokens(8), batch_size=2))
        hidden = None
    except ValueError as error:
        hidden = str(error)
    strategy.destroy_process_groups()
    # with tensor parallelism the copies' layers are replaced by sharded ones before the draw
    strategy = HybridParallelStrategy(zero_stage=3, tensor_parallel_size=2, tp_plan="llama")
    module = Sliced()
    cpu_trainer(strategy, max_steps=0).fit(module, DataLoader(Tokens(8), batch_size=2))
    tp_start = final_state(module, strategy)  # (on rank 0)
    strategy.destroy_process_groups()
    strategy = HybridParallelStrategy(zero_stage=3)
    module = Dpo()
    cpu_trainer(strategy, max_steps=0).fit(module, DataLoader(Tokens(8), batch_size=2))
    out: dict[str, Any] = {"start": module.start, "seed": strategy.engine.init_seed, "hidden": hidden}
    out["tp_start"] = tp_start
    out["trainer"] = final_state(module, strategy)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=FabricStrategy(zero_stage=3))
    fabric.launch()
    with fabric.init_module(empty_init=True):
        pair = nn.ModuleDict({"policy": llama(0)})
        pair["ref"] = copy.deepcopy(pair["policy"])
    fabric.setup_module(pair)
    out["fabric"] = {k: v.clone() for k, v in fabric.strategy.consolidated_state_dict().items()}  # type: ignore[attr-defined]
    fabric.strategy.destroy_process_groups()  # type: ignore[attr-defined]
    return out


def test_a_reference_copied_in_configure_model_starts_as_the_policy_at_zero3_or_is_refused() -> None:
    for rank, out in enumerate(run_distributed(_job, 2, init_group=False)):
        hidden = out["hidden"]
        assert hidden is not None and "['_ref[0]']" in hidden and "meta_init=False" in hidden, hidden
        for start in ("start", "tp_start") if rank == 0 else ("start",):
            assert len(out[start]) > 20
            for key, value in out[start].items():
                if key.startswith("ref."):
                    want = out[start]["policy." + key.removeprefix("ref.")]
                    torch.testing.assert_close(value, want, rtol=0, atol=0, msg=f"{start} {key}")
        if rank == 0:
            with params_on_meta():
                twin = Dpo()
                twin.configure_model()
            materialize_model(twin, seed=out["seed"], device=torch.device("cpu"))
            assert out["trainer"].keys() == twin.state_dict().keys()
            for key, value in twin.state_dict().items():
                torch.testing.assert_close(out["trainer"][key], value, rtol=0, atol=0, msg=key)
            for key, value in out["fabric"].items():
                if key.startswith("ref."):
                    want = out["fabric"]["policy." + key.removeprefix("ref.")]
                    torch.testing.assert_close(value, want, rtol=0, atol=0, msg=f"fabric {key}")
