"""Token-exact loss under pipeline parallelism: ``pipeline_loss`` returns ``{"loss_sum", "tokens"}``.

A Hugging Face Llama (``hf_pipeline_layers``) trains on right-padded sequences whose valid targets vary
from 1 to 15 per sample (``-100`` elsewhere), at pp2 x dp2 (world 4) with two accumulation steps per
window and a ragged split (3 samples per rank-step into 2 micro-batches): 1F1B with ZeRO-1, zb with
ZeRO-2, 1F1B with ZeRO-3. The reference is plain torch in one process: per optimizer step, the gradient
of (sum of token losses) / (valid tokens) over exactly the samples the window consumed on both
data-parallel ranks, then the same SGD step. Also: each rank's logged per-step loss is its batch's token
mean, the validation loss is the token mean over both data-parallel ranks' batches (not the mean of
their means), the naive mean of micro-batch means differs (the case is not trivial), and malformed loss
mappings and ``token_normalized()`` under pp are refused with the fix. Validation whose dp ranks run
different numbers of batches (2 against 1) logs Lightning's ``sync_dist`` mean of each rank's batch token
means instead (the per-step dp all-reduce of the token mean cannot be matched there).

A Hugging Face model with nothing but ``hf_pipeline_layers``, ``hf_causal_lm_loss`` and the default input
(dict batches from a collator: ``input_ids`` with ``attention_mask`` on left or right padding, or
``position_ids`` on packed rows, and unshifted ``labels``) trains at pp2 x dp2 and pp2 x tp2 as one
process training on the model's own ``model(**window).loss`` (Llama, GPT-2 with its tied table, Gemma 3,
Qwen3, Mixtral; ``NATIVE_CASES``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_par import HybridParallelStrategy
from lightning_par.loss import token_loss_sum
from lightning_par.pipeline import hf_causal_lm_loss
from lightning_par.pipeline.lightning import default_input
from lightning_par.pipeline.metrics import PipelineMetricError, PipelineMetrics
from tests.distributed import run_distributed
from tests.test_pp_hf import REFUSED_BEFORE_5, TRANSFORMERS_5, HFCausalLM, build
from tests.test_pp_trainer import _trainer

SEED, LR, MOMENTUM = 5, 0.3, 0.9
DP, ACCUM, BATCH, WINDOWS = 2, 2, 3, 2
N = DP * ACCUM * BATCH * WINDOWS  # every sample once, in WINDOWS optimizer steps
VAL = 2 * DP


class Padded(Dataset[tuple[Tensor, Tensor, Tensor]]):
    """Right-padded sequences of 16 tokens: sample ``i`` has ``VALID[i]`` valid targets, pad id 0 and
    target ``-100`` after them; the index comes along so the reference can replay the ranks' batches."""

    VALID: ClassVar[list[int]] = [
        1,
        15,
        2,
        14,
        3,
        1,
        15,
        6,
        2,
        9,
        1,
        12,
        4,
        15,
        1,
        7,
        3,
        2,
        13,
        1,
        8,
        15,
        2,
        5,
    ]

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(1, 64, (n, 17), generator=g)
        self.valid = [self.VALID[(i + seed) % len(self.VALID)] for i in range(n)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        x, y = self.data[i, :-1].clone(), self.data[i, 1:].clone()
        x[self.valid[i] :] = 0
        y[self.valid[i] :] = -100
        return x, y, torch.tensor(i)


class TokenLlama(HFCausalLM):
    """The pipeline protocol with the token-exact form."""

    def pipeline_loss(self, output: Tensor, batch: Any) -> Any:  # type: ignore[override]
        loss_sum, tokens = token_loss_sum(output, batch[1])
        return {"loss_sum": loss_sum, "tokens": tokens}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


class Seen(pl.Callback):
    """The sample indices of every training and validation batch this rank ran, and its logged losses."""

    def __init__(self) -> None:
        self.train: list[list[int]] = []
        self.val: list[list[int]] = []
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        self.train.append((batch["idx"] if isinstance(batch, dict) else batch[2]).tolist())

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_validation_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, *args: Any) -> None:
        self.val.append(batch[2].tolist())


def _local_checks() -> dict[str, str]:
    """Malformed ``pipeline_loss`` results, refused on the spot (no collective involved)."""
    metrics = PipelineMetrics(group=torch.distributed.group.WORLD, src=0, device=torch.device("cpu"))
    errors: dict[str, str] = {}
    loss = torch.tensor(1.0)
    for name, result in {
        "both": {"loss": loss, "loss_sum": loss, "tokens": 3},
        "no_tokens": {"loss_sum": loss},
        "float_tokens": {"loss_sum": loss, "tokens": 2.5},
    }.items():
        metrics.start(2)
        try:
            metrics.loss_of(result, where="pipeline_loss")
        except PipelineMetricError as exc:
            errors[name] = str(exc)
    metrics.start(2)
    metrics.loss_of({"loss_sum": loss, "tokens": 3}, where="pipeline_loss")
    metrics.loss_of({"loss": loss}, where="pipeline_loss")  # another form in the same step
    errors["mixed"] = str(metrics._error)
    metrics.start(2)
    metrics.add({"tokens": loss}, where="pipeline_eval")  # a metric under a reserved name
    errors["reserved"] = str(metrics._error)
    metrics.start(2)
    metrics.add({"loss": loss}, where="pipeline_eval")  # logged as val_loss already
    errors["loss"] = str(metrics._error)
    return errors


def _run(rank: int, world: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cases = {
        "1f1b-zero1": dict(pipeline_schedule="1f1b", zero_stage=1),
        "zb-zero2": dict(pipeline_schedule="zb", zero_stage=2),
        "1f1b-zero3": dict(pipeline_schedule="1f1b", zero_stage=3),
    }
    for name, kw in cases.items():
        pl.seed_everything(SEED)
        module = TokenLlama("llama", SEED)
        module.configure_model()
        strategy = HybridParallelStrategy(pipeline_parallel_size=2, num_microbatches=2, **kw)
        seen = Seen()
        # no clipping: a clipped step would hide a wrong constant factor
        trainer = _trainer(
            strategy, world, tmp, [seen], accumulate_grad_batches=ACCUM, gradient_clip_val=None
        )
        train = DataLoader(Padded(N), batch_size=BATCH, shuffle=False)
        trainer.fit(module, train, DataLoader(Padded(VAL, seed=7), batch_size=VAL // DP))
        state = strategy.consolidated_state_dict()
        out[name] = {
            "train": seen.train,
            "val": seen.val,
            "losses": seen.losses,
            "val_loss": float(trainer.callback_metrics["val_loss"]),
            "state": {k: v.clone() for k, v in state.items()},
        }
    # uneven validation (a sampler that does not pad): dp rank 0 runs 2 batches, dp rank 1 one; the token
    # mean's per-step all-reduce over dp could not match, so each rank logs its own
    pl.seed_everything(SEED)
    module = TokenLlama("llama", SEED)
    module.configure_model()
    strategy = HybridParallelStrategy(pipeline_parallel_size=2, num_microbatches=2, zero_stage=1)
    trainer = _trainer(strategy, world, tmp, [], limit_val_batches=1.0, use_distributed_sampler=False)
    dp_rank = rank % DP  # rank = pp_rank * dp + dp_rank (tp 1)
    val = DataLoader(Padded(3 * UNEVEN, seed=9), batch_sampler=_uneven_batches(dp_rank))
    out["uneven_val_loss"] = trainer.validate(module, val, verbose=False)[0]["val_loss"]
    out["errors"] = _local_checks()
    return out


UNEVEN = 4  # rows per batch of the uneven validation


def _uneven_batches(dp_rank: int) -> list[list[int]]:
    rows = [list(range(k * UNEVEN, (k + 1) * UNEVEN)) for k in range(3)]
    return rows[:2] if dp_rank == 0 else rows[2:]


def _batch(ds: Padded, idx: list[int]) -> tuple[Tensor, Tensor]:
    return torch.stack([ds[i][0] for i in idx]), torch.stack([ds[i][1] for i in idx])


def _token_mean(model: Any, x: Tensor, y: Tensor) -> Tensor:
    s, n = token_loss_sum(model(x).logits, y)
    return s / n


def test_token_exact_loss_under_pp_equals_the_global_token_mean(tmp_path: Path) -> None:
    results = run_distributed(_run, 4, str(tmp_path), init_group=False, timeout=400)
    ds, val = Padded(N), Padded(VAL, seed=7)
    for rank, r in enumerate(results):
        errors = r["errors"]
        assert "'loss_sum': sum of the token losses, 'tokens'" in errors["both"], errors
        assert "keys ['loss_sum']" in errors["no_tokens"], errors
        assert "'tokens' as float: it must be the number of valid tokens" in errors["float_tokens"], rank
        assert "'loss' for some micro-batches and 'loss_sum' for others" in errors["mixed"], errors
        assert "'tokens': that name is reserved" in errors["reserved"], errors
        assert "returned the metric 'loss': the pipeline logs" in errors["loss"], errors

    # uneven validation: Lightning's sync_dist mean of every rank's per-batch token means, at the initial
    # weights (before, the per-step dp all-reduce of the token mean could not be matched by the rank with
    # fewer batches)
    model, uneven = build("llama", seed=SEED).eval(), Padded(3 * UNEVEN, seed=9)
    with torch.no_grad():
        means = [
            float(_token_mean(model, *_batch(uneven, b))) for b in _uneven_batches(0) + _uneven_batches(1)
        ]
    for r in results:
        assert r["uneven_val_loss"] == pytest.approx(sum(means) / len(means), rel=1e-5)

    for case in ("1f1b-zero1", "zb-zero2", "1f1b-zero3"):
        # the windows as the data-parallel ranks consumed them (pipeline ranks of a dp rank agree)
        steps = [r[case]["train"] for r in results]
        dp_ranks = {tuple(map(tuple, s)) for s in steps}
        assert len(dp_ranks) == DP, f"{case}: {len(dp_ranks)} distinct data streams"
        streams = [list(map(list, s)) for s in sorted(dp_ranks)]
        assert sorted(i for s in streams for b in s for i in b) == list(range(N)), case
        windows = [
            [i for s in streams for b in s[w * ACCUM : (w + 1) * ACCUM] for i in b] for w in range(WINDOWS)
        ]

        model = build("llama", seed=SEED).train()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        with torch.no_grad():
            first_losses = {tuple(s[0]): float(_token_mean(model, *_batch(ds, s[0]))) for s in streams}
        naive_differs = False
        for w, idx in enumerate(windows):
            opt.zero_grad()
            _token_mean(model, *_batch(ds, idx)).backward()
            if w == 0:  # what averaging micro-batch means would train on instead
                exact = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
                twin = build("llama", seed=SEED).train()
                per_micro = [
                    _token_mean(twin, *_batch(ds, b[j : j + 2]))
                    for s in streams
                    for b in s[:ACCUM]
                    for j in range(0, BATCH, 2)
                ]
                (sum(per_micro) / len(per_micro)).backward()  # type: ignore[union-attr]
                naive = dict(twin.named_parameters())
                naive_differs = any(
                    (naive[n].grad - g).abs().max() > 1e-3  # type: ignore[operator]
                    for n, g in exact.items()
                )
            opt.step()
        assert naive_differs, "the case must tell the token mean from the mean of micro-batch means"

        model.eval()
        with torch.no_grad():  # each dp rank's validation batch (pipeline ranks of a replica agree)
            val_batches = sorted({tuple(r[case]["val"][0]) for r in results})
            assert len(val_batches) == DP, case
            sums = [
                token_loss_sum(model(x).logits, y) for x, y in (_batch(val, list(b)) for b in val_batches)
            ]
            val_mean = float(sum(s for s, _ in sums) / sum(n for _, n in sums))
            per_rank = [float(s / n) for s, n in sums]
        assert abs(val_mean - sum(per_rank) / DP) > 1e-4, "the case must tell the two means apart"
        for r in results:
            got = r[case]
            # this rank's first step: the token mean of its batch at the initial weights (Lightning's
            # outputs["loss"] is divided by accumulate_grad_batches)
            assert got["losses"][0] * ACCUM == pytest.approx(
                first_losses[tuple(got["train"][0])], rel=1e-5
            ), case
            # the validation loss: the token mean over the dp ranks' batches
            assert got["val_loss"] == pytest.approx(val_mean, rel=1e-5), case
        reference = {f"model.{n}": v for n, v in model.named_parameters()}  # the module's attribute
        state = results[0][case]["state"]
        assert set(reference) <= set(state), sorted(set(reference) - set(state))
        for n, value in reference.items():
            torch.testing.assert_close(state[n], value.detach(), msg=f"{case} {n}")


class HFBatches(Dataset[dict[str, Tensor]]):
    """``Padded`` as a Hugging Face collator would hand it over: a dict with ``input_ids``,
    ``attention_mask`` and unshifted ``labels`` (``-100`` on the padding), padded on the right or, as
    for tokenizers with ``padding_side="left"``, on the left; or ``"packed"`` as a flattening collator
    packs two documents into one row: ``position_ids`` restarting at the second, no mask, ``-100`` at
    each document's first token."""

    def __init__(self, n: int, side: str = "right") -> None:
        self.padded, self.side = Padded(n), side

    def __len__(self) -> int:
        return len(self.padded)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        x, _, idx = self.padded[i]
        valid = self.padded.valid[i]
        if self.side == "packed":
            x = self.padded.data[i, :-1].clone()  # no padding: the second document fills the row
            where = torch.arange(len(x))
            positions = torch.where(where < valid, where, where - valid)
            labels = x.masked_fill(positions == 0, -100)
            return {"input_ids": x, "position_ids": positions, "labels": labels, "idx": idx}
        labels = x.clone()
        labels[valid:] = -100
        mask = (torch.arange(len(x)) < valid).long()
        shift = len(x) - valid if self.side == "left" else 0  # the valid tokens moved to the end
        batch = {"input_ids": x, "attention_mask": mask, "labels": labels}
        return {k: v.roll(shift) for k, v in batch.items()} | {"idx": idx}


class NativeHF(HFCausalLM):
    """A Hugging Face model with the three-line pipeline protocol: the pieces, the model's own loss in the
    token-exact form, and the default input (``batch["input_ids"]``)."""

    def pipeline_loss(self, output: Tensor, batch: Any) -> Any:  # type: ignore[override]
        return hf_causal_lm_loss(output, batch["labels"])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


# name -> (family, batches, strategy options), world 4: left padding, where without the mask reaching every
# block the valid tokens would attend to the padding; Gemma 3: tied table, soft-capped logits, local and
# global layers with their own rotary tables; packed rows, whose positions restart and bound the
# attention; Mixtral: each token routed to 2 of 4 experts; pp2 x tp2 with the shipped llama plan: the
# mask beside head-parallel attention; GPT-NeoX (Pythia) with each stage's blocks sharded by ZeRO-3
NATIVE_CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("llama", "left", dict(pipeline_schedule="1f1b", zero_stage=1)),
    "gpt2": ("gpt2", "left", dict(pipeline_schedule="zb", zero_stage=2)),
    "gemma3": ("gemma3_text", "left", dict(pipeline_schedule="1f1b", zero_stage=1)),
    "qwen3-packed": ("qwen3", "packed", dict(pipeline_schedule="zb", zero_stage=1)),
    "mixtral": ("mixtral", "right", dict(pipeline_schedule="1f1b", zero_stage=2)),
    "llama-tp2": ("llama", "left", dict(pipeline_schedule="zb", tensor_parallel_size=2, tp_plan="llama")),
    "pythia-zero3": ("gpt_neox", "left", dict(pipeline_schedule="1f1b", zero_stage=3)),
    # recomputed blocks: their mask built again from the saved padding, or taken from the stage's cache
    "qwen2-ckpt": ("qwen2", "left", dict(pipeline_schedule="zb", activation_checkpointing=True)),
    # built on the meta device by the strategy, its weights from a full state dict: the parameter objects
    # are replaced after the cut, which the tied table's gradient exchange and the split backward follow
    "gpt2-meta": ("gpt2", "left", dict(pipeline_schedule="zb", zero_stage=2, pretrained="meta")),
}


# before transformers 5 the Gemma family is refused (test_pp_hf asserts the refusal): its case leaves out
RUN_NATIVE = {k: v for k, v in NATIVE_CASES.items() if TRANSFORMERS_5 or v[0] not in REFUSED_BEFORE_5}


def _dp(options: dict[str, Any]) -> int:
    return 4 // (2 * options.get("tensor_parallel_size", 1))


def _run_native(rank: int, world: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (family, side, options) in RUN_NATIVE.items():
        pl.seed_everything(SEED)
        module = NativeHF(family, SEED)
        if options.get("pretrained") == "meta":
            options = options | {"pretrained": build(family, seed=SEED).state_dict()}
        else:
            module.configure_model()
        strategy = HybridParallelStrategy(pipeline_parallel_size=2, num_microbatches=2, **options)
        seen = Seen()
        trainer = _trainer(
            strategy, world, tmp, [seen], accumulate_grad_batches=ACCUM, gradient_clip_val=None
        )
        batch_size = BATCH * DP // _dp(options)  # every sample once, in WINDOWS windows
        trainer.fit(module, DataLoader(HFBatches(N, side), batch_size=batch_size, shuffle=False))
        state = strategy.consolidated_state_dict()
        checkpointed = sum(getattr(m, "_lightning_par_checkpointed", False) for m in module.modules())
        out[name] = {
            "train": seen.train,
            "state": {k: v.clone() for k, v in state.items()},
            "checkpointed": checkpointed,
        }
        strategy.destroy_process_groups()
    return out


def test_hf_models_own_loss_under_pp_equals_one_process_on_the_window(tmp_path: Path) -> None:
    """At pp2 x dp2: Llama (1F1B, ZeRO-1), GPT-2 with its tied table (zb, ZeRO-2) and Gemma 3 (1F1B,
    ZeRO-1; tied, soft-capped, local and global layers) on left-padded dict batches with their attention
    masks, Qwen3 (zb, ZeRO-1) on packed rows with restarting position_ids, Mixtral (1F1B, ZeRO-2;
    experts) on right-padded batches, GPT-NeoX (1F1B, ZeRO-3) and Qwen2 (zb, activation checkpointing)
    left-padded; and a left-padded Llama at pp2 x tp2 (zb, the llama plan). With
    accumulation 2 and ragged micro-batches, the weights equal one process training on
    ``model(**window).loss``, Hugging Face's own loss over the window's samples."""
    results = run_distributed(_run_native, 4, str(tmp_path), init_group=False, timeout=400)
    for name, (family, side, options) in RUN_NATIVE.items():
        data = HFBatches(N, side)
        streams = sorted({tuple(map(tuple, r[name]["train"])) for r in results})
        assert len(streams) == _dp(options), name
        # the checkpointed case recomputes its decoder layers (2) in backward; the others none
        want = 2 if options.get("activation_checkpointing") else 0
        assert all(r[name]["checkpointed"] == want for r in results), name
        model = build(family, seed=SEED).train()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        for w in range(WINDOWS):
            idx = [i for s in streams for b in s[w * ACCUM : (w + 1) * ACCUM] for i in b]
            batch = {k: torch.stack([data[i][k] for i in idx]) for k in data[0] if k != "idx"}
            opt.zero_grad()
            model(**batch, use_cache=False).loss.backward()  # a training forward: no cache
            opt.step()
        state = results[0][name]["state"]
        for n, value in model.named_parameters():
            torch.testing.assert_close(state[f"model.{n}"], value.detach(), msg=f"{name} {n}")


def test_token_normalized_is_refused_under_pp_with_the_fix() -> None:
    strategy = HybridParallelStrategy(pipeline_parallel_size=2, num_microbatches=2)
    strategy._engine, strategy._pipeline = object(), object()  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match=r"pipeline parallelism: return \{'loss_sum'.*from pipeline_loss"):
        strategy.token_normalized(torch.tensor(1.0), 3)


def test_the_default_input_takes_input_ids_the_first_layers_keys_or_the_first_element() -> None:
    ids = torch.arange(6).view(2, 3)
    assert default_input({"input_ids": ids, "labels": ids}, owner="M") is ids
    assert default_input((ids, ids + 1), owner="M") is ids
    owner = "M.pipeline_input(batch)"  # where the input function would come from (Trainer: the module)
    with pytest.raises(TypeError, match=r"dict with keys \['labels', 'tokens'\] .* define M.pipeline_input"):
        default_input({"tokens": ids, "labels": ids}, owner=owner)
    with pytest.raises(TypeError, match=r"batch of type Tensor has no default input"):
        default_input(ids, owner="M")
    # a first layer that lists its keys (hf_pipeline_layers' embedding): the ones the batch has, in order
    keys = ("input_ids", "attention_mask", "position_ids")
    mask = torch.ones_like(ids)
    got = default_input({"labels": ids, "attention_mask": mask, "input_ids": ids}, owner="M", keys=keys)
    assert got == {"input_ids": ids, "attention_mask": mask}
    assert default_input({"input_ids": ids, "labels": ids}, owner="M", keys=keys) == {"input_ids": ids}
    with pytest.raises(TypeError, match=r"keys \['attention_mask'\] .* \(batch\['input_ids'\] for a mapping"):
        default_input({"attention_mask": mask}, owner="M", keys=keys)
