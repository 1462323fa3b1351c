"""After ``fit`` the model is whole on every rank, and what the user does with it then counts.

ZeRO-3 (the first test): a Hugging Face Llama trained 2 steps at ZeRO-3 (2 Gloo ranks), then, as after
a fit under Lightning's ``"ddp"``: the embedding read inside ``gathered_params()`` (before, refused on
every rank: "parameter ... was replaced or modified outside a forward pass", though nothing had
changed), the head halved inside ``gathered_params(writeback=True)`` and the final norm shifted in place
outside it; then ``consolidated_state_dict()`` and ``trainer.save_checkpoint`` (consolidated). Both equal
``"ddp"``'s model after the same edits; before, they returned the weights as they were at the end of fit
(the shards), dropping the edits without a word. Then a new head replaces the old one (as a merge
replaces modules): the export holds it, as ``"ddp"``'s state dict does (before, the old head, silently),
a weights-only checkpoint too, and a full checkpoint, whose optimizer state is saved by parameter name
and whose optimizer holds the vanished head, is refused naming the weights-only save (before, a bare
``KeyError`` at every stage; ``"ddp"`` saves its optimizer state by position).

ZeRO 1/2 in ``bf16-mixed`` (separate fp32 masters): see the second test.
"""

from __future__ import annotations

import io
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader

from lightning_par import HybridParallelStrategy
from lightning_par.checkpoint import consolidate
from lightning_par.fabric import HybridParallelStrategy as FabricHybridParallelStrategy
from tests.distributed import run_distributed
from tests.fits import cpu_trainer
from tests.test_strategy import Tokens
from tests.third_party import LLAMA, LoraLlama


def _job(rank: int, world: int, tmp: str, name: str) -> dict[str, Any]:
    torch.manual_seed(0)
    strategy: Any = "ddp" if name == "ddp" else HybridParallelStrategy(zero_stage=3, meta_init=False)
    module = LoraLlama(lora=False)
    pools = PoolBytes()
    trainer = cpu_trainer(strategy, devices=world, max_steps=2, limit_val_batches=0, callbacks=[pools])
    trainer.fit(module, DataLoader(Tokens(16), batch_size=2))
    if name != "ddp":  # ZeRO-3's pooled gradient buffers serve steps only: freed at the end of fit
        pools.seen.append(trainer.strategy.memory_report()["comm_buffers"])  # type: ignore[attr-defined]
    model = module.model
    assert model is not None
    # "ddp" has no gathered_params(): its model is whole anyway
    gathered = getattr(trainer.strategy, "gathered_params", lambda **_: nullcontext())
    with gathered():
        embed = model.get_input_embeddings().weight.detach().clone()
    with gathered(writeback=True), torch.no_grad():
        model.lm_head.weight.mul_(0.5)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    if name == "ddp":
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    else:
        state = trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]
    path = Path(tmp) / f"after_{name}"
    trainer.save_checkpoint(path)
    saved: dict[str, torch.Tensor] = {}
    if rank == 0:
        ckpt = torch.load(path, weights_only=False) if path.is_file() else consolidate(path)
        saved = ckpt["state_dict"]
    # a module replaced after fit (as a merge does): exported as the model holds it; the optimizer, built
    # over the old one, cannot be saved by name (refused naming the weights-only save, which works)
    torch.manual_seed(7)
    model.lm_head = nn.Linear(LLAMA["hidden_size"], LLAMA["vocab_size"], bias=False)
    if name == "ddp":
        replaced = {k: v.detach().clone() for k, v in module.state_dict().items()}
    else:
        replaced = trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]
    refused = ""
    try:
        trainer.save_checkpoint(Path(tmp) / f"replaced_{name}")
    except RuntimeError as exc:
        refused = str(exc)
    weights = Path(tmp) / f"weights_{name}"
    trainer.save_checkpoint(weights, weights_only=True)
    saved_weights: dict[str, torch.Tensor] = {}
    if rank == 0:
        ckpt = torch.load(weights, weights_only=False) if weights.is_file() else consolidate(weights)
        saved_weights = ckpt["state_dict"]
    if name != "ddp":
        trainer.strategy.destroy_process_groups()  # type: ignore[attr-defined]
    return {
        "embed": embed,
        "state": state,
        "saved": saved,
        "replaced": replaced,
        "saved_weights": saved_weights,
        "refused": refused,
        "pools": pools.seen,
    }


class PoolBytes(pl.Callback):
    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        report = getattr(trainer.strategy, "memory_report", None)
        if report is not None:
            self.seen.append(report()["comm_buffers"])


def test_edits_after_fit_reach_the_export_and_the_checkpoint_as_under_ddp(tmp_path: Path) -> None:
    ref = run_distributed(_job, 2, str(tmp_path), "ddp", init_group=False, timeout=300)
    ours = run_distributed(_job, 2, str(tmp_path), "zero3", init_group=False, timeout=300)
    for rank in range(2):
        torch.testing.assert_close(ours[rank]["embed"], ref[rank]["embed"], msg=f"rank {rank} embedding")
    for what, reference in (("state", "state"), ("saved", "state"), ("replaced", "replaced")):
        got, want = ours[0][what], ref[0][reference]
        assert set(got) == set(want), (what, sorted(set(got) ^ set(want)))
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, msg=f"{what}: {k}")
    for k, v in ref[0]["replaced"].items():
        torch.testing.assert_close(ours[0]["saved_weights"][k], v, msg=f"weights only: {k}")
        torch.testing.assert_close(ref[0]["saved_weights"][k], v, msg=f"ddp weights only: {k}")
    assert ref[0]["refused"] == ""  # "ddp" saves its optimizer positionally, whatever it was built over
    for rank in range(2):
        # before, the pools outlived the fit (more bytes than the shards on a larger Llama)
        during, after = ours[rank]["pools"]
        assert during > 0 and after == 0, ours[rank]["pools"]
        assert "no longer has (shapes [(64, 32)])" in ours[rank]["refused"], ours[rank]["refused"]
        assert "save_checkpoint(path, weights_only=True)" in ours[rank]["refused"]


class MidFitWeights(pl.Callback):
    """A weights-only checkpoint after the first step, beside the strategy's export at that moment."""

    def __init__(self, path: Path) -> None:
        self.path, self.export = path, {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 1:
            trainer.save_checkpoint(self.path, weights_only=True)
            self.export = trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]


class HeadHooked(LoraLlama):
    """A save hook for weights-only checkpoints that writes its own head (kept over the masters), exports
    the decoder under another prefix into a new dict and adds an alias of the final norm (both the masters:
    the tensors the hook got, moved or shared)."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "optimizer_states" not in checkpoint:
            shape = (LLAMA["vocab_size"], LLAMA["hidden_size"])
            state = checkpoint["state_dict"]
            state["model.lm_head.weight"] = torch.zeros(shape)
            state["alias.norm"] = state["model.model.norm.weight"]
            checkpoint["state_dict"] = {k.replace("model.model.", "decoder."): v for k, v in state.items()}


def _mixed_job(rank: int, world: int, tmp: str, name: str) -> dict[str, Any]:
    """``bf16-mixed``: at ZeRO 1/2 the fp32 masters are separate from the 16-bit compute copy."""
    torch.manual_seed(0)
    strategy: Any = "ddp" if name == "ddp" else HybridParallelStrategy(zero_stage=int(name[-1]))
    module = HeadHooked(lora=False)
    trainer = cpu_trainer(strategy, devices=world, max_steps=2, limit_val_batches=0, precision="bf16-mixed")
    mid = MidFitWeights(Path(tmp) / f"mid_{name}")
    if name != "ddp":
        trainer.callbacks.append(mid)  # type: ignore[attr-defined]
    trainer.fit(module, DataLoader(Tokens(16), batch_size=2))
    model = module.model
    assert model is not None
    gathered = getattr(trainer.strategy, "gathered_params", lambda **_: nullcontext())
    with torch.no_grad():
        model.model.norm.weight.mul_(0.5)
        head = model.lm_head.weight.detach().clone()
    with gathered(writeback=True), torch.no_grad():
        model.lm_head.weight.add_(0.25)
    own = {k: v.detach().clone() for k, v in module.state_dict().items()}
    export = own if name == "ddp" else trainer.strategy.consolidated_state_dict()  # type: ignore[attr-defined]
    path = Path(tmp) / f"mixed_{name}"
    trainer.save_checkpoint(path)
    out: dict[str, Any] = {"own": own, "head": head, "dtypes": {p.dtype for p in model.parameters()}}
    if rank == 0:
        ckpt = torch.load(path, weights_only=False) if path.is_file() else consolidate(path)
        buffer = io.BytesIO()
        torch.save(model, buffer)  # the whole module pickled, as users save a model
        buffer.seek(0)
        if name != "ddp":  # mid-fit the fp32 masters are apart from the bf16 parameters
            weights = torch.load(mid.path, weights_only=True) if mid.path.is_file() else {}
            out |= {"mid_file": mid.path.is_file(), "mid": weights, "mid_export": mid.export}
        out |= {
            "export": export,
            "saved": ckpt["state_dict"],
            "pickled": torch.load(buffer, weights_only=False),
        }
    if name != "ddp":
        trainer.strategy.destroy_process_groups()  # type: ignore[attr-defined]
    return out


def test_bf16_mixed_edits_after_fit_reach_exports_and_the_model_pickles(tmp_path: Path) -> None:
    """ZeRO 1/2 in ``bf16-mixed`` against ``"ddp"``'s contract: after fit the model holds fp32 weights, and
    the export and the checkpoint are what it holds (an in-place edit, a ``gathered_params(writeback=True)``
    write included). Before: both returned the end-of-fit masters, the write inside ``gathered_params`` was
    applied to those masters and left the parameters bf16, and ``torch.save(model)`` failed ("Can't pickle
    local object 'compute_in_fp32.<locals>.forward'": the norm layers' fp32 wrapper outlived the fit)."""
    for name in ("ddp", "zero1", "zero2"):
        results = run_distributed(_mixed_job, 2, str(tmp_path), name, init_group=False, timeout=300)
        for r in results:
            assert r["dtypes"] == {torch.float32}, (name, r["dtypes"])
            torch.testing.assert_close(r["own"]["model.lm_head.weight"], r["head"] + 0.25, msg=name)
        first = results[0]
        pickled = first["pickled"].state_dict()
        for k, v in first["own"].items():
            torch.testing.assert_close(first["export"][k], v, msg=f"{name} export {k}")
            torch.testing.assert_close(first["saved"][k], v, msg=f"{name} checkpoint {k}")
            torch.testing.assert_close(pickled[k.removeprefix("model.")], v, msg=f"{name} pickled {k}")
        if name != "ddp":
            # a weights-only checkpoint in mid-fit: one file, as "ddp" writes, holding the fp32 masters
            # (before, a directory whose weights were the bf16 copies the parameters are then)
            assert first["mid_file"] and "optimizer_states" not in first["mid"], name
            saved = dict(first["mid"]["state_dict"])
            head = saved.pop("model.lm_head.weight")
            assert torch.equal(head, torch.zeros_like(head)), name
            expected = {k.replace("model.model.", "decoder."): v for k, v in first["mid_export"].items()}
            expected["alias.norm"] = first["mid_export"]["model.model.norm.weight"]
            del expected["model.lm_head.weight"]
            assert saved.keys() == expected.keys(), (name, saved.keys() ^ expected.keys())
            for k, v in expected.items():
                assert v.dtype == torch.float32, (name, k)
                torch.testing.assert_close(saved[k], v, rtol=0, atol=0, msg=f"{name} {k}")


def _fabric_job(rank: int, world: int, name: str) -> dict[str, Any]:
    """A Fabric loop in ``bf16-mixed``, then the strategy's teardown: the user's norm layer is its own
    again (the fp32 wrapper set at setup is gone), the model is whole and fp32 (ZeRO-3 gathered, ZeRO-1's
    masters), and it pickles."""
    strategy: Any = "ddp"
    if name != "ddp":  # units per layer at ZeRO-3, so they really shard
        units = {"zero3_units": [nn.Linear, nn.LayerNorm]} if name == "zero3" else {}
        strategy = FabricHybridParallelStrategy(zero_stage=int(name[-1]), **units)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="bf16-mixed")
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped, optimizer = fabric.setup(model, optimizer)
    data = torch.Generator().manual_seed(rank)
    for _ in range(3):
        fabric.backward(wrapped(torch.randn(4, 8, generator=data)).float().pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    fabric.strategy.teardown()
    with torch.no_grad():  # an edit after teardown outlives a second teardown (a cleanup's)
        model[2].bias.fill_(0.5)
    fabric.strategy.teardown()
    another = ""
    if name != "ddp":  # a second model wants a new Fabric (the message says so after a teardown)
        other = nn.Linear(2, 2)
        try:
            fabric.setup(other, torch.optim.SGD(other.parameters(), lr=0.1))
        except ValueError as error:
            another = str(error)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copy = torch.load(buffer, weights_only=False)
    if name != "ddp":
        fabric.strategy.destroy_process_groups()  # type: ignore[attr-defined]
    return {
        "own_forward": "forward" in vars(model[1]),
        "pickled": copy.state_dict(),
        "dtypes": {p.dtype for p in model.parameters()},
        "kept": float(model[2].bias),
        "another": another,
    }


def test_fabric_teardown_leaves_the_users_whole_model() -> None:
    """After ``fabric.strategy.teardown()``: ``"ddp"``'s model, pickled. Before, ZeRO-3 left NaN
    placeholders (the model computed and pickled NaN without a word) and ZeRO-1 its bf16 compute copies;
    the norm layers' fp32 wrapper stayed (pickling failed)."""
    states = {}
    for name in ("ddp", "zero1", "zero3"):
        for r in run_distributed(_fabric_job, 2, name, init_group=False, timeout=300):
            assert r["own_forward"] is False, name
            assert r["dtypes"] == {torch.float32}, (name, r["dtypes"])
            assert r["kept"] == 0.5, (name, r["kept"])  # before, a second teardown undid the edit
            assert name == "ddp" or "create a new Fabric" in r["another"], r["another"]
            assert set(r["pickled"]) == {"0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"}
            states[name] = r["pickled"]
    # the stages compute alike; "ddp" autocasts where they run bf16 copies: bf16 round-off apart
    torch.testing.assert_close(states["zero3"], states["zero1"], rtol=0, atol=0)
    torch.testing.assert_close(states["zero1"], states["ddp"], rtol=0, atol=2e-3)
