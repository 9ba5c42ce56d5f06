"""Pack plans and kernels, and the fixed-size wire format of mask pieces (no communication)."""

from __future__ import annotations

import math

import pytest
import torch

from sparsecomm.collectives import pack, unpack
from sparsecomm.mask import ShardedMask, encoded_size, k_for, shard_size_for, topk_piece
from sparsecomm.pack import candidates, pack_plan, pieces_plan
from sparsecomm.schedule import _from_wire, _to_wire, varint_bound, wire_encoding


@pytest.mark.parametrize("numel,ws,density", [(10, 4, 1.0), (1001, 3, 0.1), (4096, 4, 0.01), (7, 2, 0.5)])
def test_pack_then_unpack_round_trips_and_zeroes_padding(numel: int, ws: int, density: float) -> None:
    mask = ShardedMask.random(numel, ws, density, torch.Generator().manual_seed(1))
    x = torch.arange(1, numel + 1, dtype=torch.float32)
    packed = pack(x, mask)
    g = mask.global_indices()
    expected = torch.where(g < numel, (g + 1).float(), torch.zeros(()))
    assert torch.equal(packed, expected)
    y = torch.full((numel,), -1.0)
    unpack(packed, mask, y)
    sel = g[g < numel]
    assert torch.equal(y[sel], x[sel])
    rest = torch.ones(numel, dtype=torch.bool)
    rest[sel] = False
    assert bool((y[rest] == -1).all())


@pytest.mark.parametrize("numel,ws,density", [(10, 4, 1.0), (1001, 3, 0.1), (4096, 4, 0.01), (7, 2, 0.5)])
def test_pack_of_pieces_equals_pack_of_their_concatenation(numel: int, ws: int, density: float) -> None:
    gen = torch.Generator().manual_seed(numel)
    mask = ShardedMask.random(numel, ws, density, gen)
    x = torch.randn(numel, generator=gen)
    cuts = sorted(torch.randint(0, numel + 1, (5,), generator=gen).tolist())
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, numel], strict=True)]  # empty pieces included
    pieces = list(torch.split(x, sizes))
    got = pack(pieces, mask, out=torch.full((mask.k * ws,), float("nan")))
    assert torch.equal(got, pack(x, mask))
    assert pieces_plan(mask, tuple(sizes), torch.device("cpu")) is pieces_plan(mask, tuple(sizes), torch.device("cpu"))


def test_index_tensors_are_built_once_per_mask_and_device() -> None:
    mask = ShardedMask.random(1000, 4, 0.1, torch.Generator().manual_seed(0))
    assert pack_plan(mask, torch.device("cpu")) is pack_plan(mask, torch.device("cpu"))
    assert mask.global_indices() is mask.global_indices()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_every_cpu_kernel_agrees_with_indexing(dtype: torch.dtype) -> None:
    src = torch.randn(10_000).to(dtype)
    idx = torch.randperm(10_000)[:777].sort().values
    for kernel in candidates(torch.device("cpu")):
        out = torch.empty(777, dtype=dtype)
        kernel.pack(src, idx, out)
        assert torch.equal(out, src[idx]), kernel.name
        dst = torch.zeros_like(src)
        kernel.unpack(out, idx, dst)
        assert torch.equal(dst[idx], src[idx]) and int((dst != 0).sum()) <= 777, kernel.name


@pytest.mark.parametrize("shard", [1, 7, 100, 4096, 1_000_003])
@pytest.mark.parametrize("density", [1.0, 0.5, 0.1, 0.01, 0.001])
def test_wire_piece_is_never_larger_than_bitmap_or_int32(shard: int, density: float) -> None:
    k = k_for(shard, 1, density)
    enc, size = wire_encoding(k, shard)
    assert size <= min(4 * k, math.ceil(shard / 8)) or enc == "bitmap"
    assert size <= 4 * k or size <= math.ceil(shard / 8)


@pytest.mark.parametrize("shard,k", [(1000, 1), (1000, 10), (4096, 41), (100_000, 1000), (1 << 20, 1 << 10)])
def test_varint_bound_holds_for_worst_and_random_pieces(shard: int, k: int) -> None:
    bound = varint_bound(k, shard)
    gen = torch.Generator().manual_seed(k)
    even = torch.linspace(0, shard - 1, k).long().unique()
    pieces = [torch.randperm(shard, generator=gen)[:k].sort().values for _ in range(20)]
    pieces += [even, torch.arange(shard - k, shard), torch.arange(k)]
    for piece in pieces:
        if piece.numel() == k:
            assert encoded_size(piece, shard, "delta-varint") <= bound


@pytest.mark.parametrize("density", [0.5, 0.05, 0.01, 0.001])
def test_wire_round_trip(density: float) -> None:
    n, ws = 200_003, 3
    size, k = shard_size_for(n, ws), k_for(n, ws, density)
    enc, nbytes = wire_encoding(k, size)
    piece = topk_piece(torch.rand(size, generator=torch.Generator().manual_seed(3)), k)
    wire = _to_wire(piece, size, enc, nbytes)
    assert wire.numel() == nbytes
    assert torch.equal(_from_wire(wire, size, k, enc), piece)
