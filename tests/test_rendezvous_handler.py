"""The ``lightning_par`` rendezvous backend hands every node the shared store of the round's rank 0, also
when rank 0 moved to another node since the store address was first learnt (no processes: a fake inner
handler and an in-memory round store)."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousInfo
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

from lightning_par.rendezvous_handler import RepublishingHandler

ADDR, PORT = RendezvousStoreInfo.MASTER_ADDR_KEY, RendezvousStoreInfo.MASTER_PORT_KEY


class FakeInner:
    """torch's handler as it behaves: the address it returns is the one it learnt in its first round."""

    use_agent_store = True

    def __init__(self, store: dist.Store, rank: int, learnt: RendezvousStoreInfo | None) -> None:
        self.store, self.rank, self.learnt = store, rank, learnt

    def next_rendezvous(self) -> RendezvousInfo:
        return RendezvousInfo(self.store, self.rank, 2, self.learnt)  # type: ignore[arg-type]


def test_a_node_that_is_no_longer_rank_0_uses_the_new_rank_0s_store() -> None:
    round_store = dist.HashStore()
    # B2, a replacement, is rank 0 of this round and made a store of its own; A learnt its own store
    # (as rank 0 of the first round) and is rank 1 now
    b2 = RepublishingHandler(FakeInner(round_store, 0, RendezvousStoreInfo("10.0.0.2", 4000)))  # type: ignore[arg-type]
    a = RepublishingHandler(FakeInner(round_store, 1, RendezvousStoreInfo("10.0.0.1", 3000)))  # type: ignore[arg-type]
    assert b2.next_rendezvous().bootstrap_store_info.master_port == 4000
    assert round_store.get(ADDR) == b"10.0.0.2" and round_store.get(PORT) == b"4000"
    info = a.next_rendezvous()
    assert (info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port) == (
        "10.0.0.2",
        4000,
    )
    assert (info.rank, info.world_size, info.store) == (1, 2, round_store)


def test_unchanged_rank_0_and_an_unshared_store_pass_through() -> None:
    round_store = dist.HashStore()
    same = RendezvousStoreInfo("10.0.0.1", 3000)
    RepublishingHandler(FakeInner(round_store, 0, same)).next_rendezvous()  # type: ignore[arg-type]
    inner = FakeInner(round_store, 1, same)
    first = inner.next_rendezvous()
    assert RepublishingHandler(inner).next_rendezvous().bootstrap_store_info is first.bootstrap_store_info  # type: ignore[arg-type]
    # a node without the shared store reads nothing from the round store (an empty one here)
    alone = RepublishingHandler(FakeInner(dist.HashStore(), 1, same))  # type: ignore[arg-type]
    alone._inner.use_agent_store = False
    assert alone.next_rendezvous().bootstrap_store_info is same
