"""The sparse rows of ``sparsecomm bench collectives`` on 2 spawned gloo ranks: results, bytes and bounds."""

from __future__ import annotations

import pytest

from optim.apps.benchmarks.sparse_ops import bench_sparse_rank
from optim.apps.cli.bench import format_sparse_table
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

NUMEL = 1 << 18


def _rank(rank: int, ws: int) -> list[dict]:
    return bench_sparse_rank(
        numels=(NUMEL,), densities=(1.0, 0.1, 0.01), dtypes=("float32",), ops=("all_reduce", "all_gather"), iters=3
    )


@pytest.mark.timeout(180)
def test_sparse_rows_are_right_and_carry_their_bounds() -> None:
    per_rank = run_ranks(_rank, 2, timeout=150.0)
    rows = per_rank[0]
    assert [(r["op"], r["density"]) for r in rows] == [
        (op, d) for op in ("all_reduce", "all_gather") for d in (1.0, 0.1, 0.01)
    ]
    for r in rows:
        assert r["#wrong"] == 0
        assert r["mem_GBps"] > 0 and r["mem_GBps"] == rows[0]["mem_GBps"]  # one probe, min over ranks
        dense = next(x for x in rows if x["op"] == r["op"] and x["density"] == 1.0)
        # The wire bound is the dense row's time at this row's share of the dense row's bytes.
        assert r["wire_bound_us"] == pytest.approx(dense["time_us"] * r["wire_bytes"] / dense["wire_bytes"])
        assert r["bound_us"] == pytest.approx(r["pack_bound_us"] + r["wire_bound_us"] + r["unpack_bound_us"])
        assert r["speedup_bound"] == pytest.approx(dense["time_us"] / r["bound_us"])
        if r["density"] < 1.0:
            assert r["wire_bytes"] < dense["wire_bytes"] and r["bound_us"] > 0
            # all_gather packs nothing (it sends its own k values); all_reduce packs and unpacks P*k of them.
            assert (r["pack_bound_us"] > 0) == (r["op"] == "all_reduce") and r["unpack_bound_us"] > 0
    lo, hi = (next(x for x in rows if x["op"] == "all_reduce" and x["density"] == d) for d in (0.01, 0.1))
    assert lo["pack_bound_us"] < hi["pack_bound_us"]  # fewer cache lines and packed values at 1%
    table = format_sparse_table(rows).splitlines()
    assert len(table) == 3 + len(rows) and "GB/s" in table[1]
