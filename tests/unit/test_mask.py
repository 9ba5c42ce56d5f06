"""Shard masks, deterministic top-k and wire encodings (:mod:`sparsecomm.mask`)."""

from __future__ import annotations

import math
import random
import struct

import numpy as np
import pytest
import torch

from optim.apps.benchmarks.mask_codec import bench_mask_codec, format_mask_codec_table
from sparsecomm.mask import (
    ENCODINGS,
    ShardedMask,
    analytic_size,
    choose_encoding,
    decode_piece,
    encode_piece,
    encoded_size,
    k_for,
    shard_size_for,
    topk_piece,
)


def _mask(rows: list[list[int]], numel: int = 10, world_size: int = 4) -> ShardedMask:
    idx = torch.tensor(rows, dtype=torch.int64)
    return ShardedMask(numel=numel, world_size=world_size, k=idx.shape[1], indices=idx)


GOOD = [[0, 2], [1, 2], [0, 1], [0, 2]]  # N=10, P=4 -> shard_size 3


# --------------------------------------------------------------------- sizes


def test_k_and_shard_size_on_odd_numel() -> None:
    assert shard_size_for(10, 4) == 3  # 12 padded positions, 10, 11 are padding
    assert shard_size_for(12, 4) == 3
    assert shard_size_for(1, 8) == 1
    assert k_for(10, 4, 1.0) == 3  # ceil(2.5) = 3 = shard_size
    assert k_for(10, 4, 0.5) == 2  # ceil(1.25)
    assert k_for(10, 4, 0.001) == 1  # never below 1
    assert k_for(1000, 4, 0.1) == 25  # decimal reading: not 26 from 0.1's binary error
    assert k_for(4_000_000, 1, 0.01) == 40_000
    assert k_for(7, 7, 1) == 1


@pytest.mark.parametrize("density", [0, 0.0, 1.5, -1, float("nan"), float("inf")])
def test_bad_density_values(density: float) -> None:
    with pytest.raises(ValueError, match="density"):
        k_for(100, 2, density)


@pytest.mark.parametrize("density", ["0.1", None, True])
def test_bad_density_types(density: object) -> None:
    with pytest.raises(TypeError, match="density"):
        k_for(100, 2, density)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("numel", "world_size", "exc", "name"),
    [
        (0, 2, ValueError, "numel"),
        (10, 0, ValueError, "world_size"),
        (True, 2, TypeError, "numel"),
        ("10", 2, TypeError, "numel"),
        (10, 2.0, TypeError, "world_size"),
    ],
)
def test_bad_sizes(numel: object, world_size: object, exc: type, name: str) -> None:
    with pytest.raises(exc, match=name):
        shard_size_for(numel, world_size)  # type: ignore[arg-type]
    with pytest.raises(exc, match=name):
        k_for(numel, world_size, 0.5)  # type: ignore[arg-type]


# --------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([[0, 2], [2, 1], [0, 1], [0, 2]], "sorted"),
        ([[0, 2], [1, 1], [0, 1], [0, 2]], "duplicate"),
        ([[0, 3], [1, 2], [0, 1], [0, 2]], "range|\\[0, 3\\)"),
        ([[-1, 2], [1, 2], [0, 1], [0, 2]], "range|\\[0, 3\\)"),
    ],
)
def test_bad_indices_rejected(rows: list[list[int]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _mask(rows)
    with pytest.raises(ValueError, match=message):
        ShardedMask.from_pieces([torch.tensor(r) for r in rows], 10, 4)


def test_wrong_shape_dtype_and_k() -> None:
    idx = torch.tensor(GOOD, dtype=torch.int64)
    with pytest.raises(ValueError, match="shape"):
        ShardedMask(numel=10, world_size=4, k=2, indices=idx[:3])
    with pytest.raises(ValueError, match="shape"):
        ShardedMask(numel=10, world_size=4, k=1, indices=idx)
    with pytest.raises(ValueError, match="shape"):
        ShardedMask(numel=10, world_size=4, k=2, indices=idx.reshape(-1))
    with pytest.raises(ValueError, match="k must be <= shard_size"):
        ShardedMask(numel=10, world_size=4, k=4, indices=torch.zeros(4, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="int64"):
        ShardedMask(numel=10, world_size=4, k=2, indices=idx.to(torch.int32))
    with pytest.raises(TypeError, match="int64"):
        ShardedMask(numel=10, world_size=4, k=2, indices=idx.double())
    with pytest.raises(TypeError, match="indices"):
        ShardedMask(numel=10, world_size=4, k=2, indices=GOOD)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="numel"):
        ShardedMask(numel=10.0, world_size=4, k=2, indices=idx)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ShardedMask(10, 4, 2, idx)  # type: ignore[misc]  # keyword-only


def test_from_pieces_validation() -> None:
    pieces = [torch.tensor(r) for r in GOOD]
    with pytest.raises(ValueError, match="k differs"):
        ShardedMask.from_pieces([*pieces[:3], torch.tensor([0, 1, 2])], 10, 4)
    with pytest.raises(ValueError, match="pieces"):
        ShardedMask.from_pieces(pieces[:3], 10, 4)
    with pytest.raises(TypeError, match="integer"):
        ShardedMask.from_pieces([p.float() for p in pieces], 10, 4)
    with pytest.raises(ValueError, match="1-D"):
        ShardedMask.from_pieces([p[None] for p in pieces], 10, 4)
    int32 = ShardedMask.from_pieces([p.to(torch.int32) for p in pieces], 10, 4)
    assert int32 == _mask(GOOD)


def test_mask_is_immutable_and_copies_input() -> None:
    idx = torch.tensor(GOOD, dtype=torch.int64)
    mask = ShardedMask(numel=10, world_size=4, k=2, indices=idx)
    digest = mask.digest()
    idx[0, 0] = 1
    assert mask.indices[0, 0] == 0 and mask.digest() == digest
    with pytest.raises(AttributeError):
        mask.k = 3  # type: ignore[misc]


# -------------------------------------------------------------- properties


def test_global_indices_layout_and_padding() -> None:
    mask = _mask(GOOD)
    assert mask.shard_size == 3 and mask.padded_numel == 12
    assert mask.density == pytest.approx(2 * 4 / 10)
    flat = mask.global_indices()
    assert flat.dtype == torch.int64
    assert flat.tolist() == [0, 2, 4, 5, 6, 7, 9, 11]  # 11 is a padding position
    assert mask.global_indices() is flat  # cached
    assert mask.piece(1).tolist() == [1, 2]
    with pytest.raises(ValueError, match="rank"):
        mask.piece(4)


def test_dense_mask() -> None:
    mask = ShardedMask.dense(10, 4)
    assert mask.k == 3
    assert mask.global_indices().tolist() == list(range(12))
    one = ShardedMask.dense(5, 1)
    assert one.global_indices().tolist() == [0, 1, 2, 3, 4] and one.density == 1.0


def test_random_mask_is_seeded_and_prefers_real_positions() -> None:
    a = ShardedMask.random(1001, 4, 0.1, torch.Generator().manual_seed(3))
    b = ShardedMask.random(1001, 4, 0.1, torch.Generator().manual_seed(3))
    c = ShardedMask.random(1001, 4, 0.1, torch.Generator().manual_seed(4))
    assert a == b and a.digest() == b.digest() and a != c
    assert a.k == k_for(1001, 4, 0.1)
    assert bool((a.global_indices() < 1001).all())
    short = ShardedMask.random(10, 4, 1.0, torch.Generator().manual_seed(0))
    assert short.piece(3).tolist() == [0, 1, 2]  # only 9 is real; padding fills the rest


def test_digest_eq_hash() -> None:
    a, b = _mask(GOOD), _mask([list(r) for r in GOOD])
    assert a == b and hash(a) == hash(b) and a.digest() == b.digest()
    assert len({a, b}) == 1
    assert -(2**63) <= a.digest() < 2**63
    changed = [list(r) for r in GOOD]
    changed[3][1] = 1
    c = _mask(changed)
    assert a != c and a.digest() != c.digest()
    # same indices, different numel (header in the digest)
    d = _mask(GOOD, numel=11)
    assert a != d and a.digest() != d.digest()
    assert a != "mask"


# -------------------------------------------------------------------- top-k


def _reference_topk(values: list[float], k: int, shard_size: int) -> list[int]:
    def key(i: int) -> tuple[int, float, int]:
        if i >= len(values):
            return (2, 0.0, i)
        if math.isnan(values[i]):
            return (1, 0.0, i)
        return (0, -values[i], i)

    return sorted(sorted(range(shard_size), key=key)[:k])


def test_topk_all_ties_picks_smallest_indices() -> None:
    for k in (1, 5, 9, 10):
        assert topk_piece(torch.zeros(10), k).tolist() == list(range(k))
    signed = torch.tensor([0.0, -0.0, 0.0, -0.0])
    assert topk_piece(signed, 2).tolist() == [0, 1]  # -0.0 ties with +0.0


def test_topk_basic_nan_and_padding() -> None:
    s = torch.tensor([1.0, float("nan"), 3.0, float("-inf"), 3.0])
    assert topk_piece(s, 2).tolist() == [2, 4]
    assert topk_piece(s, 3).tolist() == [0, 2, 4]
    assert topk_piece(s, 4).tolist() == [0, 2, 3, 4]  # -inf beats NaN
    assert topk_piece(s, 5).tolist() == [0, 1, 2, 3, 4]
    assert topk_piece(s, 5, shard_size=8).tolist() == [0, 1, 2, 3, 4]  # NaN beats padding
    assert topk_piece(s, 6, shard_size=8).tolist() == [0, 1, 2, 3, 4, 5]
    assert topk_piece(torch.full((3,), float("nan")), 2, shard_size=4).tolist() == [0, 1]
    assert topk_piece(s.half(), 2).dtype == torch.int64


def test_topk_validation() -> None:
    with pytest.raises(TypeError, match="scores"):
        topk_piece(torch.arange(4), 2)
    with pytest.raises(ValueError, match="1-D"):
        topk_piece(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="k"):
        topk_piece(torch.zeros(4), 5)
    with pytest.raises(ValueError, match="k"):
        topk_piece(torch.zeros(4), 0)
    with pytest.raises(ValueError, match="shard_size"):
        topk_piece(torch.zeros(4), 2, shard_size=3)


def test_topk_matches_brute_force_reference() -> None:
    rng = random.Random(1234)
    for _ in range(300):
        n = rng.randint(1, 40)
        size = n + rng.choice([0, 0, rng.randint(1, 5)])
        pool = [rng.choice([0.0, 1.0, -1.0, 2.5]) for _ in range(3)]
        pool += [float("nan"), float("inf"), float("-inf"), -0.0]
        values = [rng.choice(pool) if rng.random() < 0.5 else rng.gauss(0, 1) for _ in range(n)]
        k = rng.randint(1, size)
        dtype = rng.choice([torch.float32, torch.float64, torch.float16, torch.bfloat16])
        scores = torch.tensor(values, dtype=dtype)
        expected = _reference_topk(scores.double().tolist(), k, size)
        got = topk_piece(scores, k, shard_size=size)
        assert got.tolist() == expected, (values, k, size)


def test_topk_is_deterministic_on_large_ties() -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 4, (100_000,), generator=g).float()
    first = topk_piece(scores, 30_000)
    for _ in range(3):
        assert torch.equal(topk_piece(scores.clone(), 30_000), first)
    assert first.tolist() == _reference_topk(scores.tolist(), 30_000, 100_000)


def _structured_scores(n: int, seed: int) -> torch.Tensor:
    """Scores shaped like a model's: blocks of very different scale, periodic rows, an inf window, ties, NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g).abs()
    cuts = sorted(torch.randint(0, n, (6,), generator=g).tolist())
    for i, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, n], strict=True)):
        x[lo:hi] *= 10.0 ** (i % 4 - 2)
    period = int(torch.randint(16, 700, (1,), generator=g))
    x[::period] *= 50.0  # a row-periodic pattern a strided sample can alias with
    x[n // 3 : n // 3 + n // 50] = float("inf")  # the exploration window
    x[torch.randint(0, n, (n // 20,), generator=g)] = 0.5  # ties
    x[torch.randint(0, n, (n // 200,), generator=g)] = float("nan")
    return x


@pytest.mark.parametrize("seed", range(6))
def test_topk_candidate_path_is_the_exact_selection(seed: int) -> None:
    """Large shards take the sampled candidate set: the result is the full exact selection's, on any data."""
    from sparsecomm.mask import _order_key, _select_by_key

    n = [70_001, 300_000, 1_000_003][seed % 3]
    scores = _structured_scores(n, seed)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        s = scores.to(dtype)
        for density in (0.12, 0.1, 0.03, 0.01, 0.002, 0.0005):
            k = max(1, int(density * n))
            assert torch.equal(topk_piece(s, k), _select_by_key(_order_key(s), k)), (dtype, density)


# --------------------------------------------------------------- encodings


def _pieces(shard_size: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ks = {1, shard_size}
    for density in (1.0, 0.5, 0.1, 0.01, 0.001):
        ks.add(max(1, math.ceil(density * shard_size)))
    out = [torch.arange(shard_size - 1, shard_size), torch.arange(min(3, shard_size))]
    for k in sorted(ks):
        out.append(torch.randperm(shard_size, generator=g)[:k].sort().values)
    return out


@pytest.mark.parametrize("shard_size", [1, 7, 8, 9, 127, 129, 1001, 16_385, 300_007])
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_round_trip(shard_size: int, encoding: str) -> None:
    for piece in _pieces(shard_size, seed=shard_size):
        payload = encode_piece(piece, shard_size, encoding)
        assert payload.dtype == torch.uint8 and payload.dim() == 1
        assert payload.numel() == encoded_size(piece, shard_size, encoding)
        if encoding != "delta-varint":
            assert payload.numel() == analytic_size(piece.numel(), shard_size, encoding)
        back = decode_piece(payload, shard_size, piece.numel(), encoding)
        assert back.dtype == torch.int64
        assert torch.equal(back, piece)


def test_wire_formats_are_as_documented() -> None:
    piece = torch.tensor([0, 3, 130, 131])
    assert bytes(encode_piece(piece, 140, "int32").tolist()) == struct.pack("<4i", 0, 3, 130, 131)
    # v = idx[j] - idx[j-1] - 1 from idx[-1] = -1: 0, 2, 126, 0
    assert encode_piece(piece, 140, "delta-varint").tolist() == [0, 2, 126, 0]
    assert encode_piece(torch.tensor([0, 200]), 300, "delta-varint").tolist() == [0, 0xC7, 1]
    bitmap = encode_piece(torch.tensor([0, 3, 9]), 10, "bitmap")
    assert bitmap.tolist() == [0b00001001, 0b00000010]


def test_encode_accepts_other_int_dtypes_and_rejects_bad_pieces() -> None:
    piece = torch.tensor([1, 5, 9], dtype=torch.int32)
    assert encode_piece(piece, 10, "delta-varint").tolist() == [1, 3, 3]
    for bad, exc in [
        (torch.tensor([5, 1]), ValueError),
        (torch.tensor([1, 1]), ValueError),
        (torch.tensor([1, 10]), ValueError),
        (torch.tensor([], dtype=torch.int64), ValueError),
        (torch.tensor([1.0, 2.0]), TypeError),
    ]:
        with pytest.raises(exc):
            encode_piece(bad, 10, "int32")
    with pytest.raises(ValueError, match="encoding"):
        encode_piece(piece, 10, "zstd")
    with pytest.raises(ValueError, match="delta-varint"):
        analytic_size(3, 10, "delta-varint")


@pytest.mark.parametrize(
    ("payload", "encoding", "k", "message"),
    [
        ([0, 0, 0], "int32", 1, "4\\*k"),
        ([0, 0, 0, 0, 0, 0, 0, 0], "int32", 1, "4\\*k"),
        ([5, 0, 0, 0, 1, 0, 0, 0], "int32", 2, "sorted"),
        ([1, 0, 0, 0, 1, 0, 0, 0], "int32", 2, "duplicate"),
        ([0xFF, 0xFF, 0xFF, 0xFF], "int32", 1, "\\[0, 10\\)"),
        ([10, 0, 0, 0], "int32", 1, "\\[0, 10\\)"),
        ([0b11, 0], "bitmap", 1, "expected k=1"),
        ([0b11], "bitmap", 2, "bytes"),
        ([0, 0b100], "bitmap", 1, "beyond shard_size"),
        ([1, 0x80], "delta-varint", 2, "truncated"),
        ([], "delta-varint", 1, "truncated"),
        ([1, 2, 3], "delta-varint", 2, "expected k=2"),
        ([0x81, 0x80, 0x01], "delta-varint", 1, "too long"),
        ([9, 0], "delta-varint", 2, "\\[0, 10\\)"),
    ],
)
def test_malformed_payloads_raise(payload: list[int], encoding: str, k: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_piece(torch.tensor(payload, dtype=torch.uint8), 10, k, encoding)


def test_overlong_varint_rejected() -> None:
    # 0x80 0x00 is a 2-byte spelling of 0: legal length for shard_size 1000, not canonical
    with pytest.raises(ValueError, match="overlong"):
        decode_piece(torch.tensor([0x80, 0x00], dtype=torch.uint8), 1000, 1, "delta-varint")
    assert decode_piece(torch.tensor([0x80, 0x01], dtype=torch.uint8), 1000, 1, "delta-varint")[0] == 128


def test_decode_checks_payload_type() -> None:
    with pytest.raises(TypeError, match="uint8"):
        decode_piece(torch.tensor([1, 2], dtype=torch.int8), 10, 2, "delta-varint")
    with pytest.raises(ValueError, match="1-D"):
        decode_piece(torch.zeros(2, 2, dtype=torch.uint8), 10, 1, "bitmap")
    with pytest.raises(ValueError, match="encoding"):
        decode_piece(torch.zeros(2, dtype=torch.uint8), 10, 1, "bits")


def test_choose_encoding_picks_smallest_with_fixed_ties() -> None:
    shard_size = 100_000
    for piece in _pieces(shard_size, seed=7):
        choice = choose_encoding(piece, shard_size)
        sizes = {e: encoded_size(piece, shard_size, e) for e in ENCODINGS}
        assert sizes[choice] == min(sizes.values())
        assert ENCODINGS.index(choice) == min(ENCODINGS.index(e) for e in ENCODINGS if sizes[e] == sizes[choice])
    g = torch.Generator().manual_seed(0)
    dense = torch.randperm(shard_size, generator=g)[: shard_size // 2].sort().values
    sparse = torch.randperm(shard_size, generator=g)[: shard_size // 1000].sort().values
    assert choose_encoding(dense, shard_size) == "bitmap"
    assert choose_encoding(sparse, shard_size) == "delta-varint"
    # without delta-varint, indices win over the bitmap below density 1/32
    assert analytic_size(100, shard_size, "int32") < analytic_size(100, shard_size, "bitmap")
    assert analytic_size(5000, shard_size, "int32") > analytic_size(5000, shard_size, "bitmap")
    # ties: a single index in an 8-element shard costs 1 byte as bitmap and as varint
    assert choose_encoding(torch.tensor([3]), 8) == "bitmap"
    # bitmap 4 B = varint 4 B (int32 16 B): bitmap wins
    assert choose_encoding(torch.tensor([0, 8, 16, 24]), 32) == "bitmap"
    # int32 4 B = varint 4 B (2**21 needs 4 varint bytes), bitmap 512 KiB: int32 wins
    assert choose_encoding(torch.tensor([2**21]), 2**22) == "int32"
    assert encoded_size(torch.tensor([2**21]), 2**22, "delta-varint") == 4
    assert choose_encoding(torch.tensor([31]), 32) == "delta-varint"  # 1 B beats 4 B


def test_round_trip_of_a_large_one_percent_piece() -> None:
    """40,000 of 4,000,000 positions: exact in every encoding, at the sizes the formats define."""
    shard_size, k = 4_000_000, 40_000
    g = torch.Generator().manual_seed(0)
    piece = torch.randperm(shard_size, generator=g)[:k].sort().values
    payloads = {}
    for encoding in ENCODINGS:
        payload = encode_piece(piece, shard_size, encoding)
        assert payload.numel() == encoded_size(piece, shard_size, encoding)
        assert torch.equal(decode_piece(payload, shard_size, k, encoding), piece), encoding
        payloads[encoding] = payload
    # the formats, computed here: 4 bytes an index; one bit a position; 7 bits a varint byte
    assert torch.equal(payloads["int32"].view(torch.int32).long(), piece)
    bits = np.unpackbits(payloads["bitmap"].numpy(), bitorder="little")
    assert bits.size == shard_size and torch.equal(torch.from_numpy(np.flatnonzero(bits)), piece)
    gaps = torch.diff(piece, prepend=torch.tensor([-1])) - 1
    varint_bytes = sum(max(1, math.ceil(int(v).bit_length() / 7)) for v in gaps)
    assert payloads["delta-varint"].numel() == varint_bytes < payloads["int32"].numel() < payloads["bitmap"].numel()
    assert choose_encoding(piece, shard_size) == "delta-varint"


def test_mask_codec_benchmark_rows() -> None:
    """The timing lives in ``optim.apps.benchmarks.mask_codec``; here only its rows (exact bytes, no speed)."""
    rows = bench_mask_codec(shard_size=1000, k=10, repeats=2)
    assert [r["encoding"] for r in rows] == list(ENCODINGS)
    by_encoding = {r["encoding"]: r["payload_bytes"] for r in rows}
    assert by_encoding["int32"] == 40 and by_encoding["bitmap"] == 125
    assert 10 <= by_encoding["delta-varint"] <= 20  # indices below 1000: one or two varint bytes each
    for r in rows:
        assert (r["shard_size"], r["k"]) == (1000, 10)
        assert 0 < r["min_ms"] <= r["median_ms"]
    assert "delta-varint" in format_mask_codec_table(rows)
    with pytest.raises(ValueError):
        bench_mask_codec(shard_size=10, k=11)
