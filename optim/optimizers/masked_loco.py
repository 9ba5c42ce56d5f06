"""SparseLoCo with a mask agreed one outer step ahead: only values travel, through a reduce-scatter and an all-gather.

:class:`optim.SparseLoCo` sends, every H local steps, each rank's own top-k of its
error-feedback accumulator, values and positions, in one all_gather. Here the
flat model (N values) is cut into ``P`` shards of ``S = ceil(N / P)`` positions,
as in SCAPE's partitioned mask, and every rank owns one. After an outer step
each rank picks the ``k`` positions of its shard where its accumulator is
largest, and the ranks all_gather these picks: that is the mask of the *next*
outer step, the same on every rank. An outer step then is::

    e_r = decay * e_r + (global - replica_r)        # the accumulator, as in SparseLoCo
    a   = mean_r Q(e_r[mask])                       # every rank's values at the shared positions, in codes
    e_r[mask] -= Q(e_r[mask])                       # what rank r's codes dropped stays
    global[mask] -= outer_lr * a                    # every rank decodes the same bytes: the same global

with ``a`` from :func:`sparsecomm.quantized.quantized_all_reduce` (each owner
averages its shard's ``k`` values: a reduce-scatter in codes, then an all-gather
of the averages in codes). No position travels with a value; the positions of
the next mask travel once, ``w = ceil(log2 S)`` bits each. The first outer step
agrees on its mask at once (there is no earlier step to do it in).

Bytes of one rank per outer step (the ring convention of :mod:`bindings.stats`),
with ``Q(k)`` the codes of ``k`` values and ``I(k) = ceil(k * w / 8)``::

    (P - 1) * (2 * Q(k) + I(k))

against a dense fp32 all_reduce's ``2 (P - 1) / P * 4N`` per step: equal bytes
at ``2 Q(k) + I(k) = 8 * density * H * N / P``. :func:`masked_loco_plan` picks
``H`` for ``k0 = fraction * S``, then the largest ``k`` that fits, as
:func:`optim.optimizers.sparseloco.sparseloco_plan` does.

The agreement is made right after the outer step here; it could run beside
the next H local steps, which do not need it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from bindings.validate import check_choice, check_density, check_float, check_int
from optim.optimizers.sparseloco import (
    AccumulatorLoop,
    CodedPlan,
    fit_plan,
    pack_indices,
    position_bits,
    unpack_indices,
)
from sparsecomm.quantized import QUANT_BITS, quantized_all_reduce

__all__ = ["MaskedLoCo", "MaskedLoCoPlan", "fixed_masked_plan", "masked_loco_plan"]


@dataclass(frozen=True, kw_only=True)
class MaskedLoCoPlan(CodedPlan):
    """How much one outer step of :class:`MaskedLoCo` sends (beside :class:`~optim.optimizers.sparseloco.CodedPlan`'s
    fields; ``k``: mask positions in each rank's shard).

    Attributes:
        shard: Positions per shard (S; the last shard padded).
        world_size: Ranks (P).
    """

    shard: int
    world_size: int

    @property
    def index_bits(self) -> int:
        """Bits of one position inside its shard (w)."""
        return position_bits(self.shard)

    @property
    def index_bytes(self) -> int:
        """Bytes of one rank's packed mask positions."""
        return math.ceil(self.k * self.index_bits / 8)

    @property
    def message_bytes(self) -> int:
        """Bytes of one rank's share of an outer step: its codes, both ways, and its part of the next mask."""
        return 2 * self.quantizer.encoded_bytes(self.k) + self.index_bytes

    @property
    def round_bytes(self) -> int:
        """Bytes one rank sends per outer step: the values' two passes in codes, then the next mask."""
        return (self.world_size - 1) * self.message_bytes

    def wire_bytes_per_step(self) -> float:
        """Bytes a rank sends per local step on average."""
        return self.round_bytes / self.period


def fixed_masked_plan(numel: int, world_size: int, *, period: int, fraction: float, bits: int = 2) -> MaskedLoCoPlan:
    """The plan of ``period`` and ``k = round(fraction * S)`` (at least 1), ``S = ceil(numel / world_size)``.

    Raises:
        ValueError: A bad argument.
    """
    numel = check_int("numel", numel, low=1)
    ws = check_int("world_size", world_size, low=1)
    frac = check_float("fraction", fraction, low=0.0, high=1.0, low_open=True)
    shard = -(-numel // ws)
    return MaskedLoCoPlan(
        period=check_int("period", period, low=1),
        k=min(shard, max(1, round(frac * shard))),
        shard=shard,
        world_size=ws,
        bits=check_choice("bits", check_int("bits", bits), QUANT_BITS),
    )


def masked_loco_plan(
    density: float, numel: int, world_size: int, *, fraction: float = 0.03, bits: int = 2
) -> MaskedLoCoPlan:
    """``(H, k)`` at which the wire bytes per step are at most (and about) ``density`` times dense fp32's.

    Args:
        density: Wire bytes per step as a fraction of a dense fp32 all_reduce of the model.
        numel: Parameters of the model (N).
        world_size: Ranks (P).
        fraction: The share of every shard to aim ``k`` at (``k0``).
        bits: Code width of the values.

    Raises:
        ValueError: A bad argument.
    """
    d = check_density(density)
    first = fixed_masked_plan(numel, world_size, period=1, fraction=fraction, bits=bits)
    budget = 8.0 * d * numel / first.world_size  # message bytes per local step at equal bytes ((P - 1) on both sides)
    return fit_plan(first, lambda p: p.message_bytes, budget, first.shard)


class MaskedLoCo(AccumulatorLoop):
    """Wrap ``optimizer``: SparseLoCo's outer step over a mask the ranks agreed one outer step ahead.

    See the module docstring.

    Args:
        optimizer, model, warmup_steps, max_grad_norm, group: As :class:`optim.optimizers.outer.OuterLoop`.
        period: Local steps between two outer steps (H, >= 1); ``None``: 15,
            or from ``density``. Not with ``density``.
        fraction: The share of every shard sent per outer step (``k = round(fraction * S)``,
            at least 1); with ``density``, the share the plan aims at.
        density: Wire bytes per step as a fraction of a dense fp32 all_reduce:
            ``(period, k)`` from :func:`masked_loco_plan`; ``None``: from ``period`` and ``fraction``.
        bits: Code width of the sent values (2).
        outer_lr: The learning rate of the outer step (> 0).
        decay: The accumulator's decay (in ``[0, 1)``; 0.95).

    Raises:
        TypeError, ValueError: As :class:`optim.optimizers.outer.OuterLoop`.
    """

    plan: MaskedLoCoPlan

    def __init__(
        self,
        optimizer: Optimizer,
        model: torch.nn.Module,
        *,
        period: int | None = None,
        fraction: float = 0.03,
        density: float | None = None,
        bits: int = 2,
        outer_lr: float = 1.0,
        decay: float = 0.95,
        warmup_steps: int = 10,
        max_grad_norm: float = 0.0,
        group: Any = None,
    ) -> None:
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
            settings="masked",
        )

    def _make_plan(self, *, period: int, fraction: float, density: float | None, bits: int) -> MaskedLoCoPlan:
        b = self._bucket
        if density is None:
            return fixed_masked_plan(b.numel, b.world_size, period=period, fraction=fraction, bits=bits)
        return masked_loco_plan(density, b.numel, b.world_size, fraction=fraction, bits=bits)

    def _make_outer_buffers(self) -> None:
        p, dev = self.plan, self._bucket.device
        self._error = torch.zeros(p.world_size * p.shard, dtype=torch.float32, device=dev)
        self._update = torch.zeros_like(self._error)
        self._mask = torch.zeros(p.world_size * p.k, dtype=torch.int64, device=dev)
        self._agreed = torch.zeros(1, dtype=torch.int64, device=dev)  # 1 once a mask is agreed
        self._base = (torch.arange(p.world_size, device=dev) * p.shard).repeat_interleave(p.k)

    @property
    def error(self) -> Tensor:
        """This rank's accumulator ``e`` (flat fp32, ``P * S`` values; beyond the model's, zeros)."""
        return self._error

    @property
    def mask(self) -> Tensor | None:
        """The flat positions the next outer step sends, shard by shard (``None`` before the first agreement)."""
        return self._mask if int(self._agreed) else None

    def _agree_mask(self) -> None:
        """Every rank picks the ``k`` largest ``|e|`` of its own shard; the ranks all_gather the picks. Collective."""
        n, plan, b = self._bucket.numel, self.plan, self._bucket
        lo = b.rank * plan.shard
        score = self._error[lo : lo + plan.shard].abs()
        real = max(0, min(plan.shard, n - lo))
        score[real:] = -1.0  # the padding goes last
        mine = torch.topk(score, plan.k, sorted=False).indices.sort().values
        payload = pack_indices(mine, plan.index_bits)
        gathered = torch.empty(plan.world_size * payload.numel(), dtype=torch.uint8, device=payload.device)
        self._comm.all_gather(gathered, payload)
        for r, part in enumerate(gathered.view(plan.world_size, -1)):
            self._mask[r * plan.k : (r + 1) * plan.k] = unpack_indices(part, plan.k, plan.index_bits)
        self._mask.add_(self._base)
        self._agreed.fill_(1)

    def _outer_step(self) -> None:
        n, plan, comm, e = self._bucket.numel, self.plan, self._comm, self._error
        e[:n].mul_(self.decay).add_(self._global[:n] - self._flat[:n])
        with comm.stats.scope("masked_loco"):
            if not int(self._agreed):
                self._agree_mask()
            pos = self._mask
            avg = e.index_select(0, pos)
            dropped = quantized_all_reduce(comm, avg, plan.quantizer)  # avg: the average as every rank decodes it
            e.index_copy_(0, pos, dropped)
            e[n:] = 0.0
            u = self._update
            u.zero_().index_copy_(0, pos, avg)
            self._global[:n].sub_(u[:n], alpha=self.outer_lr)
            self._agree_mask()  # the next outer step's mask, from the accumulator as it is now

    def _outer_state(self) -> dict[str, Tensor]:
        return {"error": self._error, "mask": self._mask, "mask_agreed": self._agreed}
