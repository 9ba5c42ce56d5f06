"""CUDA pack kernels and sparse collectives on one GPU; skipped without one."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch

from sparsecomm.mask import ShardedMask
from sparsecomm.pack import candidates

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_every_cuda_kernel_matches_torch_indexing(dtype: torch.dtype) -> None:
    dev = torch.device("cuda")
    kernels = candidates(dev)
    assert kernels[0].name == "torch"
    src = torch.randn(1 << 20, device=dev).to(dtype)
    idx = torch.randperm(1 << 20, device=dev)[:5000].sort().values
    for kernel in kernels:
        out = torch.empty(5000, dtype=dtype, device=dev)
        kernel.pack(src, idx, out)
        assert torch.equal(out, src[idx]), kernel.name
        dst = torch.zeros_like(src)
        kernel.unpack(out, idx, dst)
        expected = torch.zeros_like(src)
        expected[idx] = src[idx]
        assert torch.equal(dst, expected), kernel.name


@pytest.mark.parametrize("backend", ["nccl", "cupy-nccl"])
def test_sparse_all_reduce_single_gpu(backend: str) -> None:
    if backend == "cupy-nccl":
        pytest.importorskip("cupy")
    import sparsecomm.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    try:
        mask = ShardedMask.random(100_003, 1, 0.01, torch.Generator().manual_seed(0))
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(100_003, device="cuda").to(dtype)
            before = x.clone()
            dist.sparse_all_reduce(x, mask)
            assert torch.equal(x, before)  # one rank: the sum is the value itself
            vals = dist.sparse_reduce_scatter(x, mask)
            assert torch.equal(vals, x[mask.global_indices("cuda")])
            out = torch.zeros_like(x)
            dist.sparse_all_gather(vals, mask, out)
            assert torch.equal(out[mask.global_indices("cuda")], vals)
    finally:
        dist.destroy_process_group()
