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
