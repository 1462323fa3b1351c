"""torchrun's c10d rendezvous with node replacement fixed, as the rendezvous backend ``lightning_par``:

    torchrun --nnodes=1:2 --rdzv-backend=lightning_par --rdzv-endpoint=HOST:PORT --rdzv-id=JOB ... train.py

Why: with torch's shared agent store (its default), the address of that store is published only in the
rendezvous round in which it is made. A node that joins a later round (a replacement, or a node that came
back) waits for it under that round's keys, which the node hosting the store never writes again: the
join hangs until the rendezvous timeout (torch 2.13: ``wait timeout ... torchelastic/role_info``). This
handler is torch's own (``c10d`` backend, every ``--rdzv-conf`` option), and after each round the node of
rank 0 writes the store's address under the round's keys again. Registered through the
``torchrun.handlers`` entry point of this package; restarts of a node's own workers need nothing of this
(see :mod:`lightning_par.rendezvous`).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo


class RepublishingHandler(RendezvousHandler):
    """Delegates to torch's handler ``inner``; :meth:`next_rendezvous` re-publishes the shared store's
    address in every round (see the module docstring)."""

    def __init__(self, inner: RendezvousHandler) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:  # what the agent reads beyond the protocol (settings, ...)
        return getattr(self._inner, name)

    def get_backend(self) -> str:
        return "lightning_par"

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._inner.next_rendezvous()
        address = info.bootstrap_store_info
        if info.rank == 0 and self._inner.use_agent_store and address is not None:
            info.store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, address.master_addr)
            info.store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(address.master_port))
        return info

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


def create(params: RendezvousParameters) -> RendezvousHandler:
    """torch's c10d handler for ``params``, re-publishing (the ``lightning_par`` backend)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    backend, store = create_backend(params)
    return RepublishingHandler(create_handler(store, backend, params))


def handler_creator() -> Any:
    """The ``torchrun.handlers`` entry point: torchrun calls it for the creator it registers."""
    return create
