"""A fresh store for every launch attempt: a restarted job never reads the keys of the attempt it replaces.

Why: torchrun hands its workers the agent's own ``TCPStore`` (``TORCHELASTIC_USE_AGENT_STORE=True``; always
with the static rendezvous, by default with c10d), and that store lives as long as the agent. The workers
of a restarted attempt initialise their process group under the same key names as the dead attempt did,
so they read its leftovers: Gloo dials the dead peers' addresses (``connectFullMesh failed ... Connection
refused``), NCCL takes a stale unique id, store barriers count the old arrivals. torch's answer is a
launcher variable (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) users do not know, and it does not cover the
static rendezvous.

How (:func:`attempt_store`): the attempt's global rank 0 starts a new ``TCPStore`` server on a free port,
writes a random nonce into it, and publishes ``(host, port, nonce)`` in the agent store under one key.
Every other rank reads that key and connects. A value left there by an earlier attempt points to a dead
server (the connection is refused) or to a live store holding another nonce, so the rank reads the key
again until the published nonce answers it, or the timeout passes. Only the publication key of the agent
store is ever read; the process group runs on the fresh store, whose keys are all of this attempt.

Both our strategies pass this store to ``init_process_group``; :class:`RestartSafeEnvironment` gives
Lightning's own strategies (``"ddp"``, ``"fsdp"``, ...) the same, as a cluster-environment plugin.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import time
import uuid
from datetime import timedelta

import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment, TorchElasticEnvironment
from typing_extensions import override

_KEY = "lightning_par/attempt_store"
_NONCE = "lightning_par/nonce"
_PROBE_S = 1.0  # a stale address fails within this; then the key is read again
_inits = itertools.count()  # stores made by this process: every rank of an attempt makes the same number


def agent_store_shared() -> bool:
    """True when the launcher (torchrun) hands the workers its own long-lived store."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def attempt_store(
    *, host: str, agent_port: int, rank: int, world_size: int, timeout: timedelta, generation: int
) -> dist.TCPStore:
    """The store of this attempt (see the module docstring): rank 0 hosts it, the others find it through
    the agent store at ``host:agent_port`` (the node of global rank 0). ``generation`` counts the stores
    this process made before (the same on every rank of an attempt), so a process group initialised
    again never finds the previous one's live store. Collective over the attempt's ranks; raises
    ``TimeoutError`` naming the key if rank 0's store does not answer within ``timeout``."""
    agent = dist.TCPStore(host, agent_port, world_size, is_master=False, timeout=timeout)
    key = f"{_KEY}/{generation}"
    if rank == 0:
        fresh = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        nonce = uuid.uuid4().hex
        fresh.set(_NONCE, nonce)
        agent.set(key, json.dumps({"host": host, "port": fresh.port, "nonce": nonce}))
        return fresh
    deadline = time.monotonic() + timeout.total_seconds()
    last = ""
    while True:
        published = json.loads(agent.get(key))  # blocks until rank 0 of some attempt has written it
        try:
            # a plain socket first: a dead attempt's port refuses at once, without torch's logged trace
            socket.create_connection((published["host"], published["port"]), timeout=_PROBE_S).close()
            probe = dist.TCPStore(
                published["host"],
                published["port"],
                world_size,
                is_master=False,
                timeout=timedelta(seconds=_PROBE_S),
                wait_for_workers=False,
            )
            if probe.get(_NONCE).decode() == published["nonce"]:
                probe.set_timeout(timeout)
                return probe
            last = "a store of another attempt answered"
        except (OSError, RuntimeError) as exc:  # refused, or no nonce within the probe time
            last = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank {rank}: the store of this attempt, published by rank 0 under {key!r} in the"
                f" launcher's store at {host}:{agent_port}, did not answer within {timeout} ({last})."
                " Check that rank 0 started and that its host accepts connections on free ports."
            )
        time.sleep(0.1)


def launch_store(
    environment: ClusterEnvironment, *, timeout: timedelta, agent_port: int | None = None
) -> dist.TCPStore | None:
    """The store our strategies pass to ``init_process_group``: :func:`attempt_store` under torchrun's
    shared store, None (the launcher's own rendezvous is fresh per attempt) otherwise. Call it before
    Lightning's ``_init_dist_connection``, which points ``MASTER_PORT`` elsewhere; ``agent_port``
    defaults to the environment's ``main_port``."""
    if not agent_store_shared():
        return None
    return attempt_store(
        host=environment.main_address,
        agent_port=environment.main_port if agent_port is None else agent_port,
        rank=environment.global_rank(),
        world_size=environment.world_size(),
        timeout=timeout,
        generation=next(_inits),
    )


class RestartSafeEnvironment(TorchElasticEnvironment):
    """torchrun's environment with a fresh store per attempt, for Lightning's own strategies:
    ``Trainer(strategy="ddp", plugins=[RestartSafeEnvironment()])`` restarts without launcher variables
    (our ``HybridParallelStrategy`` does this by itself). Outside torchrun's shared store it changes
    nothing.

    It works through the address Lightning initialises from: on first use of :attr:`main_port`, the
    attempt's store is made (:func:`attempt_store`, reaching the agent's store at the port torchrun
    published, read when this object is made) and its port returned; ``init_process_group`` then connects
    there as a client, as it would to the agent's store.
    """

    def __init__(self, *, timeout: timedelta = timedelta(minutes=30)) -> None:
        super().__init__()
        self._agent_port = int(os.environ.get("MASTER_PORT", "0"))  # Lightning overwrites it at init
        self._timeout = timeout
        self._store: dist.TCPStore | None = None  # rank 0 hosts it: held as long as the environment

    @property
    @override
    def main_port(self) -> int:
        if not agent_store_shared():
            return super().main_port
        if self._store is None:
            self._store = launch_store(self, timeout=self._timeout, agent_port=self._agent_port)
            assert self._store is not None
        return int(self._store.port)
