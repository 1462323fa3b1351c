"""The options of ``HybridParallelStrategy`` checked in its constructor, before any process starts: each
bad value fails with the option's name and what would work."""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from typing import TYPE_CHECKING, Literal

from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_par.pipeline.partition import PartitionMethod, as_cut
from lightning_par.pipeline.schedule import SCHEDULES, ScheduleName, validate_sizes
from lightning_par.tensor_parallel import resolve_plan
from lightning_par.zero.engine import ReduceChoice
from lightning_par.zero.grad_sync import GradSyncPolicy

if TYPE_CHECKING:
    import lightning.pytorch as pl

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
PipelineSchedule = ScheduleName
_START_METHODS = ("popen", "spawn", "fork", "forkserver")


def check_options(
    *,
    zero_stage: int,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    bucket_size_mb: float,
    grad_sync: GradSyncPolicy | None,
    reduce_op: ReduceChoice,
    tp_plan: str | Mapping[str, str] | None,
    num_microbatches: int | None,
    pipeline_schedule: PipelineSchedule,
    virtual_stages: int,
    pipeline_slack: int,
    partition_method: PartitionMethod | Sequence[int],
    timeout_s: float,
    start_method: StartMethod,
    zero3_units: object = None,
    reshard_after_forward: bool | None = None,
    prefetch: bool = True,
    sequence_parallel: bool = False,
    flags: Mapping[str, object] | None = None,
) -> int | None:
    """Raise a ``ValueError`` for the first bad option; return ``num_microbatches`` (``2 p`` by default
    with pipeline parallelism, else as given). ``flags``: the constructor's other on/off options, which
    must be booleans."""
    _check_types(
        numbers={"bucket_size_mb": bucket_size_mb, "timeout_s": timeout_s},
        counts={"virtual_stages": (virtual_stages, 1), "pipeline_slack": (pipeline_slack, 0)}
        | ({"num_microbatches": (num_microbatches, 1)} if num_microbatches is not None else {}),
        flags={"prefetch": prefetch, "sequence_parallel": sequence_parallel, **(flags or {})},
    )
    if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}.")
    for name, value in (
        ("tensor_parallel_size", tensor_parallel_size),
        ("pipeline_parallel_size", pipeline_parallel_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    if tp_plan is not None and not isinstance(tp_plan, str | Mapping):
        raise ValueError(f"tp_plan must be a plan name or a dict of pattern -> style, got {tp_plan!r}.")
    if isinstance(tp_plan, str):
        resolve_plan(tp_plan)  # an unknown name fails here, before any process starts
    if pipeline_parallel_size > 1:
        num_microbatches = num_microbatches or 2 * pipeline_parallel_size
        p, m, v = pipeline_parallel_size, num_microbatches, virtual_stages
        validate_sizes(pipeline_schedule, p=p, m=m, v=v, slack=pipeline_slack)
        if grad_sync == "every":
            raise ValueError(
                "grad_sync='every' with pipeline parallelism: the micro-batches of a pipeline step are"
                " reduced once, after the schedule (tied stage gradients are summed first); use"
                " grad_sync='boundary' or leave it unset."
            )
    cut, pieces = as_cut(partition_method), pipeline_parallel_size * virtual_stages
    if isinstance(cut, tuple) and pipeline_parallel_size > 1 and len(cut) != pieces:
        raise ValueError(
            f"partition_method={list(cut)} gives {len(cut)} layer counts for {pipeline_parallel_size}"
            f" stages x {virtual_stages} virtual stages: give one count per piece, {pieces} in all, in"
            " virtual-stage order."
        )
    if pipeline_schedule not in SCHEDULES:
        raise ValueError(f"pipeline_schedule must be one of {SCHEDULES}, got {pipeline_schedule!r}.")
    if not bucket_size_mb > 0:
        raise ValueError(
            f"bucket_size_mb must be > 0 (the gradient bucket size in MiB), got {bucket_size_mb!r}."
        )
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}.")
    if grad_sync is not None and grad_sync not in ("boundary", "every"):
        raise ValueError(f"grad_sync must be 'boundary', 'every' or None, got {grad_sync!r}.")
    if grad_sync == "every" and zero_stage == 0:
        raise ValueError("grad_sync='every' reduces into a gradient shard: use zero_stage 1 or 2.")
    if reduce_op not in ("auto", "all_reduce", "reduce_scatter"):
        raise ValueError(f"reduce_op must be 'auto', 'all_reduce' or 'reduce_scatter', got {reduce_op!r}.")
    if reduce_op == "reduce_scatter" and zero_stage == 0:
        raise ValueError(
            "reduce_op='reduce_scatter' reduces gradients into the shards of ZeRO stages 1-3; zero_stage=0"
            " keeps whole gradients and all-reduces them. Use zero_stage >= 1, or reduce_op 'auto'."
        )
    if start_method not in _START_METHODS:
        raise ValueError(f"start_method must be one of {_START_METHODS}, got {start_method!r}.")
    _check_stage3_options(
        zero_stage, zero3_units=zero3_units, reshard_after_forward=reshard_after_forward, prefetch=prefetch
    )
    if grad_sync is not None and zero_stage == 3:
        raise ValueError(
            f"grad_sync={grad_sync!r} applies at zero_stage 1/2 only: stage 3 reduce-scatters each unit's"
            " gradients as its backward ends. Leave grad_sync unset (None / null) at stage 3."
        )
    if sequence_parallel and tensor_parallel_size == 1:
        raise ValueError(
            "sequence_parallel=True splits the activations over a tensor-parallel group, but"
            " tensor_parallel_size=1: set tensor_parallel_size > 1, or sequence_parallel=False."
        )
    _warn_idle_options(
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        tp_plan=tp_plan,
        pipeline={
            "num_microbatches": (num_microbatches, None),
            "pipeline_schedule": (pipeline_schedule, "1f1b"),
            "virtual_stages": (virtual_stages, 1),
            "pipeline_slack": (pipeline_slack, 0),
            "partition_method": (partition_method, "compute"),
        },
    )
    return num_microbatches


def as_unit_policy(policy: object) -> object:
    """A set of rules (``{Block}``, the form Lightning's ``FSDPStrategy`` policies and litgpt take) as a
    list ordered by name, so every rank holds it in one order; anything else unchanged (checked by
    :func:`check_activation_checkpointing` / the ``zero3_units`` check)."""
    if isinstance(policy, Set):
        return sorted(
            policy, key=lambda rule: rule if isinstance(rule, str) else getattr(rule, "__qualname__", "")
        )
    return policy


def check_activation_checkpointing(policy: object) -> None:
    """``activation_checkpointing``: a bool, or a unit policy as ``zero3_units`` takes (before, a number
    was accepted and failed at fit: "'int' object is not iterable")."""
    rules = [policy] if isinstance(policy, str | type) else policy
    if isinstance(policy, bool) or (
        isinstance(rules, Sequence) and all(isinstance(r, str | type) for r in rules)
    ):
        return
    raise ValueError(
        "activation_checkpointing must be True, False, or module classes or strings (name patterns such"
        f" as 'model.layers.*', class names such as 'LlamaDecoderLayer'), or a list or set of them; got"
        f" {policy!r}."
    )


def _check_types(
    *, numbers: Mapping[str, object], counts: Mapping[str, tuple[object, int]], flags: Mapping[str, object]
) -> None:
    """Options of the wrong type, named before anything compares them (before, ``bucket_size_mb="25"``
    failed with "'>' not supported between instances of 'str' and 'int'", ``num_microbatches=2.5`` only
    at fit, ``num_microbatches=0`` became the default silently, and ``save_distributed_checkpoint="no"``
    counted as true)."""
    for name, value in numbers.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__}).")
    for name, (value, least) in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}.")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r} ({type(value).__name__}).")


def _warn_idle_options(
    *,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    tp_plan: object,
    pipeline: Mapping[str, tuple[object, object]],
) -> None:
    """Warn (rank 0) about options set away from their defaults that do nothing at this layout: pipeline
    options at ``pipeline_parallel_size=1``, a ``tp_plan`` at ``tensor_parallel_size=1``. Warned, not
    refused, so a sweep over the sizes (``pipeline_parallel_size=1,2``) keeps its other values."""
    if pipeline_parallel_size == 1:
        idle = [f"{name}={value!r}" for name, (value, default) in pipeline.items() if value != default]
        if idle:
            verb = "apply" if len(idle) > 1 else "applies"
            rank_zero_warn(
                f"{', '.join(idle)} {verb} under pipeline parallelism only, but pipeline_parallel_size=1:"
                " nothing is pipelined in this run. Set pipeline_parallel_size > 1, or leave them at their"
                " defaults."
            )
    if tensor_parallel_size == 1 and tp_plan is not None:
        rank_zero_warn(
            f"tp_plan={tp_plan!r} applies under tensor parallelism only, but tensor_parallel_size=1: the"
            " model is not split in this run. Set tensor_parallel_size > 1, or leave tp_plan unset."
        )


def _check_stage3_options(
    zero_stage: int, *, zero3_units: object, reshard_after_forward: object, prefetch: object
) -> None:
    """The unit options shape stage 3 only: below it they would be accepted and do nothing, so a run that
    meant to shard by those units would silently replicate the parameters (as ``gather_dtype``)."""
    rules = [zero3_units] if isinstance(zero3_units, str | type) else zero3_units
    if zero3_units is not None and (
        not isinstance(rules, Sequence) or not all(isinstance(r, str | type) for r in rules)
    ):
        raise ValueError(
            "zero3_units must be module classes or strings (module name patterns such as 'model.layers.*',"
            f" or class names such as 'LlamaDecoderLayer'), or a list or set of them; got {zero3_units!r}."
        )
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise ValueError(f"reshard_after_forward must be True, False or None, got {reshard_after_forward!r}.")
    given = [
        name
        for name, value in (("zero3_units", zero3_units), ("reshard_after_forward", reshard_after_forward))
        if value is not None
    ] + (["prefetch=False"] if prefetch is False else [])
    if given and zero_stage != 3:
        raise ValueError(
            f"{' and '.join(given)}: ZeRO-3 unit options, which apply at zero_stage=3 only, but zero_stage="
            f"{zero_stage}. Use zero_stage=3, or leave them at their defaults (zero3_units and"
            " reshard_after_forward None, prefetch True; null / true in a config, e.g. when a sweep varies"
            " zero_stage)."
        )


def check_fit_setup(
    trainer: pl.Trainer,
    *,
    zero_stage: int,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    masters_separate: bool,
) -> None:
    """Refuse, before anything is built, Lightning callbacks that cannot serve this layout (weight
    averaging, :func:`_check_averaging`; the fine-tuning callbacks, :func:`_check_finetuning`; pruning,
    :func:`_check_pruning`)."""
    callbacks = list(getattr(trainer, "callbacks", []))
    _check_finetuning(callbacks, zero_stage=zero_stage, pipeline_parallel_size=pipeline_parallel_size)
    _check_pruning(
        callbacks,
        zero_stage=zero_stage,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
    )
    _check_averaging(
        trainer,
        callbacks,
        zero_stage=zero_stage,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        masters_separate=masters_separate,
    )


def _check_finetuning(callbacks: list[object], *, zero_stage: int, pipeline_parallel_size: int) -> None:
    """``BaseFinetuning`` callbacks (``BackboneFinetuning`` and users' own) freeze modules at setup, then
    unfreeze them and pass their parameters to ``optimizer.add_param_group``; they also name every tensor
    in ``optimizer.param_groups`` through ``named_parameters()``. ZeRO stage 0 follows the unfreezing (its
    buckets are rebuilt, :mod:`lightning_par.zero.trainable`); ZeRO 1-3 hold shards in the optimizer, and a
    pipeline rank holds other stages' parameters as meta placeholders."""
    from lightning.pytorch.callbacks import BaseFinetuning

    tuning = [c for c in callbacks if isinstance(c, BaseFinetuning)]
    if not tuning or (zero_stage == 0 and pipeline_parallel_size == 1):
        return
    reason = (
        f"ZeRO stage {zero_stage} rebuilds the optimizer over shards of the parameters trainable at setup,"
        " so the callback can neither name the optimizer's tensors nor add parameters to it"
        if zero_stage
        else "under pipeline parallelism each rank holds only its stage's parameters"
    )
    raise ValueError(
        f"{type(tuning[0]).__name__} cannot be used with this layout: {reason}. Use zero_stage=0 without"
        " pipeline parallelism (there it trains the unfrozen parameters as one process would), or make the"
        " parameters trainable before fit and hold them still with lr=0 in a param group of their own. A"
        " callback that only freezes (it names the optimizer's tensors at every epoch start all the same):"
        " freeze in the module instead (requires_grad_(False) in __init__ or configure_model()), which"
        " every layout supports."
    )


def _check_pruning(
    callbacks: list[object], *, zero_stage: int, tensor_parallel_size: int, pipeline_parallel_size: int
) -> None:
    """``ModelPruning`` ranks weights by magnitude over the module's parameters, resets the survivors to
    their initial values by replacing ``param.data`` (the lottery-ticket default) and, at the end, makes the
    pruning permanent (``prune.remove``, replacing ``.data`` again). ZeRO 0-2 hold every parameter whole
    on every rank and take a replaced ``.data`` back into their buffers
    (``ShardedOptimizer.take_back_replaced``): they prune as ``"ddp"`` does. At ZeRO-3 the callback's
    ranking would read placeholders between steps; tensor-parallel slices and other stages' meta layers
    would be ranked apart."""
    from lightning.pytorch.callbacks import ModelPruning

    pruning = [c for c in callbacks if isinstance(c, ModelPruning)]
    if not pruning or (zero_stage < 3 and tensor_parallel_size == 1 and pipeline_parallel_size == 1):
        return
    reason = (
        "ZeRO-3 keeps the parameters as shards between steps, where the callback ranks them"
        if zero_stage == 3
        else "each rank holds a slice or a stage of the model, so weights would be ranked apart"
    )
    raise ValueError(
        f"ModelPruning cannot be used with this layout: {reason}. Use zero_stage 0-2 without tensor or"
        " pipeline parallelism (there it prunes as Lightning's 'ddp' does), or prune the exported weights"
        " after training (at ZeRO-3 also by hand inside `with trainer.strategy.gathered_params("
        "writeback=True):` on every rank)."
    )


def _check_averaging(
    trainer: pl.Trainer,
    callbacks: list[object],
    *,
    zero_stage: int,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    masters_separate: bool,
) -> None:
    """Weight averaging (``StochasticWeightAveraging``, ``WeightAveraging``/``EMAWeightAveraging``) keeps an
    unsharded copy of the LightningModule and reads and writes ``module.parameters()`` directly: right
    where every rank holds the whole model in the parameters (ZeRO 0-2 without tensor or pipeline
    parallelism, fp32 parameters that are their own masters), wrong elsewhere (ZeRO-3 placeholders,
    tensor-parallel slices, other stages' meta layers, low-precision copies of fp32 masters).
    ``StochasticWeightAveraging`` on a model with BatchNorm is refused at stages 1/2 as well: its final
    statistics epoch calls ``optimizer.step()`` without a new backward, which Lightning's 'ddp' (gradients
    kept until ``zero_grad``) and these stages (gradients released after each step) answer differently."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging

    averaging = [c for c in callbacks if isinstance(c, StochasticWeightAveraging | WeightAveraging)]
    if not averaging:
        return
    name = type(averaging[0]).__name__
    reason = None
    statistics_epoch = False  # the refusal is of SWA's BatchNorm epoch at ZeRO 1/2, with advice of its own
    works = (
        " Lightning's callback works with zero_stage 0, 1 or 2 in precision='32-true' without tensor or"
        " pipeline parallelism."
    )
    advice = (
        "Use lightning_par.callbacks.ShardedEMA (for EMAWeightAveraging) or ShardedWeightAveraging (for"
        " WeightAveraging, with its avg_fn or multi_avg_fn): the same contract at every layout, each rank"
        " averaging the fp32 values it holds." + works
    )
    module = getattr(trainer, "lightning_module", None)
    swa_statistics_epoch = (
        any(isinstance(c, StochasticWeightAveraging) for c in averaging)
        and getattr(trainer, "max_epochs", None) != -1
        and module is not None
        and StochasticWeightAveraging.pl_module_contains_batch_norm(module)
    )
    if zero_stage == 3:
        reason = "ZeRO stage 3 holds the parameters as shards, the module's tensors are placeholders"
    elif tensor_parallel_size > 1:
        reason = "tensor parallelism leaves each rank a slice of the parameters the callback copied whole"
    elif pipeline_parallel_size > 1:
        reason = "pipeline parallelism leaves other stages' layers on the meta device"
    elif masters_separate:
        reason = (
            f"ZeRO stage {zero_stage} with low-precision parameters keeps the fp32 masters in shards, which"
            " the averaged weights would not reach"
        )
    elif zero_stage in (1, 2) and swa_statistics_epoch:
        name, statistics_epoch = "StochasticWeightAveraging", True
        reason = (
            "on a model with BatchNorm it ends with an extra epoch that skips backward and zero_grad but"
            " still calls optimizer.step(), which under 'ddp' re-applies the last step's gradients (and"
            f" momentum); ZeRO stage {zero_stage} releases the gradients after every step, so that step"
            " changes nothing and the final weights would differ from 'ddp'"
        )
        advice = "Use zero_stage=0 (which matches 'ddp'), or EMAWeightAveraging / WeightAveraging."
    if name == "StochasticWeightAveraging" and reason is not None and not statistics_epoch:
        # SWA is more than an average: say what the replacement leaves to the user
        advice = (
            "Use lightning_par.callbacks.ShardedWeightAveraging (without avg_fn: SWA's equal-weight"
            " average, each rank averaging the fp32 values it holds), subclassed with should_update(step_idx"
            "=None, epoch_idx=None) returning epoch_idx is not None and epoch_idx >= your swa_epoch_start;"
            " for swa_lrs, torch.optim.swa_utils.SWALR as the scheduler in configure_optimizers; it does not"
            " run SWA's extra epoch that recomputes the BatchNorm statistics (use_buffers=True averages"
            " them instead)." + works
        )
    if reason is not None:
        raise ValueError(f"{name} cannot be used with this layout: {reason}. {advice}")
