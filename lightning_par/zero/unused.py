"""The unused-parameter verdict of an accumulation window, shared by the ZeRO engines (stages 0-3).

Each engine records, on the host, which parameters received a gradient in the window (a Python flag per
parameter set by its gradient hook: no device work). At the window's end:

* ``find_unused_parameters=False`` (the default, as in DDP): the verdict is local and costs nothing —
  no collective and no host synchronisation. A parameter without a gradient on this rank raises
  :class:`UnusedParametersError` on this rank, naming it. A parameter unused by the model is unused on
  every rank, so every rank raises the same error; a data-dependent miss on some ranks only raises on
  those (where DDP would hang in its next reduction).
* ``find_unused_parameters=True``: one small all-reduce of per-parameter "missing" counts over the
  data-parallel group, read on the host once per window (this is the one host synchronisation the flag
  costs), so that every rank agrees which parameters no rank used: they keep ``grad=None`` and get no
  optimizer update, while partially used ones are averaged with zeros.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


class UnusedParametersError(RuntimeError):
    """Some parameters received no gradient in an accumulation window."""


class MissingGradients:
    """Started when a window's reductions are launched, finished after they complete (so the count's
    all-reduce overlaps them); :meth:`finish` returns the indices of parameters that no rank used."""

    def __init__(
        self,
        touched: Sequence[bool],
        *,
        names: Sequence[str],
        group: ProcessGroup,
        device: torch.device,
        find_unused_parameters: bool,
        params: Sequence[Tensor] = (),
    ) -> None:
        self._names = list(names)
        self._params = params  # read only to word the error (which of the missing ones are frozen now)
        self._missing = [i for i, t in enumerate(touched) if not t]
        self._find_unused = find_unused_parameters
        self._world = dist.get_world_size(group)
        self._counts: Tensor | None = None
        self._work = None
        if find_unused_parameters and self._world > 1:  # every rank joins, missing something or not
            # built on the communication device: NCCL refuses CPU tensors
            counts = torch.zeros(len(touched), dtype=torch.int32, device=device)
            if self._missing:
                index = torch.tensor(self._missing, dtype=torch.int64)
                if device.type == "cuda":  # from pinned memory the copy is asynchronous: no host wait
                    index = index.pin_memory()
                counts.index_fill_(0, index.to(device, non_blocking=True), 1)
            self._counts = counts
            self._work = dist.all_reduce(counts, group=group, async_op=True)

    def finish(self) -> frozenset[int]:
        """Wait for the count (if any) and return the parameters no rank used; raise
        :class:`UnusedParametersError` when gradients are missing and ``find_unused_parameters=False``."""
        if not self._find_unused:
            if self._missing:
                names = [self._names[i] for i in self._missing]
                frozen = [i for i in self._missing if self._params and not self._params[i].requires_grad]
                if len(frozen) == len(self._missing):
                    raise UnusedParametersError(
                        f"{len(names)} parameter(s) got no gradient in this step: {names[:8]}"
                        f"{' ...' if len(names) > 8 else ''}. They are frozen (requires_grad=False) now but"
                        " were trainable at the strategy's setup (frozen during the fit, or by"
                        " toggle_optimizer), and the gradient reduction covers the parameters trainable then."
                        " Pass find_unused_parameters=True to the strategy (as Lightning's 'ddp' needs"
                        " 'ddp_find_unused_parameters_true' here), or, for a freeze that lasts, freeze them"
                        " before the fit."
                    )
                raise UnusedParametersError(
                    f"{len(names)} parameter(s) got no gradient on this data-parallel rank in this step:"
                    f" {names[:8]}{' ...' if len(names) > 8 else ''}. If that is intended, pass"
                    " find_unused_parameters=True to the strategy; otherwise use them in the loss or freeze"
                    " them (requires_grad=False) before training."
                )
            return frozenset()
        if self._counts is None:  # one rank: missing here means missing everywhere
            return frozenset(self._missing)
        assert self._work is not None
        self._work.wait()
        counts = self._counts.tolist()  # the flag's one host read per window
        return frozenset(i for i, c in enumerate(counts) if c == self._world)
