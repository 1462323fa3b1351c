"""Blockwise int8 quantization for ZeRO-3's parameter all-gather (what ZeRO++ calls quantized weights).

A shard of ``n`` values is cut into blocks of ``block`` values (the last one padded with zeros); each block
``b`` gets the scale ``s_b = max|x_b| / 127`` and is sent as ``q = round(x / s_b)`` in ``[-127, 127]``, so a
value comes back as ``q s_b`` within ``s_b / 2`` of itself: a quarter of fp32's bytes plus one fp32
scale per block. The fp32 masters stay in the shards; only the gathered compute copy is rounded.
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 256


def num_blocks(numel: int, block: int = BLOCK) -> int:
    return -(-numel // block)


def quantize_blockwise(x: Tensor, *, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """``(q, scales)``: ``x`` (1-D) as int8 values (``x.numel()`` of them) and one fp32 scale per block."""
    n = x.numel()
    padded = torch.zeros(num_blocks(n, block) * block, dtype=torch.float32, device=x.device)
    padded[:n].copy_(x)
    blocks = padded.view(-1, block)
    # a block of zeros keeps scale 1: its values quantize to 0 either way, and nothing divides by 0
    scales = blocks.abs().amax(dim=1).div_(127.0)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = blocks.div(scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return q.view(-1)[:n].contiguous(), scales


def dequantize_blockwise(q: Tensor, scales: Tensor, out: Tensor, *, parts: int, block: int = BLOCK) -> None:
    """Write into ``out`` the values of ``parts`` equal shards gathered one after another: ``q`` holds
    their int8 values, ``scales`` their blocks' scales, in the same order."""
    n = q.numel() // parts
    blocks = num_blocks(n, block)
    padded = torch.zeros(parts, blocks * block, dtype=torch.float32, device=q.device)
    padded[:, :n].copy_(q.view(parts, n))
    values = padded.view(parts, blocks, block).mul_(scales.view(parts, blocks, 1))
    out.view(parts, n).copy_(values.view(parts, -1)[:, :n])
