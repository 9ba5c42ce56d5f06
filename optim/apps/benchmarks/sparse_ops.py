"""Sparse-collective benchmark rows, measured beside the dense collective of the same op.

For each op (sparse all_reduce / reduce_scatter / all_gather), numel N,
dtype and density, every rank times:

* density 1: the **dense** collective of the same op on the N-element buffer
  (the baseline, same harness, same run);
* density < 1: the sparse collective at a mask of that density made by
  :class:`~sparsecomm.schedule.MaskSchedule` (identical on every rank by
  construction, so ``verify_mask=False``), end to end: pack + collective + unpack.

Columns: ``op backend world_size numel dtype density time_us pack_us
unpack_us wire_bytes mask_bytes mask_encoding speedup #wrong``. ``time_us``
is the median over iterations, then the maximum over ranks; ``pack_us`` /
``unpack_us`` time the pack and unpack kernels alone; ``wire_bytes`` are the
bytes this rank sent per call (byte accounting); ``mask_bytes`` the bytes this
rank sent for one mask all-gather; ``speedup`` = dense time / this time.

Bounds, measured in the same run (``mem_GBps``, ``*_bound_us``):

* ``mem_GBps``: this machine's memory-streaming rate with every rank
  streaming at once (a copy of a buffer far larger than the caches: bytes
  read + bytes written over the time, the minimum over ranks);
* ``pack_bound_us`` / ``unpack_bound_us``: the bytes pack (unpack) must move
  at that rate: the index array, every cache line of the flat buffer that
  holds a selected element (expected count for scattered positions), and
  the packed values;
* ``wire_bound_us``: the dense row's time scaled to this row's wire bytes
  (the wire at the bandwidth the dense collective reached);
* ``bound_us``: their sum, the time of a sparse collective that packs,
  sends and unpacks at those rates one after the other;
* ``speedup_bound``: dense time / ``bound_us``, the speedup such a collective
  would reach here (overlapping the three would at best hide the smaller
  ones behind the largest).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import sparsecomm.distributed as dist
from bindings.json_object import JsonObject
from sparsecomm.collectives import pack, unpack
from sparsecomm.mask import ShardedMask, shard_size_for
from sparsecomm.schedule import MaskSchedule

__all__ = ["SPARSE_OPS", "bench_sparse_rank"]

SPARSE_OPS = ("all_reduce", "reduce_scatter", "all_gather")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _median_us(fn: Callable[[], Any], iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


_LINE = 64  # cache-line bytes
_STREAM_BYTES = 1 << 27  # the streaming probe's buffer (128 MiB: far beyond any cache here)


def _stream_gbps() -> float:
    """Memory-streaming rate (GB/s, read + write) while every rank streams at once; min over ranks."""
    src = torch.ones(_STREAM_BYTES // 4)
    dst = torch.empty_like(src)
    dist.barrier()
    us = _median_us(lambda: dst.copy_(src), 5, 1)
    return -_max_over_ranks([-(2 * _STREAM_BYTES / (us * 1e-6) / 1e9)])[0]


def _index_bound_us(numel: int, elt: int, slots: int, density: float, gbps: float) -> float:
    """Microseconds to move what one pack (or unpack) touches at ``gbps``."""
    per_line = max(1, _LINE // elt)
    lines = numel / per_line * (1.0 - (1.0 - density) ** per_line)  # lines holding >= 1 selected element
    return (8 * slots + lines * _LINE + elt * slots) / (gbps * 1e3)


def _mask(comm: Any, numel: int, density: float, rank: int) -> tuple[ShardedMask, MaskSchedule]:
    sched = MaskSchedule(comm, numel=numel, density=density, delay=0)
    lo, hi = sched.own_shard
    scores = torch.rand(hi - lo, generator=torch.Generator().manual_seed(1234 + rank))
    sched.propose(0, scores)
    mask = sched.mask_for(1)
    assert mask is not None
    return mask, sched


def _dense_call(op: str, flat: torch.Tensor, n: int) -> Callable[[], Any]:
    size = shard_size_for(flat.numel(), n)
    if op == "all_reduce":
        return lambda: dist.all_reduce(flat)
    padded = torch.zeros(size * n, dtype=flat.dtype)
    shard = torch.zeros(size, dtype=flat.dtype)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(shard, padded)
    return lambda: dist.all_gather_into_tensor(padded, shard)


def _sparse_call(op: str, flat: torch.Tensor, mask: ShardedMask) -> Callable[[], Any]:
    vals = torch.zeros(mask.k, dtype=flat.dtype)
    if op == "all_reduce":
        return lambda: dist.sparse_all_reduce(flat, mask, verify_mask=False)
    if op == "reduce_scatter":
        return lambda: dist.sparse_reduce_scatter(flat, mask, output=vals, verify_mask=False)
    return lambda: dist.sparse_all_gather(vals, mask, flat, verify_mask=False)


def _wrong(op: str, numel: int, mask: ShardedMask, dtype: torch.dtype, rank: int, n: int) -> int:
    """Elements of one checked call that differ from the expected result, on this rank."""
    expected_sum = n * (n + 1) // 2
    sel = mask.global_indices()
    sel = sel[sel < numel]
    if op == "all_reduce":
        x = torch.full((numel,), float(rank + 1), dtype=dtype)
        dist.sparse_all_reduce(x, mask, verify_mask=False)
        return int((x[sel] != expected_sum).sum())
    if op == "reduce_scatter":
        x = torch.full((numel,), float(rank + 1), dtype=dtype)
        out = dist.sparse_reduce_scatter(x, mask, verify_mask=False)
        own = mask.piece(rank) + rank * mask.shard_size
        real = own < numel
        return int((out[real] != expected_sum).sum())
    out = torch.zeros(numel, dtype=dtype)
    dist.sparse_all_gather(torch.full((mask.k,), float(rank + 1), dtype=dtype), mask, out, verify_mask=False)
    owner = (torch.arange(numel) // mask.shard_size + 1).to(dtype)
    return int((out[sel] != owner[sel]).sum())


def bench_sparse_rank(
    *,
    numels: tuple[int, ...],
    densities: tuple[float, ...],
    dtypes: tuple[str, ...],
    ops: tuple[str, ...] = SPARSE_OPS,
    iters: int = 20,
    warmup: int = 3,
) -> list[JsonObject]:
    """Measure the sparse rows on this rank; the rows come back identical on every rank.

    Collective: every rank of the default group must call this.
    """
    comm = dist.get_communicator()
    n, rank = comm.world_size, comm.rank
    gbps = _stream_gbps()
    rows: list[JsonObject] = []
    for op in ops:
        for numel in numels:
            for dname in dtypes:
                dtype = _DTYPES[dname]
                flat = torch.zeros(numel, dtype=dtype)
                dense_us = _max_over_ranks([_median_us(_dense_call(op, flat, n), iters, warmup)])[0]
                comm.stats.reset()
                _dense_call(op, flat, n)()
                dense_wire = comm.stats.get(op).bytes_sent
                for density in densities:
                    row: JsonObject = {
                        "kind": "sparse",
                        "op": op,
                        "backend": comm.backend,
                        "world_size": n,
                        "numel": numel,
                        "dtype": dname,
                        "density": density,
                    }
                    if density >= 1.0:
                        row.update(
                            time_us=dense_us,
                            pack_us=0.0,
                            unpack_us=0.0,
                            wire_bytes=dense_wire,
                            mask_bytes=0,
                            mask_encoding="none",
                            speedup=1.0,
                            mem_GBps=gbps,
                            pack_bound_us=0.0,
                            unpack_bound_us=0.0,
                            wire_bound_us=dense_us,
                            bound_us=dense_us,
                            speedup_bound=1.0,
                            **{"#wrong": 0},
                        )
                        rows.append(row)
                        continue
                    comm.stats.reset()
                    mask, sched = _mask(comm, numel, density, rank)
                    mask_bytes = comm.stats.get("mask_sync").bytes_sent
                    sched.close()
                    call = _sparse_call(op, flat, mask)
                    sparse_us = _median_us(call, iters, warmup)
                    packed = pack(flat, mask)
                    pack_us = _median_us(functools.partial(pack, flat, mask, out=packed), iters, 1)
                    unpack_us = _median_us(functools.partial(unpack, packed, mask, flat), iters, 1)
                    comm.stats.reset()
                    call()
                    wire = comm.stats.get(f"sparse_{op}").bytes_sent
                    wrong = _wrong(op, numel, mask, dtype, rank, n)
                    t, p, u = _max_over_ranks([sparse_us, pack_us, unpack_us])
                    bad = torch.tensor([wrong], dtype=torch.int64)
                    dist.all_reduce(bad)
                    slots = packed.numel() if op != "all_gather" else mask.k * n
                    elt = flat.element_size()
                    pack_b = _index_bound_us(numel, elt, slots, density, gbps) if op != "all_gather" else 0.0
                    unpack_b = _index_bound_us(numel, elt, slots, density, gbps) if op != "reduce_scatter" else 0.0
                    wire_b = dense_us * wire / dense_wire if dense_wire else 0.0
                    row.update(
                        mem_GBps=gbps,
                        pack_bound_us=pack_b,
                        unpack_bound_us=unpack_b,
                        wire_bound_us=wire_b,
                        bound_us=pack_b + wire_b + unpack_b,
                        speedup_bound=dense_us / (pack_b + wire_b + unpack_b),
                        time_us=t,
                        pack_us=p,
                        unpack_us=u,
                        wire_bytes=wire,
                        mask_bytes=mask_bytes,
                        mask_encoding=sched.encoding,
                        speedup=dense_us / t if t > 0 else None,
                        **{"#wrong": int(bad)},
                    )
                    rows.append(row)
    return rows


def bench_pack(
    *,
    device: torch.device,
    numel: int,
    densities: tuple[float, ...],
    dtypes: tuple[str, ...],
    reps: int = 10,
) -> list[JsonObject]:
    """Time every pack kernel available on ``device``: one row per (kernel, dtype, density).

    Runs in one process, no communication. ``pack_us`` / ``unpack_us`` are the
    best of ``reps`` (CUDA: synchronized), ``GBps`` counts the packed bytes
    moved by pack + unpack.
    """
    from sparsecomm.pack import candidates, kernel_for, time_kernel

    rows: list[JsonObject] = []
    for dname in dtypes:
        dtype = _DTYPES[dname]
        chosen = kernel_for(device, dtype).name
        for density in densities:
            k = max(1, int(numel * density))
            for kernel in candidates(device):
                p, u = time_kernel(kernel, device, dtype, n=numel, k=k, reps=reps)
                moved = 2 * k * torch.empty((), dtype=dtype).element_size()
                rows.append(
                    {
                        "kind": "pack",
                        "kernel": kernel.name,
                        "device": str(device),
                        "numel": numel,
                        "dtype": dname,
                        "density": density,
                        "k": k,
                        "pack_us": p * 1e6,
                        "unpack_us": u * 1e6,
                        "GBps": moved / (p + u) / 1e9 if p + u > 0 else None,
                        "chosen": kernel.name == chosen,
                    }
                )
    return rows
