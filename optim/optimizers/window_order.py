"""Orders in which a staggered window visits a shard (:class:`optim.LocalAdamS`, ``window_order``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "SPREAD_BLOCK",
    "WINDOW_ORDERS",
    "SpreadWindow",
    "spread_positions",
    "spread_window",
    "window_positions",
    "window_runs",
]

WINDOW_ORDERS = ("auto", "contiguous", "spread")
"""``contiguous``: a shard in its own order; ``spread``: in the order of :func:`spread_positions`;
``auto``: spread where the window covers less than half of the shard per step, else contiguous."""

SPREAD_BLOCK = 16
"""Positions that stay together in :func:`spread_positions` (one 64-byte cache line of fp32)."""


def _spread_stride(blocks: int) -> int:
    """The block stride of :func:`spread_positions`: coprime with ``blocks``, near ``blocks / golden ratio``."""
    if blocks <= 2:
        return 1
    a = max(1, round(blocks * 0.6180339887498949))
    while math.gcd(a, blocks) != 1:
        a += 1
    return a


def spread_positions(pos: Tensor, size: int) -> Tensor:
    """Map positions of ``[0, size)`` by a fixed bijection that spreads consecutive ones over the whole range.

    Blocks of :data:`SPREAD_BLOCK` positions stay whole (cache lines); block
    ``q`` goes to block ``q * a mod nb`` (``nb`` whole blocks, ``a`` coprime
    with ``nb`` near ``nb / golden ratio``, so that any run of consecutive
    blocks lands evenly over the range); a partial last block maps to itself.
    A window of consecutive positions thus takes a share of every tensor of
    the shard instead of whole tensors.
    """
    nb = size // SPREAD_BLOCK
    full = nb * SPREAD_BLOCK
    a = _spread_stride(nb)
    q, r = torch.div(pos, SPREAD_BLOCK, rounding_mode="floor"), pos % SPREAD_BLOCK
    mapped = (q * a) % max(nb, 1) * SPREAD_BLOCK + r
    return torch.where(pos < full, mapped, pos)


def window_positions(j: int, k: int, size: int, order: str) -> Tensor:
    """The sorted shard positions of staggered window ``j``: ``[j * k, (j + 1) * k)`` mod ``size``, in ``order``.

    The spread order is sorted through a membership map of the shard: whole
    blocks are marked block by block and only the partial blocks at the
    window's ends are mapped one position at a time (no sort of ``k`` positions).
    """
    runs = window_runs(j, k, size)
    if order != "spread":
        return torch.cat([torch.arange(a, z, dtype=torch.int64) for a, z in runs])
    nb = size // SPREAD_BLOCK
    full = nb * SPREAD_BLOCK
    member = torch.zeros(size, dtype=torch.bool)
    for a, z in runs:
        qa, qz = -(-a // SPREAD_BLOCK), min(z, full) // SPREAD_BLOCK
        if qa < qz:  # whole blocks qa .. qz - 1 go to blocks q * stride mod nb
            blocks = torch.arange(qa, qz, dtype=torch.int64) * _spread_stride(nb) % nb
            member[:full].view(nb, SPREAD_BLOCK)[blocks] = True
            edges = torch.cat([torch.arange(a, qa * SPREAD_BLOCK), torch.arange(qz * SPREAD_BLOCK, z)])
        else:
            edges = torch.arange(a, z, dtype=torch.int64)
        member[spread_positions(edges, size)] = True
    return torch.from_numpy(np.flatnonzero(member.numpy()))


def window_runs(j: int, k: int, size: int) -> list[tuple[int, int]]:
    """:func:`window_positions` of the contiguous order as sorted ``[a, z)`` runs (one, or two where it wraps)."""
    lo = (j * k) % size
    return [(lo, lo + k)] if lo + k <= size else [(0, lo + k - size), (lo, size)]


@dataclass(frozen=True, kw_only=True)
class SpreadWindow:
    """The spread window of a shard as whole rows of :data:`SPREAD_BLOCK` positions, in sorted order.

    :func:`window_positions` of the spread order lists ``k`` positions one
    by one; this moves the same positions a cache line at a time (row
    ``index_select`` / ``index_copy_``, 2x faster than per position on CPU).
    ``rows`` are the sorted blocks with a window position in them; ``runs``
    are the ``[a, z)`` ranges of the gathered rows' values that belong to the
    window (all of a row but for the few rows at the window's ends); ``tail``
    are the window's positions in the partial last block.
    """

    size: int
    rows: Tensor
    runs: tuple[tuple[int, int], ...]
    tail: Tensor

    def _lines(self, x: Tensor) -> Tensor:
        return x[: self.size // SPREAD_BLOCK * SPREAD_BLOCK].view(-1, SPREAD_BLOCK)

    def take(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The window's rows and tail values of a shard-sized ``x`` (copies)."""
        return self._lines(x).index_select(0, self.rows), x.index_select(0, self.tail)

    def put(self, x: Tensor, rows: Tensor, tail: Tensor) -> None:
        """Write rows and tail values (as from :meth:`take`) back into ``x``."""
        self._lines(x).index_copy_(0, self.rows, rows)
        x.index_copy_(0, self.tail, tail)

    def values(self, rows: Tensor, tail: Tensor) -> Tensor:
        """The window's values in the order of :func:`window_positions` (a new tensor)."""
        flat = rows.reshape(-1)
        return torch.cat([flat[a:z] for a, z in self.runs] + [tail])

    def set_values(self, rows: Tensor, tail: Tensor, values: Tensor) -> None:
        """The inverse of :meth:`values`: write the window's values into rows and tail."""
        flat, at = rows.view(-1), 0
        for a, z in self.runs:
            flat[a:z] = values[at : at + z - a]
            at += z - a
        tail.copy_(values[at:])

    def write(self, x: Tensor, rows: Tensor, tail: Tensor, values: Tensor) -> None:
        """:meth:`set_values` then :meth:`put`: the window of ``x`` set to ``values``, the rest untouched."""
        self.set_values(rows, tail, values)
        self.put(x, rows, tail)


def spread_window(j: int, k: int, size: int) -> SpreadWindow:
    """Window ``j`` of the spread order as a :class:`SpreadWindow` (the positions of :func:`window_positions`)."""
    nb = size // SPREAD_BLOCK
    full, stride = nb * SPREAD_BLOCK, _spread_stride(nb)
    member = np.zeros(nb, dtype=bool)
    partial: dict[int, set[int]] = {}
    tail: list[int] = []
    for a, z in window_runs(j, k, size):
        qa, qz = -(-a // SPREAD_BLOCK), min(z, full) // SPREAD_BLOCK
        edges = [*range(a, qa * SPREAD_BLOCK), *range(qz * SPREAD_BLOCK, z)] if qa < qz else [*range(a, z)]
        if qa < qz:
            member[np.arange(qa, qz, dtype=np.int64) * stride % nb] = True
        for p in edges:  # fewer than two blocks' worth per run, plus the partial last block
            if p >= full:
                tail.append(p)
            else:
                q, r = divmod(p, SPREAD_BLOCK)
                partial.setdefault(q * stride % nb, set()).add(r)
    member[list(partial)] = True
    rows = np.flatnonzero(member)
    runs: list[tuple[int, int]] = []
    start = 0
    for q in sorted(partial):
        at = int(np.searchsorted(rows, q)) * SPREAD_BLOCK
        runs.append((start, at))
        runs.extend((at + r, at + r + 1) for r in sorted(partial[q]))
        start = at + SPREAD_BLOCK
    runs.append((start, rows.size * SPREAD_BLOCK))
    merged: list[tuple[int, int]] = []
    for a, z in runs:
        if a >= z:
            continue
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], z)
        else:
            merged.append((a, z))
    return SpreadWindow(
        size=size,
        rows=torch.from_numpy(rows.astype(np.int64)),
        runs=tuple(merged),
        tail=torch.tensor(sorted(tail), dtype=torch.int64),
    )
