"""Checkpoint save/load of :class:`~lightning_par.HybridParallelStrategy`, for every ZeRO stage: stage 0
writes Lightning's single file from rank 0, stages 1-3 a sharded directory (sharded.py: every rank
its optimizer records, at stage 3 its parameter slices; rank 0 the rest). Either loads into any stage and
dp size; a checkpoint of other parameters is refused by name. A base class, so the strategy module stays
about composition."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.strategies.parallel import ParallelStrategy
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par.checkpoint.dcp_import import is_dcp_checkpoint, read_dcp_checkpoint
from lightning_par.checkpoint.files import remove_path
from lightning_par.checkpoint.fit_state import FitState
from lightning_par.checkpoint.full import gather_full_optimizer_state, gather_full_state_dict
from lightning_par.checkpoint.hook_edits import (
    EDITS_KEY,
    FIXES,
    HIDDEN,
    HIDDEN_LOAD,
    PartialStateDict,
    StateEdits,
    StateSnapshot,
    rank_zero_view,
    state_of,
)
from lightning_par.checkpoint.io import (
    _group_names,
    check_model,
    layout_metadata,
    load_optimizer_states,
    rank_payload,
    record_comm_state,
    save_sharded,
)
from lightning_par.checkpoint.model_state import load_module_state
from lightning_par.checkpoint.sharded import (
    METADATA_KEY,
    RANK_ENTRIES_KEY,
    WRITE_HOOKS_KEY,
    is_sharded_checkpoint,
    read_meta,
    read_rank_entries,
)
from lightning_par.checkpoint.single_file import (
    DIRECTORY_NOTE,
    local_path,
    read_torch_file,
    refuse_directory,
    sharded_path,
    write_over_directory,
)
from lightning_par.checkpoint.tp_reshard import TPInfo, tp_info
from lightning_par.checkpoint.weights_only import put_masters
from lightning_par.lightning_hooks import overridden_anywhere
from lightning_par.mesh import MeshLayout, ParallelMesh
from lightning_par.zero.engine_api import Engine, reads_own_state


class ZeroCheckpointIO(ParallelStrategy):
    """A ``ParallelStrategy`` whose checkpoints follow its ZeRO engine (see the module docstring)."""

    zero_stage: int = 0
    _engine: Engine | None = None
    _fit_engine: Engine | None = None  # the last fit's, kept through evaluation runs (fit_state.py)
    _sharded_source: Path | None = None
    _left_placeholders: tuple[str, ...] = ()  # ZeRO-3 placeholders an interrupted run left (setup)

    @property
    def engine(self) -> Engine | None:
        """The ZeRO engine (after ``setup`` for fitting, and at stage 3 for evaluation too), else None."""
        return self._engine

    @property
    def state_root(self) -> nn.Module | None:
        """The model whose own state reads this strategy marks (:func:`reads_own_state`)."""
        return self.model

    @property
    @abstractmethod
    def layout(self) -> MeshLayout:
        """The strategy's mesh sizes, recorded in checkpoints."""

    @abstractmethod
    def tp_coordinates(self) -> tuple[int, int]:
        """``(tp rank, tp size)`` of this process."""

    @property
    @abstractmethod
    def mesh(self) -> ParallelMesh:
        """The strategy's process groups."""

    def _saved_engine(self) -> Engine | None:
        """What a checkpoint reads: the engine, or after an evaluation run that followed a fit, the
        evaluation's model with that fit's optimizer state (:class:`FitState`)."""
        if self._fit_engine is None:
            return self._engine
        return cast(Engine, FitState(self._engine, self._fit_engine))

    def _tp(self) -> TPInfo:
        assert self.lightning_module is not None
        rank, size = self.tp_coordinates()
        return tp_info(self.lightning_module, rank=rank, size=size)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # stage 3 loads parameters into shards, which exist only after setup()
        return self.zero_stage == 3

    def _model_in_pieces(self) -> bool:
        """No rank holds the whole model: ZeRO-3, tensor or pipeline parallelism."""
        engine = self._saved_engine()
        stage3 = engine is not None and engine.stage == 3
        return stage3 or self.tp_coordinates()[1] > 1 or self.layout.pipeline_parallel_size > 1

    def _sharded(self) -> bool:
        """Written per rank: optimizer shards (ZeRO 1-3) or model pieces."""
        engine = self._saved_engine()
        return self._model_in_pieces() or (engine is not None and engine.sharded_state is not None)

    save_distributed_checkpoint: bool = True

    def _full_file(self) -> bool:
        """Checkpoints are one ordinary file from rank 0 (everything replicated, or asked for)."""
        return not self._sharded() or not self.save_distributed_checkpoint

    def _dp_rank(self) -> int:
        try:
            return self.mesh.dp_rank
        except RuntimeError:  # no process groups yet (a single process)
            return 0

    _saving: StateSnapshot | None = None  # the state dict the save hooks receive (hook_edits.py)
    _loading: StateSnapshot | None = None  # the loaded one, before the load hooks
    _load_edits: StateEdits | None = None

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Replicated models: Lightning's own. Otherwise, with ``save_distributed_checkpoint=False``: the
        full state dict on global rank 0, its entries as zeros of their shapes elsewhere (collective:
        :func:`~lightning_par.checkpoint.hook_edits.rank_zero_view`); with distributed checkpoints:
        the buffers and other non-parameter entries (the parameters are in each rank's file). Kept as
        the save hooks receive it, for :meth:`save_checkpoint` to find what they changed."""
        state = self._module_state_dict()
        self._saving = StateSnapshot(state)
        return state

    @reads_own_state
    def _module_state_dict(self) -> dict[str, Any]:
        if not self._sharded():
            return super().lightning_module_state_dict()
        if not self.save_distributed_checkpoint:  # rank 0 writes; the other ranks' hooks see its shapes
            return rank_zero_view(
                self.consolidated_state_dict(), is_global_zero=self.is_global_zero, broadcast=self.broadcast
            )
        assert self.lightning_module is not None
        module = self.lightning_module
        if not self._model_in_pieces():
            return super().lightning_module_state_dict()
        params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
        rest = {
            k: v
            for k, v in module.state_dict().items()
            if k not in params and not (isinstance(v, Tensor) and v.is_meta)
        }
        return PartialStateDict(rest, elsewhere=frozenset(params))

    @reads_own_state
    def consolidated_state_dict(self) -> dict[str, Any]:
        """The full model state dict (parameters, trainable ones at master precision, and buffers) on
        global rank 0, ``{}`` elsewhere; collective. Every rank sends its share in turn (see
        :mod:`lightning_par.checkpoint.full`), so no rank holds more than the result and one share."""
        assert self.lightning_module is not None
        return gather_full_state_dict(
            self.lightning_module, self._saved_engine(), tp=self._tp(), dp_rank=self._dp_rank(), group=None
        )

    @override
    @reads_own_state
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self._sharded():
            return super().optimizer_state(optimizer)
        if self.save_distributed_checkpoint:
            return {}  # sharded optimizer state is written per rank by save_checkpoint
        assert self.lightning_module is not None
        module = self.lightning_module
        index = next(k for k, opt in enumerate(self.optimizers) if opt is optimizer)
        names = {p: n for n, p in module.named_parameters()}
        engine = self._saved_engine()
        return gather_full_optimizer_state(
            optimizer,
            module=module,
            engine=engine,
            param_names=_group_names(optimizer, engine, names, index),
            tp=self._tp(),
            dp_rank=self._dp_rank(),
            group=None,
        )

    @override
    @reads_own_state
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        assert self.lightning_module is not None
        for hook in checkpoint.pop(WRITE_HOOKS_KEY, []):  # callbacks' work deferred to the write
            hook(checkpoint)
        # per-rank entries callbacks added (a sharded weight average): this rank's file, never meta.pt
        entries = checkpoint.pop(RANK_ENTRIES_KEY, None) or {}
        # weights only (Lightning's save_weights_only): no optimizer is named or recorded, so one whose
        # parameters the model no longer holds (a module replaced after fit) does not stop the save
        with_optimizers = "optimizer_states" in checkpoint
        checkpoint[METADATA_KEY] = self.layout_metadata(with_optimizers=with_optimizers)
        # weights only of a model every rank holds whole (ZeRO 1/2): one file, as "ddp" writes it
        weights_file = not with_optimizers and not entries and not self._model_in_pieces()
        one_file = self._full_file() or weights_file
        saving, self._saving = self._saving, None
        if weights_file and not self._full_file():
            put_masters(checkpoint, saving, self._saved_engine(), gather=self.consolidated_state_dict)
        if saving is not None and not one_file:
            # the hooks' changes to state_dict, which the rank files' records would override at the load
            state = state_of(checkpoint)
            edits = saving.edits(state)
            if edits:
                checkpoint[METADATA_KEY][EDITS_KEY] = edits.to_meta()
            if state is not saving.source and isinstance(saving.source, PartialStateDict):
                rank_zero_warn(  # once: every save would say it again
                    f"on_save_checkpoint replaced {HIDDEN}: the parameters are saved from the model as they"
                    f" are, with what the new dict holds under their names over them. {FIXES}"
                )
        if isinstance(checkpoint.get("state_dict"), PartialStateDict):
            checkpoint["state_dict"] = dict(checkpoint["state_dict"])  # the file holds plain types
        if with_optimizers:  # beside the optimizer state it belongs with (collective)
            record_comm_state(checkpoint[METADATA_KEY], self._saved_engine())
        if one_file:
            # one ordinary Lightning file: the state dict and optimizer states are already full (rank 0),
            # or weights only of a whole model (what load_from_checkpoint reads in a plain process)
            checkpoint[METADATA_KEY]["format"] = "full"
            if self.is_global_zero:  # the only writer
                write_over_directory(
                    filepath,
                    lambda to: super(ZeroCheckpointIO, self).save_checkpoint(checkpoint, to, storage_options),
                )
            return
        if storage_options is not None:
            raise TypeError("storage_options is not supported for sharded (ZeRO 1-3) checkpoints.")
        # an older checkpoint under the same name (a directory or a single file) is replaced atomically
        path = sharded_path(self.broadcast(str(filepath)))
        payload = rank_payload(
            self.lightning_module,
            self._saved_engine(),
            self.optimizers if with_optimizers else [],
            self._tp(),
            with_model=self._model_in_pieces(),
            dp_rank=self._dp_rank(),
        )
        save_sharded(
            checkpoint,
            path,
            payload={**payload, "entries": entries},
            rank=self.global_rank,
            world_size=self.world_size,
            barrier=self.barrier,
        )
        rank_zero_warn(DIRECTORY_NOTE)  # once per process: the same message at every save

    @property
    def writes_sharded_checkpoints(self) -> bool:
        """Checkpoints are directories of per-rank files (else one Lightning file from rank 0): callbacks
        with per-rank state put it under ``checkpoint[RANK_ENTRIES_KEY][their key]`` (best from a hook
        left under ``WRITE_HOOKS_KEY``, run only when the checkpoint is written) and read it back with
        :meth:`checkpoint_rank_entries`."""
        return not self._full_file()

    def checkpoint_rank_entries(self, key: str) -> list[tuple[dict[str, Any], Any]] | None:
        """The per-rank entries saved under ``key`` in the sharded checkpoint being loaded, with each
        writer's tensor-parallel coordinates; None when the checkpoint loaded is a single file."""
        if self._sharded_source is None:
            return None
        return read_rank_entries(self._sharded_source, key)

    @reads_own_state
    def layout_metadata(self, *, with_optimizers: bool = True) -> dict[str, Any]:
        """What a checkpoint records about the model and the layout it was written with (and its
        optimizers' parameter names, unless ``with_optimizers`` is False: a weights-only save)."""
        assert self.lightning_module is not None
        layout = self.layout
        sizes = {
            "world_size": layout.world_size,
            "dp": layout.data_parallel_size,
            "tp": layout.tensor_parallel_size,
            "pp": layout.pipeline_parallel_size,
        }
        return layout_metadata(
            self.lightning_module,
            engine=self._saved_engine(),
            optimizers=self.optimizers if with_optimizers else [],
            sizes=sizes,
            tp=self._tp(),
        )

    @override
    @reads_own_state
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        text = self.broadcast(str(checkpoint_path))
        path = local_path(text)
        self._sharded_source = None
        if path is None:  # another fsspec protocol: a single file (directories are local only)
            checkpoint = self.checkpoint_io.load_checkpoint(text, weights_only=weights_only)
        elif is_dcp_checkpoint(path):  # Lightning's FSDPStrategy / ModelParallelStrategy wrote it
            checkpoint = read_dcp_checkpoint(path)
        elif is_sharded_checkpoint(path):
            checkpoint = read_meta(path)
            self._sharded_source = path
            state = state_of(checkpoint)
            elsewhere = frozenset((checkpoint.get(METADATA_KEY) or {}).get("params", {})) - set(state)
            if elsewhere:  # the parameters are in the rank files' pieces
                checkpoint["state_dict"] = PartialStateDict(state, elsewhere=elsewhere)
        elif type(self.checkpoint_io) is TorchCheckpointIO and path.is_file():
            # memory-mapped: each rank reads only the slices it keeps, not the whole file into memory
            checkpoint = read_torch_file(path, weights_only=bool(weights_only))
        else:
            refuse_directory(path)  # a folder of checkpoints given for one (before, IsADirectoryError)
            checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        # checked against the model in load_model_state_dict, after on_load_checkpoint (which may rename,
        # drop or replace entries of state_dict) and before anything loads
        self._loading = StateSnapshot(state_of(checkpoint))
        return checkpoint

    @override
    @reads_own_state
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Refuse a checkpoint of other parameters (``strict``: Lightning passes the module's
        ``strict_loading``; False leaves a fine-tune's new head out), then load it, through the changes
        the save and load hooks made to its ``state_dict`` (:mod:`~lightning_par.checkpoint.hook_edits`)."""
        assert self.lightning_module is not None
        state = state_of(checkpoint)
        # placeholders the checkpoint writes are loaded; the rest stay refused (a partial checkpoint of a
        # fine-tune's head, strict_loading=False): see StrategyLoops._refuse_placeholders
        written = set(state) | set(getattr(state, "elsewhere", ()))
        self._left_placeholders = tuple(n for n in self._left_placeholders if n not in written)
        saved = StateEdits.from_meta(checkpoint.get(METADATA_KEY))
        loading, self._loading = self._loading, None
        edits = (loading.edits(state) if loading is not None else StateEdits()).after(saved, state)
        self._load_edits = edits
        partial = loading is not None and isinstance(loading.source, PartialStateDict)
        if partial and loading is not None and state is not loading.source:  # a dict rebuilt by the hook
            rank_zero_warn(HIDDEN_LOAD)
        # a refusal of a directory in pieces: its hooks could not have renamed the parameters (said only
        # where a hook exists that could have wanted to)
        hint = (
            f" (on_load_checkpoint sees no parameters here: {HIDDEN}. {FIXES})"
            if partial and overridden_anywhere(self.lightning_module, "on_load_checkpoint")
            else ""
        )
        check_model(checkpoint, self.lightning_module, self._tp(), strict=strict, edits=edits, hint=hint)
        load_module_state(
            checkpoint,
            self.lightning_module,
            self._engine,
            sharded_path=self._sharded_source,
            tp=self._tp(),
            strict=strict,
            edits=edits,
        )

    @override
    @reads_own_state
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.lightning_module is not None
        load_optimizer_states(
            checkpoint,
            module=self.lightning_module,
            engine=self._engine,
            optimizers=self.optimizers,
            sharded_path=self._sharded_source,
            tp=self._tp(),
            edits=self._load_edits,
        )
        self._load_edits = None  # this checkpoint's: not another load's
        _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        path = local_path(filepath)
        if path is None:
            super().remove_checkpoint(filepath)  # a single file on another fsspec filesystem
        elif self.is_global_zero:
            remove_path(path)  # a link (save_last="link"): the link, not its target's tree
