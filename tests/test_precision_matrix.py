"""The mixed-precision combination matrix (see tests/precision_matrix.py): every accepted combination of
ZeRO stage x tp x pp x precision x token-exact loss against a single-process run of the same stage and
precision, with exact invariants (tied copies, clip norms, skipped fp16 steps) and a tolerance per
precision; refused combinations are refused with their error."""

from __future__ import annotations

import math
from typing import Any

import torch

from tests.distributed import run_distributed
from tests.precision_matrix import (
    WORLD,
    Combo,
    combos,
    initial_state,
    reference_key,
    refusal,
    run_matrix,
    run_references,
    tolerance,
)


def evaluate(
    results: list[dict[str, Any]], references: dict[str, Any], *, strict: bool
) -> list[dict[str, Any]]:
    """A row per combination (status, deviation, tolerance); with ``strict`` every check is asserted."""
    initial = initial_state()
    rows = []
    for combo in combos():
        row: dict[str, Any] = {**combo.__dict__, "name": combo.name}
        reason = refusal(combo)
        if reason is not None:
            row["status"] = "refused" if reason.startswith("refused") else "n/a"
            row["reason"] = reason
            rows.append(row)
            continue
        ranks = [r[combo.name] for r in results]
        errors = [r["error"] for r in ranks if "error" in r]
        if errors:
            row.update(status="error", reason=errors[0])
            rows.append(row)
            if strict:
                raise AssertionError(f"{combo.name}: {errors[0]}")
            continue
        ref = references[repr(reference_key(combo))]
        try:
            row.update(_check(combo, ranks, ref, initial))
            row["status"] = "ok"
        except AssertionError as exc:
            row.update(status="failed", reason=str(exc))
            if strict:
                raise
        rows.append(row)
    return rows


def _check(
    combo: Combo, ranks: list[dict[str, Any]], ref: dict[str, Any], initial: dict[str, Any]
) -> dict[str, Any]:
    name = combo.name
    # every rank skipped the same steps, and the reference's (16-mixed: the poisoned second step)
    for r in ranks:
        assert r["skipped"] == ranks[0]["skipped"], f"{name}: ranks skip different steps"
    assert ranks[0]["skipped"] == ref["skipped"], f"{name}: skips {ranks[0]['skipped']} vs {ref['skipped']}"
    if combo.precision == "16-mixed":
        assert ranks[0]["skipped"][1], f"{name}: the poisoned step was not skipped"
    # every rank clipped with the same global norm, within the precision's tolerance of the reference's
    norms = torch.tensor([r["norms"] for r in ranks])
    assert torch.equal(norms.nan_to_num(-1.0), norms[:1].expand_as(norms).nan_to_num(-1.0)), f"{name}: norms"
    ref_norms = torch.tensor(ref["norms"])
    clean = ~torch.tensor(ref["skipped"])
    norm_dev = float((norms[0][clean] - ref_norms[clean]).abs().max() / ref_norms[clean].abs().max())
    # the tied copies of the embedding and LM head on the first and the last pipeline stage
    if combo.pp > 1:
        per_stage = WORLD // combo.pp
        for offset in range(per_stage):
            first, last = ranks[offset]["tied"], ranks[offset + per_stage]["tied"]
            assert first == last, f"{name}: tied copies differ on ranks {offset} and {offset + per_stage}"
    export, reference = ranks[0]["export"], ref["export"]
    assert set(export) == set(reference), f"{name}: state keys"
    stored_low = combo.precision == "bf16-true" and combo.stage == 0  # bf16 parameters, no fp32 masters
    tol = tolerance(combo.precision, reference, initial, stored_low=stored_low)
    deviation = max(float((export[k].float() - v.float()).abs().max()) for k, v in reference.items())
    assert deviation <= tol, f"{name}: max |W - W_ref| = {deviation:.3g} > tolerance {tol:.3g}"
    # the norm of a gradient computed in the precision's arithmetic: relative error a few u
    u = {"32-true": 2.0**-24, "bf16-mixed": 2.0**-8, "16-mixed": 2.0**-11, "bf16-true": 2.0**-8}[
        combo.precision
    ]
    assert norm_dev <= max(4 * u, 1e-6), f"{name}: clip norm deviates by {norm_dev:.3g} (relative)"
    assert not any(math.isnan(n) for n in ranks[0]["norms"][:1]), f"{name}: no clip norm recorded"
    return {"deviation": deviation, "tolerance": tol, "norm_deviation": norm_dev}


def test_every_precision_combination_matches_one_process() -> None:
    selected = [c for c in combos() if refusal(c) is None]
    results = run_distributed(run_matrix, WORLD, selected, init_group=False, timeout=2400.0)
    keys = sorted({reference_key(c) for c in selected})
    references = run_distributed(run_references, 1, keys, init_group=False, timeout=900.0)[0]
    rows = evaluate(results, references, strict=True)
    assert sum(r["status"] == "ok" for r in rows) == len(selected)
