"""The launcher's checks of a composed config, before any process starts or at the first job of a sweep:
each failure is a :class:`ConfigError` naming the config group at fault and the fix, which
``lightning-par-train`` prints as one line with exit status 2 (:mod:`lightning_par.train`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from omegaconf import DictConfig

from lightning_par.resume_path import check_ckpt_path
from lightning_par.run_dirs import first_attempt_dir

__all__ = [
    "ConfigError",
    "check_ckpt_override",
    "check_layout",
    "check_sweep_world",
    "check_trainer_keys",
    "describe",
    "one_line",
]


class ConfigError(Exception):
    """A config group's node could not be turned into an object; ``group`` names the culprit."""

    def __init__(self, group: str, message: str) -> None:
        super().__init__(f"{group}: {message}")
        self.group = group
        self.message = message


def one_line(text: str) -> str:
    return " ".join(text.split())


def describe(exc: BaseException) -> str:
    """A one-line description of why instantiation failed, without Hydra's wrapper text."""
    # Hydra wraps constructor errors as InstantiationException("Error in call to target ...") raised
    # from the original exception; the original is what the user can act on.
    root: BaseException = exc
    while isinstance(root, InstantiationException) and root.__cause__ is not None:
        root = root.__cause__
    message = one_line(str(root))
    if isinstance(root, InstantiationException | ValueError | NotImplementedError) or not message:
        return message or type(root).__name__
    return f"{type(root).__name__}: {message}"


# Trainer arguments that build() passes itself, from their own config groups: set under trainer they would
# be overridden silently (Hydra suggests `+trainer.precision=...` when `trainer.precision=...` fails)
_GROUP_KEYS = {
    "precision": "precision=bf16-mixed (a file of conf/precision)",
    "strategy": "strategy=zero2, or strategy.<option>=... (conf/strategy)",
    "logger": "logger=csv or logger=none (conf/logger)",
    "callbacks": "callbacks=none, or +callbacks.<name>={_target_: ...} (conf/callbacks)",
}


def check_trainer_keys(cfg: DictConfig) -> None:
    for key, fix in _GROUP_KEYS.items():
        if key in cfg.trainer:
            raise ConfigError(
                "trainer", f"trainer.{key} is not read: {key} is a config group of its own; use {fix}."
            )


def check_ckpt_override(cfg: DictConfig) -> None:
    """``ckpt_path`` checked before any process starts (:mod:`lightning_par.resume_path`). ``last`` is
    compared with the task's other runs only where the run directory is new to this command: one Hydra
    made, or one :mod:`lightning_par.run_dirs` named for the first attempt of a torchrun or srun launch
    (before, a one-node torchrun, which names a new directory at every launch, started from scratch with
    Lightning's warning). Not in a sweep (its jobs are siblings of each other), nor where the user gave
    ``hydra.run.dir``, nor in a restarted attempt: one that failed before its first checkpoint starts
    afresh, as Lightning does."""
    made = HydraConfig.initialized() and HydraConfig.get().mode != RunMode.MULTIRUN
    if made:
        given = {o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.hydra}
        launched = first_attempt_dir(str(HydraConfig.get().runtime.output_dir), os.environ)
        made = "hydra.run.dir" not in given or launched
    paths = cfg.get("paths")
    checkpoint_dir = run_dir = None
    if made and paths is not None and "checkpoint_dir" in paths and "output_dir" in paths:
        checkpoint_dir, run_dir = Path(str(paths.checkpoint_dir)), Path(str(paths.output_dir))
    try:
        check_ckpt_path(
            cfg.get("ckpt_path"),
            checkpoint_dir=checkpoint_dir,
            run_dir=run_dir,
            task_name=str(cfg.get("task_name")) if cfg.get("task_name") is not None else None,
        )
    except ValueError as exc:
        raise ConfigError("ckpt_path", str(exc)) from None


def check_sweep_world(trainer: DictConfig) -> None:
    """The jobs of a sweep run in the processes its first job started (Lightning starts ranks > 0 once, and
    each re-runs the sweep in lockstep): a job asking for another process count is refused. Before, it
    reused the first job's processes silently (a 2-process job ran in 1) or failed on rank 1 alone."""
    import torch.distributed as dist

    devices, nodes = trainer.get("devices"), trainer.get("num_nodes", 1)
    if not dist.is_available() or not dist.is_initialized() or not isinstance(devices, int):
        return
    if not isinstance(nodes, int) or devices * nodes == dist.get_world_size():
        return
    world, asked = dist.get_world_size(), devices * nodes
    raise ConfigError(
        "trainer",
        f"this sweep's processes were started for {world} ranks by its first job, and this job asks for"
        f" {asked} (trainer.devices={devices}, trainer.num_nodes={nodes}): give every job of a sweep the"
        " same trainer.devices and trainer.num_nodes, or run one sweep per process count.",
    )


def check_layout(strategy: Any, model: pl.LightningModule, *, world_size: int) -> None:
    """The strategy's layout against the Trainer's process count and the model, before any process is
    started (the strategy itself finds these only at setup, on every rank, with tracebacks)."""
    from lightning_par.mesh import MeshLayout
    from lightning_par.strategy import HybridParallelStrategy
    from lightning_par.tensor_parallel import PLANS

    if not isinstance(strategy, HybridParallelStrategy):
        return
    tp, pp = strategy.tensor_parallel_size, strategy.pipeline_parallel_size
    try:
        MeshLayout(world_size=world_size, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    except ValueError as exc:
        raise ConfigError("strategy", describe(exc)) from exc
    if tp > 1 and strategy.tp_plan is None and getattr(model, "tp_plan", None) is None:
        raise ConfigError(
            "strategy",
            f"tensor_parallel_size={tp} needs a plan: set strategy.tp_plan (one of"
            f" {', '.join(sorted(PLANS))}) or give the model a tp_plan attribute.",
        )
