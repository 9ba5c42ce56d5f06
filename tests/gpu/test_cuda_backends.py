"""CUDA transports (nccl, cupy-nccl, mpi with CUDA tensors); skipped without GPUs.

One GPU runs the world-size-1 paths (NCCL refuses two ranks on one GPU);
two or more GPUs run the multi-rank bodies on spawned processes.
"""

from __future__ import annotations

import importlib.util
import socket
from datetime import timedelta

import pytest
import torch

from tests.dist.harness import run_ranks

pytestmark = pytest.mark.gpu

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
needs_two_gpus = pytest.mark.skipif(GPUS < 2, reason="multi-rank NCCL needs 2 or more GPUs")
needs_cupy = pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="needs cupy")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cuda_body(rank: int, ws: int) -> int:
    """Every collective on CUDA tensors, checked against the expected values."""
    import sparsecomm.distributed as dist
    from bindings.communicator import BaseCommunicator

    comm = dist.get_communicator()
    assert isinstance(comm, BaseCommunicator)
    dev = torch.device("cuda", torch.cuda.current_device())
    checks = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        x = torch.full((1000,), float(rank + 1), dtype=dtype, device=dev)
        dist.all_reduce(x)
        assert torch.all(x == ws * (ws + 1) / 2).item(), (dtype, x[:4])
        y = torch.full((10,), float(rank + 1), dtype=dtype, device=dev)
        dist.all_reduce(y, op=dist.ReduceOp.AVG)
        torch.testing.assert_close(y, torch.full_like(y, (ws + 1) / 2))
        out = torch.empty(10 * ws, dtype=dtype, device=dev)
        dist.all_gather_into_tensor(out, torch.full((10,), float(rank), dtype=dtype, device=dev))
        expected = torch.arange(ws, device=dev).repeat_interleave(10).to(dtype)
        assert torch.equal(out, expected)
        rs = torch.empty(10, dtype=dtype, device=dev)
        dist.reduce_scatter_tensor(rs, torch.ones(10 * ws, dtype=dtype, device=dev))
        assert torch.all(rs == ws).item()
        b = torch.full((5,), float(rank), dtype=dtype, device=dev)
        dist.broadcast(b, src=ws - 1)
        assert torch.all(b == ws - 1).item()
        checks += 5
    dist.barrier()
    return checks


def _single_rank(backend: str) -> None:
    import sparsecomm.distributed as dist

    port = _free_port()
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    try:
        assert cuda_body(0, 1) == 20
    finally:
        dist.destroy_process_group()


@needs_gpu
def test_nccl_single_rank() -> None:
    _single_rank("nccl")


@needs_gpu
@needs_cupy
def test_cupy_nccl_single_rank() -> None:
    _single_rank("cupy-nccl")


def _multi(rank: int, ws: int) -> int:
    torch.cuda.set_device(rank)
    return cuda_body(rank, ws)


@needs_two_gpus
@pytest.mark.parametrize("backend", ["nccl", pytest.param("cupy-nccl", marks=needs_cupy)])
def test_multi_rank(backend: str) -> None:
    ws = min(GPUS, 4)
    assert run_ranks(_multi, ws, backend=backend, timeout=180) == [20] * ws
