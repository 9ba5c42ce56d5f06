"""Orders in which a staggered window visits a shard (:class:`optim.LocalAdamS`, ``window_order``)."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

__all__ = ["SPREAD_BLOCK", "WINDOW_ORDERS", "spread_positions", "window_positions", "window_runs"]

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
