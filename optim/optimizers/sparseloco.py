"""SparseLoCo (Sarfi et al. 2025): local steps, then a chunk-wise top-k of an error-feedback accumulator in 2-bit codes.

Every rank runs ``period`` (H) steps of the wrapped optimizer (AdamW in the
paper) on its own replica; then the outer step (:class:`optim.optimizers.outer.OuterLoop`)::

    e_r = decay * e_r + (global - replica_r)       # the accumulator: error feedback and outer momentum at once
    s_r = Q(top-k per chunk of |e_r|)              # k entries of every chunk, their values in 2-bit codes
    e_r -= s_r                                     # at the sent positions: what the codes dropped stays
    global -= outer_lr * sum_r(s_r) / world_size   # every rank decodes the same bytes: the same global

and every replica takes the new global parameters. The flat model (N
values) is cut into ``m = ceil(N / chunk)`` chunks of ``c = ceil(N / m)``
positions (the last one padded). A rank's message of one outer step is the
:class:`sparsecomm.quantized.Quantizer` codes of its ``m * k`` values
(``bits`` bits each, a bfloat16 scale per 64) and their positions inside their
chunks in ``w = ceil(log2 c)`` bits each (12 for chunks of 4096)::

    payload(k) = ceil(m*k / 64) * (2 + 64 * bits / 8) + ceil(m * k * w / 8)   bytes

One all_gather of it moves ``(P - 1) * payload(k)`` bytes per rank (the ring
convention of :mod:`bindings.stats`), ``(P - 1) * payload(k) / H`` per step,
where a dense fp32 all_reduce of the model moves ``2 (P - 1) / P * 4N``. So
SparseLoCo sends ``density`` times the dense bytes per step when

    payload(k) = 8 * density * H * N / P

:func:`sparseloco_plan` picks ``(H, k)`` for a density: ``k0 = fraction * c``
(3% by default, the top of the paper's 1-3%), ``H = max(1, round(payload(k0) / (8 d N / P)))``,
then the largest ``k <= c`` whose payload fits ``8 d H N / P`` (so the bytes
come out at or just under ``density``; ``H`` is 1 where even one step's
budget holds more than ``k0`` entries per chunk, and ``k`` grows instead).
Memory beside the inner optimizer: the global parameters and the accumulator
(two fp32 copies of the model) and the update of one outer step (a third).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.optim import Optimizer

from bindings.validate import check_choice, check_density, check_float, check_int
from optim.optimizers.outer import OuterLoop
from sparsecomm.quantized import QUANT_BITS, Quantizer

__all__ = [
    "AccumulatorLoop",
    "CodedPlan",
    "SparseLoCo",
    "SparseLoCoPlan",
    "fit_plan",
    "fixed_plan",
    "pack_indices",
    "position_bits",
    "sparseloco_plan",
    "unpack_indices",
]

logger = logging.getLogger(__name__)

_BLOCK = 64
"""Values per bfloat16 scale of the codes."""

DEFAULT_PERIOD = 15
"""H when neither ``period`` nor ``density`` is given."""


def position_bits(positions: int) -> int:
    """Bits of one position among ``positions`` (at least 1)."""
    return max(1, (positions - 1).bit_length())


@dataclass(frozen=True, kw_only=True)
class CodedPlan:
    """What the plans of the accumulator loops share (:class:`AccumulatorLoop`).

    Attributes:
        period: Local steps between two outer steps (H).
        k: Entries sent per chunk or shard and outer step.
        bits: Code width of the values.
    """

    period: int
    k: int
    bits: int

    @property
    def quantizer(self) -> Quantizer:
        """The values' codes: ``bits`` bits each, a bfloat16 scale per 64."""
        return Quantizer(bits=self.bits, block=_BLOCK)


@dataclass(frozen=True, kw_only=True)
class SparseLoCoPlan(CodedPlan):
    """How much one SparseLoCo outer step sends (beside :class:`CodedPlan`'s fields).

    Attributes:
        chunks: Number of chunks (m).
        chunk: Positions per chunk (c; the last chunk padded).
    """

    chunks: int
    chunk: int

    @property
    def index_bits(self) -> int:
        """Bits of one position inside its chunk (w)."""
        return position_bits(self.chunk)

    @property
    def value_bytes(self) -> int:
        """Bytes of the codes of one rank's ``m * k`` values."""
        return self.quantizer.encoded_bytes(self.chunks * self.k)

    @property
    def payload_bytes(self) -> int:
        """Bytes one rank sends per outer step: the codes, then the packed positions."""
        return self.value_bytes + math.ceil(self.chunks * self.k * self.index_bits / 8)

    def wire_bytes_per_step(self, world_size: int) -> float:
        """Bytes a rank sends per local step on average (the all_gather's ring volume over H)."""
        return (world_size - 1) * self.payload_bytes / self.period


def fixed_plan(numel: int, *, period: int, fraction: float, chunk: int = 4096, bits: int = 2) -> SparseLoCoPlan:
    """The plan of ``period`` and ``k = round(fraction * c)`` (at least 1) for a model of ``numel`` parameters.

    The model is cut into ``m = ceil(numel / chunk)`` chunks of ``c = ceil(numel / m)`` positions.

    Raises:
        ValueError: A bad argument.
    """
    frac = check_float("fraction", fraction, low=0.0, high=1.0, low_open=True)
    numel = check_int("numel", numel, low=1)
    chunk = check_int("chunk", chunk, low=2, high=1 << 24)
    m = -(-numel // chunk)
    c = -(-numel // m)
    k = min(c, max(1, round(frac * c)))
    return SparseLoCoPlan(
        period=check_int("period", period, low=1),
        k=k,
        chunks=m,
        chunk=c,
        bits=check_choice("bits", check_int("bits", bits), QUANT_BITS),
    )


def sparseloco_plan(
    density: float, numel: int, world_size: int, *, chunk: int = 4096, fraction: float = 0.03, bits: int = 2
) -> SparseLoCoPlan:
    """``(H, k)`` at which SparseLoCo's wire bytes per step are at most (and about) ``density`` times dense fp32's.

    See the module docstring for the formula. Every rank computes the same plan.

    Args:
        density: Wire bytes per step as a fraction of a dense fp32 all_reduce of the model.
        numel: Parameters of the model (N).
        world_size: Ranks (P).
        chunk: Largest chunk.
        fraction: The share of every chunk to aim ``k`` at (``k0``).
        bits: Code width of the values.

    Raises:
        ValueError: A bad argument.
    """
    d = check_density(density)
    check_int("world_size", world_size, low=1)
    first = fixed_plan(numel, period=1, fraction=fraction, chunk=chunk, bits=bits)  # k0
    budget = 8.0 * d * numel / world_size  # payload bytes per local step at equal bytes
    return fit_plan(first, lambda p: p.payload_bytes, budget, first.chunk)


PlanT = TypeVar("PlanT")


def fit_plan(first: PlanT, message_bytes: Callable[[PlanT], int], budget: float, most: int) -> PlanT:
    """``first`` (a frozen plan with ``period`` and ``k``) at equal bytes: H, then the largest k that fits.

    ``H = max(1, round(message_bytes(first) / budget))``, then the largest
    ``k <= most`` (at least 1) whose message fits ``H * budget``.

    Args:
        first: The plan at its aimed-at ``k`` (``k0``).
        message_bytes: One rank's bytes per outer step of a plan, up to a factor both sides share.
        budget: Those bytes per local step that equal ``density`` times a dense fp32 all_reduce.
        most: The largest ``k``.
    """
    period = max(1, round(message_bytes(first) / budget))
    lo, hi = 1, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if message_bytes(dataclasses.replace(first, k=mid)) <= period * budget:  # type: ignore[type-var]
            lo = mid
        else:
            hi = mid - 1
    return dataclasses.replace(first, period=period, k=lo)  # type: ignore[type-var]


def pack_indices(idx: Tensor, width: int) -> Tensor:
    """Pack int64 ``idx`` (each in ``[0, 2**width)``) into ``ceil(len * width / 8)`` uint8, low bits first."""
    shifts = torch.arange(width, device=idx.device)
    bits = ((idx.unsqueeze(1) >> shifts) & 1).to(torch.uint8).reshape(-1)
    pad = -bits.numel() % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=idx.device)
    return (bits.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_indices(data: Tensor, n: int, width: int) -> Tensor:
    """The ``n`` int64 values :func:`pack_indices` packed into ``data``."""
    bits = ((data.long().unsqueeze(1) >> torch.arange(8, device=data.device)) & 1).reshape(-1)[: n * width]
    return (bits.view(n, width) << torch.arange(width, device=data.device)).sum(dim=1)


class AccumulatorLoop(OuterLoop):
    """An outer loop whose ranks keep an error-feedback accumulator and send part of it (a base class).

    The shape :class:`SparseLoCo` and :class:`optim.MaskedLoCo` share: the
    settings ``period`` or ``density``, ``fraction``, ``bits``, ``outer_lr``
    and ``decay``, checked here; a subclass turns them into its plan
    (:meth:`_make_plan`, with ``period`` and ``k``), makes its buffers and
    defines the outer step.
    """

    plan: Any
    """What one outer step sends (set by the checks)."""

    def __init__(
        self,
        optimizer: Optimizer,
        model: torch.nn.Module,
        *,
        period: int | None,
        fraction: float,
        density: float | None,
        bits: int,
        outer_lr: float,
        decay: float,
        warmup_steps: int,
        max_grad_norm: float,
        group: Any,
        settings: str,
    ) -> None:
        self._given = (period, fraction, density, bits, outer_lr, decay)
        super().__init__(
            optimizer,
            model,
            period=DEFAULT_PERIOD if period is None else period,
            warmup_steps=warmup_steps,
            max_grad_norm=max_grad_norm,
            group=group,
            settings=f"{period}|{fraction}|{density}|{bits}|{outer_lr}|{decay}|{settings}",
        )
        logger.info("%s: %s", type(self).__name__, self.plan)

    def _check_outer(self) -> None:
        period, fraction, density, bits, outer_lr, decay = self._given
        self.outer_lr = check_float("outer_lr", outer_lr, low=0.0, low_open=True)
        self.decay = check_float("decay", decay, low=0.0, high=1.0, high_open=True)
        if density is not None and period is not None:
            raise ValueError("period: give period or density, not both (density sets the period)")
        self.plan = self._make_plan(period=self._period, fraction=fraction, density=density, bits=bits)
        self._period = self.plan.period

    def _make_plan(self, *, period: int, fraction: float, density: float | None, bits: int) -> Any:
        """The plan of ``density`` (``None``: of ``period`` and ``fraction``) for this bucket."""
        raise NotImplementedError


class SparseLoCo(AccumulatorLoop):
    """Wrap ``optimizer`` (the inner one): SparseLoCo's outer step every H steps (module docstring).

    Args:
        optimizer, model, warmup_steps, max_grad_norm, group: As :class:`optim.optimizers.outer.OuterLoop`.
        period: Local steps between two outer steps (H, >= 1); ``None``: 15,
            or from ``density``. Not with ``density``.
        fraction: The share of every chunk sent per outer step (``k = round(fraction * c)``,
            at least 1); with ``density``, the share the plan aims at.
        density: Wire bytes per step as a fraction of a dense fp32 all_reduce:
            ``(period, k)`` from :func:`sparseloco_plan`; ``None``: from ``period`` and ``fraction``.
        chunk: Largest chunk of the top-k (4096 published).
        bits: Code width of the sent values (2 published).
        outer_lr: The learning rate of the outer step (> 0).
        decay: The accumulator's decay (beta, in ``[0, 1)``; 0.95).

    Raises:
        TypeError, ValueError: As :class:`optim.optimizers.outer.OuterLoop` (the same on every rank, before any
            communication but one small agreement).
    """

    plan: SparseLoCoPlan

    def __init__(
        self,
        optimizer: Optimizer,
        model: torch.nn.Module,
        *,
        period: int | None = None,
        fraction: float = 0.03,
        density: float | None = None,
        chunk: int = 4096,
        bits: int = 2,
        outer_lr: float = 1.0,
        decay: float = 0.95,
        warmup_steps: int = 10,
        max_grad_norm: float = 0.0,
        group: Any = None,
    ) -> None:
        self._chunk = chunk
        super().__init__(
            optimizer,
            model,
            period=period,
            fraction=fraction,
            density=density,
            bits=bits,
            outer_lr=outer_lr,
            decay=decay,
            warmup_steps=warmup_steps,
            max_grad_norm=max_grad_norm,
            group=group,
            settings=str(chunk),
        )
        self.last_sent: tuple[Tensor, Tensor] | None = None
        """What this rank sent at its last outer step: flat positions, and their values as every rank decodes them."""

    def _make_plan(self, *, period: int, fraction: float, density: float | None, bits: int) -> SparseLoCoPlan:
        b, chunk = self._bucket, self._chunk
        if density is None:
            return fixed_plan(b.numel, period=period, fraction=fraction, chunk=chunk, bits=bits)
        return sparseloco_plan(density, b.numel, b.world_size, chunk=chunk, fraction=fraction, bits=bits)

    def _make_outer_buffers(self) -> None:
        p, dev = self.plan, self._bucket.device
        self._error = torch.zeros(p.chunks * p.chunk, dtype=torch.float32, device=dev)
        self._update = torch.zeros_like(self._error)
        self._base = (torch.arange(p.chunks, device=dev) * p.chunk).repeat_interleave(p.k)

    @property
    def error(self) -> Tensor:
        """This rank's accumulator ``e`` (flat fp32, ``chunks * chunk`` values; beyond the model's, zeros)."""
        return self._error

    def _outer_step(self) -> None:
        n, plan, comm, e = self._bucket.numel, self.plan, self._comm, self._error
        e[:n].mul_(self.decay).add_(self._global[:n] - self._flat[:n])
        score = e.abs().view(plan.chunks, plan.chunk)
        score.view(-1)[n:] = -1.0  # the padding goes last
        local = torch.topk(score, plan.k, dim=1, sorted=False).indices.reshape(-1)
        pos = local + self._base
        values = e.index_select(0, pos)
        codes, decoded = plan.quantizer.encode(values)
        e.index_copy_(0, pos, values.sub_(decoded))
        e[n:] = 0.0
        payload = torch.cat([codes, pack_indices(local, plan.index_bits)])
        ws, size = self._bucket.world_size, payload.numel()
        gathered = torch.empty(ws * size, dtype=torch.uint8, device=payload.device)
        with comm.stats.scope("sparseloco"):
            comm.all_gather(gathered, payload)
        u, nvals = self._update, plan.chunks * plan.k
        u.zero_()
        for r in range(ws):  # in rank order, each rank's positions distinct: the same sums on every rank
            part = gathered[r * size : (r + 1) * size]
            got = plan.quantizer.decode(part[: plan.value_bytes].clone(), nvals)  # clone: the scales' alignment
            u.index_add_(0, unpack_indices(part[plan.value_bytes :], nvals, plan.index_bits) + self._base, got)
        u.div_(ws)
        self._global[:n].sub_(u[:n], alpha=self.outer_lr)
        self.last_sent = (pos, decoded)

    def _outer_state(self) -> dict[str, Tensor]:
        return {"error": self._error}
