"""``region_input`` on a module whose output something besides the column-parallel layers reads: a post-LN
model (DistilBERT, ``h = LN(h + sublayer(h))``) whose norms a user's dict plan marks ``region_input``, and
a value head (TRL's ``AutoModelForCausalLMWithValueHead``, PPO) on the final norm of a Llama under the
shipped ``"llama"`` plan, whose ``lm_head`` reads that norm through a slice.

The norm's output is then also read whole on every rank (the next residual stream, the value head), so the
region's all-reduce summed that reader's gradient once per tensor-parallel rank: before, the model trained
wrong on every rank alike, without a word (DistilBERT 0.70 off one process after 4 SGD steps; the PPO
policy's backbone gradients 1.6-2x one process's; also with sequence parallelism, where the norm's
all-gathered output is reduce-scattered, and nothing was checked). The first refusal of the post-LN case
did not see the value head: the ``lm_head``'s read through a slice could not be tapped, which silenced the
check for every region. Now every backward hands such a region's all-reduce the corrected gradient, and
both equal the unsharded model; also where the head's share changes from step to step (zero-initialised:
none in the first) and a second forward without the head runs before the backward (PPO-ptx), which a first
version deciding once per region from the first backward got wrong; LoRA with dropout under non-reentrant
checkpointing (the first tap through the dropout unpacked its saved mask: torch's "Unpack is being
triggered for a tensor that was already unpacked once"); and a penalty on the input gradient
(create_graph: the head's second-order share was 1/t of one process's). A plan whose region inputs leave a
column-parallel layer's input uncovered (the first layer's q/k/v read the embeddings' norm, not marked)
left that layer's input gradient unsummed, silently: refused in its forward, naming the layer. A deep
copy of the converted model trained itself (a critic copied from the policy after setup) is corrected as
its original (before, its regions were left out: its value head's gradient summed once per rank).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import group

from lightning_par.tensor_parallel.plan import apply_tensor_parallel
from tests.distributed import run_distributed
from tests.test_tensor_parallel import gather_full
from tests.third_party import LLAMA, checkpoint_layers, hf_model, llama

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


class ValueHeadLM(nn.Module):
    """A causal LM with a value head on its last hidden state (the final norm's output), as TRL's."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = llama()
        self.v_head = nn.Linear(LLAMA["hidden_size"], 1)

    def forward(self, ids: Tensor) -> Tensor:
        # the logits of the second half only: the lm_head reads a slice of the norm's output, whose
        # gradient the check carries back to the whole output's shape
        keep = ids.shape[1] // 2
        out = self.lm(input_ids=ids, output_hidden_states=True, logits_to_keep=keep)
        values = self.v_head(out.hidden_states[-1]).squeeze(-1)
        targets = ids[:, -keep + 1 :]
        loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), targets.flatten())
        return loss + (values - 1.0).pow(2).mean()  # type: ignore[no-any-return]


class ZeroHeadPtx(ValueHeadLM):
    """The value head zero-initialised (its gradient into the norm is 0 in the first step, not after), and
    a second forward of the LM alone before the backward (PPO-ptx): the region's outputs of one backward
    differ in their readers, and its readers' shares change from step to step."""

    def __init__(self) -> None:
        super().__init__()
        nn.init.zeros_(self.v_head.weight)

    def forward(self, ids: Tensor) -> Tensor:
        rl = super().forward(ids)
        ptx = self.lm(input_ids=ids.flip(0), labels=ids.flip(0)).loss
        return rl + 0.5 * ptx  # type: ignore[no-any-return]


class LoraValueHead(ValueHeadLM):
    """The LM under PEFT LoRA with dropout on q/v and Hugging Face's non-reentrant checkpointing (the
    QLoRA recipe): LoRA's A layers read the norm's output through the dropout, inside recomputed layers."""

    def __init__(self) -> None:
        from peft import LoraConfig, get_peft_model

        super().__init__()
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
        self.lm = get_peft_model(self.lm, config)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():  # B non-zero, so the adapters matter from the first step
            for name, p in self.lm.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        checkpoint_layers(self.lm.base_model.model, reentrant=False)


class Penalised(nn.Module):
    """A dict-plan block whose final norm a replicated value head reads beside a column-parallel head,
    trained with a penalty on its input gradient (a backward with create_graph)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm, self.fnorm = nn.LayerNorm(32), nn.LayerNorm(32)
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)
        self.head, self.vhead = nn.Linear(32, 64), nn.Linear(32, 1)

    def forward(self, ids: Tensor) -> Tensor:
        x = torch.sin(ids.float()[..., None] * torch.arange(1, 33)).requires_grad_()
        f = self.fnorm(x + self.fc2(torch.tanh(self.fc1(self.norm(x)))))
        task = 0.1 * (self.head(f).pow(2).mean() + self.vhead(f).pow(2).mean())
        (grad,) = torch.autograd.grad(task, x, create_graph=True)
        return task + grad.pow(2).mean()  # type: ignore[no-any-return]


PENALISED = {"norm": "region_input", "fnorm": "region_input", "fc1": "colwise", "fc2": "rowwise"}


def _loss(model: nn.Module, ids: Tensor) -> Tensor:
    if isinstance(model, (ValueHeadLM, Penalised)):
        return model(ids)  # type: ignore[no-any-return]
    return model(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]


def _train(model: nn.Module, ids: Tensor, steps: int = 3) -> list[float]:
    torch.manual_seed(3)  # LoRA's dropout masks: the same for the unsharded and the sharded run
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = _loss(model, ids)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


NAMES = (
    "plain", "post_ln", "value_head", "value_head_sp", "zero_head_ptx", "lora_dropout_checkpointed",
    "penalised", "llama", "copied",
)  # fmt: skip


def _job(rank: int, world: int) -> dict[str, Any]:
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    out: dict[str, Any] = {}
    distilbert = hf_model("DistilBertForMaskedLM", "DistilBertConfig", **DISTILBERT)
    torch.manual_seed(0)
    value_head = ValueHeadLM()
    runs = (
        ("plain", distilbert, PLAN, False),  # no region inputs: each column-parallel layer sums its own
        ("post_ln", distilbert, POST_LN_REGIONS, False),  # the residual stream reads every norm too
        ("value_head", value_head, "llama", False),  # the value head reads the final norm too
        ("value_head_sp", value_head, "llama", True),  # there the norm's output is all-gathered
        ("zero_head_ptx", ZeroHeadPtx(), "llama", False),
        ("lora_dropout_checkpointed", LoraValueHead(), "llama", False),
        ("penalised", Penalised(), PENALISED | {"head": "colwise_gather"}, False),
        ("llama", llama(), "llama", False),  # only column-parallel layers read its regions
    )
    for name, ref, plan, sp in runs:
        sharded = copy.deepcopy(ref)
        apply_tensor_parallel(sharded, group=group.WORLD, plan=plan, sequence_parallel=sp)
        out[name] = (_train(copy.deepcopy(ref), ids), _train(sharded, ids))
        out[f"{name}_state"] = (gather_full(sharded), _trained_state(ref, ids))
    # a copy of the converted model (a critic made from the policy after setup) trained itself: its region
    # outputs and readers are its own (before, left uncorrected: its value head's share summed t times)
    converted = copy.deepcopy(value_head)
    apply_tensor_parallel(converted, group=group.WORLD, plan="llama")
    twin = copy.deepcopy(converted)
    out["copied"] = (_train(copy.deepcopy(value_head), ids), _train(twin, ids))
    out["copied_state"] = (gather_full(twin), _trained_state(value_head, ids))
    marked = copy.deepcopy(distilbert)
    apply_tensor_parallel(marked, group=group.WORLD, plan=UNCOVERED)
    before = {k: v.detach().clone() for k, v in marked.named_parameters()}
    with pytest.raises(RuntimeError) as refused:
        _train(marked, ids)
    out["uncovered"] = str(refused.value)
    out["uncovered_untouched"] = all(torch.equal(v, before[k]) for k, v in marked.named_parameters())
    return out


def _trained_state(model: nn.Module, ids: Tensor) -> dict[str, Tensor]:
    model = copy.deepcopy(model)
    _train(model, ids)
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_region_input_read_by_other_modules_too_equals_the_unsharded_model() -> None:
    for r in run_distributed(_job, 2):
        for name in NAMES:
            want, got = r[name]
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), msg=name)
            full, ref = r[f"{name}_state"]
            assert set(full) <= set(ref) and len(full) > 10  # (a tied table once)
            for k, v in full.items():
                torch.testing.assert_close(v, ref[k], msg=f"{name}: {k}")
        uncovered = r["uncovered"]
        assert (
            "'distilbert.transformer.layer.0.attention.q_lin' reads an input that no region_input"
            in uncovered
        )
        assert r["uncovered_untouched"]
