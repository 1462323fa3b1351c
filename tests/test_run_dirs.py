"""``lightning-par-train`` under launchers that start every rank themselves: one run directory per launch.

Before: torchrun without ``--rdzv-id`` (the README's own launch line) named every job's folder
``torchrun-none``, so two jobs wrote into one folder (the second overwrote the first's ``metrics.json``,
their checkpoints mixed, and ``ckpt_path=last`` could pick the other job's); under srun each task named a
folder from its own clock, so ranks > 0 wrote folders and configs of their own. The launcher's store is a
real ``TCPStore`` here, standing in for torchrun's agent store, with rank 1 asking before rank 0 answers.
"""

from __future__ import annotations

import logging
import re
import threading
import time

import pytest
import torch.distributed as dist

from lightning_par.run_dirs import first_attempt_dir, launcher_overrides

STAMP = re.compile(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d")


def _torchrun_env(port: int, rank: int, run_id: str = "none", shared: bool = True) -> dict[str, str]:
    return {
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(shared),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
    }


def _launch(agent: dist.TCPStore) -> list[list[str]]:
    """Both ranks' overrides, rank 1 asking first (it waits for rank 0's name)."""
    got: dict[int, list[str]] = {}
    late = threading.Thread(
        target=lambda: got.update({1: launcher_overrides(_torchrun_env(agent.port, 1), ())})
    )
    late.start()
    time.sleep(0.2)
    got[0] = launcher_overrides(_torchrun_env(agent.port, 0), ())
    late.join(timeout=30)
    return [got[0], got[1]]


def _run_dir(overrides: list[str]) -> str:
    (run_dir,) = [o for o in overrides if o.startswith("hydra.run.dir=")]
    return run_dir.removeprefix("hydra.run.dir=${paths.log_dir}/${task_name}/")


def test_torchrun_jobs_without_a_run_id_get_a_folder_each_shared_by_their_ranks() -> None:
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    rank0, rank1 = _launch(agent)
    name = _run_dir(rank0)
    assert STAMP.fullmatch(name), rank0
    assert _run_dir(rank1) == name and f"hydra.sweep.dir=multirun/${{task_name}}/{name}" in rank1
    assert "hydra.output_subdir=null" in rank1 and "hydra.output_subdir=null" not in rank0
    # a restarted attempt (the agent's store outlives it) finds the first attempt's folder again
    time.sleep(1.1)
    assert _run_dir(launcher_overrides(_torchrun_env(agent.port, 0), ())) == name
    # another job (its own agent, a second later) gets a folder of its own
    other = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    second = _launch(other)
    assert _run_dir(second[0]) == _run_dir(second[1]) != name


def test_named_runs_slurm_tasks_and_plain_commands(caplog: pytest.LogCaptureFixture) -> None:
    # --rdzv-id (or --standalone's drawn id): named after it, no store needed
    assert _run_dir(launcher_overrides(_torchrun_env(1, 1, run_id="job7"), ())) == "torchrun-job7"
    # no id and no shared store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE): the old name, and the fix said
    with caplog.at_level(logging.WARNING, logger="lightning_par.run_dirs"):
        plain = launcher_overrides(_torchrun_env(1, 0, shared=False), ())
    assert _run_dir(plain) == "torchrun-none" and "pass --rdzv-id=<name>" in caplog.text
    # the user's own directory wins
    assert launcher_overrides(_torchrun_env(1, 0, run_id="j"), ("hydra.run.dir", "hydra.sweep.dir")) == []
    slurm = {"SLURM_NTASKS": "2", "SLURM_JOB_ID": "4100", "SLURM_STEP_ID": "3", "SLURM_JOB_NAME": "train"}
    task1 = launcher_overrides({**slurm, "SLURM_PROCID": "1"}, ())
    assert _run_dir(task1) == "slurm-4100.3" and "hydra.output_subdir=null" in task1
    assert "hydra.output_subdir=null" not in launcher_overrides({**slurm, "SLURM_PROCID": "0"}, ())
    # one task (a batch script running the command), an interactive shell, a plain command: Hydra's own
    assert launcher_overrides({**slurm, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, ()) == []
    assert launcher_overrides({**slurm, "SLURM_JOB_NAME": "bash", "SLURM_PROCID": "1"}, ()) == []
    assert launcher_overrides({"LOCAL_RANK": "1"}, ()) == []


def test_first_attempts_of_a_launch_are_told_from_restarts_and_given_directories() -> None:
    """``ckpt_path=last`` is checked against the task's earlier runs in a directory new to the command: the
    one a torchrun or srun launch names for its first attempt (a one-node torchrun draws a new run id at
    every launch); a restart, or a directory of another name (the user's ``hydra.run.dir``), is not."""
    torchrun = {"TORCHELASTIC_RUN_ID": "4f1c", "RANK": "1", "TORCHELASTIC_RESTART_COUNT": "0"}
    assert first_attempt_dir("/w/outputs/train/torchrun-4f1c", torchrun)
    assert not first_attempt_dir(
        "/w/outputs/train/torchrun-4f1c", {**torchrun, "TORCHELASTIC_RESTART_COUNT": "2"}
    )
    assert not first_attempt_dir("/w/outputs/train/mine", torchrun)
    unnamed = {**torchrun, "TORCHELASTIC_RUN_ID": "none"}
    assert first_attempt_dir("/w/outputs/train/2026-12-06_20-50-00", unnamed)
    assert not first_attempt_dir("/w/outputs/train/mine", unnamed)
    slurm = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NAME": "train"}
    assert first_attempt_dir("/w/outputs/train/slurm-77.0", slurm)
    assert not first_attempt_dir("/w/outputs/train/slurm-77.0", {**slurm, "SLURM_RESTART_COUNT": "1"})
    assert not first_attempt_dir("/w/outputs/train/2026-12-06_20-50-00", {})  # a plain command: Hydra's own
