"""A torchrun job whose attempt 0 loses rank 1 right after the process group formed (see
``tests/test_rendezvous.py``): ``python -m torch.distributed.run ... tests/restart_job.py OUT KIND``.

``KIND`` is ``"ours"`` (our Fabric strategy) or ``"env"`` (Lightning's DDP with
``RestartSafeEnvironment``). Every attempt all-reduces its rank + 1 and writes ``OUT/attempt{a}_rank{r}``
with the sum; attempt 0's rank 1 then SIGKILLs itself, its rank 0 waits to be stopped by the agent.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from lightning_par.fabric import HybridParallelStrategy
from lightning_par.rendezvous import RestartSafeEnvironment


def main() -> None:
    out, kind = Path(sys.argv[1]), sys.argv[2]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if kind == "ours":
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=HybridParallelStrategy(zero_stage=0))
    else:
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[RestartSafeEnvironment()])
    fabric.launch()
    t = torch.tensor([fabric.global_rank + 1.0])
    dist.all_reduce(t)
    (out / f"attempt{attempt}_rank{fabric.global_rank}").write_text(str(t.item()))
    if attempt == 0:
        if fabric.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)  # stopped by the agent when it sees rank 1 fail
    # Exiting right after a Gloo collective races with torch: the group's worker thread may release the
    # finished work (decref'ing its tensors) while Python finalises, and that thread's GIL request then
    # aborts the process ("terminate called without an active exception", seen about once in 25 exits
    # under gdb: pt_gloo_runloop in ~AsyncAllreduceWork -> take_gil -> pthread_exit). Destroying the group
    # joins its threads first.
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
