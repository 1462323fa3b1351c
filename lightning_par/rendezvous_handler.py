"""torchrun's c10d rendezvous with node replacement fixed, as the rendezvous backend ``lightning_par``:

    torchrun --nnodes=1:2 --rdzv-backend=lightning_par --rdzv-endpoint=HOST:PORT --rdzv-id=JOB ... train.py

Why: with torch's shared agent store (its default), the address of that store is published only in the
rendezvous round in which it is made. A node that joins a later round (a replacement, or a node that came
back) waits for it under that round's keys, which the node hosting the store never writes again: the
join hangs until the rendezvous timeout (torch 2.13: ``wait timeout ... torchelastic/role_info``). And a
node keeps the address it learnt in its first round even when another node becomes rank 0 later and
makes a store of its own: the nodes then hand their workers different stores, and the workers wait for
each other forever. Ranks follow the sorted node descriptors (address, agent pid), so this strikes
whenever a replacement node sorts first, e.g. when its agent's pid wrapped around.

This handler is torch's own (``c10d`` backend, every ``--rdzv-conf`` option), with one contract added:
after each round every node hands its workers the store of that round's rank 0. The node of rank 0
writes its store's address under the round's keys again; every other node reads it from there instead
of trusting the address it learnt before. Registered through the ``torchrun.handlers`` entry point of
this package; restarts of a node's own workers need nothing of this (see
:mod:`lightning_par.rendezvous`).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo


class RepublishingHandler(RendezvousHandler):
    """Delegates to torch's handler ``inner``; :meth:`next_rendezvous` makes every node of a round use the
    shared store of the round's rank 0 (see the module docstring)."""

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
        if not self._inner.use_agent_store or address is None:
            return info
        if info.rank == 0:
            info.store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, address.master_addr)
            info.store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(address.master_port))
            return info
        # blocks until rank 0 has written them (within the rendezvous's own store timeout)
        addr = info.store.get(RendezvousStoreInfo.MASTER_ADDR_KEY).decode()
        port = int(info.store.get(RendezvousStoreInfo.MASTER_PORT_KEY).decode())
        if (addr, port) == (address.master_addr, address.master_port):
            return info
        return RendezvousInfo(info.store, info.rank, info.world_size, RendezvousStoreInfo(addr, port))

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
