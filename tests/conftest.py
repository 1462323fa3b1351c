"""Session-wide test settings.

The distributed tests fork ranks from the pytest process (tests/distributed.py), and several tests run
their single-process reference in that process first. GNU OpenMP is not fork-safe: once the parent has
run a parallel region with more than one thread (MKL's vectorised ``cos`` in a Hugging Face rotary
embedding, for instance), a forked child can block forever in its first parallel region, even with
``torch.set_num_threads(1)`` in the child (seen here: a rank stuck in ``libgomp`` under ``vmsCos``). One
intra-op thread in the parent keeps the OpenMP pool from ever starting, so forking stays safe; the
references are small, and the ranks run one thread each anyway.
"""

import os
from collections.abc import Iterator

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _restore_environ() -> Iterator[None]:
    """Lightning's launcher writes ``MASTER_PORT``, ``LOCAL_RANK`` and the like into ``os.environ`` when a
    Trainer runs in the pytest process; left behind, ``LOCAL_RANK`` makes every later Lightning script
    started from this process believe its processes were created externally, and wait for ranks that
    never come. The same launcher calls ``torch.set_num_threads`` (cores / processes), which would start
    the OpenMP pool in this process and make later forks unsafe (see above). Each test gets the
    environment and one intra-op thread back."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    torch.set_num_threads(1)
