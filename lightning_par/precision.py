"""``ParallelPrecision``: the precision plugin of :class:`~lightning_par.HybridParallelStrategy`, at every
ZeRO stage, with or without tensor and pipeline parallelism (Lightning's precision strings map onto it, so
clipping norms and fp16 verdicts always go over the right groups).

Modes:

* ``"32-true"``: fp32 everywhere.
* ``"64-true"``: fp64 everywhere, as Lightning's ``DoublePrecision``: the model is built (in
  ``configure_model`` / ``init_module``) and converted to float64, floating inputs are cast to it, and
  inside a step torch's default dtype is float64; the shards, gradients and their reduction are fp64.
* ``"bf16-mixed"`` / ``"16-mixed"`` with fp32 master weights (the default at ZeRO stages 1-3): parameters
  and gradients are bf16/fp16 on every rank, the forward runs under ``torch.autocast`` (so
  precision-sensitive ops such as softmax and losses stay fp32), and the fp32 master weights and
  optimizer state live only in this rank's ZeRO shard. Memory per parameter at stage 1: 2 (params) + 4
  (the local gradient buffer, in the fp32 reduction dtype; 2 with ``reduce_dtype="bf16"``) + 4/N (the
  reduced shard) + 12/N (fp32 master + Adam); at stage 3 16/N (:mod:`lightning_par.memory`).
* the same without masters (the default at stage 0, where nothing is sharded; ``master_weights=False``
  at any stage): fp32 parameters and gradients, the forward under autocast, like Lightning's own
  ``"bf16-mixed"``; memory 4 + 4 + 8/N.
* ``"bf16-true"``: bf16 parameters without autocast: floating inputs are cast to bf16 and every op, the
  loss included, runs in bf16 unless the model upcasts itself. As Lightning's ``HalfPrecision``: inside a
  step (``forward_context``) torch's default dtype is bf16, so tensors the step creates match the
  parameters, and Fabric's module wrapper gets the outputs back in the default dtype (fp32). With
  masters (stages 1-3) the fp32 masters are in the shard; without (stage 0) the optimizer updates the
  bf16 parameters, as Lightning's does.
* fp32 masters at stage 0 (``master_weights=True``) are refused: use ZeRO-1, which keeps them at the
  same communication volume and shards them.
* Frozen floating parameters (no gradient, no master) keep Lightning's dtype: fp32 under the mixed
  modes, bf16 under ``"bf16-true"`` (``frozen_dtype="auto"``); ``frozen_dtype="compute"`` stores them in
  the 16-bit compute dtype, DeepSpeed's choice (half the memory of a frozen base, but an EMA update
  smaller than half a 16-bit step is rounded away).

Norm layers (``LayerNorm``, ``GroupNorm``, ``BatchNorm``, RMS-norm modules) compute in fp32 where their
parameters are low-precision (``norms_in_fp32=True``). Gradients are reduced in ``reduce_dtype`` (fp32 by
default, the accurate choice; ``"bf16"`` halves the traffic).

Gradient pipeline, in this order at every stage and precision: reduce (the engine, in ``reduce_dtype``)
-> attach (cast into the dtype the optimizer reads: the fp32 masters, or ``param.grad``) -> rescale
(token-exact normalisation, on the attached gradients, so no second rounding in the reduction dtype) ->
unscale and check (fp16: one verdict over every rank) -> clip (the global norm over the groups in
:attr:`grad_norm_groups`, tensor-parallel replicas and tied copies counted once) -> step.

fp16 uses dynamic loss scaling (:mod:`lightning_par.loss_scaler`): the loss is scaled before backward;
after it, the gradients of every shard are unscaled and checked for inf/NaN with one all-reduce over the
world, so every rank skips the same step. A skipped step leaves weights and optimizer state untouched;
the strategy then neither steps the LR schedulers nor counts the step (see ``HybridParallelStrategy``).
The step side (the optimizer step with that verdict, the clip, the plugin's checkpoint state) is the base
class :class:`~lightning_par.precision_steps.PrecisionSteps`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from typing_extensions import override

from lightning_par.loss_scaler import DynamicLossScaler
from lightning_par.module_dtypes import (
    autocast_gaps_in_fp32,
    cast_buffers,
    compute_in_fp32,
    explained_dtype_errors,
    is_norm,
)
from lightning_par.owned_hooks import copy_or_share
from lightning_par.precision_steps import PrecisionSteps

PrecisionMode = Literal["32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true"]
FrozenDtype = Literal["auto", "compute"]
ReduceDtype = Literal["fp32", "bf16", "fp16"]
PRECISION_MODES = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ParallelPrecision(PrecisionSteps):
    """Precision plugin for sharded training (see the module docstring).

    Args:
        precision: ``"32-true"``, ``"64-true"``, ``"bf16-mixed"``, ``"16-mixed"`` or ``"bf16-true"``.
        reduce_dtype: dtype of gradient reduction and of the gradient shard: ``"fp32"`` (default), or the
            compute dtype's ``"bf16"``/``"fp16"`` to halve the traffic.
        norms_in_fp32: compute norm layers in fp32 where their parameters are low-precision.
        loss_scale: fp16 only: keyword arguments of :class:`~lightning_par.loss_scaler.DynamicLossScaler`.
        master_weights: low-precision parameters with fp32 masters in the ZeRO shards (``True``), or fp32
            parameters under autocast (``False``; for ``"bf16-true"``: bf16 parameters updated as they
            are); default: masters at ZeRO stages 1-3, none at stage 0.
        frozen_dtype: how frozen floating parameters (``requires_grad=False``) are stored where there are
            masters. ``"auto"``: as Lightning's own strategies store them, fp32 under ``"bf16-mixed"`` /
            ``"16-mixed"`` (ZeRO-3 gathers them in the compute dtype) and bf16 under ``"bf16-true"``;
            an EMA teacher or target network updated between steps keeps its small updates, which a
            16-bit copy rounds away. ``"compute"``: the 16-bit compute dtype (DeepSpeed's choice), half
            the memory of a large frozen base (LoRA), rounded once at setup.
    """

    def __init__(
        self,
        precision: PrecisionMode = "32-true",
        *,
        reduce_dtype: ReduceDtype = "fp32",
        norms_in_fp32: bool = True,
        loss_scale: dict[str, Any] | None = None,
        master_weights: bool | None = None,
        frozen_dtype: FrozenDtype = "auto",
    ) -> None:
        if precision not in PRECISION_MODES:
            raise ValueError(f"precision must be one of {PRECISION_MODES}, got {precision!r}.")
        if frozen_dtype not in ("auto", "compute"):
            raise ValueError(f"frozen_dtype must be 'auto' or 'compute', got {frozen_dtype!r}.")
        self.frozen_dtype: FrozenDtype = frozen_dtype
        if reduce_dtype not in _DTYPES:
            raise ValueError(f"reduce_dtype must be one of {tuple(_DTYPES)}, got {reduce_dtype!r}.")
        super().__init__()
        self.precision = precision
        self.compute_dtype: torch.dtype = {
            "32-true": torch.float32,
            "64-true": torch.float64,
            "bf16-mixed": torch.bfloat16,
            "bf16-true": torch.bfloat16,
            "16-mixed": torch.float16,
        }[precision]
        # (under "64-true" gradients stay fp64, reduced in their own dtype: engine_dtypes)
        if reduce_dtype != "fp32" and _DTYPES[reduce_dtype] != self.compute_dtype:
            raise ValueError(
                f"reduce_dtype={reduce_dtype!r} with precision={precision!r}: reduce in fp32 or in the"
                " compute dtype."
            )
        self.reduce_dtype: torch.dtype = _DTYPES[reduce_dtype]
        self.norms_in_fp32 = norms_in_fp32
        self.scaler = DynamicLossScaler(**(loss_scale or {})) if precision == "16-mixed" else None
        self.grad_norm_groups: tuple[ProcessGroup, ...] = ()
        # tensor parallelism: main parameters without a tp dimension are replicated over the tp group
        # and count once in the norm
        self.tp_group: ProcessGroup | None = None
        self.step_groups: tuple[ProcessGroup | None, ...] = (None,)
        self.last_step_skipped = False
        self.last_grad_norm: Tensor | None = None  # the global norm the latest clip used
        # called once the closure's hooks and clipping have run, before the optimizer's update: the
        # Trainer strategy ends its first step's param.grad watch there (lightning_par.grad_reads)
        self.before_update: Callable[[], None] | None = None
        # called when fp16 skips a step (a non-finite gradient): the strategy's engine restarts a stateful
        # gradient compressor the gradient went into (PowerSGD's residuals)
        self.on_skip: Callable[[], None] | None = None
        self.requested_master_weights = master_weights
        self.master_weights = bool(master_weights) if master_weights is not None else self.low_precision
        self.device = torch.device("cpu")  # the communication device, set by configure()

    def __deepcopy__(self, memo: dict[int, Any]) -> ParallelPrecision:
        """Shared once it holds the run's process groups (a deep copy of a LightningModule that Fabric set
        up reaches its Fabric and so this plugin: an EMA made with ``copy.deepcopy(model)`` failed, "cannot
        pickle 'ProcessGroup' object"); copied like any object before."""
        return copy_or_share(self, memo, share=bool(self.grad_norm_groups) or self.tp_group is not None)

    @property
    def device_type(self) -> str:
        """Autocast's device type: the model's (the strategy's root device)."""
        return self.device.type

    @property
    def low_precision(self) -> bool:
        return self.compute_dtype in (torch.bfloat16, torch.float16)

    def check_trainable(self, named: Iterable[tuple[str, Tensor]]) -> None:
        """Refuse trainable fp16 parameters under ``"16-mixed"`` (a model the user already halved):
        mixed precision keeps fp32 weights (masters) and computes in fp16, and such a model has none, so
        its optimizer would update fp16 values with fp16 moments. AdamW's ``eps=1e-8`` is 0 there: a
        probe's first step wrote NaN and every later step was skipped as an overflow, so ``max_steps`` was
        never reached, silently. Lightning's ``"ddp"`` refuses it too, in the first step (torch's
        ``GradScaler`` will not unscale fp16 gradients). ``named``: the parameters to be trained (a fit's
        model, or Fabric's optimizers' parameters: a halved model only evaluated passes)."""
        if self.precision != "16-mixed":
            return
        half = [n for n, p in named if p.requires_grad and p.dtype == torch.float16]
        if half:
            raise ValueError(
                f"{len(half)} trainable parameter(s) are float16 under precision='16-mixed'"
                f" ({', '.join(half[:4])}{' ...' if len(half) > 4 else ''}): mixed precision trains fp32"
                " weights and computes in fp16 itself. Leave the model in fp32 (drop model.half() or"
                " .to(torch.float16); frozen parameters may stay fp16), or train in 16 bits throughout"
                " with precision='bf16-true'."
            )

    def engine_dtypes(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        """(compute, reduction) dtypes for the ZeRO engine: the compute dtype only where fp32 masters live
        in the shards (the engine casts the compute copy), the reduction dtype wherever gradients are low
        precision; None: the parameters' own."""
        if not self.low_precision:
            return None, None
        if self.uses_masters:
            return self.compute_dtype, self.reduce_dtype
        return None, (self.reduce_dtype if self.precision == "bf16-true" else None)

    def frozen_storage_dtype(self) -> torch.dtype | None:
        """The dtype frozen floating parameters are stored in (cast at setup; ZeRO-3's frozen shards), None
        to keep their own. Without masters the module's conversion decides (``"bf16-true"`` converts it
        all, mixed modes keep fp32), as in Lightning."""
        if not self.uses_masters:
            return None
        return self.compute_dtype if self.frozen_dtype == "compute" or self.precision == "bf16-true" else None

    @property
    def mixed(self) -> bool:
        """A mixed precision: the step's forward under autocast."""
        return self.precision in ("bf16-mixed", "16-mixed")

    @property
    def uses_masters(self) -> bool:
        """Low-precision parameters whose fp32 masters live in the ZeRO shards."""
        return self.low_precision and self.master_weights

    def configure(self, *, zero_stage: int, device: torch.device, evaluating: bool = False) -> None:
        """Resolve the stage-dependent defaults (see the module docstring) and take the strategy's root
        device (autocast's device type, and where the fp16 verdict is agreed); called by the strategy at
        setup, before ``convert_module``. ``evaluating``: a validate / test / predict run at stage 1 or 2,
        which builds no engine and so keeps no masters: the module is converted as at stage 0 (as
        Lightning's: ``"bf16-true"`` casts it; before, it stayed fp32 and met bf16 inputs)."""
        self.device = torch.device(device)
        if evaluating and zero_stage in (1, 2):
            self.master_weights = False
            return
        if self.requested_master_weights and zero_stage == 0 and self.low_precision:
            raise ValueError(
                f"ParallelPrecision({self.precision!r}, master_weights=True) keeps fp32 masters in ZeRO"
                " shards, which zero_stage=0 does not have: use zero_stage=1 (the same communication as"
                " stage 0, masters sharded 1/N), or master_weights=False."
            )
        requested = self.requested_master_weights
        self.master_weights = self.low_precision and (zero_stage > 0 if requested is None else requested)
        fp32_params = not self.master_weights and self.mixed
        if fp32_params and self.frozen_dtype == "compute":
            raise ValueError(
                f"ParallelPrecision({self.precision!r}, frozen_dtype='compute') stores frozen parameters in"
                " the compute dtype beside fp32 masters, which this run does not keep"
                f" (zero_stage={zero_stage}, master_weights={self.master_weights}): its parameters stay fp32"
                " under autocast and the option would do nothing. Use zero_stage >= 1 with masters, or"
                " frozen_dtype='auto'."
            )
        if fp32_params and self.reduce_dtype != torch.float32:
            raise ValueError(
                f"reduce_dtype={self.reduce_dtype} with fp32 parameters ({self.precision!r} without"
                " masters): gradients are fp32, reduce them in fp32."
            )

    # ------------------------------------------------------------------ module and inputs
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        # With masters the module stays fp32 here: the ZeRO engine takes the fp32 masters from it before
        # casting the compute copy, so masters start exact. Without, "bf16-true" parameters are bf16 now
        # and mixed modes keep fp32 parameters under autocast (which runs norms in fp32 by itself).
        if self.precision == "bf16-true" and not self.master_weights:
            module = module.to(self.compute_dtype)
        if self.precision == "64-true":
            module = module.double()
        if (
            self.low_precision
            and self.norms_in_fp32
            and (self.master_weights or self.precision == "bf16-true")
        ):
            for m in module.modules():
                if is_norm(m):
                    compute_in_fp32(m)
        if self.low_precision and self.master_weights:
            # not a choice: there a 16-bit weight meets fp32 tensors
            autocast_gaps_in_fp32(module, mixed=self.precision.endswith("mixed"))
        if self.precision == "bf16-true" and self.master_weights:
            cast_buffers(module, self.compute_dtype)  # as HalfPrecision's module.to(bf16) casts them
        return module

    @override
    def tensor_init_context(self) -> AbstractContextManager[None]:
        """``"64-true"``: tensors and modules created inside (``trainer.init_module()``,
        ``configure_model``) are float64, as under Lightning's ``DoublePrecision``."""
        return _default_dtype(torch.float64) if self.precision == "64-true" else nullcontext()

    @override
    def module_init_context(self) -> AbstractContextManager[None]:
        return self.tensor_init_context()

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        # with masters under autocast, a dtype clash that may be a 16-bit weight meeting an fp32 tensor
        # gets a note (module_dtypes); bf16-true casts the whole computation as "ddp" does
        notes = explained_dtype_errors(
            enabled=self.uses_masters and self.mixed, dtype=self.compute_dtype, precision=self.precision
        )
        with notes, self._dtypes():
            yield

    @contextmanager
    def _dtypes(self) -> Generator[None, None, None]:
        if self.mixed:
            # no weight-cast cache, as Lightning's MixedPrecision: a step that updates the weights and
            # runs forward again inside one training_step (manual optimization's inner loop, a GAN's two
            # optimizers) would reuse the casts of the weights before the update (before: 0.18 off "ddp")
            with torch.autocast(self.device_type, dtype=self.compute_dtype, cache_enabled=False):
                yield
        elif self.precision in ("bf16-true", "64-true"):
            # as Lightning's HalfPrecision / DoublePrecision: tensors the step creates (noise, masks,
            # positions) have the parameters' dtype; before, a GAN's torch.randn latent met bf16 weights
            # ("mat1 and mat2 must have the same dtype")
            with _default_dtype(self.compute_dtype):
                yield
        else:
            yield

    @override
    def convert_input(self, data: Any) -> Any:
        if self.precision not in ("bf16-true", "64-true"):
            return data
        return apply_to_collection(
            data, dtype=Tensor, function=lambda t: t.to(self.compute_dtype) if t.is_floating_point() else t
        )

    @override
    def convert_output(self, data: Any) -> Any:
        """Fabric's module wrapper hands the outputs back through this: under the 16-bit modes and
        ``"64-true"`` in the default dtype (fp32), as Fabric's own precision plugins do, so a loss
        computed on them outside the forward is fp32 too (before, ``"bf16-mixed"`` handed bf16 back)."""
        if self.precision == "32-true":
            return data
        default = torch.get_default_dtype()
        return apply_to_collection(
            data, dtype=Tensor, function=lambda t: t.to(default) if t.is_floating_point() else t
        )

    # ------------------------------------------------------------------ backward and step
    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale_loss(tensor)
        return super().pre_backward(tensor, module)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(default)
