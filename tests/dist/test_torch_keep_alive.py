"""The torch backend holds its last works and their tensors from Python (``bindings.torch_backend._KEEP_ALIVE``).

Without it a gloo worker thread could drop the last reference to a tensor
whose Python object only the work kept alive, and free it (taking the GIL)
while a process group's destructor holds the GIL and joins that thread: a
deadlock at exit, seen with DDP and SCAPE's mask gathers in
``examples/ddp_sparse_hook.py --scape``.
"""

from __future__ import annotations

import pytest

from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


def _held(rank: int, ws: int) -> dict:
    import torch

    import sparsecomm.distributed as dist
    from bindings import torch_backend

    comm = dist.get_communicator()
    out, inp = torch.zeros(2 * ws), torch.full((2,), float(rank))
    handle = comm.all_gather(out, inp, async_op=True)
    assert handle is not None
    handle.wait()
    keep = torch_backend._KEEP_ALIVE

    def holds_out() -> bool:
        return any(isinstance(a, torch.Tensor) and a.data_ptr() == out.data_ptr() for _, args in keep for a in args)

    held_after_wait = holds_out()
    for _ in range(2 * (keep.maxlen or 0)):  # bounded: older works are let go
        comm.all_reduce(torch.ones(2))
    return {
        "gathered": out.tolist(),
        "held": held_after_wait,
        "full": len(keep) == keep.maxlen,
        "gone": not holds_out(),
    }


def test_the_last_works_and_their_tensors_stay_held_then_go() -> None:
    res = run_ranks(_held, 2, timeout=60)
    for r in res:
        assert r["gathered"] == [0.0, 0.0, 1.0, 1.0]
        assert r["held"] and r["full"] and r["gone"]
