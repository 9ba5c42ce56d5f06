"""Averaging in a few bits per value: a quantized all-reduce with error feedback on both sides.

A sum of low-bit codes cannot be reduced by the transport (the codes of
different ranks have different scales), so the reduction runs at the owner of
each chunk, as in a reduce-scatter:

1. every rank encodes each of the ``world_size`` chunks of its values
   (chunk ``r`` is owned by rank ``r``) with a :class:`Quantizer` and sends
   chunk ``r`` to rank ``r`` (an all-to-all made of send/recv pairs, so it runs
   over every transport of :mod:`bindings`, the fault-aware one included);
2. the owner decodes the ``world_size`` contributions in rank order, averages
   them, adds its own *residual* (what its earlier encodings of the average
   dropped), encodes the result and keeps the new residual;
3. one all-gather of the owners' codes; every rank decodes the same bytes, so
   the result is identical everywhere.

Each rank gets back what the encoding of its own values dropped (its
*error*); a caller that adds it to its next input (error feedback) loses
nothing in the long run. Wire bytes per rank: ``2 * (world_size - 1)`` encoded
chunks, the same as a reduce-scatter plus an all-gather of values of
:meth:`Quantizer.bits_per_value` bits.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from bindings import Communicator, Work

__all__ = ["QUANT_BITS", "QUANTIZED_TAG", "Quantizer", "quantized_all_reduce"]

logger = logging.getLogger(__name__)

QUANT_BITS = (1, 2, 4, 8)
"""Code widths a :class:`Quantizer` offers."""

QUANTIZED_TAG = 0x5C0D
"""Send/recv tag of the all-to-all step."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Quantizer:
    """Blockwise quantization of float32 values to ``bits``-bit codes with a bfloat16 scale ``s`` per block.

    The ``2**bits`` levels are ``(u - h) * s`` for codes ``u = 0 .. 2**bits - 1``
    and ``h = (2**bits - 1) / 2`` (symmetric, no zero level), each value
    rounded to the nearest level:

    * 4 and 8 bits: ``s`` is the block's largest magnitude over ``h`` (nothing clips);
    * 2 bits: ``s`` is the block's root mean square (levels ``±s/2``, ``±3s/2``;
      larger values clip), which halves the error of a largest-magnitude scale
      on heavy-tailed values;
    * 1 bit: the sign, with the block's mean magnitude as the level (the
      level that minimises the squared error for given signs).

    Deterministic: the same values give the same bytes on every rank.

    Attributes:
        bits: Code width, one of :data:`QUANT_BITS`.
        block: Values per scale; a multiple of 8.
    """

    bits: int = 4
    block: int = 64

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or self.bits not in QUANT_BITS:
            raise ValueError(f"Invalid bits: {self.bits!r} (must be one of {QUANT_BITS})")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 8 or self.block % 8:
            raise ValueError(f"Invalid block: {self.block!r} (must be a positive multiple of 8)")

    def bits_per_value(self) -> float:
        """Wire bits per value, scales included."""
        return self.bits + 16.0 / self.block

    def encoded_bytes(self, n: int) -> int:
        """Bytes of the encoding of ``n`` values."""
        blocks = math.ceil(n / self.block)
        return blocks * (2 + self.block * self.bits // 8)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode 1-D float32 ``x``; return ``(bytes, decoded)`` (``decoded``: what a decoder will read)."""
        n, blk, bits = x.numel(), self.block, self.bits
        blocks = math.ceil(n / blk)
        xb = torch.zeros(blocks * blk, dtype=torch.float32, device=x.device)
        xb[:n] = x
        xb = xb.view(blocks, blk)
        if bits == 1:
            scale = xb.abs().mean(dim=1).to(torch.bfloat16)
            codes = (xb >= 0).to(torch.uint8)
        else:
            h = (2**bits - 1) / 2
            spread = xb.square().mean(dim=1).sqrt_() if bits == 2 else xb.abs().amax(dim=1).div_(h)
            scale = spread.to(torch.bfloat16)
            s = scale.float().clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)
            codes = (xb / s).add_(h).round_().clamp_(0, 2 * h).to(torch.uint8)
        decoded = self._values(codes, scale)[:n]
        out = torch.empty(self.encoded_bytes(n), dtype=torch.uint8, device=x.device)
        out[: 2 * blocks] = scale.view(torch.uint8)
        per = 8 // bits
        c = codes.view(-1, per)
        packed = c[:, 0].clone()
        for j in range(1, per):
            packed |= c[:, j] << (j * bits)
        out[2 * blocks :] = packed
        return out, decoded

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        """Decode the bytes of :meth:`encode` of ``n`` values into float32."""
        if data.dtype != torch.uint8 or data.numel() != self.encoded_bytes(n):
            raise ValueError(f"data: expected {self.encoded_bytes(n)} uint8 bytes for {n} values, got {data.numel()}")
        blocks, bits = math.ceil(n / self.block), self.bits
        scale = data[: 2 * blocks].view(torch.bfloat16)
        packed = data[2 * blocks :]
        mask = (1 << bits) - 1
        per = 8 // bits
        codes = torch.stack([(packed >> (j * bits)) & mask for j in range(per)], dim=1).view(blocks, self.block)
        return self._values(codes, scale)[:n]

    def _values(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        s = scale.float().unsqueeze(1)
        if self.bits == 1:
            v = codes.float().mul_(2.0).sub_(1.0).mul_(s)
        else:
            v = codes.float().sub_((2**self.bits - 1) / 2).mul_(s)
        return v.reshape(-1)


def _check(comm: Communicator, values: object, quantizer: object, residual: object) -> int:
    if not isinstance(quantizer, Quantizer):
        raise TypeError(f"quantizer: expected a Quantizer, got {type(quantizer).__name__}")
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values: expected a torch.Tensor, got {type(values).__name__}")
    if values.dtype != torch.float32 or values.dim() != 1 or not values.is_contiguous():
        raise ValueError(f"values: expected a contiguous 1-D float32 tensor, got {values.dtype} {tuple(values.shape)}")
    ws = comm.world_size
    if values.numel() % ws:
        raise ValueError(f"values: numel {values.numel()} is not a multiple of world_size {ws}")
    chunk = values.numel() // ws
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"residual: expected a torch.Tensor or None, got {type(residual).__name__}")
        if residual.dtype != torch.float32 or residual.shape != (chunk,) or residual.device != values.device:
            raise ValueError(
                f"residual: expected float32 ({chunk},) on {values.device}, "
                f"got {residual.dtype} {tuple(residual.shape)} on {residual.device}"
            )
    return chunk


def quantized_all_reduce(
    comm: Communicator, values: torch.Tensor, quantizer: Quantizer, *, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """Average ``values`` across ranks in ``quantizer``'s codes, in place; return this rank's encoding error.

    Collective: every rank of ``comm`` must call this with the same number of
    values and the same quantizer.

    Args:
        comm: The communicator.
        values: ``world_size * c`` float32 values; chunk ``r`` (elements
            ``[r * c, (r + 1) * c)``) is averaged by rank ``r``. On return they
            hold the average as every rank decodes it (the same everywhere).
        quantizer: The encoding of both directions.
        residual: This rank's ``c`` float32 values of error feedback for its
            own chunk: added to the average before it is encoded, and left
            holding what that encoding dropped. ``None``: what it drops is lost.

    Returns:
        ``values`` as given minus what this rank contributed (its own encoding
        error), a new tensor.

    Raises:
        TypeError, ValueError: Bad arguments (before any communication).
        CommError: The transport failed or ran past the communicator's timeout;
            ``values`` and ``residual`` are then left as they were.
    """
    chunk = _check(comm, values, quantizer, residual)
    ws, rank = comm.world_size, comm.rank
    nbytes = quantizer.encoded_bytes(chunk)
    sent = torch.empty(ws, nbytes, dtype=torch.uint8, device=values.device)
    mine = torch.empty_like(values)
    for r in range(ws):
        sent[r], mine[r * chunk : (r + 1) * chunk] = quantizer.encode(values[r * chunk : (r + 1) * chunk])
    error = values - mine
    got = torch.empty_like(sent)
    got[rank] = sent[rank]
    with comm.stats.scope("quantized_all_reduce"):
        works: list[Work] = []
        for step in range(1, ws):
            dst, src = (rank + step) % ws, (rank - step) % ws
            recv = comm.recv(got[src], src, tag=QUANTIZED_TAG, async_op=True)
            send = comm.send(sent[dst], dst, tag=QUANTIZED_TAG, async_op=True)
            works += [w for w in (recv, send) if isinstance(w, Work)]
        for w in works:
            w.wait()
        avg = torch.zeros(chunk, dtype=torch.float32, device=values.device)
        for r in range(ws):
            avg += quantizer.decode(got[r], chunk)
        avg /= ws
        if residual is not None:
            avg += residual
        own, decoded = quantizer.encode(avg)
        gathered = torch.empty(ws * nbytes, dtype=torch.uint8, device=values.device)
        comm.all_gather(gathered, own)
    # written only once every transfer finished: a failed call leaves values and residual as they were
    if residual is not None:
        torch.sub(avg, decoded, out=residual)
    for r in range(ws):
        values[r * chunk : (r + 1) * chunk] = quantizer.decode(gathered[r * nbytes : (r + 1) * nbytes], chunk)
    return error
