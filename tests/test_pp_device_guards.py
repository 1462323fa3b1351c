"""CPU guards for GPU correctness of the pipeline path (the checks of ``tests/test_device_guards.py``,
for pipeline steps), on 4 Gloo ranks (pp2 x dp2) through the Fabric front door.

A left-padded Hugging Face Llama (``hf_pipeline_layers``: masks and positions travel between stages),
the token-exact loss, zb (the split backward's weight passes), ZeRO-1 and ZeRO-3, two pipeline steps per
optimizer step with clipping:

(a) Explicit devices: after a first window (which learns shapes and layouts), a window runs under
    :func:`tests.probes.explicit_devices`, where a tensor created without ``device=`` is a meta tensor
    (one handed to a p2p op or a collective fails); the final weights equal the unguarded run's bitwise.
(b) Host reads per optimizer step made by the package's own code (``tests.probes.HostSyncs``): on
    pipeline ranks > 0 the step's input-signature id (one per pipeline step, ``pipeline/runtime.py``), on
    the ranks but the last stage's the previous step's metric flag, read from host memory
    (``pipeline/metrics.py``), on every rank the seed of the schedule's random state (a CPU draw, read from
    host memory: ``pipeline/steps.py``), and nothing else (clipping with ``error_if_nonfinite=False``).
"""

from __future__ import annotations

from collections import Counter
from contextlib import nullcontext
from typing import Any

import torch
from lightning.fabric import Fabric

from lightning_par.fabric import HybridParallelStrategy
from lightning_par.pipeline import hf_causal_lm_loss, hf_pipeline_layers
from tests.distributed import run_distributed
from tests.probes import HostSyncs, explicit_devices
from tests.test_fabric_pp import _rows, _window_rows
from tests.test_pp_hf import build

WORLD, PP, DP, ACCUM = 4, 2, 2, 2


def _run(stage: int, guarded: bool) -> dict[str, Any]:
    strategy = HybridParallelStrategy(
        pipeline_parallel_size=PP,
        num_microbatches=2,
        pipeline_schedule="zb",
        zero_stage=stage,
        pipeline_layers=hf_pipeline_layers,
    )
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    model = build("llama", seed=5).train()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    mesh = strategy.mesh
    reads: list[tuple[str, str]] = []
    for window in range(2):
        batches = [_rows("left", idx) for idx in _window_rows(window, mesh.dp_rank, DP)]  # host-side data
        probe = HostSyncs()
        with probe, explicit_devices() if guarded and window > 0 else nullcontext():
            for k, batch in enumerate(batches):
                with fabric.no_backward_sync(model, enabled=k < ACCUM - 1):
                    strategy.pipeline.step(
                        batch, loss_fn=lambda out, mb: hf_causal_lm_loss(out, mb["labels"]), scale=1 / ACCUM
                    )
            fabric.clip_gradients(model, optimizer, max_norm=0.5, error_if_nonfinite=False)
            optimizer.step()
            optimizer.zero_grad()
        reads = [(name, where.split(":")[0]) for name, where in probe.calls]  # the last window's
    state = strategy.consolidated_state_dict()
    strategy.destroy_process_groups()
    return {
        "reads": reads,
        "pp_rank": mesh.pp_rank,
        "state": {k: v.clone() for k, v in state.items()} if state else None,
    }


def _runs(rank: int, world: int) -> dict[int, dict[str, Any]]:
    return {stage: {"plain": _run(stage, False), "guarded": _run(stage, True)} for stage in (1, 3)}


def test_pipeline_steps_use_explicit_devices_and_read_the_host_only_where_documented() -> None:
    results = run_distributed(_runs, WORLD, init_group=False, timeout=600)
    for stage in (1, 3):
        plain, guarded = results[0][stage]["plain"]["state"], results[0][stage]["guarded"]["state"]
        assert plain is not None and guarded is not None and plain.keys() == guarded.keys()
        for name, value in plain.items():
            assert torch.equal(guarded[name], value), (stage, name)
        for r in results:
            run = r[stage]["guarded"]
            # every rank: the seed of the schedule's random state, one CPU draw per pipeline step
            want: Counter[tuple[str, str]] = Counter({("__int__", "pipeline/steps.py"): ACCUM})
            if run["pp_rank"] > 0:  # the signature id, once per pipeline step
                want[("item", "pipeline/runtime.py")] = ACCUM
            if run["pp_rank"] < PP - 1:  # the previous step's metric flag, from host memory
                want[("__bool__", "pipeline/metrics.py")] = ACCUM
            assert Counter(run["reads"]) == want, (stage, run["pp_rank"], run["reads"])
