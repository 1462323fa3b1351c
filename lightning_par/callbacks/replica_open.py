"""Opening the peer replicas of a flash store (:mod:`.replica`): the node map gathered from every rank,
the number of replicas the job's nodes allow, and the replicas' own Gloo group, so that their traffic
never meets training's collectives.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch.distributed as dist

from lightning_par.callbacks import _dist
from lightning_par.callbacks.replica import Replicator

log = logging.getLogger(__name__)


def open_replicator(
    *,
    root: Path,
    owner: str,
    node: int,
    rank: int,
    world_size: int,
    replicas: int,
    slots: int,
    timeout_s: float,
) -> Replicator | None:
    """The peer replicas of this rank (collective: every rank calls it). Fewer other nodes than
    ``replicas`` (a misconfiguration, or an elastic job that lost nodes) get what there is, with a warning
    naming ``owner``: failing would stop the survivors. None when no other node exists."""
    node_of = _dist.gather_objects(node)
    nodes = len(set(node_of))
    kept = min(replicas, nodes - 1)
    if kept < replicas:
        message = (
            f"{owner}: replicas={replicas} needs {replicas + 1} nodes (each copy goes to another node), but"
            f" the job runs on {nodes}; keeping {kept} replica(s). Pass replicas <= {nodes - 1} to silence"
            " this."
        )
        log.warning(message)
        warnings.warn(message, stacklevel=3)
    if kept == 0:
        return None
    return Replicator(
        root=root,
        rank=rank,
        world_size=world_size,
        node_of=node_of,
        replicas=kept,
        slots=slots,
        group=dist.new_group(backend="gloo"),  # replica traffic never meets training's
        timeout_s=timeout_s,
    )
