"""The user's writes to the parameters of ZeRO stages 1/2 between updates, kept as under DDP.

:class:`ParamWrites` is a base of :class:`~lightning_par.zero.sharded_optimizer.ShardedOptimizer` and
declares the attributes it works on. The trainable parameters are views of the flat compute buffer
``param_flat``; the optimizer updates this rank's shard of it, or of separate fp32 masters
(``master_flat``) in mixed precision, and refreshes the buffer from them. Two kinds of write reach the
update (and the masters an export or checkpoint reads):

* in place (a clamp, an EMA, a projection after the step): :meth:`ParamWrites.absorb_param_writes`;
* by replacing ``.data`` with a tensor of the same shape (torch's ``prune.remove``, ``ModelPruning``'s
  lottery-ticket reset): :meth:`ParamWrites.take_back_replaced`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_par.zero.grad_sync import GradSync
from lightning_par.zero.layout import Fragment


class ParamWrites:
    """Writes to the parameters between updates (see the module docstring)."""

    sync: GradSync
    fragments: list[Fragment]
    master_flat: Tensor | None
    param_flat: Tensor
    _master_slots: list[tuple[Tensor, Tensor, int]]
    _views: list[Tensor]  # each parameter's place in param_flat
    _whole_views: list[Tensor] | None  # its place in the whole fp32 copy, inside whole_masters()
    _own: list[tuple[int, int, int, int, int]]
    _params_current: bool
    _left_whole: bool

    @torch.no_grad()
    def absorb_param_writes(self) -> None:
        """Writes to the compute parameters since the last refresh reach this rank's separate masters.

        Code that edits parameters in place between steps (WGAN's weight clipping, a projection after the
        step, an EMA of other weights into these) writes the low-precision compute copy, which the next
        refresh would overwrite from the masters: the write would be lost without a word. So before each
        update, and before the masters are read (checkpoints, exports), every element of this rank's
        slice whose compute value is no longer its master cast to the compute dtype takes the compute
        value: ``m_i := c_i if c_i != cast(m_i) else m_i``. Elements nobody wrote keep their fp32
        precision; a written one has the precision it was written in. Nothing is communicated (each rank
        owns its slice, and every rank ran the same write). A no-op when the parameters are the masters
        (fp32 training: writes land in them directly) or while the masters are ahead of the parameters
        (between an update and its refresh: the update's own pass took them). Replaced parameters are
        taken back first, so once per step."""
        if not self._params_current:
            return
        self.take_back_replaced()
        if self.master_flat is None:
            return
        for _, _, lo, hi, at in self._own:
            master, compute = self.master_flat[at : at + hi - lo], self.param_flat[lo:hi]
            torch.where(compute != master.to(compute.dtype), compute, master, out=master)

    @torch.no_grad()
    def take_back_replaced(self) -> None:
        """Parameters whose ``.data`` was replaced (``p.data = ...``: torch's ``prune.remove``,
        ``ModelPruning``'s lottery-ticket reset) point at their place in the flat buffer again, which takes
        their new values as a write in place would (this rank's masters exactly, the compute copy cast);
        before, the optimizer kept updating the buffer they no longer read, then refused. Every rank runs
        the same replacement, as under DDP; another shape is refused. A pointer test per parameter. Inside
        :meth:`whole_masters` the place is in its whole copy; after :meth:`leave_whole_masters` the
        parameters are the user's (nothing to take)."""
        if self._left_whole:
            return
        views = self._views if self._whole_views is None else self._whole_views
        replaced: dict[int, Tensor] = {}
        for i, (name, p, view) in enumerate(zip(self.sync.names, self.sync.params, views, strict=True)):
            new = point_back(p, view, name=name, stage="ZeRO 1/2")
            if new is not None:
                replaced[i] = new
        if replaced and self.master_flat is not None and self._whole_views is None:
            for f, (master, _, slot) in zip(self.fragments, self._master_slots, strict=True):
                if slot in replaced:
                    master.copy_(replaced[slot].reshape(-1)[f.param_lo : f.param_hi])


def point_back(param: Tensor, view: Tensor, *, name: str, stage: str) -> Tensor | None:
    """``param`` whose ``.data`` was pointed away from ``view``, its place in an engine buffer (ZeRO 1/2's
    flat buffer, a ZeRO-3 unit's gathered one): ``view`` takes the new values and ``param`` points there
    again; the replacing tensor is returned, None where nothing was replaced (a pointer test). Another
    shape is refused."""
    if param.data_ptr() == view.data_ptr() and param.shape == view.shape:  # no .data: a new tensor per call
        return None
    if param.shape != view.shape:
        raise RuntimeError(
            f"{stage}: parameter {name!r} was given another shape ({tuple(param.shape)}, laid out as"
            f" {tuple(view.shape)}) during training. A parameter keeps its shape in the strategy's buffers:"
            " change its values (in place, or p.data = a tensor of the same shape), or build the model with"
            " the new shape before the strategy's setup."
        )
    new = param.detach()
    view.copy_(new)
    param.data = view  # the Parameter object (and autograd hooks on it) stays the same
    return new
