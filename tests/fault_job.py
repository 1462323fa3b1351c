"""A small training job for the fault-injection tests: run under torchrun, or in forked ranks (reference).

    python -m torch.distributed.run --standalone --nproc-per-node=2 --max-restarts=2 tests/fault_job.py CFG

``CFG`` is a JSON file (a positional argument: torchrun would parse options after the script that look
like its own). Keys: ``out`` (directory), ``strategy`` ("zero2", "ddp", ..., or a dict of
``HybridParallelStrategy`` keywords, e.g. pipeline stages), ``steps``, ``every``,
``persist``, ``keep_last``, ``devices``, ``num_nodes``, ``flash`` (bool), ``watchdog_s`` (or null),
``shm_dir`` (default ``$FT_SHM_DIR``), ``accumulate``, ``keep_global_batch``, ``stop_at`` (end training
at this step, the schedule still planned for ``steps``),
``clear_shm_attempts`` (attempts that start without this
rank's memory snapshots, like a replaced node), and ``faults``: a list of
``{"kind": "kill" | "kill_persist" | "kill_save" | "stall" | "node_kill", "attempt": a, "rank": r,
"step": s}``. Fault ``i`` fires once, in attempt ``a`` (``TORCHELASTIC_RESTART_COUNT``; null: the first
attempt that reaches step ``s``), on rank ``r`` (``node_kill``: on the node named by ``$FT_NODE``), and
writes ``out/fault{i}.json`` (time, pid, step) before it acts: ``kill`` SIGKILLs the rank after step ``s``;
``kill_save`` has every rank call ``trainer.save_checkpoint`` after step ``s`` and SIGKILLs rank ``r``
inside the write; ``kill_persist`` SIGKILLs it halfway through writing the
first snapshot persisted at or after step ``s``; ``stall`` blocks it before step ``s + 1``;
``node_kill`` blocks it so that the test can kill the node's agent and worker.

Every attempt writes ``out/resume_attempt{a}_rank{r}.json`` when training starts (what was resumed, the
process start time) and, if it finishes, ``out/attempt{a}_rank{r}.json`` (snapshot timings, persist
errors, the time of its first completed step) and ``out/final_rank{r}.pt`` (the state dict).
"""

from __future__ import annotations

import time

PROCESS_START = time.time()  # before the slow imports: restart time includes them

import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_par import HybridParallelStrategy  # noqa: E402
from lightning_par.callbacks import FlashCheckpoint, HangWatchdog  # noqa: E402
from lightning_par.callbacks import disk as disk_module  # noqa: E402
from lightning_par.checkpoint import files as files_module  # noqa: E402
from lightning_par.models import GPTModule  # noqa: E402
from lightning_par.rendezvous import RestartSafeEnvironment  # noqa: E402
from lightning_par.state_guard import reads_of  # noqa: E402

MODEL = dict(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32, bias=False, learning_rate=1e-2)
SAMPLES = 48  # 12 batches of 2 per rank at world 2: several epochs, resumes land mid-epoch


class Tokens(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        self.data = torch.randint(0, 64, (n, 17), generator=torch.Generator().manual_seed(123))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


class LlamaModule(pl.LightningModule):
    """Hugging Face's Llama with the same data: its parameters are registered in another order than
    backward finishes them (a decoder layer's norms after its attention and MLP), so the ZeRO-1/2 bucket
    layout learnt in the first backward differs from the declared one."""

    def __init__(self, max_steps: int) -> None:
        super().__init__()
        from tests.third_party import llama

        self.model = llama(0)
        self.max_steps = max_steps

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(input_ids=x, use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / (self.max_steps + 1))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def stall_here(seconds: float) -> None:
    """A rank that stops making progress (the watchdog's stack dump names this function)."""
    time.sleep(seconds)


class Fault(pl.Callback):
    """Injects fault ``index`` of the config once (see the module docstring)."""

    def __init__(self, fault: dict[str, Any], index: int, out: Path) -> None:
        self.fault = fault
        self.marker = out / f"fault{index}.json"
        # "attempt": None arms the fault in any attempt until it fired (attempt counts are per agent)
        attempt = fault.get("attempt", 0)
        self.armed = attempt in (None, _attempt()) and not self.marker.exists()

    def _mine(self, trainer: pl.Trainer) -> bool:
        if self.fault["kind"] == "node_kill":
            return os.environ.get("FT_NODE") == self.fault.get("node", "B")
        return trainer.global_rank == self.fault.get("rank")

    def _mark(self, trainer: pl.Trainer) -> None:
        record = {
            "time": time.time(),
            "pid": os.getpid(),
            "rank": trainer.global_rank,
            "step": trainer.global_step,
        }
        self.marker.write_text(json.dumps(record))

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not (self.armed and self.fault["kind"] == "kill_persist" and self._mine(trainer)):
            return
        real = disk_module.write_bytes
        step = self.fault["step"]

        def write_bytes(fd: int, data: memoryview) -> None:
            if trainer.global_step >= step and len(data) > 1024:
                real(fd, data[: len(data) // 2])
                self._mark(trainer)
                os.kill(os.getpid(), signal.SIGKILL)  # during a persist: half the file is written
            real(fd, data)

        disk_module.write_bytes = write_bytes

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int
    ) -> None:
        stall = self.armed and self.fault["kind"] == "stall" and self._mine(trainer)
        if stall and trainer.global_step == self.fault["step"]:
            self._mark(trainer)
            stall_here(3600)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        at_step = self.armed and trainer.global_step == self.fault.get("step")
        if at_step and self.fault["kind"] == "kill_save":
            self._save_and_die(trainer)
        if not (at_step and self._mine(trainer)):
            return
        if self.fault["kind"] == "kill":
            self._mark(trainer)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fault["kind"] == "node_kill":
            self._mark(trainer)
            stall_here(120)  # the test kills this node's agent and this worker now

    def _save_and_die(self, trainer: pl.Trainer) -> None:
        """Every rank saves a Lightning checkpoint; the chosen one is SIGKILLed inside the write."""
        self.armed = False
        if self._mine(trainer):
            real = files_module.torch.save

            def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
                f.write(b"\0" * 4096)  # part of a file, then the process is gone
                f.flush()
                self._mark(trainer)
                os.kill(os.getpid(), signal.SIGKILL)
                real(obj, f, *args, **kwargs)

            files_module.torch.save = save  # type: ignore[assignment]
        trainer.save_checkpoint(self.marker.parent / "lightning_ckpt" / f"step{trainer.global_step}")


class ResumeRecord(pl.Callback):
    """Writes what this attempt resumed from, once training starts (after FlashCheckpoint's resume)."""

    def __init__(self, out: Path, flash: FlashCheckpoint | None) -> None:
        self.out = out
        self.flash = flash

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        record = {
            "attempt": _attempt(),
            "rank": trainer.global_rank,
            "node": os.environ.get("FT_NODE"),
            "process_start": PROCESS_START,
            "resumed": self.flash.resumed if self.flash else None,
        }
        (self.out / f"resume_attempt{_attempt()}_rank{trainer.global_rank}.json").write_text(
            json.dumps(record)
        )


class FirstStep(pl.Callback):
    """The time of this process's first completed step, also written to ``out/progress/<pid>.json``
    (with the node, rank, process start and what was resumed) for the recovery figures."""

    def __init__(self, out: Path, flash: FlashCheckpoint | None) -> None:
        self.time: float | None = None
        self.out = out
        self.flash = flash

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.time is None:
            self.time = time.time()
            record = {
                "pid": os.getpid(),
                "node": os.environ.get("FT_NODE"),
                "rank": trainer.global_rank,
                "world_size": trainer.world_size,
                "process_start": PROCESS_START,
                "first_step": self.time,
                "step": trainer.global_step,
                "resumed": self.flash.resumed if self.flash else None,
            }
            (self.out / "progress").mkdir(exist_ok=True)
            (self.out / "progress" / f"{os.getpid()}.json").write_text(json.dumps(record, default=str))


def train(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run the job described by ``cfg`` on this rank; return its final state dict and what happened."""
    torch.set_num_threads(1)
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    shm_dir = Path(cfg.get("shm_dir") or os.environ.get("FT_SHM_DIR", "/dev/shm"))
    if _attempt() in cfg.get("clear_shm_attempts", []):
        for d in shm_dir.glob(f"lightning_par_flash/*/rank{rank:05d}"):
            shutil.rmtree(d)  # a replaced node: its memory snapshots are gone
    callbacks: list[pl.Callback] = [Fault(f, i, out) for i, f in enumerate(cfg.get("faults", []))]
    flash = None
    if cfg.get("flash", True):
        flash = FlashCheckpoint(
            out / "flash",
            every_n_steps=cfg.get("every", 2),
            persist_every_n_steps=cfg.get("persist", 6),
            keep_last=cfg.get("keep_last", 2),
            shm_dir=shm_dir,
            flush_timeout_s=10.0,
            keep_global_batch=cfg.get("keep_global_batch", False),
            **({"replicas": cfg["replicas"]} if "replicas" in cfg else {}),
        )
        callbacks.append(flash)
    first = FirstStep(out, flash)
    callbacks += [ResumeRecord(out, flash), first]
    if cfg.get("watchdog_s"):
        callbacks.append(HangWatchdog(timeout_s=cfg["watchdog_s"], flush_timeout_s=5.0))
    plugins = []
    if cfg.get("strategy", "zero2") == "ddp" and "TORCHELASTIC_RUN_ID" in os.environ:
        plugins.append(RestartSafeEnvironment())  # Lightning's DDP: a store per attempt
    pl.seed_everything(7, verbose=False)
    module: pl.LightningModule = (
        LlamaModule(cfg["steps"])
        if cfg.get("model") == "llama"
        else GPTModule(**MODEL, warmup_steps=2, max_steps=cfg["steps"])
    )
    strategy = cfg.get("strategy", "zero2")
    if isinstance(strategy, dict):
        strategy = HybridParallelStrategy(**strategy)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=cfg.get("devices", 2),
        # "auto": as many nodes as torchrun's agents in this round (elastic jobs)
        num_nodes=int(os.environ["GROUP_WORLD_SIZE"])
        if cfg.get("num_nodes") == "auto"
        else cfg.get("num_nodes", 1),
        strategy=strategy,
        max_steps=cfg.get("stop_at", cfg["steps"]),  # the schedule still runs to cfg["steps"]
        accumulate_grad_batches=cfg.get("accumulate", 1),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=str(out),
        callbacks=callbacks,
        plugins=plugins,
    )
    started = time.time()
    trainer.fit(module, DataLoader(Tokens(SAMPLES), batch_size=2, shuffle=True))
    result = {
        "attempt": _attempt(),
        "rank": trainer.global_rank,
        "started": started,
        "first_step": first.time,
        "resumed": flash.resumed if flash else None,
        "stats": flash.stats if flash else [],
        "errors": flash.errors if flash else [],
        "global_step": trainer.global_step,
    }
    # under pipeline parallelism a rank holds its own stages; the others are meta placeholders (a user's
    # state_dict() of the whole model is refused then; this reads this rank's entries deliberately)
    with reads_of(module)():
        state = {k: v.detach().clone() for k, v in module.state_dict().items() if not v.is_meta}
    return {"state": state, "result": result}


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    out = Path(cfg["out"])
    done = train(cfg)
    rank = done["result"]["rank"]
    (out / f"attempt{_attempt()}_rank{rank}.json").write_text(json.dumps(done["result"], default=str))
    torch.save(done["state"], out / f"final_rank{rank}.pt")


if __name__ == "__main__":
    main()
