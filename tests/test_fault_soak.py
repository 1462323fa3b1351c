"""A fault-injection soak under plain torchrun (CPU, Gloo, localhost, no extra environment variables).

One job of two torchrun agents ("nodes", one rank each, c10d rendezvous through our ``lightning_par``
backend, separate shared memory per node) is hit by 8 faults at random steps, one after the other: SIGKILL
of a random rank (three times), SIGKILL during a persist, SIGKILL during ``trainer.save_checkpoint``, a
stalled rank (the hang watchdog exits 75), and twice a whole node (its agent and worker SIGKILLed, a
replacement agent with empty shared memory joins). The final weights equal an uninterrupted run's,
bitwise. Every fault's recovery time (SIGKILL to the first step of the resumed job) is written to
``soak.json`` in the test's directory, by the source the lost rank's part came from.

The elastic case: two agents with ``--nnodes=1:2``, a node lost and not replaced; the survivor continues
alone from the newest snapshot, resharded to dp 1 with the accumulation doubled
(``keep_global_batch=True``), and ends equal to the uninterrupted dp-1 run (accumulation 2) within fp32
reduction-order tolerance (``rtol=1e-4, atol=1e-6``; the dp-2 and dp-1 runs sum the same gradients in
another order).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from tests import fault_job
from tests.distributed import free_port, run_distributed
from tests.test_fault_tolerance import _assert_equal_weights, _env, _read, _reference, _torchrun, shm_root

__all__ = ["shm_root"]  # the fixture


class Agents:
    """torchrun agents of one job, one per simulated node, each in its own session (killed as a node)."""

    def __init__(self, tmp: Path, cfg: Path, shm: Path, options: tuple[str, ...], conf: str = "") -> None:
        self.tmp, self.cfg, self.shm, self.options, self.conf = tmp, cfg, shm, options, conf
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: list[Any] = []

    def start(self, node: str, *, host: bool) -> None:
        env = _env(FT_NODE=node, FT_SHM_DIR=str(self.shm / node))
        log = open(self.tmp / f"agent_{node}.log", "wb")  # noqa: SIM115 (closed in stop())
        self.logs.append(log)
        self.procs[node] = subprocess.Popen(
            [*_torchrun(*self.options, f"--rdzv-conf=is_host={str(host).lower()}{self.conf}"), str(self.cfg)],
            cwd=self.tmp,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def kill_node(self, node: str, worker_pid: int) -> None:
        os.kill(worker_pid, signal.SIGKILL)  # torchrun workers have their own session: kill both
        os.killpg(self.procs[node].pid, signal.SIGKILL)
        self.procs[node].wait()

    def log(self, node: str) -> str:
        return (self.tmp / f"agent_{node}.log").read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for log in self.logs:
            log.close()


def _faults(rng: random.Random) -> list[dict[str, Any]]:
    kinds = ["kill", "kill_persist", "kill", "stall", "kill_save", "node_kill", "kill", "node_kill"]
    faults, step, nodes = [], 1, iter(["B", "B2"])
    for kind in kinds:
        step += rng.randint(3, 4)
        fault: dict[str, Any] = {"kind": kind, "attempt": None, "rank": rng.randrange(2), "step": step}
        if kind == "node_kill":
            fault["node"] = next(nodes)
        faults.append(fault)
    return faults


def test_soak_eight_faults_two_nodes(tmp_path: Path, shm_root: Path) -> None:
    rng = random.Random()
    faults = _faults(rng)
    out = tmp_path / "out"
    cfg = {
        "out": str(out),
        "strategy": "zero2",
        "devices": 1,
        "num_nodes": 2,
        "steps": faults[-1]["step"] + 5,
        "every": 2,
        "persist": 4,
        "watchdog_s": 8.0,
        "replicas": 1,  # each node's snapshots also in the other node's memory
        "faults": faults,
    }
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    port = free_port()
    options = (
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=lightning_par",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=soak-{port}",
        "--max-restarts=12",
    )
    agents = Agents(tmp_path, tmp_path / "cfg.json", shm_root, options)
    what = f"faults {faults}"
    try:
        agents.start("A", host=True)
        time.sleep(1.0)  # A hosts the rendezvous store
        agents.start("B", host=False)
        reference = _reference(cfg, 2)  # meanwhile, in forked ranks
        node_kills = [(i, f) for i, f in enumerate(faults) if f["kind"] == "node_kill"]
        deadline = time.monotonic() + 900
        for index, fault in node_kills:
            marker = out / f"fault{index}.json"
            while not marker.exists():
                assert agents.procs["A"].poll() is None, f"{what}\n{agents.log('A')}"
                assert time.monotonic() < deadline, f"the job never reached fault {index}: {what}"
                time.sleep(0.2)
            time.sleep(0.2)
            agents.kill_node(fault["node"], _read(marker)["pid"])
            agents.start(fault["node"] + "2" if fault["node"] == "B" else "B3", host=False)
        assert agents.procs["A"].wait(timeout=600) == 0, f"{what}\n{agents.log('A')}"
        assert agents.procs["B3"].wait(timeout=100) == 0, f"{what}\n{agents.log('B3')}"
    finally:
        agents.stop()
    for i in range(len(faults)):
        assert (out / f"fault{i}.json").exists(), f"fault {i} never fired: {what}"
    log = agents.log("A")
    assert "exitcode: 75" in (tmp_path / "agent_A.log").read_text(errors="replace") or "exitcode: 75" in (
        tmp_path / "agent_B2.log"
    ).read_text(errors="replace"), "the stalled rank was not ended by the watchdog"
    _assert_equal_weights(out, reference)
    _write_recovery(tmp_path, out, faults)
    del log


def _write_recovery(tmp_path: Path, out: Path, faults: list[dict[str, Any]]) -> None:
    """SIGKILL (or stall) to the first step of the next process, by where the resumed parts came from."""
    progress = sorted((_read(p) for p in (out / "progress").glob("*.json")), key=lambda r: r["first_step"])
    rows = []
    for i, fault in enumerate(faults):
        t = _read(out / f"fault{i}.json")["time"]
        after = [r for r in progress if r["process_start"] > t and r["resumed"]]
        if after:
            first = after[0]
            sources = sorted({s.split(" (")[0] for r in after[:2] for s in r["resumed"]["sources"]})
            rows.append({"kind": fault["kind"], "recovery_s": first["first_step"] - t, "sources": sources})
    (tmp_path / "soak.json").write_text(json.dumps(rows, indent=1))
    assert len(rows) == len(faults), rows


def test_elastic_two_nodes_to_one(tmp_path: Path, shm_root: Path) -> None:
    out = tmp_path / "out"
    cfg = {
        "out": str(out),
        "strategy": "zero2",
        "devices": 1,
        "num_nodes": "auto",
        "steps": 16,
        "every": 2,
        "persist": 2,
        "keep_global_batch": True,
        "faults": [{"kind": "node_kill", "attempt": None, "node": "B", "step": 7}],
    }
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    port = free_port()
    options = (
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=lightning_par",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=elastic-{port}",
        "--max-restarts=2",
    )
    # the survivor's round closes 2 s after it rejoined alone (torch's default waits 30 s for more nodes)
    agents = Agents(tmp_path, tmp_path / "cfg.json", shm_root, options, conf=",last_call_timeout=2")
    try:
        agents.start("B", host=False)  # B waits for A's store, so both join round 0
        agents.start("A", host=True)
        marker = out / "fault0.json"
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert agents.procs["A"].poll() is None, agents.log("A")
            assert time.monotonic() < deadline, "the job never reached the fault"
            time.sleep(0.2)
        time.sleep(0.2)
        killed = time.time()
        agents.kill_node("B", _read(marker)["pid"])
        assert agents.procs["A"].wait(timeout=400) == 0, agents.log("A")
    finally:
        agents.stop()
    plain = {**cfg, "out": str(tmp_path / "ref"), "flash": False, "faults": [], "num_nodes": 1}

    def job(rank: int, world_size: int, c: dict[str, Any]) -> dict[str, torch.Tensor]:
        return fault_job.train(c)["state"]

    dp1 = run_distributed(job, 1, {**plain, "devices": 1, "accumulate": 2}, init_group=False)[0]
    got = torch.load(out / "final_rank0.pt", weights_only=True)
    for name, value in dp1.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6, msg=name)
    resumed = [r for r in map(_read, (out / "progress").glob("*.json")) if r["resumed"]]
    assert len(resumed) == 1 and resumed[0]["world_size"] == 1, resumed
    record = resumed[0]
    assert record["resumed"]["world_size"] == 2 and record["resumed"]["step"] in (4, 6), record
    (tmp_path / "elastic.json").write_text(
        json.dumps({"resume_s": record["first_step"] - killed, "sources": record["resumed"]["sources"]})
    )
