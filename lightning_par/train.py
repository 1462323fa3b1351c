"""Hydra entry point: ``lightning-par-train`` and ``python -m lightning_par.train`` are the same command.

The configuration is composed from the groups in ``conf/`` (model, data, strategy, precision, trainer,
fault_tolerance, callbacks, logger, paths, hydra, experiment); see ``conf/train.yaml``. Launch lines::

    lightning-par-train                                          # CPU default: tiny GPT, 2 processes, dp
    lightning-par-train experiment=smoke                         # seconds-long end-to-end check
    lightning-par-train strategy=zero2 trainer=gpu precision=bf16-mixed model=gpt_small
    lightning-par-train trainer.max_steps=50 hydra.run.dir=/tmp/run
    lightning-par-train -m model.learning_rate=1e-3,3e-3             # a sweep; each job returns val_loss
    lightning-par-train --cfg job                                # print the composed config, run nothing
    lightning-par-train --help

Contract of one run:
  * everything it writes lives in one directory, ``${paths.output_dir}`` (Hydra's run directory):
    ``.hydra/`` (the composed config), ``train.log``, ``checkpoints/``, the logger's files and
    ``metrics.json`` (final ``trainer.callback_metrics`` as floats, plus ``global_step``, ``world_size``
    and ``wall_time_s``, the seconds from building the objects to the end of ``fit``);
  * processes that Lightning starts for ranks > 0 re-run this command into the same directory (in a
    sweep: the same sweep directory) and write no config, metrics or folders of their own; so do the
    ranks torchrun or srun start (:mod:`lightning_par.run_dirs` names their shared directory);
  * a bad value in a config group is reported as one line on stderr,
    ``lightning-par-train: <group>: <what went wrong>``, with exit status 2;
  * the task returns the final ``val_loss`` (NaN when no validation ran) so Hydra sweepers can optimise it.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import math
import os
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import hydra
import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from lightning_par.run_dirs import launcher_overrides
from lightning_par.sweep import record_stopped_job
from lightning_par.train_checks import (
    ConfigError,
    check_ckpt_override,
    check_layout,
    check_sweep_world,
    check_trainer_keys,
    describe,
    one_line,
)

__all__ = ["ConfigError", "TrainingRun", "build", "find_config_dir", "main", "train"]

log = logging.getLogger(__name__)

PROG = "lightning-par-train"
# Exit status for invalid configuration (argparse's convention for usage errors).
EXIT_CONFIG_ERROR = 2
# A regular (non-editable) install ships conf/ as data files under <prefix>/share/lightning_par/conf
# (see [tool.setuptools.data-files] in pyproject.toml).
_INSTALLED_CONF = "share/lightning_par/conf"
# Set by rank 0 during a sweep (`-m`) so the processes Lightning starts for ranks > 0, which inherit the
# environment, write into rank 0's sweep directory instead of a new timestamped one (see main()).
SWEEP_DIR_ENV = "LIGHTNING_PAR_SWEEP_DIR"


@dataclass
class TrainingRun:
    """Everything ``trainer.fit`` needs, built from a composed config by :func:`build`."""

    datamodule: pl.LightningDataModule
    model: pl.LightningModule
    trainer: pl.Trainer


def find_config_dir() -> Path:
    """The directory holding ``train.yaml`` and the config groups.

    Looked up in this order:
      1. ``<repo>/conf`` next to the package directory: a source checkout or an editable install,
         so edits to the YAML files take effect without reinstalling;
      2. the data files of an installed distribution (``<prefix>/share/lightning_par/conf``), found
         through the distribution's file list so that any install scheme (venv, ``--user``,
         ``--prefix``) works.

    Raises:
        FileNotFoundError: with the places searched, if neither holds ``train.yaml``.
    """
    checkout = Path(__file__).resolve().parent.parent / "conf"
    if (checkout / "train.yaml").is_file():
        return checkout
    searched = [str(checkout)]
    try:
        files = importlib.metadata.distribution("lightning_par").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.as_posix().endswith(f"{_INSTALLED_CONF}/train.yaml"):
            installed = Path(str(file.locate())).resolve().parent
            if installed.is_dir():
                return installed
            searched.append(str(installed))
    raise FileNotFoundError(
        f"no Hydra config directory with train.yaml found (searched: {', '.join(searched)}, and the "
        "installed lightning_par distribution's data files); reinstall with `pip install lightning_par`"
        " or run from a source checkout"
    )


def instantiate_group(group: str, node: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate(node, **kwargs)``, turning any failure into :class:`ConfigError`.

    Constructors receive plain ``dict``/``list`` values, never OmegaConf containers: objects keep their
    arguments (``save_hyperparameters``), and an OmegaConf object inside a checkpoint makes
    ``torch.load(weights_only=True)`` refuse it on resume.
    """
    kwargs.setdefault("_convert_", "all")
    try:
        return hydra.utils.instantiate(node, **kwargs)
    except Exception as exc:
        raise ConfigError(group, describe(exc)) from exc


def instantiate_named(group: str, node: DictConfig | None) -> list[Any]:
    """Instantiate every ``_target_`` entry of a group of named nodes (callbacks, loggers), in order."""
    if node is None:
        return []
    return [
        instantiate_group(group + "." + str(name), child)
        for name, child in node.items()
        if isinstance(child, DictConfig) and "_target_" in child
    ]


def build(cfg: DictConfig) -> TrainingRun:
    """Instantiate the datamodule, model, strategy, callbacks, loggers and trainer of a composed config.

    Raises:
        ConfigError: naming the first group whose node fails to instantiate (bad value, unknown key,
            unknown ``_target_``, missing interpolation) or, as ``trainer``, a Trainer that refuses its
            arguments (e.g. ``trainer.devices=0``).
    """
    check_trainer_keys(cfg)
    check_ckpt_override(cfg)
    check_sweep_world(cfg.trainer)
    datamodule = instantiate_group("data", cfg.data)
    model = instantiate_group("model", cfg.model)
    strategy = instantiate_group("strategy", cfg.strategy)
    callbacks = instantiate_named("callbacks", cfg.get("callbacks")) + instantiate_named(
        "fault_tolerance", cfg.get("fault_tolerance")
    )
    loggers = instantiate_named("logger", cfg.get("logger"))
    if not loggers:
        # LearningRateMonitor refuses a Trainer without a logger; logger=none means "log nothing"
        kept = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
        if len(kept) != len(callbacks):
            log.info("logger=none: the LearningRateMonitor callback is dropped (it needs a logger)")
        callbacks = kept
    # _partial_: the Trainer's own arguments come from YAML, the objects above are passed in Python so
    # that OmegaConf never has to hold (or copy) them.
    make_trainer = instantiate_group("trainer", cfg.trainer, _partial_=True)
    try:
        trainer = make_trainer(
            strategy=strategy,
            callbacks=callbacks,
            logger=loggers if loggers else False,
            precision=cfg.precision,
        )
    except Exception as exc:
        raise ConfigError("trainer", describe(exc)) from exc
    check_layout(strategy, model, world_size=trainer.world_size)
    return TrainingRun(datamodule=datamodule, model=model, trainer=trainer)


def _write_metrics(path: Path, trainer: pl.Trainer, wall_time_s: float) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for name, value in trainer.callback_metrics.items():
        try:
            metrics[name] = float(value)
        except (TypeError, ValueError, RuntimeError):
            continue  # non-scalar metrics have no single float to report
    record = {
        **metrics,
        "global_step": trainer.global_step,
        "world_size": trainer.world_size,
        "wall_time_s": wall_time_s,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename, so a reader never sees half a file.
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return metrics


@contextmanager
def _sweep_shared_with_other_ranks() -> Iterator[None]:
    """In a sweep's job on rank 0: tell the ranks Lightning starts where the sweep lives, keep its record.

    Ranks > 0 re-run the whole sweep in lockstep with rank 0 (Lightning passes the original arguments on);
    :func:`main` points them at rank 0's sweep directory through the environment they inherit. Hydra makes
    every sweep rewrite ``multirun.yaml``; rank 0's version (without the per-rank overrides) is put back.
    """
    in_sweep = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    if not in_sweep or getattr(rank_zero_only, "rank", 0) != 0:
        yield
        return
    sweep_dir = Path(HydraConfig.get().sweep.dir).resolve()
    os.environ[SWEEP_DIR_ENV] = str(sweep_dir)
    record = sweep_dir / "multirun.yaml"
    saved = record.read_bytes() if record.is_file() else None
    try:
        yield
    finally:
        if saved is not None and record.is_file() and record.read_bytes() != saved:
            record.write_bytes(saved)


@rank_zero_only
def _log_config(cfg: DictConfig) -> None:
    log.info("Resolved config:\n%s", OmegaConf.to_yaml(cfg, resolve=True))


def train(cfg: DictConfig) -> float:
    """Run one training job from a composed config; return the final ``val_loss`` (NaN if none).

    On global rank 0 it logs the resolved config once and writes ``<paths.output_dir>/metrics.json``.
    """
    start = time.perf_counter()
    _log_config(cfg)
    if cfg.get("seed") is not None:
        # verbose=False: Lightning would print this to stderr, which is reserved for errors.
        pl.seed_everything(cfg.seed, workers=True, verbose=False)
        log.info("Seed set to %d", cfg.seed)
    run = build(cfg)
    with _sweep_shared_with_other_ranks():
        run.trainer.fit(run.model, datamodule=run.datamodule, ckpt_path=cfg.get("ckpt_path"))
    wall_time_s = time.perf_counter() - start
    metrics: dict[str, float] = {}
    if run.trainer.is_global_zero:
        path = Path(cfg.paths.output_dir) / "metrics.json"
        metrics = _write_metrics(path, run.trainer, wall_time_s)
        log.info("Wrote %s (step %d, %.1f s)", path, run.trainer.global_step, wall_time_s)
    else:
        metrics = {k: float(v) for k, v in run.trainer.callback_metrics.items() if v.numel() == 1}
    release = getattr(run.trainer.strategy, "destroy_process_groups", None)
    if callable(release):  # the next job of a sweep runs in this process: leave no group behind
        release()
    return metrics.get("val_loss", math.nan)


def _fail(message: str) -> NoReturn:
    print(f"{PROG}: {one_line(message)}", file=sys.stderr)
    sys.exit(EXIT_CONFIG_ERROR)


def _task(cfg: DictConfig) -> float:
    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    # Python warnings through logging, so each run's train.log keeps them beside its metrics (a sweep's
    # jobs share one stderr; before, a job's log did not say that ZeRO-3 drew its initial weights apart
    # from the other stages'), on the console through Hydra's handler (stdout, as its other lines); for
    # this run only, unless the caller's process captured them already
    captured = getattr(warnings.showwarning, "__module__", None) == "logging"
    logging.captureWarnings(True)
    try:
        return train(cfg)
    except ConfigError as exc:
        if multirun:
            # in a sweep the job fails, is reported in the sweep summary, and the next job runs (config
            # errors are raised on every rank alike, before any collective)
            print(f"{PROG}: {one_line(str(exc))}", file=sys.stderr)
            raise
        _fail(str(exc))
    except Exception as exc:
        if multirun and _processes() > 1:
            _stop_sweep(exc)
        raise
    finally:
        logging.captureWarnings(captured)


def _processes() -> int:
    """The processes of this run: the sweep's process group where it exists, else the launch's count."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _stop_sweep(exc: BaseException) -> NoReturn:
    """A job of a sweep over several processes failed on this rank. Its peers may be waiting in the
    job's collectives while Hydra would move this rank on to the next job: the ranks would never meet
    again (before: the sweep hung, silently, even through Ctrl-C). The error is printed and this process
    ends at once, so the peers' collectives fail and they end the same way."""
    rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
    traceback.print_exception(exc, file=sys.stderr)
    print(
        f"{PROG}: rank {rank}: the job failed ({type(exc).__name__}: {one_line(str(exc))}). A sweep over"
        " several processes stops at a job's runtime failure, since its ranks cannot continue in step;"
        " fix it and sweep the remaining values again.",
        file=sys.stderr,
        flush=True,
    )
    try:  # the failed job's row in the summary (Hydra's on_job_end does not run after os._exit)
        record_stopped_job(exc)
    except Exception as summary_error:  # the error above matters more than its row
        print(f"{PROG}: the sweep summary was not written: {summary_error}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)  # not SystemExit: the job's threads (snapshot writers, Lightning's) must not hold the exit


def main() -> None:
    """Console script ``lightning-par-train``: run :func:`train` with the Hydra overrides in ``sys.argv``."""
    try:
        config_dir = find_config_dir()
    except FileNotFoundError as exc:
        _fail(str(exc))
    sweep_dir = os.environ.get(SWEEP_DIR_ENV)
    if sweep_dir and os.environ.get("LOCAL_RANK", "0") != "0":
        # A rank > 0 that Lightning started from a sweep's job: it re-runs the same sweep in lockstep
        # with rank 0 (Lightning passes the original arguments on), but its sweep directory would be a
        # new timestamp; join rank 0's instead. Lightning already points single runs at rank 0's run dir.
        sys.argv.append(f'hydra.sweep.dir="{sweep_dir}"')
    given = {arg.split("=", 1)[0].lstrip("+~") for arg in sys.argv[1:]}
    sys.argv.extend(launcher_overrides(os.environ, given))  # torchrun / srun: one directory for all ranks
    # Decorated here rather than at import time: the config directory is only known at run time.
    hydra.main(version_base="1.3", config_path=str(config_dir), config_name="train")(_task)()


if __name__ == "__main__":
    main()
