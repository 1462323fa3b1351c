"""The end of a pipeline ``predict`` step: the last virtual stage's outputs of all micro-batches,
concatenated along dim 0, sent to every rank of the pipeline group, so that each returns the same tensor.

One header travels first (the result's shape and dtype, or ``-1`` for a failure), read on the host once
per call by the ranks that do not hold the result, then the result itself in one broadcast. A failure on
the last stage (a ``pipeline_predict`` that returned no tensor, micro-batch results that disagree in
shape) is raised on every rank, with its text, rather than leaving the other stages waiting.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_par.pipeline.mail import HEADER, Spec, decode, encode


def share_outputs(
    outputs: list[Tensor],
    failed: list[BaseException],
    *,
    src: int,
    group: ProcessGroup,
    device: torch.device,
) -> Tensor:
    """The concatenation of ``outputs`` (held by global rank ``src``, the last stage; empty elsewhere)
    on every rank of ``group``, or ``failed[0]`` (recorded on ``src``) raised on each of them."""
    on_last = bool(outputs or failed)
    shapes = sorted({f"{tuple(o.shape[1:])} {o.dtype}" for o in outputs})
    if len(shapes) > 1 and not failed:
        failed.append(
            TypeError(
                "predict under pipeline parallelism concatenates the micro-batches' results along dim 0:"
                f" they must agree in their other dimensions and dtype, got {shapes}."
            )
        )
    result = torch.cat(outputs).contiguous() if outputs and not failed else None
    if failed:  # every rank raises, not only the last stage (the others would wait for the result)
        header = torch.full((HEADER,), -1, dtype=torch.int64, device=device)
    elif result is not None:
        header = encode(Spec.of(result), device=device)
    else:
        header = torch.zeros(HEADER, dtype=torch.int64, device=device)
    dist.broadcast(header, src=src, group=group)
    values = None if on_last else header.tolist()  # the result's shape, or a failure: one host read
    if failed or (values is not None and values[0] == -1):
        box: list[Any] = [f"{type(failed[0]).__name__}: {failed[0]}" if failed else None]
        dist.broadcast_object_list(box, src=src, group=group, device=device)
        if failed:
            raise failed[0]
        raise RuntimeError(f"predict failed on the last pipeline stage (global rank {src}): {box[0]}")
    if result is None:
        assert values is not None
        ((shape, dtype),) = decode(values).parts
        result = torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(result, src=src, group=group)
    return result
