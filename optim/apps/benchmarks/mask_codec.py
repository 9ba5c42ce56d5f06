"""Encode + decode time of one shard's mask indices in each wire encoding of :mod:`sparsecomm.mask`.

``python -m optim.apps.benchmarks.mask_codec [--shard-size N] [--k K] [--repeats R] [--seed S]`` times
:func:`~sparsecomm.mask.encode_piece` followed by :func:`~sparsecomm.mask.decode_piece` of ``k``
sorted random positions of an ``N``-element shard (default 40,000 of 4,000,000, a 1 % mask) in
every encoding, and prints one row per encoding: the payload bytes and the median and minimum
time over ``R`` repeats. Payload sizes are exact; times are wall-clock on this machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bindings.json_object import JsonObject
from sparsecomm.mask import ENCODINGS, decode_piece, encode_piece

__all__ = ["bench_mask_codec", "format_mask_codec_table", "main"]


def bench_mask_codec(shard_size: int = 4_000_000, k: int = 40_000, repeats: int = 7, seed: int = 0) -> list[JsonObject]:
    """Time encode + decode of ``k`` random sorted positions of a ``shard_size`` shard, per encoding.

    Args:
        shard_size: Elements of the shard.
        k: Positions in the mask (``1 <= k <= shard_size``).
        repeats: Timed encode + decode round trips per encoding.
        seed: Seed of the positions.

    Returns:
        One row per encoding: ``encoding``, ``shard_size``, ``k``, ``payload_bytes``,
        ``median_ms`` and ``min_ms``.

    Raises:
        ValueError: Bad sizes.
        RuntimeError: A round trip did not give the positions back.
    """
    if not 1 <= k <= shard_size or repeats < 1:
        raise ValueError(f"need 1 <= k <= shard_size and repeats >= 1, got k={k}, {shard_size=}, {repeats=}")
    g = torch.Generator().manual_seed(seed)
    piece = torch.randperm(shard_size, generator=g)[:k].sort().values
    rows = []
    for encoding in ENCODINGS:
        times = []
        payload = back = piece
        for _ in range(repeats):
            start = time.perf_counter()
            payload = encode_piece(piece, shard_size, encoding)
            back = decode_piece(payload, shard_size, k, encoding)
            times.append(time.perf_counter() - start)
        if not torch.equal(back, piece):
            raise RuntimeError(f"{encoding}: the round trip changed the positions")
        rows.append(
            {
                "encoding": encoding,
                "shard_size": shard_size,
                "k": k,
                "payload_bytes": payload.numel(),
                "median_ms": 1e3 * statistics.median(times),
                "min_ms": 1e3 * min(times),
            }
        )
    return rows


def format_mask_codec_table(rows: list[JsonObject]) -> str:
    """The rows of :func:`bench_mask_codec` as a text table."""
    lines = [f"{'encoding':>12} {'shard_size':>11} {'k':>9} {'bytes':>9} {'median ms':>10} {'min ms':>8}"]
    for r in rows:
        lines.append(
            f"{r['encoding']:>12} {r['shard_size']:>11} {r['k']:>9} {r['payload_bytes']:>9} "
            f"{r['median_ms']:>10.2f} {r['min_ms']:>8.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line and print its table."""
    p = argparse.ArgumentParser(prog="python -m optim.apps.benchmarks.mask_codec", description=__doc__.splitlines()[0])
    p.add_argument("--shard-size", type=int, default=4_000_000, help="elements of the shard")
    p.add_argument("--k", type=int, default=40_000, help="positions in the mask")
    p.add_argument("--repeats", type=int, default=7, help="timed round trips per encoding")
    p.add_argument("--seed", type=int, default=0, help="seed of the positions")
    a = p.parse_args(argv)
    rows = bench_mask_codec(a.shard_size, a.k, a.repeats, a.seed)
    sys.stdout.write(format_mask_codec_table(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
