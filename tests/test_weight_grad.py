"""The split backward of ``zb`` (``WeightGradSplit``) against autograd's fused backward, in one process:
gradients from nothing, accumulated onto existing ones, into an engine buffer (``grad_of``), and under
bf16 autocast where the buffer's dtype differs from the output gradient's."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_par.pipeline.weight_grad import GradOf, WeightGradSplit


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
                split.backward(out, grad, x, chunk=0, key=(0, i))
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
