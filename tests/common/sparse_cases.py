"""Sparse-collective test bodies shared by gloo (spawned ranks) and mpi (mpirun).

Inputs are small integers from generators seeded by (seed, rank), so every
rank can compute the single-process dense reference and sums are exact.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

import sparsecomm.distributed as dist
from bindings.stats import ring_bytes
from sparsecomm.mask import ShardedMask, shard_size_for, topk_piece
from sparsecomm.schedule import MaskSchedule
from tests.common.bad_input_cases import _expect
from tests.common.quantized_cases import QUANTIZED_CASES

DENSITIES = (1.0, 0.5, 0.1, 0.01, 0.001)
SIZES = (1, 7, 1001, 10007)
VALUE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _input(seed: int, rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + rank * 104729 + n)
    return torch.randint(-8, 9, (n,), generator=g).to(dtype)


def _mask(seed: int, n: int, ws: int, density: float) -> ShardedMask:
    return ShardedMask.random(n, ws, density, torch.Generator().manual_seed(seed))


def _reference(inputs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([x.double() for x in inputs]).sum(0)


def _real(mask: ShardedMask) -> torch.Tensor:
    g = mask.global_indices()
    return g[g < mask.numel]


def case_sparse_matches_dense_reference(rank: int, ws: int) -> int:
    """RS / AG / AR at random masks equal the dense reference restricted to the mask."""
    checks = 0
    for seed, (n, density) in enumerate((n, d) for n in SIZES for d in DENSITIES):
        mask = _mask(seed, n, ws, density)
        for dtype in VALUE_DTYPES:
            inputs = [_input(seed, r, n, dtype) for r in range(ws)]
            ref = _reference(inputs)
            padded = torch.zeros(mask.padded_numel, dtype=torch.float64)
            padded[:n] = ref
            # reduce-scatter: this rank's k values, in mask order
            for op, scale in (("sum", 1.0), ("avg", 1.0 / ws)):
                got = dist.sparse_reduce_scatter(inputs[rank].clone(), mask, op=op)
                # the same values given as pieces laid end to end (a model's gradients)
                pieces = list(torch.split(inputs[rank], [n // 3, 0, n - n // 3]))
                assert torch.equal(dist.sparse_reduce_scatter(pieces, mask, op=op), got)
                own = mask.piece(rank) + rank * mask.shard_size
                expected = (padded[own] * scale).to(dtype)
                torch.testing.assert_close(got, expected, msg=f"RS {op} n={n} d={density} {dtype}")
                checks += 1
            # all-gather: every shard's values land at the mask, the rest untouched
            shard_vals = (padded[mask.piece(rank) + rank * mask.shard_size] + rank).to(dtype)
            out = torch.full((n,), -100.0, dtype=dtype)
            work = dist.sparse_all_gather(shard_vals, mask, out, async_op=True)
            work.wait()
            expected_out = torch.full((n,), -100.0, dtype=torch.float64)
            for r in range(ws):
                pos = mask.piece(r) + r * mask.shard_size
                keep = pos < n
                expected_out[pos[keep]] = padded[pos[keep]] + r
            torch.testing.assert_close(out, expected_out.to(dtype), msg=f"AG n={n} d={density} {dtype}")
            # all-reduce in place: masked positions reduced, the others keep this rank's input
            t = inputs[rank].clone().reshape(-1)
            dist.sparse_all_reduce(t, mask)
            expected_t = inputs[rank].double().clone()
            sel = _real(mask)
            expected_t[sel] = ref[sel]
            torch.testing.assert_close(t, expected_t.to(dtype), msg=f"AR n={n} d={density} {dtype}")
            checks += 2
    return checks


def case_unselected_poison_never_travels(rank: int, ws: int) -> int:
    """NaN / Inf on unselected positions of some ranks reach no output anywhere."""
    n = 4099
    checks = 0
    for density in (0.5, 0.01):
        mask = _mask(11, n, ws, density)
        sel = _real(mask)
        unselected = torch.ones(n, dtype=torch.bool)
        unselected[sel] = False
        clean = [_input(3, r, n, torch.float32) for r in range(ws)]
        ref = _reference(clean)
        x = clean[rank].clone()
        if rank % 2 == 1:  # odd ranks poison every unselected position
            x[unselected] = torch.where(torch.arange(n)[unselected] % 2 == 0, float("nan"), float("inf"))
        t = x.clone()
        dist.sparse_all_reduce(t, mask)
        assert torch.isfinite(t[sel]).all()
        torch.testing.assert_close(t[sel], ref[sel].float())
        # positions outside the mask hold this rank's own values, bit for bit
        assert torch.equal(t[unselected].nan_to_num(1e9, 1e9, -1e9), x[unselected].nan_to_num(1e9, 1e9, -1e9))
        vals = dist.sparse_reduce_scatter(x, mask)
        assert torch.isfinite(vals).all()
        out = torch.zeros(n)
        dist.sparse_all_gather(vals, mask, out)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out[sel], ref[sel].float())
        checks += 3
    return checks


def case_density_one_equals_dense(rank: int, ws: int) -> int:
    """With the dense mask, the sparse collectives equal the dense ones."""
    checks = 0
    for n in (ws * 37, 1003):
        mask = ShardedMask.dense(n, ws)
        x = _input(5, rank, n, torch.float32)
        a, b = x.clone(), x.clone()
        dist.sparse_all_reduce(a, mask)
        dist.all_reduce(b)
        assert torch.equal(a, b)
        padded = torch.zeros(mask.padded_numel)
        padded[:n] = x
        dense_out = torch.empty(mask.shard_size)
        dist.reduce_scatter_tensor(dense_out, padded)
        assert torch.equal(dist.sparse_reduce_scatter(x, mask), dense_out)
        checks += 2
    return checks


def case_byte_accounting(rank: int, ws: int) -> int:
    """Sparse ops count exactly the analytic bytes of their packed collectives; mask sync too."""
    stats = dist.get_stats()
    comm = dist.get_communicator()
    n = 100_003
    checks = 0
    for density in (1.0, 0.1, 0.01):
        mask = _mask(2, n, ws, density)
        pk_bytes = mask.k * ws * 4
        stats.reset()
        x = _input(1, rank, n, torch.float32)
        dist.sparse_all_reduce(x, mask, verify_mask=False)
        assert (stats.get("sparse_all_reduce").bytes_sent,) == (ring_bytes("all_reduce", pk_bytes, ws)[0],)
        vals = dist.sparse_reduce_scatter(x, mask, verify_mask=False)
        via_ar = getattr(comm, "reduce_scatter_uses_all_reduce", lambda b: False)(pk_bytes)
        rs = ring_bytes("all_reduce", pk_bytes, ws) if via_ar else ring_bytes("reduce_scatter", mask.k * 4, ws)
        assert stats.get("sparse_reduce_scatter").bytes_sent == rs[0]
        dist.sparse_all_gather(vals, mask, x)
        assert stats.get("sparse_all_gather").bytes_sent == ring_bytes("all_gather", mask.k * 4, ws)[0]
        assert stats.get("mask_check").calls == 1  # only the all-gather verified its mask
        # no dense op was counted on its own
        assert stats.get("all_reduce").calls == 0 and stats.get("all_gather").calls == 0
        sched = MaskSchedule(comm, numel=n, density=density, delay=0)
        lo, hi = sched.own_shard
        sched.propose(0, torch.rand(hi - lo, generator=torch.Generator().manual_seed(rank)))
        sched.mask_for(1)
        assert stats.get("mask_sync").bytes_sent == ring_bytes("all_gather", sched.piece_bytes, ws)[0]
        size = shard_size_for(n, ws)
        assert sched.piece_bytes <= min(4 * mask.k, math.ceil(size / 8)), (sched.encoding, sched.piece_bytes)
        checks += 5
    return checks


def _scores(step: int, r: int, ws: int, n: int) -> torch.Tensor:
    size = shard_size_for(n, ws)
    real = max(0, min(size, n - r * size))
    return torch.rand(real, generator=torch.Generator().manual_seed(step * 1000 + r))


def case_mask_provenance(rank: int, ws: int) -> int:
    """The mask used at step t is the one made after step t-1-D from every owner's scores."""
    comm = dist.get_communicator()
    n = 50_021
    checks = 0
    for delay in (0, 1, 2):
        for density in (0.3, 0.01):
            for background in (False, True):
                with MaskSchedule(comm, numel=n, density=density, delay=delay) as sched:
                    checks += _provenance_steps(sched, rank, ws, n, delay, background)
    with MaskSchedule(comm, numel=n, density=0.01, delay=1) as sched:  # a bad piece fails on every rank
        sched.propose(0, lambda: torch.rand(3))
        assert sched.scheduled(2) and sched.pending_steps == [2]
        _expect(ValueError, "values for this rank's shard", sched.settle)
        assert not sched.scheduled(2) and sched.mask_for(2) is None
        sched.propose(1, lambda: _scores(1, rank, ws, n))
        sched.discard_unsent()  # built, never sent: nothing in flight
        assert sched.pending_steps == []
        checks += 3
    return checks


def _provenance_steps(sched: MaskSchedule, rank: int, ws: int, n: int, delay: int, background: bool) -> int:
    checks = 0
    for step in range(6):
        if background and step % 2:  # odd steps settle first (as SCAPE's step does); even ones let mask_for do it
            sched.settle()
        mask = sched.mask_for(step)
        made = step - 1 - delay
        if made < 0:
            assert mask is None, (step, delay)
        else:
            size = shard_size_for(n, ws)
            pieces = [topk_piece(_scores(made, r, ws, n), sched.k, shard_size=size) for r in range(ws)]
            assert mask == ShardedMask.from_pieces(pieces, n, ws), (step, delay)
            checks += 1
        if background:
            time.sleep(0.002 * (step % 3))  # some gathers finish before prefetch looks, some after
            sched.prefetch()
            sched.propose(step, lambda step=step: _scores(step, rank, ws, n))
        else:
            sched.propose(step, _scores(step, rank, ws, n))
        assert sched.pending_steps[-1] == step + 1 + delay
    return checks


def case_sparse_bad_input(rank: int, ws: int) -> int:
    """Bad input: the same clear error on every rank, no hang, nothing written."""
    n = 1000
    mask = _mask(1, n, ws, 0.1)
    x = torch.ones(n)
    out = torch.full((n,), 7.0)
    cases: list[tuple[type[BaseException], str, Callable[[], Any]]] = [
        (ValueError, "numel", lambda: dist.sparse_all_reduce(torch.ones(n + 1), mask)),
        (ValueError, "world_size", lambda: dist.sparse_all_reduce(x, _mask(1, n, ws + 1, 0.1))),
        (TypeError, "mask", lambda: dist.sparse_all_reduce(x, "mask")),
        (TypeError, "dtype", lambda: dist.sparse_all_reduce(torch.ones(n, dtype=torch.int64), mask)),
        (ValueError, "op", lambda: dist.sparse_all_reduce(x, mask, op="max")),
        (ValueError, "output", lambda: dist.sparse_reduce_scatter(x, mask, output=torch.empty(mask.k - 1))),
        (ValueError, "pieces hold", lambda: dist.sparse_reduce_scatter([torch.ones(n - 1)], mask)),
        (TypeError, "sequence", lambda: dist.sparse_reduce_scatter([], mask)),
        (TypeError, "input[1]", lambda: dist.sparse_reduce_scatter([x, "grad"], mask)),
        (
            TypeError,
            "one dtype",
            lambda: dist.sparse_reduce_scatter([torch.ones(1), torch.ones(n - 1, dtype=torch.float64)], mask),
        ),
        (ValueError, "shard_values", lambda: dist.sparse_all_gather(torch.ones(mask.k + 1), mask, out)),
        (ValueError, "numel", lambda: dist.sparse_all_gather(torch.ones(mask.k), mask, torch.zeros(n - 1))),
        (
            TypeError,
            "dtype",
            lambda: dist.sparse_all_gather(torch.ones(mask.k), mask, torch.zeros(n, dtype=torch.float64)),
        ),
        (ValueError, "density", lambda: MaskSchedule(dist.get_communicator(), numel=n, density=0.0)),
        (ValueError, "density", lambda: MaskSchedule(dist.get_communicator(), numel=n, density=1.5)),
        (ValueError, "delay", lambda: MaskSchedule(dist.get_communicator(), numel=n, density=0.1, delay=-1)),
    ]
    for exc, needle, fn in cases:
        _expect(exc, needle, fn)
    assert torch.equal(out, torch.full((n,), 7.0))
    if ws > 1:  # masks that differ between ranks: every rank refuses, nothing written
        mine = _mask(100 + rank, n, ws, 0.1)
        t = torch.ones(n)
        _expect(ValueError, "differ", lambda: dist.sparse_all_reduce(t, mine))
        assert torch.equal(t, torch.ones(n))
        _expect(ValueError, "differ", lambda: dist.sparse_all_gather(torch.ones(mine.k), mine, out))
        assert torch.equal(out, torch.full((n,), 7.0))
    y = torch.full((n,), float(rank + 1))
    dist.sparse_all_reduce(y, mask)  # still in step with each other
    assert y[_real(mask)].eq(ws * (ws + 1) / 2).all()
    return len(cases)


SPARSE_CASES: dict[str, Callable[[int, int], int]] = {
    "matches_dense_reference": case_sparse_matches_dense_reference,
    "unselected_poison_never_travels": case_unselected_poison_never_travels,
    "density_one_equals_dense": case_density_one_equals_dense,
    "byte_accounting": case_byte_accounting,
    "mask_provenance": case_mask_provenance,
    "bad_input": case_sparse_bad_input,
    **QUANTIZED_CASES,
}


def run_sparse_cases(rank: int, ws: int) -> dict[str, int]:
    """Run every sparse case in order; return the checks per case."""
    done: dict[str, int] = {}
    for name, fn in SPARSE_CASES.items():
        try:
            done[name] = fn(rank, ws)
        except Exception as exc:
            raise AssertionError(f"sparse case {name!r} failed on rank {rank} of {ws}: {exc}") from exc
    return done
