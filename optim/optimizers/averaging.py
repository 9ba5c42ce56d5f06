"""Averaging replicas a window at a time: the engine of :class:`optim.LocalAdamS` and :class:`optim.LocalOptimizer`.

Every rank steps its own *replica* of some flat buffers (the parameters, maybe
the first moment); after each step, a :class:`ReplicaAverager` averages part
of them over the ranks. It is put together from small parts, each with one job:

* :class:`Averaging`: the settings, with their ``"auto"`` values resolved
  (:func:`auto_wire_bits`);
* a *schedule* (:class:`Staggered`: a window of ``k`` positions of every shard,
  moving by ``k`` each step, in a *window order* of
  :mod:`optim.optimizers.window_order`; :class:`Periodic`: every position every
  ``period`` steps) says what is averaged after a step;
* an *encoding* (:class:`Codes`: the changes since the last average in
  low-bit codes with error feedback, at once or beside the next step;
  :class:`Changes`: the changes as bfloat16 values; :class:`Values`: the
  float32 values themselves) says how it travels.

The codes' averaging itself (window slots, the exchange on a background
thread) is :mod:`optim.optimizers.code_averaging`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from bindings import ReduceOp
from bindings.validate import check_bool, check_choice, check_density, check_int
from optim.optimizers.code_averaging import CodeAverager, WindowSlots
from optim.optimizers.window_order import WINDOW_ORDERS, window_positions
from sparsecomm.collectives import sparse_all_reduce
from sparsecomm.mask import ShardedMask, k_for
from sparsecomm.quantized import QUANT_BITS, Quantizer

__all__ = [
    "LOCAL_SCHEDULES",
    "WIRE_DTYPES",
    "Averaging",
    "Changes",
    "Codes",
    "Encoding",
    "Periodic",
    "ReplicaAverager",
    "Schedule",
    "Staggered",
    "Tracked",
    "Values",
    "auto_wire_bits",
]


# ---------------------------------------------------------------------- settings
LOCAL_SCHEDULES = ("staggered", "periodic")
WIRE_DTYPES = (torch.float32, torch.bfloat16)


def auto_wire_bits(density: float, buffers: int = 1) -> int:
    """The code width at ``density``: the widest code whose window covers half of every shard per step.

    The staggered window of ``b``-bit codes covers ``32 * density / (buffers * (b + 0.25))``
    of the positions per step, where ``buffers`` is 2 when the window carries the
    first moment's changes too (``average_moment``). Where no code reaches half of
    them (density below 0.035 with one buffer), 1 bit, the code that covers the most. In the convergence
    suite the replicas' drift between two averages of a position cost more
    than the codes' coarseness until positions were averaged about every
    other step (``benchmarks/README.md``).
    """
    if buffers not in (1, 2):
        raise ValueError(f"Invalid buffers: {buffers!r} (must be 1 or 2)")
    for bits in sorted(QUANT_BITS, reverse=True):
        if 32.0 * density / (buffers * Quantizer(bits=bits).bits_per_value()) >= 0.5:
            return bits
    return min(QUANT_BITS)


@dataclass(frozen=True, kw_only=True)
class Averaging:
    """How the replicas are averaged, every ``"auto"`` resolved (:meth:`resolve`).

    Attributes:
        density: Value bytes per step as a fraction of a dense exchange of the replica.
        schedule: ``"staggered"`` or ``"periodic"``.
        warmup_steps: Steps that average the gradients instead (dense).
        wire_dtype: ``torch.bfloat16``: the changes since the last average travel (an anchor per buffer);
            ``torch.float32``: the values themselves.
        wire_bits: The code width of the changes, or ``None`` (``wire_dtype`` values).
        window_order: ``"contiguous"`` or ``"spread"``.
        average_moment: Whether the window carries the first moment's changes too.
        overlap: Whether each averaging lands one step late, beside the next step.
        wire_density: Fraction of the positions averaged per step at the wire's size per position.
        narrow: Whether the window of the parameters' changes alone covers under half of each shard per step
            (the switch of the ``"auto"`` settings).
    """

    density: float
    schedule: str
    warmup_steps: int
    wire_dtype: torch.dtype
    wire_bits: int | None
    window_order: str
    average_moment: bool
    overlap: bool
    wire_density: float
    narrow: bool

    @property
    def period(self) -> int:
        """Steps between two dense averages (``periodic``)."""
        return max(1, round(1.0 / self.wire_density))

    @classmethod
    def resolve(
        cls,
        *,
        density: object,
        schedule: str,
        warmup_steps: object,
        wire_dtype: torch.dtype,
        wire_bits: int | str | None,
        window_order: str,
        average_moment: bool | str,
        overlap: object,
    ) -> Averaging:
        """Check the settings and resolve their ``"auto"`` values (see :class:`optim.LocalAdamS`).

        Raises:
            ValueError: A bad or contradictory setting.
        """
        check_choice("schedule", schedule, LOCAL_SCHEDULES)
        check_choice("window_order", window_order, WINDOW_ORDERS)
        check_choice("wire_dtype", wire_dtype, WIRE_DTYPES)
        check_choice("average_moment", average_moment, ("auto", True, False))
        overlapped = check_bool("overlap", overlap)
        d = check_density(density)
        warmup = check_int("warmup_steps", warmup_steps, low=0)
        scale = float(torch.finfo(torch.float32).bits // torch.finfo(wire_dtype).bits)
        auto_bits = wire_bits == "auto"
        if auto_bits:
            wire_bits = None if wire_dtype == torch.float32 else auto_wire_bits(d)
        if isinstance(wire_bits, str) or not (wire_bits is None or wire_bits in QUANT_BITS):
            raise ValueError(f"Invalid wire_bits: {wire_bits!r} (must be 'auto', None or one of {QUANT_BITS})")
        if wire_bits is not None:
            if wire_dtype == torch.float32:
                raise ValueError("wire_bits encodes the changes since the last average: use wire_dtype=torch.bfloat16")
            scale = torch.finfo(torch.float32).bits / Quantizer(bits=wire_bits).bits_per_value()
        narrow = d * scale < 0.5
        if average_moment == "auto":
            average_moment = wire_bits is not None and not narrow
        if average_moment and wire_bits is None:
            raise ValueError("average_moment sends the first moment's changes in codes: set wire_bits")
        buffers = 2 if average_moment else 1
        if average_moment and auto_bits:
            wire_bits = auto_wire_bits(d, buffers)
        if overlapped and wire_bits is None:
            raise ValueError("overlap runs the averaging of the changes in codes beside the next step: set wire_bits")
        if wire_bits is not None:
            scale = torch.finfo(torch.float32).bits / (buffers * Quantizer(bits=wire_bits).bits_per_value())
        if window_order == "auto":
            window_order = "spread" if narrow else "contiguous"
        return cls(
            density=d,
            schedule=schedule,
            warmup_steps=warmup,
            wire_dtype=wire_dtype,
            wire_bits=wire_bits,
            window_order=window_order,
            average_moment=bool(average_moment),
            overlap=overlapped,
            wire_density=min(1.0, d * scale),
            narrow=narrow,
        )

    def tag(self) -> str:
        """The settings as they enter an optimizer's fingerprint."""
        return (
            f"{self.schedule}|{self.wire_dtype}"
            + ("|spread" if self.window_order == "spread" else "")
            + ("" if self.wire_bits is None else f"|int{self.wire_bits}")
            + ("|moment" if self.average_moment else "")
            + ("|overlap" if self.overlap else "")
        )


# ---------------------------------------------------------------------- schedules
class Schedule(Protocol):
    """What is averaged after a step."""

    @property
    def warmup_steps(self) -> int:
        """Steps that average the gradients instead."""
        ...

    def due(self, t: int) -> bool:
        """Whether (part of) the replicas are averaged after step ``t``."""
        ...

    def slots(self, t: int) -> WindowSlots:
        """Where the positions averaged after step ``t`` sit."""
        ...

    def mask(self, t: int) -> ShardedMask | None:
        """The positions averaged after step ``t`` as a mask (``None``: all of them)."""
        ...


@dataclass(frozen=True)
class Staggered:
    """After every step past the warm-up, window ``t - warmup_steps`` of ``k`` positions of every shard."""

    k: int
    numel: int
    shard_size: int
    world_size: int
    order: str
    warmup_steps: int

    def due(self, t: int) -> bool:
        return t >= self.warmup_steps

    def slots(self, t: int) -> WindowSlots:
        return WindowSlots(t - self.warmup_steps, self.k, self.shard_size, self.world_size, self.order)

    def mask(self, t: int) -> ShardedMask:
        pos = window_positions(t - self.warmup_steps, self.k, self.shard_size, self.order)
        return ShardedMask(
            numel=self.numel, world_size=self.world_size, k=self.k, indices=pos.expand(self.world_size, self.k)
        )


@dataclass(frozen=True)
class Periodic:
    """Every position, after every ``period``-th step past the warm-up."""

    period: int
    shard_size: int
    world_size: int
    warmup_steps: int

    def due(self, t: int) -> bool:
        return t >= self.warmup_steps and (t + 1 - self.warmup_steps) % self.period == 0

    def slots(self, t: int) -> WindowSlots:
        return WindowSlots(0, self.shard_size, self.shard_size, self.world_size, "contiguous")

    def mask(self, t: int) -> None:
        return None


# ---------------------------------------------------------------------- encodings
@dataclass
class Tracked:
    """A replicated flat buffer the averaging keeps close: its last average and the owner's residual of its codes."""

    buf: Tensor
    anchor: Tensor | None
    residual: Tensor | None


class Encoding(Protocol):
    """How an averaging travels; one may still be in flight after :meth:`average` returns."""

    def average(self, t: int, schedule: Schedule, tracked: list[Tracked]) -> None:
        """Average ``tracked`` at the positions of step ``t``. Collective: every rank must call this."""
        ...

    def land(self) -> None:
        """Write the averaging in flight into the buffers (no-op if none)."""
        ...

    def landed_into(self, buf: Tensor) -> None:
        """Add to ``buf`` what the averaging in flight will add to it (no-op if none)."""
        ...

    def wait(self) -> None:
        """Wait until the averaging in flight has moved its bytes."""
        ...

    def drop(self) -> None:
        """Forget the averaging in flight unwaited. Local."""
        ...

    def abandon(self) -> None:
        """:meth:`drop` and let any thread go. Local."""
        ...

    def close(self) -> None:
        """Land the averaging in flight and stop any thread."""
        ...


class _AtOnce:
    """An encoding whose averaging lands in the step that starts it."""

    def land(self) -> None:
        pass

    def landed_into(self, buf: Tensor) -> None:
        pass

    def wait(self) -> None:
        pass

    def drop(self) -> None:
        pass

    def abandon(self) -> None:
        pass

    def close(self) -> None:
        pass


class Values(_AtOnce):
    """The float32 values themselves: a dense all_reduce, or a sparse one of the window."""

    def __init__(self, comm: Any, numel: int) -> None:
        self.comm, self.numel = comm, numel

    def average(self, t: int, schedule: Schedule, tracked: list[Tracked]) -> None:
        mask = schedule.mask(t)
        for tr in tracked:
            if mask is None:
                self.comm.all_reduce(tr.buf, ReduceOp.AVG)
            else:
                sparse_all_reduce(self.comm, tr.buf[: self.numel], mask, "avg", verify_mask=False)


class Changes(_AtOnce):
    """The changes since the anchor as ``dtype`` values (one padded buffer of them)."""

    def __init__(self, comm: Any, numel: int, padded_numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.comm, self.numel = comm, numel
        self._delta = torch.zeros(padded_numel, dtype=dtype, device=device)

    def average(self, t: int, schedule: Schedule, tracked: list[Tracked]) -> None:
        mask, delta = schedule.mask(t), self._delta
        for tr in tracked:
            flat, anchor = tr.buf, tr.anchor
            assert anchor is not None
            if mask is None:
                torch.sub(flat, anchor, out=delta)
                self.comm.all_reduce(delta, ReduceOp.AVG)
                anchor.add_(delta)
                flat.copy_(anchor)
                continue
            pos = mask.global_indices(flat.device)
            averaged = anchor.index_select(0, pos)
            delta.index_copy_(0, pos, flat.index_select(0, pos).sub_(averaged).to(delta.dtype))
            sparse_all_reduce(self.comm, delta[: self.numel], mask, "avg", verify_mask=False)
            averaged.add_(delta.index_select(0, pos))
            anchor.index_copy_(0, pos, averaged)
            flat.index_copy_(0, pos, averaged)


class Codes:
    """The changes since the anchor in low-bit codes with error feedback (:class:`CodeAverager`)."""

    def __init__(self, comm: Any, quantizer: Quantizer, *, overlap: bool, numel: int, own_numel: int) -> None:
        self.codes = CodeAverager(comm, quantizer, overlap=overlap, numel=numel, own_numel=own_numel)

    def average(self, t: int, schedule: Schedule, tracked: list[Tracked]) -> None:
        self.codes.land()  # overlap: the averaging started after the last step
        anchored = [(tr.buf, tr.anchor, tr.residual) for tr in tracked]
        self.codes.start(t, schedule.slots(t), anchored)  # type: ignore[arg-type]

    def land(self) -> None:
        self.codes.land()

    def landed_into(self, buf: Tensor) -> None:
        self.codes.landed_into(buf)

    def wait(self) -> None:
        self.codes.wait()

    def drop(self) -> None:
        self.codes.drop()

    def abandon(self) -> None:
        self.codes.abandon()

    def close(self) -> None:
        self.codes.close()


# ---------------------------------------------------------------------- the averager
_ANCHOR_NAMES = {"params": ("anchor", "wire_residual"), "exp_avg": ("exp_avg_anchor", "exp_avg_wire_residual")}


class ReplicaAverager:
    """Averages replicated flat buffers over the ranks after each step, as :class:`Averaging` says.

    Args:
        comm: The communicator.
        bucket: The flat layout of the buffers (:class:`optim.optimizers.buckets.FlatBucket`).
        averaging: The resolved settings.
        buffers: The flat buffers to average by name: ``"params"`` (the
            replica) and, with ``average_moment``, ``"exp_avg"`` (its first moment).
    """

    def __init__(self, comm: Any, bucket: Any, averaging: Averaging, buffers: dict[str, Tensor]) -> None:
        a, b = averaging, bucket
        self.averaging, self.world_size = a, b.world_size
        self.k = k_for(b.numel, b.world_size, a.wire_density)
        """Positions of every shard averaged per step (staggered)."""
        self.schedule: Schedule = (
            Staggered(self.k, b.numel, b.shard_size, b.world_size, a.window_order, a.warmup_steps)
            if a.schedule == "staggered"
            else Periodic(a.period, b.shard_size, b.world_size, a.warmup_steps)
        )
        self.quantizer = None if a.wire_bits is None else Quantizer(bits=a.wire_bits)
        anchored = a.wire_dtype != torch.float32
        self.tracked: dict[str, Tracked] = {}
        for name, buf in buffers.items():
            self.tracked[name] = Tracked(
                buf,
                buf.clone() if anchored else None,
                b.new_shard() if self.quantizer is not None else None,
            )
        self.encoding: Encoding
        if self.quantizer is not None:
            self.encoding = Codes(comm, self.quantizer, overlap=a.overlap, numel=b.numel, own_numel=b.real)
        elif anchored:
            self.encoding = Changes(comm, b.numel, b.padded_numel, a.wire_dtype, buffers["params"].device)
        else:
            self.encoding = Values(comm, b.numel)
        self._repost = False  # restored with the last step's averaging unsent: send it at the next step

    def anchor(self, name: str = "params") -> Tensor | None:
        """The last average of every position of buffer ``name`` (``None``: float32 values, no anchor)."""
        return self.tracked[name].anchor

    def after_step(self, t: int) -> None:
        """Average what the schedule says after step ``t``. Collective: every rank must call this after every step.

        During the warm-up the replicas are identical: the anchors follow them.
        """
        if t < self.averaging.warmup_steps:
            for tr in self.tracked.values():
                if tr.anchor is not None:
                    tr.anchor.copy_(tr.buf)
            return
        if self.world_size == 1 or not self.schedule.due(t):
            return  # one rank: nothing to average (and no rounding of its own changes)
        self.encoding.average(t, self.schedule, list(self.tracked.values()))

    def settle(self, step: int) -> None:
        """Before step ``step``, after a restore: send the averaging step ``step - 1`` started (the same bytes)."""
        if not self._repost:
            return
        self._repost = False
        t = step - 1
        if self.world_size > 1 and t >= self.averaging.warmup_steps and self.schedule.due(t):
            self.encoding.average(t, self.schedule, list(self.tracked.values()))

    def quiesce(self) -> None:
        """Drop the averaging in flight unwaited before a restore; the restored state sends it again."""
        self.encoding.drop()
        self._repost = self.averaging.overlap

    def land(self) -> None:
        """Write the averaging in flight into the buffers (no-op without one)."""
        self.encoding.land()

    def landed_into(self, buf: Tensor) -> None:
        """Add to ``buf`` what the averaging in flight will add to it; anchors and residuals stay as they are."""
        self.encoding.landed_into(buf)

    def wait(self) -> None:
        """Wait until the averaging in flight has moved its bytes; it still lands at the next step."""
        self.encoding.wait()

    def abandon(self) -> None:
        """Drop the averaging in flight without waiting for it (its transport failed). Local."""
        self._repost = False
        self.encoding.abandon()

    def close(self) -> None:
        """Land the averaging still in flight and stop its thread."""
        self.encoding.close()

    def full_state(self) -> dict[str, Tensor]:
        """The anchors (full size), by their snapshot names."""
        return {_ANCHOR_NAMES[n][0]: tr.anchor for n, tr in self.tracked.items() if tr.anchor is not None}

    def own_state(self) -> dict[str, Tensor]:
        """The owner's residuals of the codes (this rank's shard), by their snapshot names."""
        return {_ANCHOR_NAMES[n][1]: tr.residual for n, tr in self.tracked.items() if tr.residual is not None}
