"""Partitioned, delayed mask synchronization.

Each rank owns one shard of the flat buffer and is the only rank that builds
that shard's piece of the next mask, from a score tensor (top-k, ties broken
by index). :meth:`MaskSchedule.propose` encodes the piece and starts an
asynchronous all-gather of the encoded pieces; the assembled mask becomes the
mask of step ``t + 1 + delay`` (``delay`` = D, default 1). With D = 1 the
gather has a whole step of compute to finish, and :meth:`MaskSchedule.mask_for`
waits only when the mask is first needed.

The piece itself (scoring, top-k, encoding) can be built beside the caller's
next compute: :meth:`MaskSchedule.propose` with a *callable* that makes the
scores runs it, the top-k and the encoding on one worker thread (CPU scores
only), and the gather is posted by :meth:`MaskSchedule.settle`, which every
rank calls at the same point of its program (SCAPE: first thing in the next
``step()``); :meth:`MaskSchedule.prefetch` hands a finished gather's decoding
to the same thread (SCAPE: at the end of a step). Pure compute runs on the thread and every collective is posted by
the caller's thread, so collectives keep the same order on every rank, and the
selected positions are the same bit for bit as when proposed in line.

Wire format: every piece is padded to the same number of bytes, so one plain
all-gather carries them. The encoding is a pure function of (k, shard_size),
hence the same on every rank: the smallest *guaranteed* size among

* ``bitmap``: ceil(shard_size / 8) bytes;
* ``int32``: 4k bytes;
* ``delta-varint``: a 4-byte length, then LEB128 gaps, padded to the bound
  k + ceil(k · log128(shard_size / k)) + 1 (Jensen's inequality on the gaps).

So mask bytes never exceed the smaller of the bitmap and int32 sizes, and are
about half the int32 size at densities near 1%.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from bindings import Communicator, Work
from bindings.validate import check_int
from sparsecomm.mask import (
    ShardedMask,
    decode_piece,
    encode_piece,
    k_for,
    shard_size_for,
    topk_piece,
)

__all__ = ["MaskSchedule", "wire_encoding", "varint_bound"]

logger = logging.getLogger(__name__)

_LEN_BYTES = 4


def varint_bound(k: int, shard_size: int) -> int:
    """Upper bound on the delta-varint payload of any k sorted indices below shard_size."""
    return k + math.ceil(k * math.log(max(shard_size / k, 1.0), 128)) + 1


def wire_encoding(k: int, shard_size: int) -> tuple[str, int]:
    """Return (encoding, bytes per piece on the wire) for pieces of k indices."""
    sizes = {
        "bitmap": -(-shard_size // 8),
        "int32": 4 * k,
        "delta-varint": _LEN_BYTES + varint_bound(k, shard_size),
    }
    if shard_size > 2**31 - 1:
        del sizes["int32"]
    order = ("bitmap", "int32", "delta-varint")
    best = min(sizes, key=lambda name: (sizes[name], order.index(name)))
    return best, sizes[best]


def _to_wire(indices: torch.Tensor, shard_size: int, encoding: str, nbytes: int) -> torch.Tensor:
    payload = encode_piece(indices, shard_size, encoding)
    wire = torch.zeros(nbytes, dtype=torch.uint8)
    if encoding == "delta-varint":
        n = payload.numel()
        wire[:_LEN_BYTES] = torch.tensor(list(n.to_bytes(_LEN_BYTES, "little")), dtype=torch.uint8)
        wire[_LEN_BYTES : _LEN_BYTES + n] = payload
    else:
        wire[: payload.numel()] = payload
    return wire


def _from_wire(wire: torch.Tensor, shard_size: int, k: int, encoding: str) -> torch.Tensor:
    if encoding == "delta-varint":
        n = int.from_bytes(bytes(wire[:_LEN_BYTES].tolist()), "little")
        if n > wire.numel() - _LEN_BYTES:
            raise ValueError("mask piece: delta-varint length exceeds the piece")
        return decode_piece(wire[_LEN_BYTES : _LEN_BYTES + n], shard_size, k, encoding)
    return decode_piece(wire, shard_size, k, encoding)


@dataclass
class _InFlight:
    made_at: int
    gathered: torch.Tensor
    work: Work


@dataclass
class _Building:
    made_at: int
    wire: Future[torch.Tensor]


@dataclass
class _Decoding:
    made_at: int
    mask: Future[ShardedMask]


class MaskSchedule:
    """Holds the masks in flight and hands out the mask of each step.

    Args:
        comm: Communicator of the ranks that share the flat buffer.
        numel: N, elements of the flat buffer.
        density: Fraction of positions kept, in (0, 1].
        delay: D: a mask made after step t is used at step t + 1 + D.

    Example::

        sched = MaskSchedule(comm, numel=n, density=0.01, delay=1)
        for step in range(steps):
            mask = sched.mask_for(step)          # None until the first mask arrives
            ...                                  # sparse collectives with mask
            sched.propose(step, my_shard_scores) # the mask of step + 2
    """

    def __init__(self, comm: Communicator, *, numel: int, density: float, delay: int = 1) -> None:
        delay = check_int("delay", delay, low=0)
        self._comm = comm
        self.numel = numel
        self.world_size = comm.world_size
        self.k = k_for(numel, comm.world_size, density)
        self.shard_size = shard_size_for(numel, comm.world_size)
        self.density = density
        self.delay = delay
        self.encoding, self.piece_bytes = wire_encoding(self.k, self.shard_size)
        self._building: dict[int, _Building] = {}
        self._decoding: dict[int, _Decoding] = {}
        self._in_flight: dict[int, _InFlight] = {}
        self._ready: dict[int, ShardedMask] = {}
        self._worker: ThreadPoolExecutor | None = None

    @property
    def own_shard(self) -> tuple[int, int]:
        """(start, stop) of this rank's shard within the N real elements."""
        start = self._comm.rank * self.shard_size
        return min(start, self.numel), min(start + self.shard_size, self.numel)

    def target_step(self, made_at: int) -> int:
        """Step that uses the mask made after ``made_at``."""
        return made_at + 1 + self.delay

    def propose(self, step: int, scores: torch.Tensor | Callable[[], torch.Tensor]) -> int:
        """Build this rank's piece from ``scores`` and start gathering the pieces.

        Collective: every rank must call this for the same ``step``.

        Args:
            step: The step just finished.
            scores: Scores of this rank's shard: as many elements as the shard
                has real positions (``own_shard``), any float dtype and device.
                Or a callable that returns them: it runs, with the top-k and
                the encoding, on the schedule's worker thread, and the gather
                starts at the next :meth:`settle` (or any call that needs the
                mask). The callable must only read state that the caller
                leaves unchanged until then.

        Returns:
            The step that will use the new mask.

        Raises:
            ValueError: Wrong number of scores, or a mask is already in flight for that step.
            TypeError: ``scores`` is neither a float tensor nor a callable
                (a callable's wrong result raises from :meth:`settle`).
        """
        target = self.target_step(step)
        if self.scheduled(target):
            raise ValueError(f"step: a mask for step {target} is already scheduled")
        if callable(scores) and not isinstance(scores, torch.Tensor):
            self._building[target] = _Building(step, self._thread().submit(self._wire_for, scores))
            return target
        self._post(target, step, self._wire_for(scores))
        return target

    def _thread(self) -> ThreadPoolExecutor:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparsecomm-mask")
        return self._worker

    def _wire_for(self, scores: torch.Tensor | Callable[[], torch.Tensor]) -> torch.Tensor:
        if callable(scores) and not isinstance(scores, torch.Tensor):
            scores = scores()
        start, stop = self.own_shard
        if not isinstance(scores, torch.Tensor) or not scores.is_floating_point():
            raise TypeError("scores: expected a floating-point torch.Tensor")
        if scores.numel() != stop - start:
            raise ValueError(f"scores: expected {stop - start} values for this rank's shard, got {scores.numel()}")
        piece = topk_piece(scores.detach().reshape(-1).cpu(), self.k, shard_size=self.shard_size)
        return _to_wire(piece, self.shard_size, self.encoding, self.piece_bytes)

    def _post(self, target: int, made_at: int, wire: torch.Tensor) -> None:
        gathered = torch.empty(self.piece_bytes * self.world_size, dtype=torch.uint8)
        with self._comm.stats.scope("mask_sync"):
            work = self._comm.all_gather(gathered, wire, async_op=True)
        assert work is not None
        self._in_flight[target] = _InFlight(made_at, gathered, work)

    def settle(self) -> None:
        """Wait for the pieces being built on the worker thread and start their gathers.

        Collective: every rank must call this at the same point (it posts the
        gathers of pieces proposed with a callable). Re-raises what building a
        piece raised, on every rank alike (the same bad scores give the same
        error).
        """
        building, self._building = self._building, {}
        failure: BaseException | None = None
        for target in sorted(building):
            try:
                wire = building[target].wire.result()
            except BaseException as exc:  # noqa: BLE001 - joined first, raised below
                failure = failure or exc
                continue
            if failure is None:
                self._post(target, building[target].made_at, wire)
        if failure is not None:
            raise failure

    def discard_unsent(self) -> None:
        """Wait for the pieces being built on the worker thread and drop them unsent (no communication)."""
        building, self._building = self._building, {}
        for entry in building.values():
            entry.wire.exception()

    def prefetch(self) -> None:
        """Decode, on the worker thread, every gathered mask whose gather has already finished (no wait)."""
        for target in sorted(self._in_flight):
            pending = self._in_flight[target]
            if not pending.work.is_completed():
                continue
            del self._in_flight[target]
            pending.work.wait()
            self._decoding[target] = _Decoding(pending.made_at, self._thread().submit(self._decode, pending.gathered))

    def _decode(self, gathered: torch.Tensor) -> ShardedMask:
        wires = gathered.view(self.world_size, self.piece_bytes)
        rows = torch.empty(self.world_size, self.k, dtype=torch.int64)
        for r in range(self.world_size):
            rows[r] = _from_wire(wires[r], self.shard_size, self.k, self.encoding)  # checked while decoded
        mask = ShardedMask._of_checked_rows(rows, self.numel)
        mask.global_indices()  # build the index tensors once, now
        return mask

    def _drop_decoding(self) -> None:
        decoding, self._decoding = self._decoding, {}
        for entry in decoding.values():
            entry.mask.exception()

    def install(self, step: int, mask: ShardedMask) -> None:
        """Use ``mask`` at ``step`` (e.g. a dense or restored mask); every rank must pass the same."""
        if mask.numel != self.numel or mask.world_size != self.world_size:
            raise ValueError("mask: built for another numel or world size")
        self._ready[step] = mask

    def scheduled(self, step: int) -> bool:
        """Whether a mask for ``step`` is installed, being built or being gathered (no wait, nothing dropped)."""
        return step in self._ready or step in self._in_flight or step in self._building or step in self._decoding

    def mask_for(self, step: int) -> ShardedMask | None:
        """Return the mask of ``step``, waiting for its all-gather if it is still in flight.

        Returns ``None`` when no mask was made for ``step`` (warm-up). Masks of
        earlier steps are dropped.
        """
        for old in [s for s in self._ready if s < step]:
            del self._ready[old]
        for old in [s for s in self._decoding if s < step]:
            self._decoding.pop(old).mask.exception()
        return self._ready_mask(step)

    def masks_from(self, step: int, count: int) -> dict[int, ShardedMask]:
        """The masks of steps ``step .. step + count - 1`` that were made, waiting for their gathers; none dropped.

        For saving the schedule: the steps keep their masks for :meth:`mask_for`.
        """
        masks = {s: self._ready_mask(s) for s in range(step, step + count)}
        return {s: m for s, m in masks.items() if m is not None}

    def _ready_mask(self, step: int) -> ShardedMask | None:
        """The mask of ``step``, waited for and kept ready (``None``: none was made)."""
        if step in self._ready:
            return self._ready[step]
        if step in self._building:
            self.settle()
        decoding = self._decoding.pop(step, None)
        if decoding is not None:
            mask = decoding.mask.result()
            made_at = decoding.made_at
        else:
            pending = self._in_flight.pop(step, None)
            if pending is None:
                return None
            pending.work.wait()
            mask = self._decode(pending.gathered)
            made_at = pending.made_at
        self._ready[step] = mask
        logger.debug("mask for step %d (made after step %d) ready", step, made_at)
        return mask

    def close(self) -> None:
        """Finish every gather still in flight and drop them.

        Collective: every rank must call this. A transport may still be
        writing into the buffers of an unfinished gather, so a schedule that
        is thrown away must be closed first (``with MaskSchedule(...)`` does it).
        Pieces still being built are waited for and dropped unsent.
        """
        self.discard_unsent()
        self._drop_decoding()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        pending, self._in_flight = self._in_flight, {}
        for entry in pending.values():
            entry.work.wait()
        self._ready.clear()

    def abandon(self) -> None:
        """Drop every gather in flight without waiting for it, and every ready mask.

        For a transport that has already been aborted (a failed epoch), where
        waiting could only fail. The work handles keep their buffers alive, so
        nothing is written into freed memory (torch transports; an MPI
        transport must be closed with :meth:`close`). Pieces still being
        built (pure compute, bounded) are waited for and dropped.
        """
        self.discard_unsent()
        self._drop_decoding()
        self._in_flight = {}
        self._ready.clear()

    def __enter__(self) -> MaskSchedule:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pending_steps(self) -> list[int]:
        """Steps whose masks are still being built or gathered."""
        return sorted([*self._in_flight, *self._building, *self._decoding])
