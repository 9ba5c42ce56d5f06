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
3. every owner sends its codes to every other rank (an all-gather, again made
   of send/recv pairs); every rank decodes the same bytes, so the result is
   identical everywhere.

Each rank gets back what the encoding of its own values dropped (its
*error*); a caller that adds it to its next input (error feedback) loses
nothing in the long run. Wire bytes per rank: ``2 * (world_size - 1)`` encoded
chunks, the same as a reduce-scatter plus an all-gather of values of
:meth:`Quantizer.bits_per_value` bits (each direction in its own codes where
the averages get a ``gather_quantizer``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable

import torch

from bindings import Communicator, Work
from bindings.validate import check_choice, check_int

__all__ = ["QUANT_BITS", "QUANTIZED_TAG", "Quantizer", "quantized_all_reduce"]

logger = logging.getLogger(__name__)

QUANT_BITS = (1, 2, 4, 8)
"""Code widths a :class:`Quantizer` offers."""

QUANTIZED_TAG = 0x5C0D
"""Send/recv tag of the all-to-all step (``QUANTIZED_TAG + 1``: the gather of the averages)."""


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
        check_choice("bits", check_int("bits", self.bits), QUANT_BITS)
        if check_int("block", self.block, low=8) % 8:
            raise ValueError(f"Invalid block: {self.block!r} (must be a positive multiple of 8)")

    def bits_per_value(self) -> float:
        """Wire bits per value, scales included."""
        return self.bits + 16.0 / self.block

    def encoded_bytes(self, n: int) -> int:
        """Bytes of the encoding of ``n`` values."""
        blocks = math.ceil(n / self.block)
        return blocks * (2 + self.block * self.bits // 8)

    def encode(
        self, x: torch.Tensor, *, out: torch.Tensor | None = None, decoded: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode 1-D float32 ``x``; return ``(bytes, decoded)`` (``decoded``: what a decoder will read).

        Args:
            x: The values (1-D float32).
            out: Where to write the bytes (``encoded_bytes(n)`` uint8); ``None``: a new tensor.
            decoded: Where to write the decoded values (``n`` float32, not
                overlapping ``x``); ``None``: a new tensor.
        """
        n, blk = x.numel(), self.block
        out = _buffer(out, "out", self.encoded_bytes(n), torch.uint8, x.device)
        dec = _buffer(decoded, "decoded", n, torch.float32, x.device)
        full, blocks = n // blk, math.ceil(n / blk)
        scales, packed, per_block = out[: 2 * blocks].view(torch.bfloat16), out[2 * blocks :], blk * self.bits // 8
        if full:
            xb, work = x[: full * blk].view(full, blk), dec[: full * blk].view(full, blk)
            self._encode_blocks(xb, scales[:full], packed[: full * per_block], work)
        if blocks > full:  # the last block, padded with zeros
            tail = torch.zeros(1, blk, dtype=torch.float32, device=x.device)
            tail[0, : n - full * blk] = x[full * blk :]
            work = torch.empty_like(tail)
            self._encode_blocks(tail, scales[full:], packed[full * per_block :], work)
            dec[full * blk :] = work[0, : n - full * blk]
        return out, dec

    def _encode_blocks(self, xb: torch.Tensor, scales: torch.Tensor, packed: torch.Tensor, work: torch.Tensor) -> None:
        """Encode ``[b, block]`` values into ``b`` scales and their packed codes; ``work`` ends up decoded."""
        bits = self.bits
        if bits == 1:
            scale = torch.abs(xb, out=work).mean(dim=1).to(torch.bfloat16)
            codes = torch.ge(xb, 0).view(torch.uint8)
            work.copy_(codes)
        else:
            h = (2**bits - 1) / 2
            if bits == 2:
                spread = torch.mul(xb, xb, out=work).mean(dim=1).sqrt_()
            else:  # the largest magnitude: max(max x, -min x), two passes without a full-size temporary
                spread = torch.maximum(xb.amax(dim=1), xb.amin(dim=1).neg_()).abs_().div_(h)
            scale = spread.to(torch.bfloat16)
            s = scale.float().clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)
            torch.div(xb, s, out=work).add_(h).round_().clamp_(0, 2 * h)
            codes = work.to(torch.uint8)
        scales.copy_(scale)
        per = 8 // bits
        c = codes.view(-1, per)
        packed.copy_(c[:, 0])
        for j in range(1, per):
            packed |= c[:, j] << (j * bits)
        self._values_(work, scale)

    def decode(self, data: torch.Tensor, n: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode the bytes of :meth:`encode` of ``n`` values into float32 (into ``out`` if given)."""
        if data.dtype != torch.uint8 or data.numel() != self.encoded_bytes(n):
            raise ValueError(f"data: expected {self.encoded_bytes(n)} uint8 bytes for {n} values, got {data.numel()}")
        dec = _buffer(out, "out", n, torch.float32, data.device)
        blk = self.block
        full, blocks = n // blk, math.ceil(n / blk)
        scales, packed, per_block = data[: 2 * blocks].view(torch.bfloat16), data[2 * blocks :], blk * self.bits // 8
        if full:
            self._decode_blocks(scales[:full], packed[: full * per_block], dec[: full * blk].view(full, blk))
        if blocks > full:
            work = torch.empty(1, blk, dtype=torch.float32, device=data.device)
            self._decode_blocks(scales[full:], packed[full * per_block :], work)
            dec[full * blk :] = work[0, : n - full * blk]
        return dec

    def _decode_blocks(self, scales: torch.Tensor, packed: torch.Tensor, work: torch.Tensor) -> None:
        bits = self.bits
        mask, per = (1 << bits) - 1, 8 // bits
        c = work.view(-1, per)
        if per >= 4:  # 1 and 2 bits: every byte's codes from a table (4x faster than shifting per code)
            torch.index_select(_byte_levels(bits, packed.device), 0, packed.int(), out=c)
            work.mul_(scales.float().unsqueeze(1))
            return
        for j in range(per):
            c[:, j].copy_(packed if per == 1 else (packed >> (j * bits)) & mask)
        self._values_(work, scales)

    def _values_(self, codes: torch.Tensor, scale: torch.Tensor) -> None:
        """Codes held as floats, ``[blocks, block]``, into their values, in place."""
        s = scale.float().unsqueeze(1)
        if self.bits == 1:
            codes.mul_(2.0).sub_(1.0).mul_(s)
        else:
            codes.sub_((2**self.bits - 1) / 2).mul_(s)


@functools.lru_cache(maxsize=16)
def _byte_levels(bits: int, device: torch.device) -> torch.Tensor:
    """``[256, 8 // bits]`` float32: the unscaled levels of the codes packed in each byte value."""
    per, mask = 8 // bits, (1 << bits) - 1
    codes = torch.tensor([[(b >> (j * bits)) & mask for j in range(per)] for b in range(256)], dtype=torch.float32)
    levels = codes.mul_(2.0).sub_(1.0) if bits == 1 else codes.sub_((2**bits - 1) / 2)
    return levels.to(device)


def _buffer(buf: torch.Tensor | None, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``buf`` checked to be a contiguous 1-D ``dtype`` tensor of ``numel`` elements on ``device``, or a new one."""
    if buf is None:
        return torch.empty(numel, dtype=dtype, device=device)
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(buf).__name__}")
    if buf.dtype != dtype or buf.shape != (numel,) or buf.device != device or not buf.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous {dtype} ({numel},) tensor on {device}, "
            f"got {buf.dtype} {tuple(buf.shape)} on {buf.device}"
        )
    return buf


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


def _exchange(comm: Communicator, outgoing: Callable[[int], torch.Tensor], got: torch.Tensor, tag: int) -> None:
    """Send ``outgoing(r)`` to every other rank ``r`` and receive row ``r`` of ``got`` from it (point to point)."""
    ws, rank = comm.world_size, comm.rank
    works: list[Work] = []
    for step in range(1, ws):
        dst, src = (rank + step) % ws, (rank - step) % ws
        recv = comm.recv(got[src], src, tag=tag, async_op=True)
        send = comm.send(outgoing(dst), dst, tag=tag, async_op=True)
        works += [w for w in (recv, send) if isinstance(w, Work)]
    for w in works:
        w.wait()


def quantized_all_reduce(
    comm: Communicator,
    values: torch.Tensor,
    quantizer: Quantizer,
    *,
    residual: torch.Tensor | None = None,
    gather_quantizer: Quantizer | None = None,
) -> torch.Tensor:
    """Average ``values`` across ranks in ``quantizer``'s codes, in place; return this rank's encoding error.

    Collective: every rank of ``comm`` must call this with the same number of
    values and the same quantizer. It moves its bytes in point-to-point
    messages of its own tags only (:data:`QUANTIZED_TAG`), no collective, so
    one call may run on another thread beside the caller's collectives on
    the same communicator (:class:`optim.LocalAdamS` with ``overlap=True``),
    as long as no two calls run at once.

    Args:
        comm: The communicator.
        values: ``world_size * c`` float32 values; chunk ``r`` (elements
            ``[r * c, (r + 1) * c)``) is averaged by rank ``r``. On return they
            hold the average as every rank decodes it (the same everywhere).
        quantizer: The encoding of the values every rank sends to the owners,
            and of the averages too unless ``gather_quantizer`` is given.
        residual: This rank's ``c`` float32 values of error feedback for its
            own chunk: added to the average before it is encoded, and left
            holding what that encoding dropped. ``None``: what it drops is lost.
        gather_quantizer: The encoding of the averages the owners send to
            every rank (``None``: ``quantizer``). The ranks' codes are
            averaged, which shrinks their error; the average's codes are what
            every rank decodes, so a wider code counts more there for the
            same bytes (:class:`optim.CodedGradients`).

    Returns:
        ``values`` as given minus what this rank contributed (its own encoding
        error), a new tensor.

    Raises:
        TypeError, ValueError: Bad arguments (before any communication).
        CommError: The transport failed or ran past the communicator's timeout;
            ``values`` and ``residual`` are then left as they were.
    """
    chunk = _check(comm, values, quantizer, residual)
    if gather_quantizer is None:
        gather_quantizer = quantizer
    elif not isinstance(gather_quantizer, Quantizer):
        raise TypeError(f"gather_quantizer: expected a Quantizer or None, got {type(gather_quantizer).__name__}")
    ws, rank = comm.world_size, comm.rank
    nbytes, gbytes = quantizer.encoded_bytes(chunk), gather_quantizer.encoded_bytes(chunk)
    sent = torch.empty(ws, nbytes, dtype=torch.uint8, device=values.device)
    error = torch.empty_like(values)  # first what this rank's codes decode to
    for r in range(ws):
        part = slice(r * chunk, (r + 1) * chunk)
        quantizer.encode(values[part], out=sent[r], decoded=error[part])
    torch.sub(values, error, out=error)
    got = torch.empty_like(sent)
    got[rank] = sent[rank]
    with comm.stats.scope("quantized_all_reduce"):
        _exchange(comm, lambda r: sent[r], got, QUANTIZED_TAG)
        avg = torch.zeros(chunk, dtype=torch.float32, device=values.device)
        contribution = torch.empty_like(avg)
        for r in range(ws):
            avg += quantizer.decode(got[r], chunk, out=contribution)
        avg /= ws
        if residual is not None:
            avg += residual
        own, decoded = gather_quantizer.encode(avg, decoded=contribution)
        gathered = torch.empty(ws * gbytes, dtype=torch.uint8, device=values.device)
        gathered.view(ws, gbytes)[rank] = own
        _exchange(comm, lambda r: own, gathered.view(ws, gbytes), QUANTIZED_TAG + 1)
    # written only once every transfer finished: a failed call leaves values and residual as they were
    if residual is not None:
        torch.sub(avg, decoded, out=residual)
    for r in range(ws):
        piece = gathered[r * gbytes : (r + 1) * gbytes]
        gather_quantizer.decode(piece, chunk, out=values[r * chunk : (r + 1) * chunk])
    return error
