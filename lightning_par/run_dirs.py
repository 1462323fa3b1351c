"""One run directory for all ranks of ``lightning-par-train`` when a launcher starts every rank itself.

Under ``torchrun`` or ``srun`` each rank runs the command on its own, and Hydra would name a run directory
per process from its clock (ranks starting a second apart get two folders). :func:`launcher_overrides`
gives every rank of one launch the same ``hydra.run.dir`` / ``hydra.sweep.dir`` and keeps ranks > 0 from
writing a ``.hydra`` record of their own. The name is:

* torchrun with a run id (``--rdzv-id``; ``--standalone`` and a one-node launch without
  ``--rdzv-endpoint`` / ``--master-port`` get a new one from torch at every launch): ``torchrun-<id>``,
  the same across restarts, so a restarted job finds its folder again;
* torchrun without one (its run id is then the literal ``none`` for every job, which put separate jobs
  into one folder, each overwriting the other's ``metrics.json`` and checkpoints): a timestamp that rank 0
  writes into the launcher's store (``TORCHELASTIC_USE_AGENT_STORE``: the agent's store lives as long
  as the job, so a restart reads the first attempt's name back) and the others read from it;
* SLURM with several tasks (Lightning's ``SLURMEnvironment.detect()``: tasks started by ``srun``, not an
  interactive shell): ``slurm-<job id>[.<step id>]``, the same when a requeued job runs again.

Lightning's own launcher needs none of this: it points the ranks it starts at rank 0's directory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from datetime import timedelta
from pathlib import PurePath

__all__ = ["first_attempt_dir", "launcher_overrides", "launcher_run_name"]

log = logging.getLogger(__name__)

_RUN_NAME_KEY = "lightning_par/run_dir_name"
_STAMP = "%Y-%m-%d_%H-%M-%S"  # Hydra's run directories' format (conf/hydra/default.yaml)


def _torchrun_name(env: Mapping[str, str], *, timeout: timedelta) -> str:
    run_id = env["TORCHELASTIC_RUN_ID"]
    if run_id != "none":
        return f"torchrun-{run_id}"
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        # no store outlives the ranks' start: nothing to agree through before the process group
        log.warning(
            "torchrun without --rdzv-id: every such job would write into outputs/<task>/torchrun-none;"
            " pass --rdzv-id=<name> (or --standalone, or hydra.run.dir=...) to keep jobs apart."
        )
        return "torchrun-none"
    import torch.distributed as dist

    store = dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        is_master=False,
        timeout=timeout,
        wait_for_workers=False,
    )
    if env.get("RANK", "0") == "0":  # a restarted attempt finds the first attempt's name and keeps it
        return store.compare_set(_RUN_NAME_KEY, "", time.strftime(_STAMP)).decode()
    return store.get(_RUN_NAME_KEY).decode()  # waits for rank 0 (up to the timeout)


def _slurm_name(env: Mapping[str, str]) -> str:
    step = env.get("SLURM_STEP_ID")
    return f"slurm-{env['SLURM_JOB_ID']}" + (f".{step}" if step else "")


def _under_slurm(env: Mapping[str, str]) -> bool:
    """Lightning's rule (``SLURMEnvironment.detect``) on ``env``, srun tasks and not an interactive
    shell, with several tasks: one task (a batch script running the command itself, perhaps several
    times) keeps Hydra's timestamped directories."""
    if env.get("SLURM_JOB_NAME") in ("bash", "interactive") or "SLURM_JOB_ID" not in env:
        return False
    return int(env.get("SLURM_NTASKS", "1") or 1) > 1


def launcher_run_name(
    env: Mapping[str, str], *, timeout: timedelta = timedelta(minutes=10)
) -> tuple[str, str] | None:
    """``(run directory name, this process's global rank)`` under torchrun or SLURM; None otherwise (a
    plain command, whose ranks > 0 Lightning starts and points at rank 0's directory). Under torchrun
    without a run id every rank waits for rank 0's name, up to ``timeout``."""
    if "TORCHELASTIC_RUN_ID" in env:
        return _torchrun_name(env, timeout=timeout), env.get("RANK", "0")
    if _under_slurm(env):
        return _slurm_name(env), env.get("SLURM_PROCID", "0")
    return None


def launcher_overrides(env: Mapping[str, str], given: Collection[str]) -> list[str]:
    """Hydra overrides that put every rank of a torchrun / srun launch into one run (or sweep) directory
    and let rank 0 alone write the ``.hydra`` record; ``given``: the override keys already on the command
    line (the user's ``hydra.run.dir`` wins). Empty outside those launchers."""
    named = launcher_run_name(env)
    if named is None:
        return []
    name, rank = named
    out = []
    if "hydra.run.dir" not in given:
        out.append(f"hydra.run.dir=${{paths.log_dir}}/${{task_name}}/{name}")
    if "hydra.sweep.dir" not in given:
        out.append(f"hydra.sweep.dir=multirun/${{task_name}}/{name}")
    if rank != "0" and "hydra.output_subdir" not in given:
        out.append("hydra.output_subdir=null")
    return out


def first_attempt_dir(run_dir: str, env: Mapping[str, str]) -> bool:
    """Whether ``run_dir`` (resolved) is the one :func:`launcher_overrides` names for the first attempt of
    a torchrun or srun launch: its name is this launch's (``torchrun-<run id>``, rank 0's timestamp without
    one, ``slurm-<job>[.<step>]``). Such a directory is new unless its name is stable across launches (a
    one-node torchrun draws a new run id for every launch, ``--rdzv-id`` or not, unless given
    ``--rdzv-endpoint`` or ``--master-port``), so ``ckpt_path=last`` is checked against the task's other
    runs as for a directory Hydra made. A restarted attempt (torchrun's ``TORCHELASTIC_RESTART_COUNT``, a
    requeued job's ``SLURM_RESTART_COUNT``) keeps its launch's directory: it resumes what it holds or
    starts afresh."""
    name = PurePath(run_dir).name
    if "TORCHELASTIC_RUN_ID" in env:
        run_id = env["TORCHELASTIC_RUN_ID"]
        ours = name == f"torchrun-{run_id}" if run_id != "none" else _is_stamp(name)
        return ours and env.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if _under_slurm(env):
        return name == _slurm_name(env) and env.get("SLURM_RESTART_COUNT", "0") == "0"
    return False


def _is_stamp(name: str) -> bool:
    try:
        time.strptime(name, _STAMP)
    except ValueError:
        return False
    return True
