"""The Hydra configs in conf/ and the ``lightning-par-train`` entry point.

* Every option of every config group composes and instantiates into the objects it names (``trainer=gpu``
  only composes: this runs on CPU machines).
* The console script trains end to end with our ``dp`` strategy on 2 CPU processes and leaves exactly one
  run directory (ranks > 0 write into rank 0's).
* Bad input gives one actionable line and a non-zero exit status; ``--help`` lists the config groups.

Time on a 2-core machine: the end-to-end run is a subprocess started before the other tests (module
fixture) so that its start-up (importing torch and Lightning once per rank) overlaps them; the runs that
stop before training call ``main()`` in this process instead of paying that start-up again.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.singleton import Singleton
from hydra.utils import get_class
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig, OmegaConf

import lightning_par
from lightning_par import HybridParallelStrategy
from lightning_par.models import GPTModule, StdlibCorpusDataModule
from lightning_par.train import (
    PROG,
    SWEEP_DIR_ENV,
    ConfigError,
    TrainingRun,
    build,
    find_config_dir,
    instantiate_named,
    main,
)
from lightning_par.train_checks import check_layout, check_sweep_world

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest depends on tomli before 3.11
    import tomli as tomllib

REPO = Path(lightning_par.__file__).resolve().parent.parent
CONF = find_config_dir()
# Groups whose options are checked one by one; `hydra` is Hydra's own and is checked on its own.
GROUPS = (
    "model",
    "data",
    "strategy",
    "precision",
    "trainer",
    "fault_tolerance",
    "callbacks",
    "logger",
    "paths",
    "experiment",
)
CASES = [(group, path.stem) for group in GROUPS for path in sorted((CONF / group).glob("*.yaml"))]
# Parameter counts the model configs promise in their comments (and ARCHITECTURE/FACTS rely on).
MODEL_PARAMS = {"gpt_tiny": (0.5e6, 1.5e6), "gpt_small": (20e6, 30e6)}
# Lightning runs fp16 AMP as bf16 AMP on CPU (with a warning); everything else is taken as given.
CPU_PRECISION = {"16-mixed": "bf16-mixed"}


def compose_config(output_dir: Path, *overrides: str) -> DictConfig:
    """The config `lightning-par-train <overrides>` would run, with outputs under ``output_dir``."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        # paths.output_dir stands in for ${hydra:runtime.output_dir}, which exists only inside a Hydra run.
        return compose("train", overrides=[f"paths.output_dir='{output_dir}'", *overrides])


def root_cause(exc: BaseException) -> BaseException:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


# ---------------------------------------------------------------------------------------- config groups
def test_every_config_group_is_covered_and_packaged() -> None:
    groups = {path.name for path in CONF.iterdir() if path.is_dir()}
    assert groups == {*GROUPS, "hydra"}, "a new config group needs a place in GROUPS"
    assert CONF == REPO / "conf", "a source checkout must use the repository's conf/ directly"

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["lightning-par-train"] == "lightning_par.train:main"
    # A regular install ships conf/ as data files, one entry per directory (data-files does not recurse).
    data_files = pyproject["tool"]["setuptools"]["data-files"]
    for directory in [CONF, *(CONF / group for group in sorted(groups))]:
        rel = directory.relative_to(CONF).as_posix()
        target = "share/lightning_par/conf" + ("" if rel == "." else f"/{rel}")
        source = "conf" + ("" if rel == "." else f"/{rel}")
        assert data_files.get(target) == [f"{source}/*.yaml"], f"{source}/ is not packaged"


def test_hydra_settings_keep_one_directory_per_run() -> None:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=smoke"], return_hydra_config=True)
    assert cfg.hydra.job.chdir is False
    timestamp = r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d"
    assert re.fullmatch(rf"outputs/smoke/{timestamp}", cfg.hydra.run.dir), cfg.hydra.run.dir
    assert re.fullmatch(rf"multirun/smoke/{timestamp}", cfg.hydra.sweep.dir), cfg.hydra.sweep.dir
    assert cfg.hydra.help.app_name == PROG


def _check_run(group: str, option: str, cfg: DictConfig, run: TrainingRun, output_dir: Path) -> None:
    trainer = run.trainer
    # Set by Lightning's callback connector, hence unknown to type checkers.
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
    if group == "model":
        assert isinstance(run.model, GPTModule)
        run.model.configure_model()  # the network is built here, not in __init__
        n_params = sum(p.numel() for p in run.model.parameters())
        low, high = MODEL_PARAMS.get(option, (1, math.inf))
        assert low <= n_params <= high, f"{option}: {n_params} parameters"
        assert isinstance(run.datamodule, StdlibCorpusDataModule)
        assert run.datamodule.block_size == cfg.model.block_size
        # Resuming loads checkpoints with weights_only=True: hyperparameters must be plain Python values
        # (OmegaConf containers are refused), so constructors must not receive them.
        for hparams in (run.model.hparams, run.datamodule.hparams):
            buffer = io.BytesIO()
            torch.save(dict(hparams), buffer)
            buffer.seek(0)
            assert torch.load(buffer, weights_only=True) == dict(hparams)
    elif group == "data":
        assert isinstance(run.datamodule, StdlibCorpusDataModule)
        assert run.datamodule.block_size == cfg.model.block_size
        assert run.datamodule.seed == cfg.seed
    elif group == "strategy":
        assert type(trainer.strategy) is get_class(cfg.strategy._target_)
        assert trainer.num_devices == 2
        if isinstance(trainer.strategy, HybridParallelStrategy):
            assert trainer.strategy.zero_stage == cfg.strategy.zero_stage
            for key, value in cfg.strategy.items():
                if key not in ("_target_", "timeout_s", "start_method", "process_group_backend"):
                    assert getattr(trainer.strategy, key) == value, key
    elif group == "precision":
        assert trainer.precision == CPU_PRECISION.get(option, option)
    elif group == "trainer":
        assert isinstance(trainer.accelerator, CPUAccelerator)
        assert trainer.num_devices == cfg.trainer.devices
        assert trainer.max_steps == cfg.trainer.max_steps
        assert Path(trainer.default_root_dir) == output_dir
    elif group in ("callbacks", "fault_tolerance"):
        nodes = cfg[group]
        assert len(instantiate_named(group, nodes)) == len(nodes)
        for node in nodes.values():
            assert any(type(cb) is get_class(node._target_) for cb in callbacks)
        if group == "callbacks" and option == "default":
            best, last = [cb for cb in callbacks if isinstance(cb, ModelCheckpoint)]
            for checkpoint in (best, last):
                assert Path(str(checkpoint.dirpath)) == output_dir / "checkpoints"
            # the best by val_loss, and last.ckpt after every validation (tests/test_default_callbacks.py)
            assert best.monitor == "val_loss" and not best.save_last
            assert last.monitor is None and last.filename == "last" and last.save_top_k == 1
            assert any(isinstance(cb, LearningRateMonitor) for cb in callbacks)
            assert any(isinstance(cb, TQDMProgressBar) for cb in callbacks)
    elif group == "logger":
        assert [type(lg) for lg in trainer.loggers] == [get_class(n._target_) for n in cfg.logger.values()]
        if not cfg.logger:
            assert trainer.logger is None
        for logger in trainer.loggers:
            if isinstance(logger, CSVLogger):
                assert Path(logger.save_dir) == output_dir
    elif group == "paths":
        assert Path(cfg.paths.checkpoint_dir) == output_dir / "checkpoints"
    elif group == "experiment":
        assert cfg.task_name == option
        # the preset wins over the defaults it overrides
        assert trainer.max_steps == cfg.trainer.max_steps
        assert trainer.num_devices == cfg.trainer.devices
        if isinstance(trainer.strategy, HybridParallelStrategy):
            for key in ("zero_stage", "tensor_parallel_size", "pipeline_parallel_size"):
                assert getattr(trainer.strategy, key) == cfg.strategy[key], key
    else:
        raise AssertionError(f"no check for group {group!r}")


@pytest.mark.filterwarnings("ignore:.*AMP with fp16 is not supported on CPU")
@pytest.mark.parametrize(("group", "option"), CASES, ids=[f"{g}={o}" for g, o in CASES])
def test_every_option_composes_and_instantiates(group: str, option: str, tmp_path: Path) -> None:
    cfg = compose_config(tmp_path, f"{group}={option}")
    if group == "trainer" and cfg.trainer.accelerator != "cpu":
        # Only composing is possible on a CPU machine; the precision comes from the precision group.
        assert cfg.trainer.accelerator == "gpu" and cfg.trainer.devices == -1
        assert "precision" not in cfg.trainer and cfg.precision == "32-true"
        return
    run = build(cfg)
    _check_run(group, option, cfg, run, tmp_path)


def test_powersgd_from_the_command_line(tmp_path: Path) -> None:
    """``strategy.comm_hook=powersgd strategy.powersgd_rank=4`` (and PowerSGD's other fields through
    ``comm_hook_state``) reach the strategy; a bad rank is refused with the strategy group named."""
    cfg = compose_config(
        tmp_path,
        "strategy=hybrid",
        "strategy.comm_hook=powersgd",
        "strategy.powersgd_rank=4",
        "strategy.comm_hook_state={start_iter: 5}",
    )
    strategy = build(cfg).trainer.strategy
    assert isinstance(strategy, HybridParallelStrategy)
    assert (strategy.comm_hook, strategy.powersgd_rank) == ("powersgd", 4)
    assert dict(strategy.comm_hook_state) == {"start_iter": 5}
    with pytest.raises(ConfigError) as info:
        build(
            compose_config(
                tmp_path, "strategy=hybrid", "strategy.comm_hook=powersgd", "strategy.powersgd_rank=0"
            )
        )
    assert info.value.group == "strategy" and "powersgd_rank" in info.value.message


def test_pipeline_cut_from_the_command_line(tmp_path: Path) -> None:
    """``strategy.partition_method=[3,1]`` (a Hydra list) reaches the strategy as layer counts; a count
    list of the wrong length is refused with the strategy group named."""
    overrides = ("strategy=hybrid", "strategy.pipeline_parallel_size=2", "strategy.num_microbatches=2")
    strategy = build(compose_config(tmp_path, *overrides, "strategy.partition_method=[3,1]")).trainer.strategy
    assert isinstance(strategy, HybridParallelStrategy) and strategy.partition_method == (3, 1)
    with pytest.raises(ConfigError) as info:
        build(compose_config(tmp_path, *overrides, "strategy.partition_method=[1,1,2]"))
    assert info.value.group == "strategy" and "gives 3 layer counts for 2 stages" in info.value.message


def test_layout_checked_before_any_process_starts(tmp_path: Path) -> None:
    """A layout the process count cannot hold, or tensor parallelism without a plan, is refused at build
    time with the strategy group named (before, only after the ranks were launched: a traceback on each
    rank, exit status 1). The shipped GPT module carries its plan, so tp alone is enough."""
    with pytest.raises(ConfigError) as info:
        build(compose_config(tmp_path, "strategy=hybrid", "strategy.tensor_parallel_size=3"))
    assert info.value.group == "strategy" and "Impossible parallel layout" in info.value.message
    run = build(compose_config(tmp_path, "strategy=hybrid", "strategy.tensor_parallel_size=2"))
    assert run.model.tp_plan == "gpt" and run.trainer.strategy.tensor_parallel_size == 2  # type: ignore[attr-defined]
    with pytest.raises(ConfigError) as info:
        check_layout(HybridParallelStrategy(tensor_parallel_size=2), pl.LightningModule(), world_size=2)
    assert info.value.group == "strategy" and "needs a plan: set strategy.tp_plan" in info.value.message


def test_warnings_reach_the_run_log_for_the_run_only(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A warning raised during a run goes through logging (Hydra writes it to the run's train.log; before,
    a sweep job's log missed ZeRO-3's "meta init draws the initial values" warning, on the shared
    stderr only), and Python's warning display is the caller's again after the run."""
    import lightning_par.train as entry

    def run(cfg: DictConfig) -> float:
        warnings.warn("drawn apart from the other stages", UserWarning, stacklevel=1)
        return 1.5

    monkeypatch.setattr(entry, "train", run)
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="py.warnings"):
        warnings.simplefilter("always")
        before = warnings.showwarning
        assert entry._task(OmegaConf.create({})) == 1.5
        after = warnings.showwarning
        logging.captureWarnings(True)  # a caller that captures warnings itself keeps capturing
        entry._task(OmegaConf.create({}))
        kept = warnings.showwarning
        logging.captureWarnings(False)
    logged = [r.getMessage() for r in caplog.records if r.name == "py.warnings"]
    assert len(logged) == 2 and "drawn apart from the other stages" in logged[0], logged
    assert after is before
    assert getattr(kept, "__module__", None) == "logging", kept


def test_bad_value_names_its_group(tmp_path: Path) -> None:
    cfg = compose_config(tmp_path, "model.n_head=3")
    with pytest.raises(ConfigError) as info:
        build(cfg)
    assert info.value.group == "model" and "n_head" in info.value.message and "\n" not in str(info.value)


def test_silent_overrides_and_late_errors_are_refused_at_build(tmp_path: Path) -> None:
    """Each was found by a probe of the command line: before, the first three trained in 32-true with the
    default logger and callbacks (Hydra suggests `+trainer.precision=...` when `trainer.precision=...`
    fails, and build() passed its own values over them); a missing ckpt_path failed after every rank had
    built the model, with a traceback; a sweep job asking for another process count than the sweep's
    first job ran in that job's processes (2 devices in 1 process, silently) or failed on rank 1 alone."""
    for override, fix in (
        ("+trainer.precision=bf16-mixed", "use precision=bf16-mixed"),
        ("+trainer.strategy=ddp", "use strategy=zero2"),
        ("+trainer.logger=false", "use logger=csv or logger=none"),
    ):
        with pytest.raises(ConfigError) as info:
            build(compose_config(tmp_path, override))
        assert info.value.group == "trainer" and fix in info.value.message, info.value.message
    with pytest.raises(ConfigError) as info:
        build(compose_config(tmp_path, f"ckpt_path={tmp_path / 'nope.ckpt'}"))
    assert info.value.group == "ckpt_path" and "no checkpoint at" in info.value.message
    torch.distributed.init_process_group(
        "gloo", rank=0, world_size=1, store=torch.distributed.HashStore()
    )  # the group a sweep's first job left
    try:
        with pytest.raises(ConfigError) as info:
            check_sweep_world(OmegaConf.create({"devices": 2, "num_nodes": 1}))
        assert "started for 1 ranks by its first job, and this job asks for 2" in info.value.message
        check_sweep_world(OmegaConf.create({"devices": 1, "num_nodes": 1}))  # the same count: fine
    finally:
        torch.distributed.destroy_process_group()


# ------------------------------------------------------------------------------------ command-line runs
WRAPPER = """import sys
from lightning_par.train import main

if __name__ == "__main__":
    sys.exit(main())
"""
# Launcher and debugging variables of the test's own environment would change what a run does.
LAUNCH_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "HYDRA_FULL_ERROR", SWEEP_DIR_ENV)


def _command(script_dir: Path) -> list[str]:
    """The installed console script of this interpreter, else the wrapper pip would install for it."""
    installed = Path(sys.executable).parent / PROG
    if installed.is_file():
        return [str(installed)]
    # Same as pip's generated script for `lightning-par-train = "lightning_par.train:main"`: a real file,
    # because Lightning relaunches ranks > 0 with `python <sys.argv[0]> ...`.
    wrapper = script_dir / PROG
    wrapper.write_text(WRAPPER)
    return [sys.executable, str(wrapper)]


@dataclass
class Finished:
    """A finished run: exit status, output, and the directory it was started in."""

    returncode: int | str | None
    stdout: str
    stderr: str
    cwd: Path

    def __str__(self) -> str:
        return f"exit {self.returncode}\n--- stderr (tail):\n{self.stderr[-3000:]}"


class SmokeRun:
    """`lightning-par-train experiment=smoke` in a subprocess, started at once; :meth:`wait` for it."""

    def __init__(self, root: pytest.TempPathFactory) -> None:
        self.cwd = root.mktemp("smoke")
        env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
        # The code under test, whether or not (and wherever) the package is installed.
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
        self._proc = subprocess.Popen(
            [*_command(root.mktemp("bin")), "experiment=smoke"],
            cwd=self.cwd,
            env=env,
            text=True,
            # A session of its own, so that the process Lightning starts for rank 1 can be killed with it.
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self._result: Finished | None = None

    def wait(self) -> Finished:
        if self._result is None:
            stdout, stderr = self._proc.communicate(timeout=300)
            self._result = Finished(self._proc.returncode, stdout, stderr, self.cwd)
        return self._result

    def kill(self) -> None:
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.communicate()


@pytest.fixture(scope="module", autouse=True)
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmokeRun]:
    # autouse: the run starts before this module's other tests and overlaps with them (it spends most of
    # its time importing torch and Lightning, twice: once per rank).
    run = SmokeRun(tmp_path_factory)
    try:
        yield run
    finally:
        run.kill()


def test_console_script_trains_into_one_run_directory(smoke_run: SmokeRun) -> None:
    run = smoke_run.wait()
    assert run.returncode == 0, run
    # No hydra.run.dir given: the default layout outputs/<task_name>/<timestamp>, once, for both ranks.
    assert [p.name for p in run.cwd.iterdir()] == ["outputs"], run
    (task_dir,) = (run.cwd / "outputs").iterdir()
    assert task_dir.name == "smoke"
    (run_dir,) = task_dir.iterdir()
    assert list(run.cwd.rglob(".hydra")) == [run_dir / ".hydra"]
    assert list(run.cwd.rglob("metrics.json")) == [run_dir / "metrics.json"]
    # Rank 1 was relaunched into the same directory (its own log file, no config or metrics of its own).
    assert (run_dir / "train_ddp_process_1.log").is_file()

    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert math.isfinite(metrics["val_loss"]) and metrics["val_loss"] > 0
    assert metrics["global_step"] == 4 and metrics["world_size"] == 2
    assert metrics["wall_time_s"] > 0
    checkpoints = {p.name for p in (run_dir / "checkpoints").glob("*.ckpt")}
    assert "last.ckpt" in checkpoints and len(checkpoints) >= 2, checkpoints
    assert "Resolved config" in (run_dir / "train.log").read_text()


def run_main(
    args: list[str],
    cwd: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    env: dict[str, str] | None = None,
) -> Finished:
    """``lightning-par-train <args>`` in this process (each new process would re-import torch/Lightning),
    with the launcher variables ``env`` (torchrun's, say) set for the call.

    Only for runs that stop before training. Hydra's logging setup is switched off so that no handler
    outlives the test, and Hydra's global state is restored afterwards.
    """
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", [PROG, *args, "hydra/job_logging=none", "hydra/hydra_logging=none"])
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    state = Singleton.get_state()
    try:
        with pytest.raises(SystemExit) as exited:
            main()
    finally:
        Singleton.set_state(state)
    out, err = capfd.readouterr()
    return Finished(exited.value.code, out, err, cwd)


@pytest.mark.parametrize(
    ("override", "needle"), [("strategy.bucket_size_mb=-1", "bucket_size_mb"), ("+strategy.foo=1", "'foo'")]
)
def test_bad_value_is_one_line_and_exit_2(
    override: str,
    needle: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    run = run_main([override], tmp_path, monkeypatch, capfd)
    assert run.returncode == 2, run
    assert "Traceback" not in run.stderr, run
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith(f"{PROG}: strategy: ") and needle in line, run
    assert not list(tmp_path.rglob("metrics.json"))


def test_resume_without_the_run_directory_names_the_earlier_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # `ckpt_path=last` alone: Hydra makes a new run directory, which holds nothing to resume. Before, the
    # run warned and trained from scratch; now the command names the earlier run and the override.
    for stamp, age in (("2026-01-01_00-00-00", 200.0), ("2026-01-02_00-00-00", 100.0)):
        earlier = tmp_path / "outputs" / "smoke" / stamp / "checkpoints" / "last.ckpt"
        earlier.parent.mkdir(parents=True)
        earlier.write_bytes(b"")
        os.utime(earlier, (earlier.stat().st_atime, earlier.stat().st_mtime - age))
        (earlier.parent.parent / ".hydra").mkdir()  # what Hydra saves in a run: the task's name
        (earlier.parent.parent / ".hydra" / "config.yaml").write_text("task_name: smoke\n")
    run = run_main(["experiment=smoke", "ckpt_path=last"], tmp_path, monkeypatch, capfd)
    assert run.returncode == 2, run
    (line,) = run.stderr.strip().splitlines()
    newest = tmp_path / "outputs" / "smoke" / "2026-01-02_00-00-00"
    assert line.startswith(f"{PROG}: ckpt_path: ckpt_path=last finds no last checkpoint"), line
    assert f"hydra.run.dir='{newest}' ckpt_path=last" in line, line
    assert not list(tmp_path.rglob("metrics.json"))
    # a run directory given (by the user, or for torchrun / srun ranks): not compared with the others, so
    # a restarted attempt that failed before its first checkpoint starts afresh (stopped here by a bad
    # trainer value, which is checked after ckpt_path)
    given = tmp_path / "outputs" / "smoke" / "given"
    args = ["experiment=smoke", "ckpt_path=last", f"hydra.run.dir={given}", "trainer.devices=0"]
    run = run_main(args, tmp_path, monkeypatch, capfd)
    assert run.returncode == 2 and run.stderr.startswith(f"{PROG}: trainer: "), run
    # a one-node torchrun names a new directory at each launch (torch draws a new run id, --rdzv-id or
    # not): its first attempt is compared with the earlier runs too (before, it trained from scratch with
    # Lightning's warning); a restarted attempt keeps its launch's directory
    torchrun = {"TORCHELASTIC_RUN_ID": "0b5e-new-launch", "RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}
    args = ["experiment=smoke", "ckpt_path=last", "trainer.devices=0"]
    run = run_main(args, tmp_path, monkeypatch, capfd, env=torchrun)
    assert run.returncode == 2, run
    assert f"hydra.run.dir='{newest}' ckpt_path=last" in run.stderr, run
    run = run_main(args, tmp_path, monkeypatch, capfd, env={**torchrun, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert run.returncode == 2 and run.stderr.startswith(f"{PROG}: trainer: "), run


@pytest.mark.parametrize(
    ("group", "bad", "listed"), [("strategy", "zero9", "dp"), ("experiment", "nope", "smoke")]
)
def test_unknown_option_lists_the_available_ones(
    group: str,
    bad: str,
    listed: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    run = run_main([f"{group}={bad}"], tmp_path, monkeypatch, capfd)
    assert run.returncode == 1, run
    assert "Traceback" not in run.stderr, run
    assert f"Could not find '{group}/{bad}'" in run.stderr
    assert f"Available options in '{group}'" in run.stderr and f"\t{listed}\n" in run.stderr
    assert not list(tmp_path.iterdir()), "nothing may be created for a config that does not compose"


def test_help_lists_config_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    run = run_main(["--help"], tmp_path, monkeypatch, capfd)
    assert run.returncode == 0, run
    assert f"{PROG} is powered by Hydra" in run.stdout
    assert "strategy: dp, hybrid, lightning_ddp, zero1, zero2, zero3" in run.stdout
