"""Averaging replicas in low-bit codes a window at a time, at once or beside the next step.

Every rank holds a *replica* of some flat buffers (the parameters, maybe the
first moment) and, for each, the *anchor*: the last average of every
position, the same on every rank. After a step, the positions of a window
(:class:`WindowSlots`) are averaged: each rank sends its change since the
anchor in :class:`sparsecomm.quantized.Quantizer` codes, each position's owner
averages them (:func:`sparsecomm.quantized.quantized_all_reduce`, point to
point only), and every rank adds the average to its anchor. Each rank keeps
what the codes of its own change dropped in its replica, each owner what the
codes of the average dropped in its *residual* (one shard).

:class:`CodeAverager` runs one such averaging in the step that starts it, or
(``overlap``) on a background thread while the caller computes the next step,
landing it after that step: each replica then adds the average minus the
change it sent, keeping what it did meanwhile. It is the ``Codes`` encoding
of :mod:`optim.optimizers.averaging`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from optim.optimizers.window_order import spread_window, window_runs
from sparsecomm.quantized import Quantizer, quantized_all_reduce
from sparsecomm.worker import SerialWorker

__all__ = ["CodeAverager", "WindowSlots"]


class WindowSlots:
    """Where one averaging's positions sit in a flat buffer of ``world_size`` shards, and in one shard.

    Staggered window ``j`` of ``k`` positions per shard in ``order``
    (:func:`window_runs`, :func:`spread_window`), or every position
    (``k = shard_size``, the periodic schedule). Values at the positions are
    ordered shard by shard. The contiguous order works on slices in place;
    the spread order copies whole rows (:class:`optim.optimizers.window_order.SpreadWindow`)
    and hands them back so that a later write into a buffer that did not change
    in between need not copy them again.
    """

    Rows = list[tuple[Tensor, Tensor]] | None

    def __init__(self, j: int, k: int, shard_size: int, world_size: int, order: str) -> None:
        self.shard_size = shard_size
        self.runs = window_runs(j, k, shard_size)
        self.spread = spread_window(j, k, shard_size) if order == "spread" else None

    def _shards(self, x: Tensor) -> list[Tensor]:
        return list(x.view(-1, self.shard_size))

    def _slices(self, x: Tensor, values: Tensor) -> Iterator[tuple[Tensor, Tensor]]:
        """``(x's slice, the values' slice)`` of every run of every shard of ``x`` (contiguous order)."""
        at = 0
        for shard in self._shards(x):
            for a, z in self.runs:
                yield shard[a:z], values[at : at + z - a]
                at += z - a

    def read(self, x: Tensor) -> tuple[Tensor, Rows]:
        """The positions' values of each shard of ``x`` (or of one shard-sized ``x``), a new tensor, and the rows."""
        w = self.spread
        if w is None:
            return torch.cat([s[a:z] for s in self._shards(x) for a, z in self.runs]), None
        rows = [w.take(s) for s in self._shards(x)]
        return torch.cat([w.values(*r) for r in rows]), rows

    def sub_(self, values: Tensor, x: Tensor) -> Rows:
        """``values -= x`` at the positions, in place; returns the rows of ``x`` it copied (spread order)."""
        if self.spread is None:
            for xs, vs in self._slices(x, values):
                vs.sub_(xs)
            return None
        taken, rows = self.read(x)
        values.sub_(taken)
        return rows

    def write(self, x: Tensor, values: Tensor, rows: Rows = None) -> None:
        """Set the positions of ``x`` to ``values``; ``rows``: those :meth:`read` copied of ``x`` unchanged since."""
        w = self.spread
        if w is None:
            for xs, vs in self._slices(x, values):
                xs.copy_(vs)
            return
        shards = self._shards(x)
        for i, (s, v) in enumerate(zip(shards, values.split(values.numel() // len(shards)), strict=True)):
            w.write(s, *(w.take(s) if rows is None else rows[i]), v)

    def land(
        self, buf: Tensor, anchor: Tensor, avg: Tensor, error: Tensor, late: bool, rows: Rows, buf_rows: Rows
    ) -> None:
        """``anchor += avg`` at the positions; then ``buf = anchor + error`` there, or ``late``: ``buf += error``.

        ``rows``: the anchor's rows from :meth:`sub_`; ``buf_rows``: ``buf``'s from :meth:`read` (unchanged since
        unless ``late``).
        """
        w = self.spread
        if w is None:
            for (an, av), (bf, er) in zip(self._slices(anchor, avg), self._slices(buf, error), strict=True):
                an += av
                if late:
                    bf += er
                else:
                    torch.add(an, er, out=bf)
            return
        assert rows is not None
        k = avg.numel() // len(rows)
        for i, (an, bf) in enumerate(zip(self._shards(anchor), self._shards(buf), strict=True)):
            averaged = w.values(*rows[i]).add_(avg[i * k : (i + 1) * k])
            w.write(an, *rows[i], averaged)
            if late:  # buf moved on since it was read: copy its rows again
                bf_rows = w.take(bf)
                w.write(bf, *bf_rows, w.values(*bf_rows).add_(error[i * k : (i + 1) * k]))
            else:
                assert buf_rows is not None
                w.write(bf, *buf_rows[i], averaged.add_(error[i * k : (i + 1) * k]))


@dataclass
class _Part:
    """One buffer's share of an averaging in codes: what the exchange sends and what landing it needs."""

    buf: Tensor
    anchor: Tensor
    residual: Tensor  # the owner's residual (this rank's shard)
    change: Tensor  # the buffer's change since the anchor: sent, then the average
    anchor_rows: WindowSlots.Rows
    buf_rows: WindowSlots.Rows
    mine: Tensor  # the owner's residual at this rank's positions
    mine_rows: WindowSlots.Rows
    error: Tensor | None = None  # after the exchange: this rank's encoding error (late: plus avg - change sent)


@dataclass
class _Exchange:
    """An averaging in codes started after step ``step``: its parts and, with ``overlap``, the worker's future."""

    step: int
    slots: WindowSlots
    parts: list[_Part]
    late: bool
    numel: int  # the buffers' elements before their padding
    own_numel: int  # the elements of this rank's shard before the padding
    done: torch.futures.Future[None] | None = None


def _exchange(comm: Any, quantizer: Quantizer, parts: list[_Part], late: bool) -> None:
    """Average every part's change in codes (point to point only: may run on a worker thread)."""
    for part in parts:
        sent = part.change.clone() if late else None
        part.error = quantized_all_reduce(comm, part.change, quantizer, residual=part.mine)
        if sent is not None:  # lands a step late: add the average minus what this rank sent to its current values
            part.error.add_(part.change).sub_(sent)


class CodeAverager:
    """Averages windows of replicas in codes, in the step that starts them or (``overlap``) one step late.

    Args:
        comm: The communicator (point-to-point messages only).
        quantizer: The codes of both directions.
        overlap: Run each averaging on a background thread beside the caller's
            next step and land it after that step (:meth:`land`); one such
            averager per communicator at a time.
        numel: The buffers' elements before their padding.
        own_numel: The elements of this rank's shard before the padding.
            Landing keeps the padding of buffers, anchors and residuals zero
            (codes need not decode a zero change to zero), so state restored
            with zero padding averages as the original did.
    """

    def __init__(self, comm: Any, quantizer: Quantizer, *, overlap: bool, numel: int, own_numel: int) -> None:
        self.comm, self.quantizer, self.overlap = comm, quantizer, overlap
        self.numel, self.own_numel = numel, own_numel
        self._in_flight: _Exchange | None = None
        self._worker: SerialWorker[None] | None = None

    @property
    def in_flight(self) -> bool:
        """Whether an averaging was started and has not landed yet."""
        return self._in_flight is not None

    def start(self, step: int, slots: WindowSlots, anchored: list[tuple[Tensor, Tensor, Tensor]]) -> None:
        """Average ``(buffer, anchor, owner's residual)`` triples at ``slots``; lands at once unless ``overlap``.

        Collective: every rank must call this with the same slots and buffer sizes.
        """
        parts = []
        for buf, anchor, residual in anchored:
            change, buf_rows = slots.read(buf)
            anchor_rows = slots.sub_(change, anchor)
            mine, mine_rows = slots.read(residual)
            parts.append(_Part(buf, anchor, residual, change, anchor_rows, buf_rows, mine, mine_rows))
        ex = _Exchange(step, slots, parts, late=self.overlap, numel=self.numel, own_numel=self.own_numel)
        if not self.overlap:
            _exchange(self.comm, self.quantizer, parts, late=False)
            _land(ex)
            return
        if self._worker is None:
            self._worker = SerialWorker("sparsecomm-local-average")
        comm, quantizer = self.comm, self.quantizer
        ex.done = self._worker.submit(lambda: _exchange(comm, quantizer, parts, late=True))
        self._in_flight = ex

    def land(self) -> None:
        """Wait for the averaging in flight and write it into the buffers, anchors and residuals (no-op if none)."""
        ex, self._in_flight = self._in_flight, None
        if ex is None:
            return
        assert ex.done is not None
        ex.done.wait()
        _land(ex)

    def wait(self) -> None:
        """Wait until the averaging in flight has moved its bytes; it lands at :meth:`land`."""
        ex = self._in_flight
        if ex is not None and ex.done is not None:
            ex.done.wait()

    def landed_into(self, buf: Tensor) -> None:
        """Write into ``buf`` what the averaging in flight will add to it, leaving anchors and residuals as they are.

        For a look at the replicas as they will be once it lands (the caller
        puts ``buf`` back); a no-op without one in flight.
        """
        ex = self._in_flight
        if ex is None:
            return
        self.wait()
        for part in ex.parts:
            if part.buf is buf:
                assert part.error is not None
                now, rows = ex.slots.read(buf)
                ex.slots.write(buf, now.add_(part.error), rows)

    def drop(self) -> None:
        """Forget the averaging in flight unwaited (its thread writes only its own copies). Local."""
        ex, self._in_flight = self._in_flight, None
        if ex is not None and ex.done is not None and not ex.done.done() and self._worker is not None:
            self._worker.retire()  # it may be blocked on a failed transport: a new thread serves what comes next
            self._worker = None

    def abandon(self) -> None:
        """:meth:`drop`, and let the thread go without waiting for it. Local."""
        self.drop()
        if self._worker is not None:
            self._worker.retire()
            self._worker = None

    def close(self) -> None:
        """Land the averaging in flight and stop the thread."""
        self.land()
        if self._worker is not None:
            self._worker.stop()
            self._worker = None


def _land(ex: _Exchange) -> None:
    for part in ex.parts:
        assert part.error is not None
        ex.slots.write(part.residual, part.mine, part.mine_rows)
        ex.slots.land(part.buf, part.anchor, part.change, part.error, ex.late, part.anchor_rows, part.buf_rows)
        part.buf[ex.numel :].zero_()
        part.anchor[ex.numel :].zero_()
        part.residual[ex.own_numel :].zero_()
