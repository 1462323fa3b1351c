"""``FlashSnapshots``: flash checkpoints for Lightning Fabric loops, with automatic resume.

The store is the Trainer's (:class:`lightning_par.callbacks.store.FlashStore`: memory slots in
``shm_dir``, background persists to ``dirpath`` with atomic writes and checksums, agreement across ranks
on the newest snapshot complete everywhere, memory preferred over disk); this class is its Fabric front
door. It takes the same state dict as ``fabric.save`` and changes nothing of the user's objects (no
wrappers, patches or hooks)::

    fabric = Fabric(strategy="zero2", ...)
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "epoch": 0}
    with FlashSnapshots(fabric, "checkpoints/flash", persist_every_n_steps=100) as snapshots:
        start = snapshots.restore(state) or 0        # collective; the step of the snapshot loaded
        for step in range(start, max_steps):
            loss = ...; fabric.backward(loss)
            snapshots.fence()                        # needed only under Lightning's own strategies
            optimizer.step(); optimizer.zero_grad(); scheduler.step()
            if (step + 1) % 10 == 0:
                snapshots.snapshot(step + 1, state)  # every rank, at the same steps

A rank's snapshot holds its model and optimizer trees (:mod:`lightning_par.checkpoint.rank_state`: this
rank's shards at ZeRO 1-3, the replicated state under Lightning's DDP and single-device strategies), the
``state_dict()`` of every other entry that has one (LR schedulers, ...), the other entries as they are
(ints, floats, dicts, tensors), the precision plugin's state (the fp16 loss scale) and the torch / CUDA /
numpy / Python generator states. The loop's data position is the loop's: derive it from the step
:meth:`FlashSnapshots.restore` returns, or keep it in the state dict.

``snapshot_copy="overlap"`` copies the weights and optimizer state on a thread while the next step's
forward and backward run; the copy must end before the next ``optimizer.step()`` changes them.
lightning_par's strategy waits for it at the start of every optimizer step by itself (the fence is
registered in ``strategy.before_optimizer_step`` and removed by :meth:`close`); under Lightning's own DDP
and single-device strategies the loop calls :meth:`FlashSnapshots.fence` before ``optimizer.step()`` (a
missing fence can tear the snapshot), or passes ``snapshot_copy="blocking"``, which needs none.
Snapshots are per rank and for the same layout: the same strategy, world size, model, optimizers and
state keys (checked when restoring; a sharded ``fabric.save`` checkpoint reshards, these do not).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.fabric.wrappers import is_wrapped
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_par.callbacks import _dist
from lightning_par.callbacks.store import FlashStore
from lightning_par.callbacks.writer import SnapshotCopy
from lightning_par.checkpoint import rank_state
from lightning_par.fabric.checkpoint import is_stateful, layout
from lightning_par.fabric.strategy import HybridParallelStrategy
from lightning_par.zero.engine_api import Engine

_OWNER = "FlashSnapshots"


@dataclass(frozen=True)
class _Parts:
    """A Fabric state dict sorted by what a snapshot does with each entry."""

    module_key: str
    module: nn.Module  # unwrapped from Fabric's wrapper
    optimizer_keys: list[str]
    optimizers: list[Optimizer]  # unwrapped, in the order of the state dict
    stateful: list[str]  # entries restored through load_state_dict
    values: list[str]  # entries replaced in the dict

    def kinds(self) -> dict[str, str]:
        """Key -> kind, for the fingerprint: a snapshot restores into the same keys of the same kinds."""
        out = {self.module_key: "model", **dict.fromkeys(self.optimizer_keys, "optimizer")}
        return {**out, **dict.fromkeys(self.stateful, "state_dict"), **dict.fromkeys(self.values, "value")}


class FlashSnapshots:
    """Snapshots of a Fabric loop's state dict, restored after a crash (see the module docstring).

    Construct it on every rank after ``fabric.launch()`` (collective: it checks that every rank can write
    ``dirpath`` and starts a new lineage); ``with`` closes it.

    Args:
        fabric: the launched Fabric; its strategy is lightning_par's ``HybridParallelStrategy`` (ZeRO 0-3)
            or Lightning's DDP or single-device strategy.
        dirpath: where snapshots are persisted (shared by all ranks or local to each node).
        persist_every_n_steps: snapshots whose step is a multiple of this are also written to ``dirpath``
            (in the background; the other snapshots live in shared memory only).
        keep_last: persisted snapshots to keep (older ones are deleted once a newer one is on every rank).
        shm_dir: the shared-memory file system for the memory snapshots; if it lacks room they are staged
            in ``dirpath/.staging`` on disk instead, with a warning.
        memory_slots: 2 keeps the previous snapshot while the next is written; 1 halves the memory.
        snapshot_copy: ``"overlap"`` copies the weights and optimizer state while the next step computes
            (lightning_par's strategy then fences each ``optimizer.step()`` itself; under Lightning's
            strategies call :meth:`fence` before it), ``"blocking"`` before returning.
        flush_timeout_s: the longest :meth:`flush` (and the flush at the end) may take.
        replicas: copies of every snapshot in the shared memory of ranks on other nodes (see
            ``FlashCheckpoint``).
    """

    def __init__(
        self,
        fabric: Fabric,
        dirpath: str | Path,
        *,
        persist_every_n_steps: int = 100,
        keep_last: int = 2,
        shm_dir: str | Path = "/dev/shm",
        memory_slots: int = 2,
        snapshot_copy: SnapshotCopy = "overlap",
        flush_timeout_s: float = 30.0,
        replicas: int = 0,
    ) -> None:
        self._store = FlashStore(
            dirpath,
            owner=_OWNER,
            persist_every_n_steps=persist_every_n_steps,
            keep_last=keep_last,
            shm_dir=shm_dir,
            memory_slots=memory_slots,
            snapshot_copy=snapshot_copy,
            flush_timeout_s=flush_timeout_s,
            replicas=replicas,
        )
        strategy = fabric.strategy
        supported = isinstance(strategy, DDPStrategy | SingleDeviceStrategy)  # ours derives from DDP
        # DeepSpeed derives from DDPStrategy too, but its engine keeps the optimizer state out of reach
        if not supported or isinstance(strategy, DeepSpeedStrategy):
            raise TypeError(
                f"{_OWNER} supports lightning_par's Fabric HybridParallelStrategy (ZeRO 0-3) and Lightning's"
                f" DDP and single-device strategies, not {type(strategy).__name__}."
            )
        if fabric.world_size > 1 and not _dist.initialized():
            raise RuntimeError(f"{_OWNER}: call fabric.launch() first, then make it on every rank.")
        self._fabric = fabric
        self._fingerprints: dict[tuple[Any, ...], dict[str, Any]] = {}  # one entry: the current objects
        self.resumed: dict[str, Any] | None = None  # what restore() loaded: step, lineage, sources
        self._failed = False
        self._store.open(
            rank=fabric.global_rank,
            world_size=fabric.world_size,
            device=strategy.root_device,
            node=fabric.node_rank,
        )
        self._store.start_lineage()  # restore() continues the snapshot's lineage instead
        # lightning_par's strategy fences every optimizer step itself; under Lightning's strategies the
        # loop calls fence() (or uses snapshot_copy="blocking")
        if isinstance(strategy, HybridParallelStrategy):
            strategy.before_optimizer_step.append(self._store.fence)

    # ------------------------------------------------------------------ state
    @property
    def errors(self) -> list[str]:
        """Persist errors of this rank (also logged; training goes on, older snapshots stay intact)."""
        return self._store.errors

    @property
    def stats(self) -> list[dict[str, Any]]:
        """One record per snapshot of this rank: step, bytes, persist, capture / copy / fence times."""
        return self._store.stats

    @property
    def lineage(self) -> str:
        """The id of the run the snapshots belong to (a restore continues the one it restored)."""
        return self._store.lineage

    # ------------------------------------------------------------------ the state dict
    def _engine(self) -> Engine | None:
        strategy = self._fabric.strategy
        if not isinstance(strategy, HybridParallelStrategy):
            return None
        if strategy.engine is None:
            raise RuntimeError(f"{_OWNER}: set up the model first (fabric.setup).")
        return strategy.engine

    def _split(self, state: dict[str, Any]) -> _Parts:
        if not isinstance(state, dict):
            raise TypeError(f"{_OWNER}: pass the state as a dict (as for fabric.save), not {type(state)}.")
        modules = [k for k, v in state.items() if isinstance(v, nn.Module)]
        strategy = self._fabric.strategy
        # the set-up model; other modules (an EMA copy, a frozen teacher) are entries with a state dict
        if isinstance(strategy, HybridParallelStrategy):
            models = [k for k in modules if _unwrap(state[k]) is strategy.module]
        else:  # Fabric's own strategies: the module it wrapped, or the only one
            models = [k for k in modules if is_wrapped(state[k])] or (modules if len(modules) == 1 else [])
        if len(models) != 1:
            found = f"modules {modules}, of which {models} set up" if modules else "no module"
            raise ValueError(
                f"{_OWNER}: the state must hold the model fabric.setup() returned, once ({found}); the"
                " strategy sets up one module: wrap several trained networks in one nn.Module."
            )
        model_key = models[0]
        module = _unwrap(state[model_key])
        opt_keys = [k for k, v in state.items() if isinstance(v, Optimizer)]
        optimizers = [state[k].optimizer if is_wrapped(state[k]) else state[k] for k in opt_keys]
        if isinstance(strategy, HybridParallelStrategy):
            for k, opt in zip(opt_keys, optimizers, strict=True):
                if not any(opt is o for o in strategy.optimizers):
                    raise ValueError(f"{_OWNER}: state[{k!r}] is not an optimizer set up with this module.")
        rest = [k for k in state if k != model_key and k not in opt_keys]
        stateful = [k for k in rest if is_stateful(state[k])]
        values = [k for k in rest if k not in stateful]
        return _Parts(model_key, module, opt_keys, optimizers, stateful, values)

    def _fingerprint(self, parts: _Parts) -> dict[str, Any]:
        """What must be equal for a snapshot to load: the Trainer's fingerprint of model, optimizers,
        strategy and layout, plus the state dict's keys and kinds. Computed once per set of objects (it
        walks every parameter), not at every snapshot."""
        key = (id(parts.module), *map(id, parts.optimizers), *parts.kinds().items())
        if key not in self._fingerprints:
            self._fingerprints = {key: self._compute_fingerprint(parts)}
        return self._fingerprints[key]

    def _compute_fingerprint(self, parts: _Parts) -> dict[str, Any]:
        strategy, world = self._fabric.strategy, self._fabric.world_size
        recorded = None
        if isinstance(strategy, HybridParallelStrategy):
            recorded = layout(strategy, parts.optimizers)
        found = rank_state.fingerprint(
            parts.module,
            parts.optimizers,
            strategy=type(strategy).__name__,
            world_size=world,
            layout=recorded,
        )
        return {**found, "fabric_state": parts.kinds()}

    def _capture(self, parts: _Parts, state: dict[str, Any]) -> tuple[dict[str, Any], set[int]]:
        model, optim, step_tensors = rank_state.capture(parts.module, self._engine(), parts.optimizers)
        tree = {
            "model": model,
            "optim": optim,
            "stateful": {k: _taken(state[k]) for k in parts.stateful},
            "values": {k: state[k] for k in parts.values},
            "precision": self._fabric.strategy.precision.state_dict(),
            "rng": _collect_rng_states(include_cuda=True),
        }
        return tree, rank_state.storages(step_tensors)

    # ------------------------------------------------------------------ the loop's calls
    def restore(self, state: dict[str, Any]) -> int | None:
        """Load the newest snapshot complete on every rank (memory first, then disk; corrupt or partial
        ones are skipped with a warning) into ``state`` in place and return its step; None if there is
        none (the run starts fresh). Models and optimizers are loaded into, entries with
        ``load_state_dict`` get their saved state, the other entries are replaced (top-level tensors on
        their current device); the generators and the precision state are restored too. Collective: every
        rank calls it, after ``fabric.setup``.

        Raises:
            ValueError: the snapshot was written by another model, optimizer set, layout or state keys;
                the differences are named and nothing is loaded, changed or deleted.
        """
        parts = self._split(state)
        fingerprint = self._fingerprint(parts)
        self._store.fence()
        found = self._store.find()
        if found is None:
            return None
        remedy = "restore with the original model, optimizers, state keys and layout, or pass another dirpath"
        self._store.check(found, fingerprint, remedy=remedy)
        saved = found.state
        rank_state.load(parts.module, self._engine(), parts.optimizers, saved["model"], saved["optim"])
        for k in parts.stateful:
            state[k].load_state_dict(saved["stateful"][k])
        for k in parts.values:
            value, current = saved["values"][k], state[k]
            if isinstance(value, Tensor) and isinstance(current, Tensor):
                value = value.to(current.device)  # snapshots are read back on the host
            state[k] = value
        self._fabric.strategy.precision.load_state_dict(saved["precision"])
        _set_rng_states(saved["rng"])
        self._store.adopt(found)
        self.resumed = {"step": found.step, "lineage": self.lineage, "sources": found.sources}
        rank_zero_info(f"{_OWNER}: restored step {found.step} (lineage {self.lineage}) from {found.sources}")
        return found.step

    def snapshot(self, step: int, state: dict[str, Any]) -> None:
        """Snapshot ``state`` as of ``step`` (an integer that grows, e.g. the optimizer steps done), after
        ``optimizer.step()``. Every rank calls it at the same steps (a persist step, a multiple of
        ``persist_every_n_steps``, is collective); a step already snapshotted is skipped. With
        ``snapshot_copy="overlap"`` call :meth:`fence` before the next ``optimizer.step()``."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"{_OWNER}: step must be a non-negative integer, got {step!r}.")
        parts = self._split(state)
        fingerprint = self._fingerprint(parts)
        self._store.write(step=step, capture=partial(self._capture, parts, state), fingerprint=fingerprint)

    def fence(self) -> None:
        """Wait until the last snapshot's copy has read the weights and optimizer state: under Lightning's
        own strategies call it before every ``optimizer.step()`` (lightning_par's strategy does it itself;
        a no-op when no copy is in flight, or with ``"blocking"``)."""
        self._store.fence()

    def flush(self, timeout: float | None = None) -> bool:
        """Write the newest complete memory snapshot to disk unless it is there; True once it is.
        Bounded by ``timeout`` (default ``flush_timeout_s``); never a collective."""
        return self._store.flush(timeout)

    def close(self, *, failed: bool = False) -> None:
        """End the run: normally the newest snapshot is flushed to disk and the shared memory freed (the
        same command run again with more steps continues from there); with ``failed`` the memory
        snapshots are left for the restart. Not a collective; a second call does nothing."""
        strategy = self._fabric.strategy
        if (
            isinstance(strategy, HybridParallelStrategy)
            and self._store.fence in strategy.before_optimizer_step
        ):
            strategy.before_optimizer_step.remove(self._store.fence)
        self._store.close(failed=failed or self._failed)

    def __enter__(self) -> FlashSnapshots:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            # a crash: the newest memory snapshot also goes to disk (bounded), the memory stays for the
            # restart (this host's restart resumes from it without reading the disk)
            self._failed = True
            self.flush()
        self.close()


def _unwrap(module: nn.Module) -> nn.Module:
    return module.module if is_wrapped(module) else module  # type: ignore[return-value]


def _taken(entry: Any) -> Any:
    """An entry's state for a snapshot: a module's tensors copied now (an EMA is updated in place by the
    next step, while the snapshot may still be copying in the background); others' ``state_dict()``."""
    state = entry.state_dict()
    if isinstance(entry, nn.Module):
        return {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in state.items()}
    return state
