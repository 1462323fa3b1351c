"""Run a function on N Gloo ranks and collect what each returns.

Processes are forked (tens of milliseconds, against 1-2 s for spawn), get one torch thread each, join a
Gloo group through a file store, and send back either their result or their traceback. Group several
checks into one function so a test module pays for few launches.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    store_path: str,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    queue: Any,
    init_group: bool,
) -> None:
    # torchrun-like environment, so code under test (Lightning included) sees externally created processes
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        GROUP_RANK="0",
    )
    torch.set_num_threads(1)
    try:
        if init_group:
            dist.init_process_group(
                "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size
            )
        result = fn(rank, world_size, *args)
        # plain bytes: tensors pickled through multiprocessing would live in shared memory owned by this
        # process, which is gone by the time the parent unpickles them
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    init_group: bool = True,
) -> list[T]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked ranks; return results by rank.

    With ``init_group=False`` the ranks only get torchrun-style environment variables (for code such as
    Lightning's strategies that initialises the group itself).
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        port = free_port()
        procs = [
            ctx.Process(
                target=_worker, args=(r, world_size, store, port, fn, args, queue, init_group), daemon=False
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: list[str] = []
        try:
            for _ in range(world_size):
                rank, ok, payload = queue.get(timeout=timeout)
                if ok:
                    results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
                else:
                    errors.append(f"--- rank {rank} ---\n{payload}")
                    break  # the other ranks are probably stuck in a collective
        except Exception as exc:  # queue.Empty on timeout
            errors.append(f"timed out after {timeout}s waiting for ranks ({exc!r})")
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
    if errors:
        raise AssertionError("distributed run failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
