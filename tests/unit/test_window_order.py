"""The order in which LocalAdamS's staggered window visits a shard (``window_order.spread_positions``)."""

from __future__ import annotations

import pytest
import torch

from optim.optimizers.window_order import SPREAD_BLOCK, spread_positions, spread_window, window_positions, window_runs


@pytest.mark.parametrize("size", [1, 2, 15, 16, 17, 31, 32, 33, 48, 100, 1000, 4099, 65536, 100_003])
def test_a_bijection_of_the_shard(size: int) -> None:
    out = spread_positions(torch.arange(size), size)
    assert out.dtype == torch.int64
    assert torch.equal(out.sort().values, torch.arange(size))


def test_blocks_stay_whole_and_the_partial_tail_stays_put() -> None:
    size = 10 * SPREAD_BLOCK + 5
    out = spread_positions(torch.arange(size), size)
    blocks = out[: 10 * SPREAD_BLOCK].view(10, SPREAD_BLOCK)
    assert torch.equal(blocks - blocks[:, :1], torch.arange(SPREAD_BLOCK).expand(10, -1))  # contiguous lines
    assert torch.equal(blocks[:, 0] % SPREAD_BLOCK, torch.zeros(10, dtype=torch.int64))  # aligned
    assert torch.equal(out[10 * SPREAD_BLOCK :], torch.arange(10 * SPREAD_BLOCK, size))


@pytest.mark.parametrize("size,k", [(1_000_000, 100_000), (1_000_000, 10_000), (54_321, 1_000)])
def test_any_window_of_consecutive_positions_lands_evenly_over_the_shard(size: int, k: int) -> None:
    """Each tenth of the shard gets between half and twice its share of every window (not one tenth all)."""
    for lo in (0, size // 3, size - k // 2):
        pos = spread_positions(torch.arange(lo, lo + k) % size, size)
        counts = torch.bincount(pos * 10 // size, minlength=10)
        assert counts.min() >= k / 20 and counts.max() <= k / 5, (lo, counts.tolist())


def test_the_same_on_every_call() -> None:
    a = spread_positions(torch.arange(500, 900), 12_345)
    b = spread_positions(torch.arange(500, 900), 12_345)
    assert torch.equal(a, b)


@pytest.mark.parametrize(("k", "size"), [(1, 1), (3, 10), (10, 10), (7, 100), (64, 1000)])
def test_contiguous_window_runs_cover_exactly_its_positions(k: int, size: int) -> None:
    for j in range(25):
        pos = window_positions(j, k, size, "contiguous")
        assert pos.numel() == k and torch.equal(pos, pos.unique())
        runs = window_runs(j, k, size)
        assert 1 <= len(runs) <= 2
        assert torch.equal(torch.cat([torch.arange(a, z) for a, z in runs]), pos)
        spread = window_positions(j, k, size, "spread")
        assert torch.equal(spread, spread_positions(torch.arange(j * k, (j + 1) * k) % size, size).sort().values)


@pytest.mark.parametrize(("k", "size"), [(5, 15), (16, 16), (17, 33), (40, 160), (100, 1003), (999, 1003)])
def test_spread_window_equals_the_sorted_map_of_its_positions(k: int, size: int) -> None:
    for j in range(40):
        want = spread_positions(torch.arange(j * k, (j + 1) * k) % size, size).sort().values
        assert torch.equal(window_positions(j, k, size, "spread"), want), j


@pytest.mark.parametrize(
    ("k", "size"),
    [(1, 1), (5, 15), (16, 16), (17, 33), (40, 160), (100, 1003), (999, 1003), (3, 1000), (4_000, 65_541)],
)
def test_spread_window_rows_move_exactly_the_window_positions(k: int, size: int) -> None:
    x = torch.randn(size)
    for j in range(30):
        pos = window_positions(j, k, size, "spread")
        w = spread_window(j, k, size)
        rows, tail = w.take(x)
        assert torch.equal(w.values(rows, tail), x[pos]), j
        new = torch.randn(k)
        w.set_values(rows, tail, new)
        y = x.clone()
        w.put(y, rows, tail)
        want = x.clone()
        want[pos] = new
        assert torch.equal(y, want), j  # the window's positions written, every other one unchanged
