"""Layers whose weights meet fp32 tensors outside autocast, in 16-bit precision at ZeRO 1-3 (2 Gloo ranks).

With fp32 masters in the shards the parameters a module computes with are bf16 copies, where Lightning's
``"ddp"`` keeps fp32 parameters under autocast (``"bf16-mixed"``) or casts the whole module, buffers
included (``"bf16-true"``). Ops that CPU autocast does not cast then met a bf16 weight and an fp32 tensor,
and the first step failed where ``"ddp"`` trains:

* torch's ``nn.Bilinear`` ("All tensors must have the same dtype"), ``nn.EmbeddingBag`` with fp32
  ``per_sample_weights``, ``nn.InstanceNorm1d(affine=True)`` of an fp32 input ("mixed dtype (CPU)"), and a
  leaf norm of the user's whose name ends in ``LayerNorm`` (ConvNeXt's kind: ``F.layer_norm`` of an
  upcast input): now computed in fp32 (``lightning_par.module_dtypes``);
* ``"bf16-true"``: float buffers stayed fp32 at ZeRO 1-3 (``"ddp"`` makes them bf16), so a masked weight
  ``W * mask`` failed; now they are cast as Lightning's ``HalfPrecision`` casts them;
* any other such op of the user's (``torch.lerp`` with an fp32 weight, ``index_add_`` into an fp32
  buffer, ...) is explained: the error names the cause and ``master_weights=False``.

And a deep copy of a model whose norms compute in fp32 (an EMA made during the fit) ran the original's
weights, silently (the wrapper was a closure over the original module); now the copy computes with its own.
Reference: ``"ddp"`` at the same precision, within bf16 rounding (``"ddp"`` computes with fp32 weights).
"""

from __future__ import annotations

import copy
import pickle
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_par import HybridParallelStrategy
from lightning_par.module_dtypes import compute_in_fp32, explained_dtype_errors, restore_norms
from tests.distributed import run_distributed
from tests.fits import cpu_trainer, final_state

STEPS, N = 3, 32


class ChannelsLayerNorm(nn.Module):
    """A user's norm in ConvNeXt's style: the statistics of an upcast input, the weight applied as is."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(width)), nn.Parameter(torch.zeros(width))

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x.float(), x.shape[-1:], self.weight, self.bias)


class Zoo(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bilinear = nn.Bilinear(8, 8, 8)
        self.bag = nn.EmbeddingBag(16, 8, mode="sum")
        self.inorm = nn.InstanceNorm1d(8, affine=True)
        self.norm = ChannelsLayerNorm(8)
        self.head = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, idx, w, z, y = batch
        h = self.bilinear(x, x) + self.bag(idx, per_sample_weights=w) + self.inorm(z).mean(-1)
        return F.mse_loss(self.head(self.norm(h)).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Masked(pl.LightningModule):
    """A weight times a fixed float mask buffer (pruning, structured sparsity)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.register_buffer("mask", (torch.rand(8, 8) > 0.3).float())
        self.mask_dtypes: list[torch.dtype] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, *_, y = batch
        self.mask_dtypes.append(self.mask.dtype)
        return F.mse_loss((x @ (self.weight * self.mask).t()).sum(-1, keepdim=True).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(N, 8, generator=g),
        torch.randint(0, 16, (N, 3), generator=g),
        torch.rand(N, 3, generator=g),
        torch.randn(N, 8, 4, generator=g),
        torch.randn(N, 1, generator=g),
    )


def _fits(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for module_class, precision in ((Zoo, "bf16-mixed"), (Masked, "bf16-true")):
        for name in ("ddp", "zero1", "zero3"):
            strategy: Any = "ddp" if name == "ddp" else HybridParallelStrategy(zero_stage=int(name[-1]))
            module = module_class()
            trainer = cpu_trainer(strategy, devices=world, max_steps=STEPS, precision=precision)
            trainer.fit(module, DataLoader(_data(), batch_size=4))
            state = {k: v.float() for k, v in final_state(module, strategy).items()}
            out[f"{module_class.__name__}/{name}"] = {
                "state": state,
                "masks": getattr(module, "mask_dtypes", []),
            }
    return out


def test_layers_outside_autocast_train_at_zero_1_and_3_as_ddp() -> None:
    results = run_distributed(_fits, 2, init_group=False, timeout=300)[0]
    for model, atol in (("Zoo", 5e-3), ("Masked", 2e-2)):
        ddp = results[f"{model}/ddp"]["state"]
        for stage in ("zero1", "zero3"):
            state = results[f"{model}/{stage}"]["state"]
            assert state.keys() == ddp.keys()
            for key, value in ddp.items():
                torch.testing.assert_close(
                    state[key], value, rtol=2e-2, atol=atol, msg=f"{model} {stage} {key}"
                )
    # the buffer in the parameters' dtype inside the step, as "ddp"'s bf16-true makes it
    for name in ("ddp", "zero1", "zero3"):
        assert set(results[f"Masked/{name}"]["masks"]) == {torch.bfloat16}, name


def test_a_deep_copy_of_a_norm_computing_in_fp32_uses_its_own_weights() -> None:
    norm = nn.LayerNorm(8)
    norm.to(torch.bfloat16)  # the engine's compute copies
    compute_in_fp32(norm)
    ema = copy.deepcopy(norm)
    with torch.no_grad():
        ema.bias.add_(5.0)
    x = torch.randn(4, 8)
    torch.testing.assert_close(ema(x).mean(), torch.tensor(5.0), atol=1e-2, rtol=0)  # before: about 0
    torch.testing.assert_close(norm(x).mean(), torch.tensor(0.0), atol=1e-2, rtol=0)
    restore_norms(ema)
    assert "forward" not in ema.__dict__


def test_other_dtype_clashes_are_explained() -> None:
    """A note on torch's own exception (same object and type, traceback kept), naming the cause that may
    apply and the fixes, with the run's precision; once, however many contexts it crosses."""
    a, b = torch.randn(4, dtype=torch.bfloat16), torch.randn(4, dtype=torch.bfloat16)

    def notes() -> Any:
        return explained_dtype_errors(enabled=True, dtype=torch.bfloat16, precision="16-mixed")

    with pytest.raises(RuntimeError) as caught, notes(), notes():
        torch.lerp(a, b, torch.rand(4))
    assert type(caught.value) is RuntimeError and caught.value.__cause__ is None
    (note,) = caught.value.__notes__
    assert "bfloat16 copies" in note and "ParallelPrecision('16-mixed', master_weights=False)" in note, note

    class ConfigError(RuntimeError):
        """A user's own error: it keeps its type."""

    with pytest.raises(ConfigError) as own, notes():
        raise ConfigError("expected dtype float32 in my config")
    # neither a user's own words nor a clash of two other dtypes get the note (before, both did)
    with pytest.raises(RuntimeError) as doubles, notes():
        torch.randn(2, 3) @ torch.randn(3, 2, dtype=torch.float64)
    assert not getattr(own.value, "__notes__", None) and not getattr(doubles.value, "__notes__", None)
    plain = explained_dtype_errors(enabled=False, dtype=torch.bfloat16, precision="bf16-mixed")
    with pytest.raises(RuntimeError) as untouched, plain:  # without masters: torch's own message
        torch.lerp(a, b, torch.rand(4))
    assert not getattr(untouched.value, "__notes__", None)


def test_a_wrapped_norm_pickles_and_keeps_fp32_statistics() -> None:
    """A pickled model (``torch.save(self.net)`` in a hook during the fit) loads and computes as the
    original; a BatchNorm whose module was cast whole (``"bf16-true"`` without masters: evaluation at
    ZeRO 1-2, ZeRO-0) keeps its running statistics in fp32, the dtype it computes in (before, "expected
    scalar type Float but found BFloat16")."""
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.LayerNorm(4)).to(torch.bfloat16)
    for m in (net[1], net[2]):
        compute_in_fp32(m)
    assert net[1].running_mean.dtype == torch.float32
    x = torch.randn(8, 4, dtype=torch.bfloat16)
    out = net(x)
    loaded = pickle.loads(pickle.dumps(net))
    net.eval(), loaded.eval()
    torch.testing.assert_close(loaded(x), net(x), rtol=0, atol=0)
    assert out.dtype == torch.bfloat16


class Failing(Zoo):
    fail = True

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if self.fail and batch_idx == 1:
            raise ValueError("the user's bug")
        return super().training_step(batch, batch_idx)


class SaveFirst(pl.Callback):
    """``trainer.save_checkpoint(path)`` after the first batch."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 1:
            trainer.save_checkpoint(self.path)


def _failed_fits(rank: int, world: int, tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    said: dict[str, Any] = {}
    ckpt = f"{tmp}/first.ckpt"
    units = [nn.Linear, nn.Bilinear]  # units apart from the root, which stays gathered inside a step
    for stage, precision in ((1, "bf16-mixed"), (3, "32-true")):
        strategy = HybridParallelStrategy(zero_stage=stage, zero3_units=units if stage == 3 else None)
        trainer = cpu_trainer(
            strategy, devices=world, max_steps=STEPS, precision=precision, callbacks=[SaveFirst(ckpt)]
        )
        module = Failing()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(ValueError, match="the user's bug"):
                trainer.fit(module, DataLoader(_data(), batch_size=4))
        strategy.destroy_process_groups()
        said[f"zero{stage}"] = [str(w.message) for w in caught if "were not gathered back" in str(w.message)]
        said[f"zero{stage}-dtype"] = [str(module.head.weight.dtype)]
    # a retry on the placeholders: refused, unless a checkpoint is loaded into them (then equal to a fresh
    # model resumed from it); before, it trained and evaluated on NaN, silently
    module.fail = False

    def retry(model: Failing, resume: str | None) -> Any:
        strategy = HybridParallelStrategy(zero_stage=3, zero3_units=units)
        trainer = cpu_trainer(strategy, devices=world, max_steps=STEPS)
        try:
            trainer.fit(model, DataLoader(_data(), batch_size=4), ckpt_path=resume)
        except ValueError as error:
            strategy.destroy_process_groups()
            return str(error)
        return final_state(model, strategy)

    said["left"] = sorted(n for n, p in module.named_parameters() if torch.isnan(p).any())
    said["retry"] = retry(module, None)
    said["resumed"] = retry(module, ckpt)
    fresh = Failing()
    fresh.fail = False
    said["fresh"] = retry(fresh, ckpt)
    # a checkpoint that writes only some of them (a fine-tune saving its head, strict_loading=False): the
    # rest are still refused (before, they trained on NaN)
    again = Failing()
    strategy = HybridParallelStrategy(zero_stage=3, zero3_units=units, save_distributed_checkpoint=False)
    failed = cpu_trainer(strategy, devices=world, max_steps=STEPS, callbacks=[SaveFirst(ckpt + ".whole")])
    with pytest.raises(ValueError, match="the user's bug"):
        failed.fit(again, DataLoader(_data(), batch_size=4))
    strategy.destroy_process_groups()
    if rank == 0:
        whole = torch.load(ckpt + ".whole", weights_only=False)
        whole["state_dict"] = {k: v for k, v in whole["state_dict"].items() if k.startswith("head.")}
        torch.save(whole, ckpt + ".head")
    torch.distributed.barrier()
    again.fail, again.strict_loading = False, False
    said["partial"] = retry(again, ckpt + ".head")
    again.strict_loading = True
    try:
        failed.fit(again, DataLoader(_data(), batch_size=4), ckpt_path=ckpt + ".whole")
        said["same_trainer"] = final_state(again, strategy)
    except ValueError as error:
        strategy.destroy_process_groups()
        said["same_trainer"] = str(error)
    # kept sharded after a fit (unshard_on_teardown=False): another run on the same strategy is refused
    # before its engine replaces the fit's shards, which stay readable (before: NaN, and the shards lost)
    kept = Failing()
    kept.fail = False
    strategy = HybridParallelStrategy(zero_stage=3, zero3_units=units, unshard_on_teardown=False)
    trainer = cpu_trainer(strategy, devices=world, max_steps=STEPS)
    trainer.fit(kept, DataLoader(_data(), batch_size=4))
    before = strategy.consolidated_state_dict()
    try:
        trainer.fit(kept, DataLoader(_data(), batch_size=4))
        said["kept"] = "not refused"
    except ValueError as error:
        said["kept"] = str(error)
    after = strategy.consolidated_state_dict()
    said["kept_intact"] = before.keys() == after.keys() and all(
        torch.equal(v, after[k]) for k, v in before.items()
    )
    said["kept_finite"] = all(bool(torch.isfinite(v).all()) for v in before.values())
    strategy.destroy_process_groups()
    return said


def test_a_fit_stopped_by_an_exception_says_what_the_model_holds(tmp_path: Any) -> None:
    """After an exception the strategy does not gather the weights back (the other ranks may not join):
    the model holds the bf16 compute copies (ZeRO 1-2 with masters) or ZeRO-3's placeholders, which a retry
    on the same object would start from, silently; rank 0 now says so and how to start again."""
    said = run_distributed(_failed_fits, 2, str(tmp_path), init_group=False, timeout=300)[0]
    # the bf16 copies' values, back in fp32 as a finished fit leaves them (before: bf16, which a retry took
    # for the model's own dtype)
    assert said["zero1-dtype"] == ["torch.float32"]
    (zero1,) = said["zero1"]
    assert "torch.bfloat16 compute copies' values, cast back to torch.float32" in zero1
    assert "resume from a checkpoint" in zero1
    (zero3,) = said["zero3"]
    assert "ZeRO-3's NaN placeholders" in zero3
    assert said["left"] == ["bilinear.bias", "bilinear.weight", "head.bias", "head.weight"]
    assert "4 of the model's 9 parameters" in said["retry"], said["retry"]
    assert "2 of the model's 9 parameters (e.g. ['bilinear.weight', 'bilinear.bias'])" in said["partial"], (
        said
    )
    assert "this strategy's last fit kept the model sharded" in said["kept"], said["kept"]
    # the same Trainer resumed after its exception, as the warning advises: as a fresh model resumed
    assert isinstance(said["same_trainer"], dict), said["same_trainer"]
    for name, value in said["fresh"].items():
        torch.testing.assert_close(said["same_trainer"][name], value, msg=f"same trainer: {name}")
    assert said["kept_intact"] and said["kept_finite"]
    assert "hold ZeRO-3's placeholders" in said["retry"] and "ckpt_path" in said["retry"], said["retry"]
    assert isinstance(said["resumed"], dict) and isinstance(said["fresh"], dict), said
    assert said["resumed"].keys() == said["fresh"].keys()
    for name, value in said["fresh"].items():
        assert torch.isfinite(value).all(), name
        torch.testing.assert_close(said["resumed"][name], value, msg=name)
