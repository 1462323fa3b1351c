"""PowerSGD for our flat gradient buckets: rank-``r`` gradient compression with error feedback.

The math (Vogels et al., 2019), per gradient matrix ``G_k`` of rank ``k`` (a parameter of shape
``(n, ...)`` viewed as ``n x m``), with ``E_k`` the rank's error-feedback residual and ``Q`` a warm-started
``m x r`` matrix shared by all ranks::

    M_k = G_k + E_k
    P   = orth( Σ_k M_k Q )            # one all-reduce of every P of the bucket
    Q   = (1/N) Σ_k M_k^T P            # one all-reduce of every Q of the bucket; kept for the next step
    G   = P Q^T                         # what every rank hands to the optimizer
    E_k = M_k - G

``P`` and ``Q`` depend on the ranks' ``M_k`` only through their mean ``M̄ = Ḡ + Ē``, and so does the
update: the trajectory of the weights is a function of the mean residual ``Ē`` alone. That is what makes
the state portable: a checkpoint stores ``Ē`` (one all-reduce at save time), and any data-parallel size
resumes by giving every rank ``E_k = Ē`` (exact in real arithmetic; equal to round-off in floats).

Per bucket: matrices where compression saves at least ``min_compression_rate`` x the bytes are compressed
(``r (n + m) <= n m / rate``); vectors, small matrices and embedding tables (row-sparse gradients, see
``compress_embeddings``) are all-reduced uncompressed, packed into one tensor. A bucket under
``min_bucket_numel`` elements is all-reduced whole, and so is every bucket during the first
``start_iter`` optimizer steps (no residual is kept then). The P all-reduce is started when the hook
runs (overlapping the rest of backward); the rest runs when the engine collects the bucket.

Use through ``HybridParallelStrategy(comm_hook="powersgd", powersgd_rank=r)`` (a mapping in
``comm_hook_state`` sets the other fields), or ``comm_hook=powersgd_hook,
comm_hook_state=PowerSGDState(...)`` on :func:`lightning_par.zero.engine.apply_zero`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_par.zero.comm_hooks import CommHookBucket, check_powersgd_fields


@dataclass
class _Matrix:
    """One compressed gradient matrix of a bucket: its ``n x m`` view and its P and Q views."""

    param: nn.Parameter
    grad: Tensor  # n x m view of the bucket
    p: Tensor  # n x r view of the bucket's flat P
    q: Tensor  # m x r view of the bucket's flat Q


@dataclass
class _Plan:
    """How one bucket (identified by its parameters) is compressed."""

    key: tuple[int, ...]  # the buffer's address and the parameters' ids
    matrices: list[_Matrix]
    plain: list[Tensor]  # gradients sent uncompressed
    p_flat: Tensor
    q_flat: Tensor


class _Pending:
    """The engine's handle on a compressed bucket in flight: ``wait()`` finishes it and returns the
    averaged, decompressed bucket (the engine only calls ``wait``)."""

    def __init__(
        self, state: PowerSGDState, plan: _Plan, buffer: Tensor, works: list[Any], packed: Tensor | None
    ) -> None:
        self._state, self._plan, self._buffer, self._works, self._packed = state, plan, buffer, works, packed

    def wait(self) -> Tensor:
        return self._state._finish(self._plan, self._buffer, self._works, self._packed)


class _Done:
    def __init__(self, work: Any, buffer: Tensor) -> None:
        self._work, self._buffer = work, buffer

    def wait(self) -> Tensor:
        self._work.wait()
        return self._buffer


class PowerSGDState:
    """PowerSGD's settings and state over ``group`` (see the module docstring).

    Args:
        group: the data-parallel process group.
        rank: the approximation rank ``r`` (>= 1).
        start_iter: optimizer steps reduced uncompressed before compression starts (torch's
            ``start_powerSGD_iter``); the iteration count advances once per step.
        min_compression_rate: compress a matrix only if this saves at least that factor of its bytes.
        min_bucket_numel: buckets smaller than this are all-reduced uncompressed.
        error_feedback: keep the residual ``E_k`` (needed for convergence; off only for experiments).
        warm_start: reuse the previous step's ``Q`` (one power iteration per step converges over steps).
        seed: seed of the initial random ``Q`` (the same on every rank).
        compress_embeddings: also compress the weights of ``nn.Embedding`` modules (see :meth:`bind`).
            Off by default: an embedding's gradient has a row per token, non-zero only for the tokens of
            the batch, and a rank-``r`` approximation spreads it over every row (measured: +2.6% loss on
            the benchmark GPT with them compressed, +0.8-1.3% without).
    """

    def __init__(
        self,
        *,
        group: ProcessGroup,
        rank: int = 1,
        start_iter: int = 10,
        min_compression_rate: float = 2.0,
        min_bucket_numel: int = 0,
        error_feedback: bool = True,
        warm_start: bool = True,
        seed: int = 0,
        compress_embeddings: bool = False,
    ) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
            raise ValueError(f"powersgd_rank must be a positive integer, got {rank!r}.")
        check_powersgd_fields(
            {
                "start_iter": start_iter,
                "min_compression_rate": min_compression_rate,
                "min_bucket_numel": min_bucket_numel,
                "seed": seed,
                "error_feedback": error_feedback,
                "warm_start": warm_start,
                "compress_embeddings": compress_embeddings,
            }
        )
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = rank
        self.start_iter = start_iter
        self.min_compression_rate = float(min_compression_rate)
        self.min_bucket_numel = int(min_bucket_numel)
        self.error_feedback = error_feedback
        self.warm_start = warm_start
        self.seed = seed
        self.compress_embeddings = compress_embeddings
        self._uncompressed: set[int] = set()  # ids of parameters always sent uncompressed (bind)
        self.iteration = 0
        self._plans: dict[int, _Plan] = {}
        self._error: dict[nn.Parameter, Tensor] = {}
        self._q: dict[nn.Parameter, Tensor] = {}  # the last Q of each matrix (views of a plan's q_flat)
        self._random = torch.Generator().manual_seed(seed)
        self._device_random: dict[torch.device, torch.Generator] = {}  # see _redraw
        self._device_resume: dict[str, Tensor] = {}  # a checkpoint's device generator states, by type

    # ------------------------------------------------------------------ plan
    def bind(self, module: nn.Module) -> None:
        """Learn from the model which parameters to leave uncompressed: the weights of its
        ``nn.Embedding`` modules, unless ``compress_embeddings`` (the engine calls this once)."""
        if not self.compress_embeddings:
            self._uncompressed |= {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}

    def _compressible(self, param: nn.Parameter, grad: Tensor) -> bool:
        if grad.dim() < 2 or id(param) in self._uncompressed:
            return False
        n = grad.shape[0]
        m = grad.numel() // n
        return self.rank * (n + m) * self.min_compression_rate <= n * m

    def _plan(self, bucket: CommHookBucket) -> _Plan:
        params = bucket.parameters()
        # the plan holds views of the bucket's buffer: a rebuilt layout (new buffer) gets a new plan
        key = (bucket.buffer().data_ptr(), *(id(p) for p in params))
        plan = self._plans.get(bucket.index())
        if plan is not None and plan.key == key:
            return plan
        grads = bucket.gradients()
        chosen = [(p, g) for p, g in zip(params, grads, strict=True) if self._compressible(p, g)]
        plain = [g for p, g in zip(params, grads, strict=True) if not self._compressible(p, g)]
        buffer = bucket.buffer()
        r = self.rank
        shapes = [(g.shape[0], g.numel() // g.shape[0]) for _, g in chosen]
        p_flat = torch.empty(sum(n * r for n, _ in shapes), dtype=buffer.dtype, device=buffer.device)
        q_flat = torch.empty(sum(m * r for _, m in shapes), dtype=buffer.dtype, device=buffer.device)
        matrices, po, qo = [], 0, 0
        for (param, grad), (n, m) in zip(chosen, shapes, strict=True):
            q = q_flat[qo : qo + m * r].view(m, r)
            old = self._q.get(param)
            if old is not None and old.shape == q.shape:
                q.copy_(old)  # a relayout keeps the warm start
            else:
                # drawn on the host from one seeded generator, so every rank starts from the same Q
                q.copy_(torch.randn(m, r, generator=self._random, dtype=torch.float32))
            self._q[param] = q
            matrices.append(_Matrix(param, grad.view(n, m), p_flat[po : po + n * r].view(n, r), q))
            po, qo = po + n * r, qo + m * r
        plan = _Plan(key=key, matrices=matrices, plain=plain, p_flat=p_flat, q_flat=q_flat)
        self._plans[bucket.index()] = plan
        return plan

    def _residual(self, m: _Matrix) -> Tensor:
        """``E_k`` of a matrix, in the bucket's dtype and device (zero the first time)."""
        error = self._error.get(m.param)
        if error is None or error.numel() != m.grad.numel():
            error = torch.zeros_like(m.grad)
        elif error.dtype != m.grad.dtype or error.device != m.grad.device or error.shape != m.grad.shape:
            error = error.to(m.grad).view_as(m.grad)  # restored from a checkpoint
        self._error[m.param] = error
        return error

    # ------------------------------------------------------------------ the hook
    def start(self, bucket: CommHookBucket) -> Any:
        """Begin reducing ``bucket``; returns a handle whose ``wait()`` gives the averaged bucket."""
        buffer = bucket.buffer()
        compressing = self.iteration >= self.start_iter and buffer.numel() >= self.min_bucket_numel
        if bucket.is_last():
            self.iteration += 1
        if compressing:
            plan = self._plan(bucket)
            if plan.matrices:
                return self._start_compressed(plan, buffer)
        work = dist.all_reduce(buffer, op=dist.ReduceOp.AVG, group=self.group, async_op=True)
        return _Done(work, buffer)

    @torch.no_grad()
    def _start_compressed(self, plan: _Plan, buffer: Tensor) -> _Pending:
        works = []
        packed = torch.cat([g.reshape(-1) for g in plan.plain]) if plan.plain else None
        if packed is not None:
            works.append(dist.all_reduce(packed, op=dist.ReduceOp.AVG, group=self.group, async_op=True))
        if not self.warm_start:
            for m in plan.matrices:
                self._redraw(m.q)
        for m in plan.matrices:
            matrix = m.grad
            if self.error_feedback:
                matrix = self._residual(m).add_(m.grad)  # M_k = G_k + E_k, kept in the residual's memory
            torch.mm(matrix, m.q, out=m.p)
        works.append(dist.all_reduce(plan.p_flat, group=self.group, async_op=True))
        return _Pending(self, plan, buffer, works, packed)

    @torch.no_grad()
    def _finish(self, plan: _Plan, buffer: Tensor, works: list[Any], packed: Tensor | None) -> Tensor:
        for work in works:
            work.wait()
        matrices = [self._error[m.param] if self.error_feedback else m.grad for m in plan.matrices]
        for m, matrix in zip(plan.matrices, matrices, strict=True):
            # P's column space is all that matters: an orthonormal basis of it (QR in fp32)
            m.p.copy_(torch.linalg.qr(m.p.float(), mode="reduced").Q)
            torch.mm(matrix.t(), m.p, out=m.q)
        dist.all_reduce(plan.q_flat, group=self.group)
        plan.q_flat.div_(self.world)
        for m, matrix in zip(plan.matrices, matrices, strict=True):
            torch.mm(m.p, m.q.t(), out=m.grad)  # the average every rank applies
            if self.error_feedback:
                matrix.sub_(m.grad)  # E_k = M_k - P Q^T
        if packed is not None:
            offset = 0
            for g in plan.plain:
                g.copy_(packed[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        return buffer

    @torch.no_grad()
    def step_skipped(self) -> None:
        """A step the fp16 loss scaler skipped (a non-finite gradient on some rank): that gradient went into
        every rank's residuals and warm-started ``Q`` (through the all-reduces), so every later ``M = G + E``
        would be non-finite too and every step skipped, silently (a probe: one overflow on one rank froze a
        Llama for good). Both restart: ``E`` at zero, ``Q`` drawn again from the seeded generator (in step
        on every rank), and the skipped step does not count."""
        for error in self._error.values():
            error.zero_()
        for q in self._q.values():
            self._redraw(q)
        self.iteration = max(0, self.iteration - 1)

    def _redraw(self, q: Tensor) -> None:
        """Fill ``q`` with fresh N(0, 1) values, the same on every rank (the ranks draw in step, from
        generators seeded alike): on the CPU from the seeded host generator, as torch's hook draws; on a
        GPU from a device generator, since a host draw copied in would wait for the device once per matrix
        and step."""
        if q.device.type == "cpu":
            q.copy_(torch.randn(q.shape, generator=self._random, dtype=torch.float32))
            return
        if q.device not in self._device_random:
            generator = torch.Generator(device=q.device).manual_seed(self.seed)
            resumed = self._device_resume.get(q.device.type)
            if resumed is not None:
                generator.set_state(resumed)
            self._device_random[q.device] = generator
        q.normal_(generator=self._device_random[q.device])

    # ------------------------------------------------------------------ state
    def state_dict(self, names: Mapping[nn.Parameter, str], *, average: bool = False) -> dict[str, Any]:
        """The state by parameter name: ``iteration``, ``rank``, ``q`` (shared by all ranks),
        ``error`` (this rank's residuals, or with ``average=True`` their mean over the group: one
        all-reduce, collective; what any data-parallel size resumes from) and ``random``, the states of
        the generators that draw ``Q`` (alike on every rank), so that a resumed run without
        ``warm_start`` draws what the uninterrupted one would have. Live tensors unless averaged."""
        error = {names[p]: e for p, e in self._error.items() if p in names}
        if average and self.world > 1 and error:
            flat = torch.cat([e.reshape(-1) for e in error.values()])
            dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self.group)
            offset, averaged = 0, {}
            for name, e in error.items():
                averaged[name] = flat[offset : offset + e.numel()].view_as(e)
                offset += e.numel()
            error = averaged
        return {
            "kind": "powersgd",
            "iteration": self.iteration,
            "rank": self.rank,
            "q": {names[p]: q for p, q in self._q.items() if p in names},
            "error": error,
            "random": {
                "host": self._random.get_state(),
                **{device.type: g.get_state() for device, g in self._device_random.items()},
            },
        }

    def load_state_dict(self, state: Mapping[str, Any], params: Mapping[str, nn.Parameter]) -> None:
        """Restore :meth:`state_dict`'s output (same or other data-parallel size). Residuals of unknown
        names or other shapes are dropped with a warning; a ``Q`` of another rank restarts at random."""
        if state.get("kind") != "powersgd":
            raise ValueError(f"Not a PowerSGD state: kind {state.get('kind')!r}.")
        self.iteration = int(state["iteration"])
        random = dict(state.get("random", {}))
        if "host" in random:
            self._random.set_state(random.pop("host"))
        else:  # a checkpoint of an older version: Q is drawn from the seed again
            self._random.manual_seed(self.seed)
            if not self.warm_start:
                warnings.warn(
                    "PowerSGD: the checkpoint holds no state of the generators that draw Q (written by an"
                    " older version): with warm_start=False the resumed run draws Q from the seed again,"
                    " so it does not continue exactly as the interrupted one would have.",
                    stacklevel=2,
                )
        self._device_resume = random
        self._device_random = {}
        self._plans = {}  # rebuilt, warm-starting from the restored Q, at the next compressed step
        dropped = []
        self._error, self._q = {}, {}
        for name, error in state["error"].items():
            param = params.get(name)
            if param is None or error.shape[0] != param.shape[0] or error.numel() != param.numel():
                dropped.append(name)
                continue
            self._error[param] = error.detach().to(param.device).clone()
        if dropped:
            warnings.warn(
                f"PowerSGD: the saved residuals of {dropped[:5]} do not fit the model; they start at zero.",
                stacklevel=2,
            )
        if int(state["rank"]) != self.rank:
            warnings.warn(
                f"PowerSGD: the checkpoint used rank {state['rank']}, this run {self.rank}: Q restarts at"
                " random (the residuals are kept).",
                stacklevel=2,
            )
            return
        for name, q in state["q"].items():
            param = params.get(name)
            if param is not None:
                self._q[param] = q.detach().to(param.device).clone()


def powersgd_hook(state: PowerSGDState, bucket: CommHookBucket) -> Any:
    """``hook(state, bucket)`` for our engine (see the module docstring): starts the bucket's reduction
    and returns a handle whose ``wait()`` yields the averaged gradient."""
    return state.start(bucket)


__all__ = ["PowerSGDState", "powersgd_hook"]
