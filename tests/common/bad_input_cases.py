"""Bad-input test bodies shared by gloo and mpi runs.

Every bad call must raise the expected error on every rank *before* any
communication: after the whole list, one good all_reduce must still give the
right answer, which it would not if some rank had sent anything.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

import sparsecomm.distributed as dist
from bindings.errors import CollectiveMismatchError, CommError, CommTimeoutError


def _expect(
    exc_type: type[BaseException] | tuple[type[BaseException], ...], needle: str, fn: Callable[[], Any]
) -> None:
    try:
        fn()
    except exc_type as exc:
        assert needle in str(exc), f"error {exc!r} does not name {needle!r}"
        return
    raise AssertionError(f"expected {exc_type} naming {needle!r}, nothing was raised")


def _sync_check(rank: int, ws: int) -> None:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == ws * (ws + 1) / 2, f"ranks out of step after bad input: {t.item()}"


def case_bad_arguments(rank: int, ws: int) -> int:
    """Local argument errors: same error on every rank, nothing sent."""
    f32 = torch.zeros(4)
    cases: list[tuple[Any, str, Callable[[], Any]]] = [
        (ValueError, "op", lambda: dist.all_reduce(f32, op="median")),
        (ValueError, "op", lambda: dist.all_reduce(f32, op=dist.ReduceOp.PREMUL_SUM)),
        (TypeError, "op", lambda: dist.all_reduce(torch.zeros(4, dtype=torch.int64), op=dist.ReduceOp.AVG)),
        (TypeError, "op", lambda: dist.all_reduce(f32, op=dist.ReduceOp.BAND)),
        (TypeError, "tensor", lambda: dist.all_reduce([1.0, 2.0])),
        (TypeError, "dtype", lambda: dist.all_reduce(torch.zeros(2, dtype=torch.complex64))),
        (TypeError, "async_op", lambda: dist.all_reduce(f32, async_op="yes")),
        (ValueError, "src", lambda: dist.broadcast(f32, src=ws)),
        (ValueError, "src", lambda: dist.broadcast(f32, src=-1)),
        (ValueError, "src", lambda: dist.broadcast(f32)),
        (ValueError, "src", lambda: dist.broadcast(f32, src=0, group_src=0)),
        (ValueError, "group_src", lambda: dist.broadcast(f32, group_src=ws + 3)),
        (TypeError, "src", lambda: dist.broadcast(f32, src=0.5)),
        (ValueError, "output", lambda: dist.all_gather_into_tensor(torch.zeros(4 * ws + 1), f32)),
        (ValueError, "output", lambda: dist.all_gather_into_tensor(torch.zeros(ws, 3), f32)),
        (TypeError, "dtype", lambda: dist.all_gather_into_tensor(torch.zeros(4 * ws, dtype=torch.float64), f32)),
        (ValueError, "input", lambda: dist.reduce_scatter_tensor(f32, torch.zeros(4 * ws + 2))),
        (TypeError, "dtype", lambda: dist.reduce_scatter_tensor(f32, torch.zeros(4 * ws, dtype=torch.int64))),
        (ValueError, "tensor_list", lambda: dist.all_gather([torch.zeros(4)] * (ws + 1), f32)),
        (ValueError, "tensor_list[0]", lambda: dist.all_gather([torch.zeros(5)] * ws, f32)),
        (TypeError, "tensor_list[0]", lambda: dist.all_gather([torch.zeros(4, dtype=torch.int64)] * ws, f32)),
        (TypeError, "tensor_list", lambda: dist.all_gather(torch.zeros(4), f32)),
        (ValueError, "input_list", lambda: dist.reduce_scatter(f32, [torch.zeros(4)] * (ws + 1))),
        (ValueError, "input_list[0]", lambda: dist.reduce_scatter(f32, [torch.zeros(3)] * ws)),
        (ValueError, "dst", lambda: dist.send(f32, dst=ws)),
        (ValueError, "dst", lambda: dist.send(f32, dst=rank)),
        (ValueError, "src", lambda: dist.recv(f32, src=rank)),
        (ValueError, "src", lambda: dist.recv(f32, src=ws + 1)),
        (ValueError, "tag", lambda: dist.send(f32, dst=(rank + 1) % ws, tag=-1)),
        (ValueError, "ranks", lambda: dist.new_group([0, ws])),
        (ValueError, "ranks", lambda: dist.new_group([0, 0])),
        (ValueError, "backend", lambda: dist.new_group([0], backend="nccl-typo")),
        (TypeError, "group", lambda: dist.all_reduce(f32, group="world")),
        (TypeError, "timeout", lambda: dist.barrier(timeout=5)),
    ]
    for exc_type, needle, fn in cases:
        _expect(exc_type, needle, fn)
    _sync_check(rank, ws)
    return len(cases)


def case_mismatch_detected(rank: int, ws: int) -> int:
    """With check_collectives on, ranks that disagree all raise, and nothing hangs."""
    checks = 0
    if ws > 1:
        n = 10 if rank == 0 else 12
        _expect(CollectiveMismatchError, "numel", lambda: dist.all_reduce(torch.ones(n)))
        dtype = torch.float32 if rank == 0 else torch.float64
        _expect(CollectiveMismatchError, "dtype", lambda: dist.all_reduce(torch.ones(4, dtype=dtype)))
        op = dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX
        _expect(CollectiveMismatchError, "op", lambda: dist.all_reduce(torch.ones(4), op=op))
        _expect(CollectiveMismatchError, "root", lambda: dist.broadcast(torch.ones(4), src=rank))

        def different_collectives() -> None:
            if rank == 0:
                dist.all_reduce(torch.ones(4))
            else:
                dist.all_gather_into_tensor(torch.ones(4 * ws), torch.ones(4))

        _expect(CollectiveMismatchError, "collective", different_collectives)
        checks += 5
    _sync_check(rank, ws)
    return checks + 1


def case_missing_peer_times_out(rank: int, ws: int) -> float:
    """Without the check, a collective whose peer never joins ends at the timeout, named."""
    if rank == 0:
        t0 = time.monotonic()
        work = dist.all_reduce(torch.ones(8), async_op=True)
        try:
            work.wait(timeout=timedelta(seconds=2))
        except (CommTimeoutError, CommError) as exc:
            assert "all_reduce" in str(exc), exc
            return time.monotonic() - t0
        raise AssertionError("all_reduce without its peers did not time out")
    time.sleep(4)  # never joins the collective
    return 0.0
