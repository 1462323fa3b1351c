"""GPU check, part 6: gradient compression on the device (world size 1, NCCL on CUDA).

At world size 1 every collective is an identity, but NCCL still refuses a tensor that is not on the GPU,
so these runs catch host tensors in the compression paths: our PowerSGD (stages 0 and 1, compressing from
the first step, accumulation 2, clipping), the bf16 reduce-scatter at stage 2, and ZeRO-3 with the bf16
reduction and int8-quantized parameter gathers. Checked against the uncompressed stage-0 run of the same
model and data: every loss finite; the bf16 reduction and the int8 gathers move the weights by at most a
few bf16 / int8 steps of the update (their rounding only); PowerSGD changes the trajectory (a rank-2
approximation of every gradient matrix) yet ends within 5% of the uncompressed final loss.
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from benchmarks.gpu_check_correctness import Fail, Sizes, fit, module

VARIANTS: dict[str, dict[str, Any]] = {
    "zero0-none": dict(zero_stage=0),
    "zero0-powersgd": dict(
        zero_stage=0, comm_hook="powersgd", powersgd_rank=2, comm_hook_state={"start_iter": 0}
    ),
    "zero1-powersgd": dict(
        zero_stage=1, comm_hook="powersgd", powersgd_rank=2, comm_hook_state={"start_iter": 0}
    ),
    "zero2-bf16": dict(zero_stage=2, comm_hook="bf16", reduce_op="reduce_scatter"),
    "zero3-bf16-int8": dict(zero_stage=3, comm_hook="bf16", gather_dtype="int8"),
}


def _diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    """Largest absolute difference over the floating-point entries both hold (read on the host, once)."""
    keys = [k for k in a if k in b and a[k].is_floating_point()]
    return max(float((a[k].detach().cpu().float() - b[k].detach().cpu().float()).abs().max()) for k in keys)


def part_compress(sizes: Sizes, device: str, root: str, fail: Fail) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for name, kw in VARIANTS.items():
        rows[name] = fit(sizes, device, kw["zero_stage"], "32-true", False, "sgd", root, strategy_kw=kw)
    base = rows["zero0-none"]
    moved = _diff(base["final"], module(sizes, "cpu", token=False, optimizer="sgd").state_dict())
    out: dict[str, Any] = {"update_size": moved}
    for name, row in rows.items():
        if not row["losses"] or not all(math.isfinite(x) for x in row["losses"]):
            fail(f"compression {name}: losses {row['losses']}")
        diff = _diff(row["final"], base["final"])
        out[name] = {"losses": row["losses"], "max_dw_vs_uncompressed": diff, "seconds": row["seconds"]}
        if name.endswith(("bf16", "int8")) and not diff <= 0.05 * moved + 1e-6:
            fail(
                f"compression {name}: weights {diff:.3g} from the uncompressed run (the updates: {moved:.3g})"
            )
        if "powersgd" in name and not row["losses"][-1] <= 1.05 * base["losses"][-1]:
            fail(f"compression {name}: final loss {row['losses'][-1]:.4f} vs {base['losses'][-1]:.4f}")
    return out
