"""abort(): the aborting rank refuses further calls; its peers fail fast instead of hanging."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch

import sparsecomm.distributed as dist
from bindings.errors import CommAbortedError, CommError
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


def _abort_body(rank: int, ws: int) -> float:
    comm = dist.get_communicator()
    dist.barrier()
    if rank == 0:
        comm.abort()
        try:
            dist.all_reduce(torch.ones(4))
        except CommAbortedError:
            return 0.0
        raise AssertionError("a collective on an aborted communicator did not raise")
    t0 = time.monotonic()
    work = dist.all_reduce(torch.ones(1 << 16), async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=30))
    except CommError:
        return time.monotonic() - t0
    raise AssertionError("the peer of an aborted rank completed an all_reduce")


def test_abort_makes_peers_fail_fast_on_gloo() -> None:
    res = run_ranks(_abort_body, 2, timeout=90, op_timeout=60)
    assert res[1] < 15.0, res  # far below the 30 s deadline of the wait
    print(f"peer failed {res[1]:.3f} s after the abort")
