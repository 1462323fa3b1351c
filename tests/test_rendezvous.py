"""Restarts under plain torchrun: each attempt's process group runs on a store of its own
(``lightning_par.rendezvous``), so the first restart recovers without ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``.

With torch's shared agent store and Lightning's plain DDP the restarted Gloo ranks dial the dead attempt's
peer (``connectFullMesh failed ... Connection refused``); these jobs kill a rank right after the group
formed and check that attempt 1 forms a working group at once: our Fabric strategy under the static
rendezvous, Lightning's DDP with ``RestartSafeEnvironment`` under c10d (the Trainer strategy under c10d is
``tests/test_fault_tolerance.py``'s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_par.rendezvous import attempt_store
from tests.distributed import free_port

REPO = Path(__file__).resolve().parent.parent
LAUNCH_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _attempt_stores(agent_port: int, timeout: float) -> list[object]:
    """Ranks 0 and 1 of one attempt, in threads (no process group is made)."""
    got: list[object] = [None, None]

    def rank(r: int) -> None:
        try:
            got[r] = attempt_store(
                host="127.0.0.1",
                agent_port=agent_port,
                rank=r,
                world_size=2,
                timeout=timedelta(seconds=timeout),
                generation=0,
            )
        except Exception as exc:  # handed to the test thread
            got[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]  # rank 1 reads first
    threads[0].start()
    threads[0].join(1.5)  # rank 1 meets the stale publication before rank 0 replaces it
    threads[1].start()
    for t in threads:
        t.join(30)
    return got


def test_stale_publications_are_skipped() -> None:
    agent = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    older = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)  # alive, another nonce
    older.set("lightning_par/nonce", "0" * 32)
    dead = free_port()
    for stale in (
        {"host": "127.0.0.1", "port": dead, "nonce": "1" * 32},
        {"host": "127.0.0.1", "port": older.port, "nonce": "2" * 32},
    ):
        agent.set("lightning_par/attempt_store/0", json.dumps(stale))
        s0, s1 = _attempt_stores(agent.port, timeout=20)
        assert isinstance(s0, dist.TCPStore) and isinstance(s1, dist.TCPStore), (s0, s1)
        assert s1.port == s0.port != stale["port"]
        s1.set("from_rank1", "x")
        assert s0.get("from_rank1") == b"x"  # one store, this attempt's


def test_no_publication_times_out_with_the_key_named() -> None:
    agent = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    agent.set(
        "lightning_par/attempt_store/7", json.dumps({"host": "127.0.0.1", "port": free_port(), "nonce": "x"})
    )
    with pytest.raises(TimeoutError, match=r"lightning_par/attempt_store/7.*did not answer"):
        attempt_store(
            host="127.0.0.1",
            agent_port=agent.port,
            rank=1,
            world_size=2,
            timeout=timedelta(seconds=3),
            generation=7,
        )


@pytest.mark.parametrize(("rendezvous", "kind"), [("static", "ours"), ("c10d", "env")])
def test_first_restart_recovers(tmp_path: Path, rendezvous: str, kind: str) -> None:
    port = free_port()
    if rendezvous == "static":
        options = [
            "--rdzv-backend=static",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "--node-rank=0",
        ]
    else:
        options = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=rz{port}"]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = "1"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--monitor-interval=0.2",
        *options,
        str(REPO / "tests" / "restart_job.py"),
        str(tmp_path),
        kind,
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    for attempt in (0, 1):
        for rank in (0, 1):
            assert (tmp_path / f"attempt{attempt}_rank{rank}").read_text() == "3.0", log[-3000:]
    assert "Connection refused" not in log
