"""``region_input`` where it does not fit: a post-LN model (DistilBERT, ``h = LN(h + sublayer(h))``) whose
norms a user's dict plan marks ``region_input``, as the README's "the norm before a region" suggests.

The norm's output is the next residual stream as well as the column-parallel layers' input, so the
region's all-reduce summed its (already whole) gradient once per tensor-parallel rank: before, the model
trained wrong on every rank alike, without a word (a probe: weights 0.70 off one process after 4 SGD
steps). Now the first backward compares the gradient reaching each region's output with what its
column-parallel readers send back and stops, naming the module, before any optimizer step: the weights
are untouched. A plan whose region inputs leave a column-parallel layer's input uncovered (the first
layer's q/k/v read the embeddings' norm, not marked) left that layer's input gradient unsummed,
silently: now refused in the first forward, naming the layer. The same plan without ``region_input``
entries (each column-parallel layer summing its own input gradient) equals the unsharded model; a
shipped plan on a pre-LN model (Llama's norms as region inputs) passes the check and equals it too
(``tests/test_tp_families.py`` covers the other families).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed import group

from lightning_par.tensor_parallel.plan import apply_tensor_parallel
from tests.distributed import run_distributed
from tests.test_tensor_parallel import gather_full
from tests.third_party import hf_model, llama

DISTILBERT = dict(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=32, dropout=0.0,
    attention_dropout=0.0,
)  # fmt: skip
PLAN = {
    "*.attention.q_lin": "colwise",
    "*.attention.k_lin": "colwise",
    "*.attention.v_lin": "colwise",
    "*.attention.out_lin": "rowwise",
    "*.ffn.lin1": "colwise",
    "*.ffn.lin2": "rowwise",
}
NORMS = {"*.sa_layer_norm": "region_input", "*.output_layer_norm": "region_input"}
POST_LN_REGIONS = PLAN | NORMS | {"*.embeddings.LayerNorm": "region_input"}
# the first layer's q/k/v read the embeddings' norm, not marked: their input gradients were never summed
UNCOVERED = PLAN | NORMS


def _loss(model: nn.Module, ids: Tensor) -> Tensor:
    return model(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]


def _train(model: nn.Module, ids: Tensor, steps: int = 3) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = _loss(model, ids)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _job(rank: int, world: int) -> dict[str, Any]:
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    out: dict[str, Any] = {}
    ref = hf_model("DistilBertForMaskedLM", "DistilBertConfig", **DISTILBERT)
    plain = copy.deepcopy(ref)
    apply_tensor_parallel(plain, group=group.WORLD, plan=PLAN)
    out["plain"] = (_train(copy.deepcopy(ref), ids), _train(plain, ids))
    out["plain_state"] = (gather_full(plain), _trained_state(ref, ids))
    for name, plan in (("refused", POST_LN_REGIONS), ("uncovered", UNCOVERED)):
        marked = copy.deepcopy(ref)
        apply_tensor_parallel(marked, group=group.WORLD, plan=plan)
        before = {k: v.detach().clone() for k, v in marked.named_parameters()}
        with pytest.raises(RuntimeError) as refused:
            _train(marked, ids)
        out[name] = str(refused.value)
        out[f"{name}_untouched"] = all(torch.equal(v, before[k]) for k, v in marked.named_parameters())
    # a pre-LN model under the shipped plan (its norms are region inputs): checked, and equal
    pre_ln = llama()
    sharded = copy.deepcopy(pre_ln)
    apply_tensor_parallel(sharded, group=group.WORLD, plan="llama")
    out["llama"] = (_train(copy.deepcopy(pre_ln), ids), _train(sharded, ids))
    return out


def _trained_state(model: nn.Module, ids: Tensor) -> dict[str, Tensor]:
    model = copy.deepcopy(model)
    _train(model, ids)
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_region_input_on_a_post_ln_norm_is_refused_in_the_first_backward() -> None:
    for r in run_distributed(_job, 2):
        want, got = r["plain"]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want))
        full, ref = r["plain_state"]
        assert set(full) <= set(ref) and len(full) > 10  # (a tied table once)
        for k, v in full.items():
            torch.testing.assert_close(v, ref[k], msg=k)
        refused = r["refused"]
        assert "tp_plan marks 'distilbert.transformer.layer." in refused, refused
        assert "_layer_norm' region_input, but its output is also read" in refused
        assert "post-LN" in refused and "Leave" in refused
        uncovered = r["uncovered"]
        assert (
            "'distilbert.transformer.layer.0.attention.q_lin' reads an input that no region_input"
            in uncovered
        )
        assert r["refused_untouched"] and r["uncovered_untouched"]
        want, got = r["llama"]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want))
