"""The blockwise quantizer of the quantized all-reduce: levels, error bounds, bytes, bad arguments."""

from __future__ import annotations

import math

import pytest
import torch

from sparsecomm.quantized import QUANT_BITS, Quantizer


def _values(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.distributions.StudentT(3.0).sample((n,)) * torch.rand(n, generator=g)


@pytest.mark.parametrize("bits", QUANT_BITS)
@pytest.mark.parametrize("n", [1, 63, 64, 1000])
def test_decode_reads_what_encode_says_and_bytes_are_exact(bits: int, n: int) -> None:
    q = Quantizer(bits=bits)
    x = _values(n)
    data, decoded = q.encode(x)
    assert data.dtype == torch.uint8
    assert data.numel() == q.encoded_bytes(n) == math.ceil(n / 64) * (2 + 64 * bits // 8)
    assert torch.equal(q.decode(data, n), decoded)
    again, _ = q.encode(x.clone())
    assert torch.equal(data, again)  # deterministic: the same bytes on every rank


@pytest.mark.parametrize("bits", [4, 8])
def test_wide_codes_never_clip_and_err_by_at_most_half_a_level(bits: int) -> None:
    q = Quantizer(bits=bits)
    x = _values(4096, seed=1)
    _, dec = q.encode(x)
    xb, db = x.view(-1, 64), dec.view(-1, 64)
    h = (2**bits - 1) / 2
    step = xb.abs().amax(dim=1, keepdim=True) / h * 1.01  # the bfloat16 scale rounds by < 1%
    assert ((xb - db).abs() <= step / 2 + 1e-7).all()


def test_error_shrinks_with_bits_and_two_bits_beat_one() -> None:
    x = _values(8192, seed=2)
    errs = [float((x - Quantizer(bits=b).encode(x)[1]).norm() / x.norm()) for b in QUANT_BITS]
    assert errs == sorted(errs, reverse=True), errs
    assert errs[-1] < 0.02  # 8 bits: about 1% on heavy-tailed values


def test_one_bit_keeps_signs_and_the_blocks_mean_magnitude() -> None:
    x = _values(128, seed=3)
    _, dec = Quantizer(bits=1).encode(x)
    assert torch.equal(dec >= 0, x >= 0)
    mean = x.view(2, 64).abs().mean(dim=1).to(torch.bfloat16).float()
    assert torch.equal(dec.view(2, 64).abs(), mean[:, None].expand(2, 64))


def test_zero_block_decodes_to_zero_for_wide_codes() -> None:
    for bits in (2, 4, 8):
        _, dec = Quantizer(bits=bits).encode(torch.zeros(70))
        assert dec.abs().max() == 0.0


@pytest.mark.parametrize(
    "kwargs", [{"bits": 3}, {"bits": 0}, {"bits": True}, {"bits": 4.0}, {"block": 12}, {"block": 0}, {"block": True}]
)
def test_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Quantizer(**kwargs)


def test_decode_checks_its_bytes() -> None:
    q = Quantizer(bits=4)
    data, _ = q.encode(torch.ones(10))
    with pytest.raises(ValueError):
        q.decode(data[:-1], 10)
    with pytest.raises(ValueError):
        q.decode(data.to(torch.int8), 10)


def _f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


@pytest.mark.parametrize("bits", QUANT_BITS)
@pytest.mark.parametrize("n", [5, 64, 200])
def test_bytes_and_decoded_values_match_a_per_value_reference(bits: int, n: int) -> None:
    """Every code from its definition, one value at a time, given the block's scale (checked to ~bfloat16)."""
    q = Quantizer(bits=bits)
    x = _values(n, seed=3)
    x[0], x[-1] = 0.0, -0.0
    data, dec = q.encode(x)
    blocks, per, mask, h = math.ceil(n / 64), 8 // bits, (1 << bits) - 1, (2**bits - 1) / 2
    scales = data[: 2 * blocks].view(torch.bfloat16).float().tolist()
    packed = data[2 * blocks :].tolist()
    xs = x.tolist() + [0.0] * (blocks * 64 - n)
    for b in range(blocks):
        vals = xs[b * 64 : (b + 1) * 64]
        if bits == 1:
            want = sum(abs(v) for v in vals) / 64
        elif bits == 2:
            want = math.sqrt(sum(v * v for v in vals) / 64)
        else:
            want = max(abs(v) for v in vals) / h
        assert scales[b] == pytest.approx(want, rel=2**-8)
    tiny = torch.finfo(torch.float32).tiny
    for i, v in enumerate(xs):
        s = scales[i // 64]
        if bits == 1:
            code = int(v >= 0)
            level = (_f32(code) * 2 - 1) * _f32(s)
        else:
            code = int(min(max(torch.round(_f32(v) / _f32(max(s, tiny)) + h).item(), 0), 2 * h))
            level = (_f32(code) - h) * _f32(s)
        assert (packed[i // per] >> ((i % per) * bits)) & mask == code, (i, v)
        if i < n:
            assert dec[i].view(torch.int32) == level.view(torch.int32), (i, v)


@pytest.mark.parametrize("bits", QUANT_BITS)
@pytest.mark.parametrize("n", [64, 1000])
def test_encode_and_decode_into_given_buffers(bits: int, n: int) -> None:
    q = Quantizer(bits=bits)
    x = _values(n, seed=4)
    data, dec = q.encode(x)
    out, into = torch.empty(q.encoded_bytes(n), dtype=torch.uint8), torch.empty(n)
    got, got_dec = q.encode(x, out=out, decoded=into)
    assert got is out and got_dec is into and torch.equal(out, data) and torch.equal(into, dec)
    back = torch.empty(n)
    assert q.decode(data, n, out=back) is back and torch.equal(back, dec)
    with pytest.raises(ValueError, match="out"):
        q.encode(x, out=torch.empty(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="decoded"):
        q.encode(x, decoded=torch.empty(n, dtype=torch.float64))
    with pytest.raises(TypeError, match="out"):
        q.decode(data, n, out=[0.0] * n)  # type: ignore[arg-type]
