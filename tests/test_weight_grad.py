"""The split backward of ``zb`` (``WeightGradSplit``) against autograd's fused backward, in one process:
gradients from nothing, accumulated onto existing ones, into an engine buffer (``grad_of``), and under
bf16 autocast where the buffer's dtype differs from the output gradient's; Hugging Face's ``Conv1D``
(GPT-2's block); our tensor-parallel linears on 2 ranks against the unsharded layers; a chunk with
nothing to defer; and reentrant activation checkpointing refused with the fix."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import GPT2Config
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.pytorch_utils import Conv1D

from lightning_par.pipeline.weight_grad import GradOf, WeightGradSplit
from lightning_par.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from tests.distributed import run_distributed
from tests.third_party import checkpoint_layers, gpt2


class _Net(nn.Module):
    """Linear layers of every kind the split meets: with and without bias, one whose weight is shared
    (stays in ``B``), one whose input needs no gradient (stays in ``B`` that time), and a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.side = nn.Linear(8, 16)  # fed a constant: its input needs no gradient
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16, bias=False)
        self.norm = nn.LayerNorm(16)
        self.tied_a = nn.Linear(16, 16)
        self.tied_b = nn.Linear(16, 16)
        self.tied_b.weight = self.tied_a.weight

    def forward(self, x: Tensor, const: Tensor) -> Tensor:
        h = x + self.side(const)
        h = h + self.down(torch.relu(self.up(self.norm(h))))
        return self.tied_b(torch.tanh(self.tied_a(h)))


def _grads(net: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


def _run(
    net: _Net,
    xs: list[Tensor],
    const: Tensor,
    *,
    split: WeightGradSplit | None,
    dtype: torch.dtype | None,
    grad_of: GradOf | None = None,
) -> list[Tensor]:
    input_grads: list[Tensor] = []
    ctx = split.attached() if split is not None else torch.enable_grad()
    with ctx:
        for i, x0 in enumerate(xs):
            x = x0.clone().requires_grad_()
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                if split is not None:
                    with split.forward((0, i)):
                        out = net(x, const)
                else:
                    out = net(x, const)
            grad = torch.ones_like(out) / out.numel()
            if split is None:
                torch.autograd.backward(out, grad)
            else:
                split.backward(out, [grad], x, chunk=0, key=(0, i))
            assert x.grad is not None
            input_grads.append(x.grad)
        if split is not None:
            for i in range(len(xs)):  # W after every B, as at the end of a zb step
                split.weights((0, i), grad_of)
    return input_grads


def test_split_backward_equals_the_fused_backward() -> None:
    torch.manual_seed(0)
    net = _Net()
    xs = [torch.randn(3, 5, 16) for _ in range(3)]
    const = torch.randn(3, 5, 8)
    ref_inputs = _run(net, xs, const, split=None, dtype=None)
    ref = _grads(net)

    for preset in (False, True):  # from no gradient, and accumulated onto an existing one
        net.zero_grad(set_to_none=True)
        if preset:
            for p in net.parameters():
                p.grad = torch.full_like(p, 0.5)
        split = WeightGradSplit([net])
        got_inputs = _run(net, xs, const, split=split, dtype=None)
        for a, b in zip(got_inputs, ref_inputs, strict=True):
            torch.testing.assert_close(a, b)
        got = _grads(net)
        assert got.keys() == ref.keys()
        for name, g in ref.items():
            torch.testing.assert_close(got[name], g + (0.5 if preset else 0.0), msg=name)

    # into an engine buffer: parameters have no .grad, W adds into grad_of(param)
    net.zero_grad(set_to_none=True)
    buffers = {p: torch.zeros_like(p) for p in net.parameters()}
    split = WeightGradSplit([net])
    _run(net, xs, const, split=split, dtype=None, grad_of=buffers.get)
    for name, p in net.named_parameters():
        deferred = p.grad is None  # B filled .grad for the parameters it kept
        got_g = buffers[p] if deferred else p.grad
        torch.testing.assert_close(got_g, ref[name], msg=name)
    assert buffers[net.up.weight].abs().sum() > 0 and net.up.weight.grad is None
    assert net.side.weight.grad is not None  # its input needed no gradient: it stayed in B


def test_split_backward_under_bf16_autocast_adds_into_an_fp32_buffer() -> None:
    torch.manual_seed(1)
    net = _Net()
    xs = [torch.randn(2, 4, 16) for _ in range(2)]
    const = torch.randn(2, 4, 8)
    _run(net, xs, const, split=None, dtype=torch.bfloat16)
    ref = _grads(net)
    net.zero_grad(set_to_none=True)
    buffers = {p: torch.zeros_like(p) for p in net.parameters()}  # fp32, the output gradients are bf16
    _run(net, xs, const, split=WeightGradSplit([net]), dtype=torch.bfloat16, grad_of=buffers.get)
    for name, p in net.named_parameters():
        got_g = buffers[p] if p.grad is None else p.grad
        assert got_g.dtype == torch.float32
        torch.testing.assert_close(got_g, ref[name], rtol=2e-2, atol=2e-3, msg=name)


def _split_equals_fused(net: nn.Module) -> tuple[WeightGradSplit, dict[nn.Parameter, Tensor]]:
    """Two micro-batches through ``net`` (width 16) with the split backward into engine buffers against
    the fused backward: input gradients and every parameter's gradient equal; the split and the buffers
    (what W filled) for further checks."""
    xs = [torch.randn(2, 5, 16) for _ in range(2)]
    const = torch.randn(2, 5, 16)
    ref_inputs = _run(net, xs, const, split=None, dtype=None)
    ref = _grads(net)
    net.zero_grad(set_to_none=True)
    buffers = {p: torch.zeros_like(p) for p in net.parameters()}
    split = WeightGradSplit([net])
    got_inputs = _run(net, xs, const, split=split, dtype=None, grad_of=buffers.get)
    for a, b in zip(got_inputs, ref_inputs, strict=True):
        torch.testing.assert_close(a, b)
    for name, p in net.named_parameters():
        got_g = buffers[p] if p.grad is None else p.grad
        torch.testing.assert_close(got_g, ref[name], msg=name)
    return split, buffers


class _HFBlock(nn.Module):
    """One GPT-2 block (four ``Conv1D`` layers, two norms) in ``_run``'s calling convention."""

    def __init__(self) -> None:
        super().__init__()
        cfg = GPT2Config(
            n_embd=16, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager"
        )  # a bare block: transformers 4.x resolves no attention kernel without a model around it
        self.block = GPT2Block(cfg)

    def forward(self, x: Tensor, const: Tensor) -> Tensor:
        out = self.block(x + const)
        return out[0] if isinstance(out, tuple) else out


def test_split_backward_defers_hugging_face_conv1d() -> None:
    """GPT-2's ``Conv1D`` stores its weight ``(in, out)``: W adds ``xᵀ dy`` there, into the engine's
    buffer, and the block's gradients equal the fused backward's."""
    torch.manual_seed(2)
    net = _HFBlock()
    split, buffers = _split_equals_fused(net)
    conv = [m for m in net.modules() if isinstance(m, Conv1D)]
    assert len(conv) == 4 and set(split._linears) == set(conv)
    for m in conv:  # deferred to W: nothing in .grad, everything in the buffer
        assert m.weight.grad is None and m.bias.grad is None and buffers[m.weight].abs().sum() > 0
    assert net.block.ln_1.weight.grad is not None  # norms stay in B


def test_a_chunk_with_nothing_to_defer_warns_and_still_equals_the_fused_backward() -> None:
    torch.manual_seed(3)
    frozen = nn.Linear(16, 16).requires_grad_(False)
    net = nn.Sequential(nn.LayerNorm(16), frozen, nn.Tanh())
    x0 = torch.randn(4, 16)
    x_ref = x0.clone().requires_grad_()
    net(x_ref).sum().backward()
    ref = _grads(net)
    net.zero_grad(set_to_none=True)
    with pytest.warns(
        UserWarning, match=r"found nothing to defer: pipeline rank 1's chunks .* Use pipeline_sch"
    ):
        split = WeightGradSplit([net], rank=1)
    x = x0.clone().requires_grad_()
    with split.attached():
        with split.forward((0, 0)):
            out = net(x).sum()
        split.backward(out, None, x, chunk=0, key=(0, 0))
        split.weights((0, 0))
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert _grads(net).keys() == ref.keys() == {"0.weight", "0.bias"}
    for name, g in ref.items():
        torch.testing.assert_close(_grads(net)[name], g, msg=name)


def _tp_split(rank: int, world: int) -> str:
    """A column-parallel, a row-parallel and a gathering column-parallel layer cut from unsharded
    ``nn.Linear`` layers; two micro-batches with the split backward (W after both) against the unsharded
    layers' fused backward: this rank's slices of every gradient, and the input gradient."""
    torch.manual_seed(0)
    lin1, lin2, lin3 = nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 8)
    xs = [torch.randn(3, 4, 16) for _ in range(2)]
    ref_dx = []
    for x0 in xs:
        x = x0.clone().requires_grad_()
        (lin3(F.gelu(lin2(F.gelu(lin1(x))))).square().mean() / len(xs)).backward()
        ref_dx.append(x.grad)
    group = dist.group.WORLD
    c1 = ColumnParallelLinear.from_linear(lin1, group=group)
    r2 = RowParallelLinear.from_linear(lin2, group=group)
    c3 = ColumnParallelLinear.from_linear(lin3, group=group, gather_output=True)  # stays in B
    chunk = nn.Sequential(c1, nn.GELU(), r2, nn.GELU(), c3)
    split = WeightGradSplit([chunk])
    assert split._linears == [c1, r2]
    buffers = {p: torch.zeros_like(p) for p in chunk.parameters()}
    with split.attached():
        for i, x0 in enumerate(xs):
            x = x0.clone().requires_grad_()
            with split.forward((0, i)):
                out = chunk(x).square().mean() / len(xs)
            split.backward(out, None, x, chunk=0, key=(0, i))
            torch.testing.assert_close(x.grad, ref_dx[i])
        for i in range(len(xs)):
            split.weights((0, i), buffers.get)
    rows, out = slice(rank * 16, (rank + 1) * 16), slice(rank * 4, (rank + 1) * 4)  # 32 and 8 split
    expect = {
        c1.weight: lin1.weight.grad[rows], c1.bias: lin1.bias.grad[rows],
        r2.weight: lin2.weight.grad[:, rows], r2.bias: lin2.bias.grad,
        c3.weight: lin3.weight.grad[out], c3.bias: lin3.bias.grad[out],
    }  # fmt: skip
    for p, g in expect.items():
        deferred = p.grad is None
        assert deferred == (p is not c3.weight and p is not c3.bias)
        torch.testing.assert_close(buffers[p] if deferred else p.grad, g)
    return "ok"


def test_split_backward_defers_tensor_parallel_linears() -> None:
    assert run_distributed(_tp_split, 2) == ["ok", "ok"]


class _TorchEncoderLayer(nn.Module):
    """``nn.TransformerEncoderLayer``: its ``nn.MultiheadAttention`` multiplies by ``out_proj.weight``
    inside ``F.multi_head_attention_forward``, never calling ``out_proj`` (an ``nn.Linear``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)

    def forward(self, x: Tensor, const: Tensor) -> Tensor:
        return self.layer(x + const)


def test_a_linear_applied_without_its_forward_stays_in_b() -> None:
    """A deferrable layer whose forward did not run in a micro-batch (its weight used functionally, as
    ``nn.MultiheadAttention``'s ``out_proj``) has nothing recorded for ``W``: its gradients come from
    ``B``, and every gradient equals the fused backward's."""
    torch.manual_seed(4)
    net = _TorchEncoderLayer()
    _, buffers = _split_equals_fused(net)
    out_proj = net.layer.self_attn.out_proj
    assert out_proj.weight.grad is not None  # B computed it: the layer's forward never ran
    assert net.layer.linear1.weight.grad is None and buffers[net.layer.linear1.weight].abs().sum() > 0


class _HandCheckpointed(nn.Module):
    """A user's layer checkpointed by hand, reentrantly: no flag to see, torch raises inside ``B``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return checkpoint(self.lin, x, use_reentrant=True)


def test_reentrant_activation_checkpointing_is_refused_with_the_fix() -> None:
    fix = r"use_reentrant=False .* or use pipeline_schedule='1f1b'"
    model = gpt2()
    blocks = model.transformer.h  # a chunk of Hugging Face blocks
    checkpoint_layers(model, reentrant=True)
    with pytest.raises(
        ValueError, match=r"2 layer\(s\) .* reentrant activation checkpointing \(0, 1\)\. .*" + fix
    ):
        WeightGradSplit([blocks])
    checkpoint_layers(model, reentrant=False)  # the non-reentrant kind is deferred as usual
    split = WeightGradSplit([blocks])
    checkpoint_layers(model, reentrant=True)  # turned on after the split was built: refused at the step
    with pytest.raises(ValueError, match=fix), split.attached():
        raise AssertionError("attached() must refuse before the step runs")
    net = _HandCheckpointed()
    split = WeightGradSplit([net])
    x = torch.randn(2, 8, requires_grad=True)
    with split.attached(), pytest.raises(RuntimeError, match=r"inside a pipeline chunk\. .*" + fix):
        with split.forward((0, 0)):
            out = net(x).sum()
        split.backward(out, None, x, chunk=0, key=(0, 0))
