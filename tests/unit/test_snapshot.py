"""The snapshot encoding (:func:`encode_tree` / :func:`decode_tree`) and the double-buffered :class:`SnapshotRing`."""

from __future__ import annotations

import json

import pytest
import torch

from optim.state.snapshot import SnapshotRing, decode_tree, encode_tree

ALL_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 1e3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def _assert_same(a: object, b: object) -> None:
    """Structural equality; tensors bit for bit (dtype, shape, bytes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) if a.numel() else True
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (a.keys(), getattr(b, "keys", lambda: b)())
        for k in a:
            _assert_same(a[k], b[k])
        return
    if isinstance(a, (list, tuple)):
        assert isinstance(b, list) and len(a) == len(b)  # tuples come back as lists
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
        return
    assert type(a) is type(b) and a == b, (a, b)


def _header(buf: torch.Tensor) -> dict:
    n = int.from_bytes(buf[:8].numpy().tobytes(), "little")
    return json.loads(buf[8 : 8 + n].numpy().tobytes())


def _with_header(buf: torch.Tensor, header: object, raw: bytes | None = None) -> torch.Tensor:
    """``buf`` with its header replaced (the tensor bytes kept after it)."""
    n = int.from_bytes(buf[:8].numpy().tobytes(), "little")
    body = buf[8 + n :].numpy().tobytes()
    hb = raw if raw is not None else json.dumps(header).encode()
    data = len(hb).to_bytes(8, "little") + hb + body
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


# ------------------------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 0, 2), (4, 5), (2, 3, 4)], ids=str)
def test_round_trip_every_dtype_and_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = _tensor(dtype, shape)
    back = decode_tree(encode_tree(t))
    _assert_same(t, back)


def test_round_trip_bfloat16_bits_exact() -> None:
    # every bfloat16 bit pattern, NaNs and infinities included, survives unchanged
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    t = bits.view(torch.bfloat16)
    back = decode_tree(encode_tree({"w": t}))["w"]
    assert back.dtype == torch.bfloat16
    assert torch.equal(back.view(torch.int16), bits)


def test_round_trip_nested_tree() -> None:
    tree = {
        "optim": {
            "state": {0: {"m": _tensor(torch.float32, (5, 3)), "v": _tensor(torch.bfloat16, (5, 3), 1)}, 7: {}},
            "masks": [_tensor(torch.bool, (11,)), None, [_tensor(torch.int64, (2,)), []]],
            "empty": torch.empty(0, 4, dtype=torch.float16),
        },
        "rng": torch.get_rng_state(),
        "step": 12,
        "lr": 3e-4,
        "name": "scape ü",
        "flags": [True, False, None],
        -3: "negative int key",
        "tuple": (1, 2.5, "x"),
    }
    back = decode_tree(encode_tree(tree))
    _assert_same(tree, back)
    assert set(back["optim"]["state"]) == {0, 7}  # int keys stay ints
    assert -3 in back


def test_decoded_tensors_are_independent_of_the_buffer() -> None:
    t = torch.arange(6, dtype=torch.float32)
    buf = encode_tree({"t": t})
    back = decode_tree(buf)["t"]
    buf.zero_()
    assert torch.equal(back, torch.arange(6, dtype=torch.float32))


def test_encode_into_out_buffer_and_trailing_bytes_ignored() -> None:
    tree = {"a": _tensor(torch.float64, (9,)), "b": [1, 2]}
    exact = encode_tree(tree)
    out = torch.full((exact.numel() + 100,), 0xAB, dtype=torch.uint8)
    got = encode_tree(tree, out)
    assert got.data_ptr() == out.data_ptr() and got.numel() == exact.numel()
    assert torch.equal(got, exact)
    _assert_same(tree, decode_tree(out))  # the 0xAB tail after the content is ignored
    small = torch.zeros(4, dtype=torch.uint8)
    grown = encode_tree(tree, small)  # too small: a new tensor, ``small`` untouched
    assert grown.data_ptr() != small.data_ptr() and torch.equal(grown, exact)
    assert not small.any()


def test_encode_rejects_unsupported_values() -> None:
    with pytest.raises(TypeError):
        encode_tree({"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(TypeError):
        encode_tree({(1, 2): 3})
    with pytest.raises(TypeError):
        encode_tree({"s": {1, 2}})
    with pytest.raises(TypeError):
        encode_tree(object())


# ------------------------------------------------------------------------------------- corrupted input
@pytest.fixture
def good() -> torch.Tensor:
    return encode_tree({"a": torch.arange(10, dtype=torch.int32), "b": [torch.ones(2, 3)], "s": 5})


def test_decode_rejects_bad_container() -> None:
    with pytest.raises(ValueError):
        decode_tree(torch.zeros(16, dtype=torch.int64))
    with pytest.raises(ValueError):
        decode_tree(torch.zeros(4, 4, dtype=torch.uint8))
    with pytest.raises(ValueError):
        decode_tree(b"not a tensor")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        decode_tree(torch.zeros(5, dtype=torch.uint8))  # shorter than the length field


@pytest.mark.parametrize("hlen", [0, -1 & ((1 << 64) - 1), 1 << 40, 10_000])
def test_decode_rejects_bad_header_length(good: torch.Tensor, hlen: int) -> None:
    buf = good.clone()
    buf[:8] = torch.frombuffer(bytearray(hlen.to_bytes(8, "little")), dtype=torch.uint8)
    with pytest.raises(ValueError, match="header length"):
        decode_tree(buf)


def test_decode_rejects_truncated_buffer(good: torch.Tensor) -> None:
    n = int.from_bytes(good[:8].numpy().tobytes(), "little")
    with pytest.raises(ValueError):
        decode_tree(good[: 8 + n // 2].clone())  # header cut
    with pytest.raises(ValueError):
        decode_tree(good[:-1].clone())  # last tensor byte missing


@pytest.mark.parametrize(
    "raw", [b"{not json", b"\xff\xfe\x00", b"[1, 2]", b'"tree"', b'{"tree": 1}', b'{"tensors": []}', b"null"]
)
def test_decode_rejects_non_json_or_malformed_header(good: torch.Tensor, raw: bytes) -> None:
    with pytest.raises(ValueError):
        decode_tree(_with_header(good, None, raw=raw))


def _mutate_meta(good: torch.Tensor, **fields: object) -> torch.Tensor:
    header = _header(good)
    header["tensors"][0].update(fields)
    return _with_header(good, header)


@pytest.mark.parametrize(
    "fields",
    [
        {"offset": 10_000},  # range past the buffer
        {"nbytes": 10_000},
        {"offset": 1 << 62},
        {"offset": -4},
        {"nbytes": -40},
        {"offset": "0"},
        {"offset": True},
        {"nbytes": 4.0},
        {"offset": None},
    ],
    ids=str,
)
def test_decode_rejects_bad_tensor_range(good: torch.Tensor, fields: dict) -> None:
    with pytest.raises(ValueError):
        decode_tree(_mutate_meta(good, **fields))


@pytest.mark.parametrize("dtype", ["torch.complex64", "float32", "torch.qint8", "", None, 3, ["torch.int32"]], ids=str)
def test_decode_rejects_unknown_dtype(good: torch.Tensor, dtype: object) -> None:
    with pytest.raises(ValueError, match="dtype"):
        decode_tree(_mutate_meta(good, dtype=dtype))


@pytest.mark.parametrize(
    "shape", [[11], [2, 5, 2], [-10], [10.0], ["10"], [True] * 10, 10, None, {"0": 10}, [1 << 40, 1 << 40]], ids=str
)
def test_decode_rejects_bad_shape(good: torch.Tensor, shape: object) -> None:
    with pytest.raises(ValueError):
        decode_tree(_mutate_meta(good, shape=shape))


def test_decode_rejects_shape_whose_element_count_overflows_int64(good: torch.Tensor) -> None:
    # 2**62 * 4 elements wrap to 0 in int64: with nbytes 0 that must not pass as an empty tensor
    with pytest.raises(ValueError):
        decode_tree(_mutate_meta(good, shape=[1 << 62, 4], nbytes=0, offset=0))


def test_decode_accepts_a_consistent_reshape(good: torch.Tensor) -> None:
    # sanity of the mutation helper: a shape with the same byte count is fine
    back = decode_tree(_mutate_meta(good, shape=[2, 5]))
    assert torch.equal(back["a"], torch.arange(10, dtype=torch.int32).reshape(2, 5))


@pytest.mark.parametrize(
    "tree",
    [
        {"__tensor__": 5},  # reference past the tensor list
        {"__tensor__": -1},
        {"__tensor__": True},
        {"__tensor__": "0"},
        {"__dict__": [["a"]]},
        {"__dict__": [[["k"], 1]]},
        {"__dict__": [[1.5, 1]]},
        {"__dict__": "ab"},
        {"__list__": 3},
        {"__pickle__": "x"},
        {"__tensor__": 0, "extra": 1},
        {"__list__": [{"__tensor__": 9}]},
    ],
    ids=str,
)
def test_decode_rejects_bad_tree_nodes(good: torch.Tensor, tree: object) -> None:
    header = _header(good)
    header["tree"] = tree
    with pytest.raises(ValueError):
        decode_tree(_with_header(good, header))


def test_decode_rejects_bad_tensor_list(good: torch.Tensor) -> None:
    for tensors in ({"0": {}}, [5], ["x"], [None]):
        header = _header(good)
        header["tensors"] = tensors
        with pytest.raises(ValueError):
            decode_tree(_with_header(good, header))


def test_decode_survives_random_corruption(good: torch.Tensor) -> None:
    """Changing any header byte either still decodes or raises ``ValueError``: never another exception."""
    n = int.from_bytes(good[:8].numpy().tobytes(), "little")
    g = torch.Generator().manual_seed(1)
    for pos in range(8 + n):
        # every byte inverted, then XORed with a random non-zero mask: each buffer differs from the original
        for mask in (0xFF, int(torch.randint(1, 256, (1,), generator=g))):
            buf = good.clone()
            buf[pos] ^= mask
            assert int(buf[pos]) != int(good[pos])
            try:
                decode_tree(buf)
            except ValueError:
                pass


# ------------------------------------------------------------------------------------------ SnapshotRing
def test_ring_keeps_the_newest_two_versions() -> None:
    ring = SnapshotRing()
    trees = {v: {"step": v, "x": torch.full((100,), float(v))} for v in range(6)}
    for v in range(6):
        ring.put(v, trees[v])
        assert ring.versions() == list(range(max(0, v - 1), v + 1))
        for held in ring.versions():
            _assert_same(trees[held], decode_tree(ring.get(held)))
    assert ring.get(0) is None and ring.get(3) is None and ring.get(99) is None
    assert len(ring._buffers) == 3  # allocated once, reused


def test_ring_never_overwrites_a_held_version_while_writing() -> None:
    ring = SnapshotRing()
    ring.put(1, {"x": torch.full((64,), 1.0)})
    ring.put(2, {"x": torch.full((64,), 2.0)})
    held = {v: ring.get(v).clone() for v in (1, 2)}
    views = {v: ring.get(v) for v in (1, 2)}
    # the write of version 3 goes to the third buffer: both held versions stay intact meanwhile
    ring.put(3, {"x": torch.full((64,), 3.0)})
    assert torch.equal(views[2], held[2])
    assert torch.equal(views[1], held[1])  # dropped from the ring, but its bytes were not the ones written
    # version 4 reuses the buffer of version 1 (the oldest), never the ones of 2 or 3 while writing
    v3 = ring.get(3).clone()
    ring.put_bytes(4, encode_tree({"x": torch.full((64,), 4.0)}))
    assert torch.equal(views[2], held[2])  # version 2's buffer was not the one written
    assert ring.versions() == [3, 4]
    assert torch.equal(ring.get(3), v3)
    assert decode_tree(ring.get(4))["x"][0].item() == 4.0


def test_ring_write_buffer_is_disjoint_from_held_buffers() -> None:
    """Whatever the sizes, the buffer a new version is written into is never one of the held versions'."""
    ring = SnapshotRing()
    sizes = [10, 500, 20, 2000, 5, 5, 3000, 1, 800]
    for v, n in enumerate(sizes):
        held = {u: (ring.get(u).data_ptr(), ring.get(u).clone()) for u in ring.versions()}
        if v % 2:
            ring.put_bytes(v, encode_tree({"x": torch.full((n,), v, dtype=torch.int16)}))
        else:
            ring.put(v, {"x": torch.full((n,), v, dtype=torch.int16)})
        new_ptr = ring.get(v).data_ptr()
        for u, (ptr, data) in held.items():
            assert new_ptr != ptr, (v, u)
            if u in ring.versions():
                assert torch.equal(ring.get(u), data), (v, u)
        x = decode_tree(ring.get(v))["x"]
        assert x.numel() == n and bool((x == v).all())


def test_ring_clear_and_nbytes() -> None:
    ring = SnapshotRing()
    ring.put(5, {"x": torch.zeros(1000)})
    ring.put(6, {"x": torch.zeros(1000)})
    assert ring.nbytes() >= 2 * 4000
    ring.clear()
    assert ring.versions() == [] and ring.get(5) is None
    assert ring.nbytes() >= 2 * 4000  # the buffers stay allocated
    ring.put(7, {"x": torch.ones(3)})
    assert ring.versions() == [7]
