"""Fault injection under ``torchrun`` on localhost (CPU, Gloo), against uninterrupted runs.

* One single-node job (ZeRO-2, 2 ranks, ``--max-restarts=3``) is hit three times, one fault per attempt:
  SIGKILL of a random rank after a random step (the restart resumes from the memory snapshot); SIGKILL of
  a rank halfway through writing a persisted snapshot, with the next attempt's shared memory wiped like a
  replaced node's (it resumes from the last snapshot complete on disk; the partial one is removed and
  named, never loaded); a rank that stalls (the hang watchdog dumps the stacks and exits 75 within its
  timeout; the restart resumes from memory). The final weights equal an uninterrupted run's, bitwise.
* Two torchrun agents (c10d rendezvous, Lightning's ``"ddp"``, one process each, separate shared memory
  per "node"): node B's agent and worker are SIGKILLed and a replacement agent joins; node A's rank
  resumes from memory, the new node's from disk, and the run ends with the uninterrupted weights.

The jobs are ``tests/fault_job.py``; the references run the same code in forked ranks without faults or
snapshots. The launches are plain torchrun (no ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``): our strategy, and
Lightning's DDP with ``RestartSafeEnvironment``, give each attempt a store of its own
(``lightning_par.rendezvous``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import fault_job
from tests.distributed import free_port, run_distributed

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "tests" / "fault_job.py"
LAUNCH_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def shm_root() -> Iterator[Path]:
    root = Path("/dev/shm") / f"lightning_par_test_{uuid.uuid4().hex[:8]}"
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # plain torchrun: restarts must work without it
    # torchrun sets this only for --nproc-per-node > 1; torch.set_num_threads(1) inside the process is not
    # enough for bitwise equality with the references (kernels are chosen by the start-up environment)
    env["OMP_NUM_THREADS"] = "1"
    return {**env, **extra}


def _torchrun(*options: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--monitor-interval=0.2", *options, str(JOB)]


def _start_single_node(tmp_path: Path, cfg: dict[str, Any], *, max_restarts: int) -> subprocess.Popen[str]:
    """``torchrun --standalone`` with 2 processes on the job ``cfg`` (written to ``tmp_path/cfg.json``)."""
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    return subprocess.Popen(
        [
            *_torchrun("--standalone", "--nproc-per-node=2", f"--max-restarts={max_restarts}"),
            str(tmp_path / "cfg.json"),
        ],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _reference(cfg: dict[str, Any], world: int) -> list[dict[str, torch.Tensor]]:
    plain = {**cfg, "flash": False, "faults": [], "watchdog_s": None, "devices": world, "num_nodes": 1}

    def job(rank: int, world_size: int, c: dict[str, Any]) -> dict[str, torch.Tensor]:
        return fault_job.train(c)["state"]

    return run_distributed(job, world, plain, init_group=False)


def _assert_equal_weights(out: Path, reference: list[dict[str, torch.Tensor]]) -> None:
    for rank, ref in enumerate(reference):
        got = torch.load(out / f"final_rank{rank}.pt", weights_only=True)
        assert got.keys() == ref.keys()
        for name, value in ref.items():
            assert torch.equal(got[name], value), f"rank {rank}: {name} differs from the uninterrupted run"


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def test_torchrun_restarts_after_kill_partial_persist_and_stall(tmp_path: Path, shm_root: Path) -> None:
    rng = random.Random()
    kill_rank, kill_step = rng.randrange(2), rng.randint(3, 9)
    persist_rank, stall_rank = rng.randrange(2), rng.randrange(2)
    watchdog_s = 6.0
    out = tmp_path / "out"
    cfg = {
        "out": str(out),
        "strategy": "zero2",
        "steps": 20,
        "every": 2,
        "persist": 6,
        "shm_dir": str(shm_root),
        "watchdog_s": watchdog_s,
        "clear_shm_attempts": [2],
        "faults": [
            {"kind": "kill", "attempt": 0, "rank": kill_rank, "step": kill_step},
            {"kind": "kill_persist", "attempt": 1, "rank": persist_rank, "step": 12},
            {"kind": "stall", "attempt": 2, "rank": stall_rank, "step": 16},
        ],
    }
    what = f"faults {cfg['faults']}"
    proc = _start_single_node(tmp_path, cfg, max_restarts=3)
    reference = _reference(cfg, 2)  # meanwhile, in forked ranks
    log, _ = proc.communicate(timeout=600)
    (tmp_path / "torchrun.log").write_text(log)
    assert proc.returncode == 0, f"{what}\n{log[-4000:]}"

    def resumed(attempt: int) -> list[dict[str, Any]]:
        return [_read(out / f"resume_attempt{attempt}_rank{r}.json")["resumed"] for r in range(2)]

    # 1) SIGKILL after step k (before that step's snapshot): the newest snapshot is the one before it
    expected = kill_step - (2 if kill_step % 2 == 0 else 1)
    for r in resumed(1):
        assert r["step"] == expected, what
        assert all(s.startswith("memory") for s in r["sources"]), r
    # 2) SIGKILL while step 12 was being written; shared memory gone: the last complete disk snapshot
    assert _read(out / "fault1.json")["step"] >= 12
    for r in resumed(2):
        assert r["step"] == 6 and all(s.startswith("disk") for s in r["sources"]), (what, r)
    assert "removed 1 partial file(s) of interrupted saves" in log and "rank" in log
    assert "not complete on every rank" in log and "step 12" in log
    # 3) the stalled rank: stacks in the log, exit status 75 within the timeout, resume from memory
    assert "HangWatchdog: no training progress" in log and "in stall_here" in log, log[-3000:]
    assert "exitcode: 75" in log
    stall = _read(out / "fault2.json")["time"]
    restart = min(_read(out / f"resume_attempt3_rank{r}.json")["process_start"] for r in range(2))
    assert restart - stall < watchdog_s + 20, f"the restart came {restart - stall:.1f} s after the stall"
    for r in resumed(3):
        assert r["step"] == 16 and all(s.startswith("memory") for s in r["sources"]), r
    final = [_read(out / f"attempt3_rank{r}.json") for r in range(2)]
    assert all(f["global_step"] == 20 and not f["errors"] for f in final), final
    _assert_equal_weights(out, reference)


def test_pipeline_restart_after_kill_resumes_from_memory(tmp_path: Path, shm_root: Path) -> None:
    """Two pipeline stages (pp 2 x ZeRO-1, 1F1B): a random rank SIGKILLed after a random step; torchrun
    restarts both and every stage resumes its own part of the newest snapshot, ending bitwise equal to
    an uninterrupted pipeline run."""
    rng = random.Random()
    kill_rank, kill_step = rng.randrange(2), rng.randint(3, 7)
    out = tmp_path / "out"
    cfg = {
        "out": str(out),
        "strategy": {"pipeline_parallel_size": 2, "num_microbatches": 2, "zero_stage": 1},
        "steps": 10,
        "every": 2,
        "persist": 6,
        "shm_dir": str(shm_root),
        "faults": [{"kind": "kill", "attempt": 0, "rank": kill_rank, "step": kill_step}],
    }
    what = f"faults {cfg['faults']}"
    proc = _start_single_node(tmp_path, cfg, max_restarts=1)
    reference = _reference(cfg, 2)
    log, _ = proc.communicate(timeout=600)
    (tmp_path / "torchrun.log").write_text(log)
    assert proc.returncode == 0, f"{what}\n{log[-4000:]}"
    expected = kill_step - (2 if kill_step % 2 == 0 else 1)
    for r in range(2):
        resumed = _read(out / f"resume_attempt1_rank{r}.json")["resumed"]
        assert resumed["step"] == expected and all(s.startswith("memory") for s in resumed["sources"]), (
            what,
            resumed,
        )
        assert _read(out / f"attempt1_rank{r}.json")["global_step"] == 10
    assert reference[0] and reference[1] and set(reference[0]) != set(reference[1])  # a stage each
    _assert_equal_weights(out, reference)


@pytest.mark.parametrize("replacement_first", [False, True], ids=["A-stays-rank-0", "B2-becomes-rank-0"])
def test_two_nodes_survive_a_killed_agent(tmp_path: Path, shm_root: Path, replacement_first: bool) -> None:
    """Node B's agent and worker are killed; a replacement B2 joins and both nodes resume. The rendezvous
    ranks nodes by address (then agent pid), set here so that B2 sorts after A or before it. Before it:
    B2's node becomes rank 0 and makes the workers' shared store anew; torch's handler left A's workers
    on A's old store, and the job hung (in CI it struck when B2's agent pid wrapped around below A's)."""
    out = tmp_path / "out"
    cfg = {
        "out": str(out),
        "strategy": "ddp",
        "devices": 1,
        "num_nodes": 2,
        "steps": 12,
        "every": 2,
        "persist": 4,
        "faults": [{"kind": "node_kill", "attempt": 0, "node": "B", "step": 5}],
    }
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    port = free_port()
    logs: list[Any] = []

    def agent(node: str, is_host: bool, addr: str) -> subprocess.Popen[bytes]:
        options = (
            f"--local-addr={addr}",  # the rendezvous ranks nodes by address first
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=lightning_par",  # c10d, with a replacement node able to join
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=ft-{port}",
            f"--rdzv-conf=is_host={str(is_host).lower()}",
            "--max-restarts=2",
        )
        env = _env(FT_NODE=node, FT_SHM_DIR=str(shm_root / node))
        log = open(tmp_path / f"agent_{node}.log", "wb")  # noqa: SIM115 (closed after the test)
        logs.append(log)
        return subprocess.Popen(
            [*_torchrun(*options), str(tmp_path / "cfg.json")],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the agent's process group: killed like a lost node
        )

    a = agent("A", True, "127.0.0.2")
    time.sleep(1.0)  # A hosts the rendezvous store
    b = agent("B", False, "127.0.0.3")
    agents = [a, b]
    try:
        reference = _reference(cfg, 2)
        marker = out / "fault0.json"
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert a.poll() is None and b.poll() is None, "an agent ended before the fault"
            assert time.monotonic() < deadline, "the job never reached the fault"
            time.sleep(0.2)
        time.sleep(0.2)
        worker = _read(marker)["pid"]
        os.kill(worker, signal.SIGKILL)  # torchrun workers have their own session: kill both
        os.killpg(b.pid, signal.SIGKILL)
        b.wait()
        replacement = agent("B2", False, "127.0.0.1" if replacement_first else "127.0.0.4")
        agents.append(replacement)
        assert a.wait(timeout=300) == 0, (tmp_path / "agent_A.log").read_text()[-4000:]
        assert replacement.wait(timeout=100) == 0, (tmp_path / "agent_B2.log").read_text()[-4000:]
    finally:
        for p in agents:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for log in logs:
            log.close()
    records = [_read(f) for f in out.glob("resume_attempt*_rank*.json")]
    after = [r for r in records if r["resumed"] is not None]
    assert {r["node"] for r in after} == {"A", "B2"}, records
    steps = {r["resumed"]["step"] for r in after}
    assert len(steps) == 1 and steps.pop() >= 4, after
    assert {(r["node"], r["rank"]) for r in after} == {
        ("A", int(replacement_first)),
        ("B2", 1 - replacement_first),
    }
    for r in after:
        # A's memory holds the part of rank 0, its rank before the fault: its own if it still is rank 0
        mine = r["resumed"]["sources"][r["rank"]]
        assert mine.startswith("memory" if (r["node"], r["rank"]) == ("A", 0) else "disk"), r
    _assert_equal_weights(out, reference)
