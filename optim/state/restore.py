"""A slot's snapshots, their replication, and the agreement on what to restore after a failure.

:class:`SlotSnapshots` keeps the two newest snapshots of this slot (own ring)
and of the previous slot (ward ring, filled by the replicator thread), and
moves them where a new epoch needs them. After a reconfiguration every member reports one row: its old slot, the slot
it guards as a buddy (the previous one), and the versions in its own ring and
in its ward's ring. :func:`plan_restore` turns the gathered rows into the
newest step every old slot still has and the new rank that holds each lost
slot's copy. It is pure (no communication), so every member computes the same
plan from the same rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from torch.optim.optimizer import StateDict

import sparsecomm.distributed as dist
from optim.state.run_stats import SnapshotStats
from optim.state.snapshot import Replicator, SnapshotRing, UnrecoverableStateError, decode_tree
from resilient_comm import FaultAwareCommunicator, Reconfiguration

__all__ = ["ROW_LEN", "ReportRow", "RestorePlan", "SlotSnapshots", "plan_restore"]

#: Entries of one member's row: old slot, ward slot, two own versions, two ward versions (``-1``: none).
ROW_LEN = 6


@dataclass(frozen=True, kw_only=True)
class RestorePlan:
    """The outcome of the agreement.

    Attributes:
        step: The step to restore: ``0`` is the initial state (rebuilt from the
            seed, no snapshot needed); ``-1`` means snapshots are off and the run
            starts again at step 1.
        holders: Lost (or stateless) old slot -> new rank that holds its copy.
        old_world: World size of the epoch that failed.
    """

    step: int
    holders: dict[int, int] = field(default_factory=dict)
    old_world: int = 0


@dataclass(frozen=True, kw_only=True)
class ReportRow:
    """What one member of a new epoch holds, as it reports it for :func:`plan_restore`.

    Attributes:
        slot: Its slot in the failed epoch (``-1``: a promoted spare, which holds nothing).
        ward: The slot it guards as a buddy, the previous one (``-1`` for a spare).
        own: The versions in its own ring, newest two at most.
        warded: The versions in its ward's ring, newest two at most.
    """

    slot: int
    ward: int
    own: tuple[int, ...] = ()
    warded: tuple[int, ...] = ()

    @classmethod
    def of(cls, old_slot: int, old_world: int, own: Sequence[int], ward: Sequence[int]) -> ReportRow:
        """The row of the member that held ``old_slot`` of ``old_world`` (``old_slot < 0``: a promoted spare)."""
        if old_slot < 0:
            return cls(slot=-1, ward=-1)
        return cls(slot=old_slot, ward=(old_slot - 1) % old_world, own=tuple(own)[:2], warded=tuple(ward)[:2])

    def to_ints(self) -> list[int]:
        """The row on the wire: ``ROW_LEN`` integers, ``-1`` where a version is missing."""
        return [self.slot, self.ward, *(list(self.own) + [-1, -1])[:2], *(list(self.warded) + [-1, -1])[:2]]

    @classmethod
    def from_ints(cls, ints: Sequence[int]) -> ReportRow:
        """The row :meth:`to_ints` sent.

        Raises:
            ValueError: Not ``ROW_LEN`` integers.
        """
        if len(ints) != ROW_LEN:
            raise ValueError(f"table: every row must have {ROW_LEN} entries, got {len(ints)}")
        slot, ward, o1, o2, w1, w2 = (int(v) for v in ints)
        return cls(
            slot=slot, ward=ward, own=tuple(v for v in (o1, o2) if v >= 0), warded=tuple(v for v in (w1, w2) if v >= 0)
        )


def plan_restore(table: Sequence[ReportRow], old_world: int, snapshots: bool = True) -> RestorePlan:
    """The newest step whose state every old slot still has, and who holds each lost slot's copy.

    Args:
        table: One :class:`ReportRow` per member of the new epoch, in new-rank order.
        old_world: World size of the epoch that failed.
        snapshots: Whether snapshots are kept at all.

    Raises:
        ValueError: A malformed table.
        UnrecoverableStateError: Some old slot has no copy of any step left.
    """
    if old_world < 1:
        raise ValueError(f"old_world: must be >= 1, got {old_world}")
    have: dict[int, set[int]] = {s: set() for s in range(old_world)}
    holders: dict[int, int] = {}
    # A slot's state is on its holder, unless the holder has none (a spare promoted by an epoch whose
    # recovery failed before it restored): then, as for a lost slot, the buddy's copy counts.
    stateful = {r.slot for r in table if r.slot >= 0 and r.own}
    for new_rank, row in enumerate(table):
        if row.slot >= old_world or row.ward >= old_world:
            raise ValueError(f"table: slot {row.slot} or ward {row.ward} outside {old_world} old slots")
        if row.slot >= 0:
            have[row.slot] |= set(row.own)
        if row.ward >= 0 and row.ward not in stateful:
            have[row.ward] |= set(row.warded)
            holders[row.ward] = new_rank
    if any(0 in r.own for r in table) or not any(have.values()):
        # At most one step in (or not even the first snapshot taken): the initial state, version 0, is
        # rebuilt from the seed on every slot, also on one whose first snapshot never reached its buddy.
        for versions in have.values():
            versions.add(0)
    common = set.intersection(*have.values())
    step = max(common) if common and snapshots else -1
    if step < 0 and snapshots:
        lost = [s for s, v in have.items() if not v]
        raise UnrecoverableStateError(f"no common snapshot step: slots {lost} have no copy left")
    return RestorePlan(step=step, holders=holders, old_world=old_world)


class SlotSnapshots:
    """This slot's snapshots and its ward's, replicated on a background thread.

    Args:
        comm: The member's communicator (its side channel carries the replication).
        timeout: Deadline of the snapshot copy and of the replication.
    """

    def __init__(self, comm: FaultAwareCommunicator, timeout: timedelta) -> None:
        self.comm, self.timeout = comm, timeout
        self.own, self.ward = SnapshotRing(), SnapshotRing()
        self.replicator: Replicator | None = None
        self._submitted = -1  # the last version handed to the replicator
        self.put_s: list[float] = []
        self._persist_error: str | None = None

    def put(self, step: int, tree: StateDict, persist: Callable[[torch.Tensor], None] | None = None) -> None:
        """Hold the state after ``step``: collected by the caller, copied and replicated by the replicator thread.

        The copy overlaps the next step's forward and backward; :meth:`settle`
        waits for it before the optimizer changes the live tensors again.
        ``persist`` gets the encoded bytes once they are replicated (on the
        replicator thread; without one, here): a persistent checkpoint.
        """
        t0 = time.perf_counter()
        if self.replicator is not None:
            self._wait_replicated()
            self.replicator.submit_tree(step, tree, self.own, persist)
            self._submitted = step
        else:
            data = self.own.put(step, tree)
            if persist is not None:
                try:
                    persist(data)
                except Exception as exc:  # noqa: BLE001 - reported like the replicator's
                    self._persist_error = f"version {step}: {exc}"
        self.put_s.append(time.perf_counter() - t0)

    @property
    def persist_error(self) -> str | None:
        """Why the last persistent checkpoint write failed, or ``None``."""
        if self.replicator is not None and self.replicator.persist_error is not None:
            return self.replicator.persist_error
        return self._persist_error

    def settle(self) -> None:
        """Wait until the last snapshot was copied out (it reads the optimizer's live tensors)."""
        if self.replicator is None:
            return
        t0 = time.perf_counter()
        if not self.replicator.wait_encoded(self.timeout.total_seconds()):
            raise RuntimeError("snapshot copy did not finish")
        if self.put_s:
            self.put_s[-1] += time.perf_counter() - t0
        failed = self.replicator.failed
        if failed is not None and self.comm.healthy:
            # not a peer failure (the epoch is fine): going on would leave this slot unprotected
            raise RuntimeError(f"snapshot replication stopped: {failed}")

    def start_replication(self, version: int, headroom: int) -> None:
        """Replicate on the current epoch, beginning with the held ``version``. Collective.

        Args:
            version: A version held in the own ring.
            headroom: Bytes a later snapshot may add to the largest one held now.
        """
        side = self.comm.side_channel
        if side is None:
            return
        held = (self.own.get(v) for v in self.own.versions())
        cap = torch.tensor([max((b.numel() for b in held if b is not None), default=0)], dtype=torch.int64)
        dist.all_reduce(cap, op=dist.ReduceOp.MAX)
        self.replicator = Replicator(side, int(cap) + headroom, self.ward, self.timeout)
        buf = self.own.get(version)
        assert buf is not None
        self.replicator.submit(version, buf)
        self._submitted = version

    def _wait_replicated(self) -> None:
        """Wait until the buddy acknowledged the last version submitted (or replication stopped, or the deadline).

        The own ring keeps two versions: were the replication more than one
        version behind, the buddy's copy of this slot could be older than
        every version some other slot still holds, and a failure then would
        leave no step every slot has. A slower replication holds the step
        here instead (counted in :attr:`put_s`).
        """
        rep = self.replicator
        assert rep is not None
        end = time.monotonic() + self.timeout.total_seconds()
        while rep.replicated < self._submitted and rep.failed is None and time.monotonic() < end:
            time.sleep(0.0005)

    def drain(self) -> None:
        """Wait for the replication in flight (the end of a run)."""
        if self.replicator is not None:
            self.replicator.drain(self.timeout.total_seconds())

    def stop(self) -> None:
        """Stop the replicator thread (local, idempotent)."""
        if self.replicator is not None:
            self.replicator.stop()
            self.replicator = None

    def clear(self) -> None:
        """Forget every held version (after a restore, the rings start again)."""
        self.own.clear()
        self.ward.clear()

    def stats(self) -> SnapshotStats:
        """Median snapshot time on the critical path, ring sizes and replication totals."""
        rep, put_s = self.replicator, sorted(self.put_s)
        return SnapshotStats(
            snapshot_ms_median=1000 * put_s[len(put_s) // 2] if put_s else 0.0,
            own_bytes=self.own.nbytes(),
            ward_bytes=self.ward.nbytes(),
            replicated_bytes=rep.bytes_sent if rep else 0,
            replication_busy_s=rep.busy_s if rep else 0.0,
        )

    def agree(self, change: Reconfiguration | None, snapshots: bool) -> tuple[RestorePlan, int]:
        """Gather every member's holdings and plan the restore. Collective.

        Returns:
            The plan, and this member's slot in the old epoch (``-1``: a promoted spare).
        """
        comm = self.comm
        old_slot = -1
        if change is not None and not change.promoted_here:
            inverse = {new: old for old, new in change.rank_map.items()}
            old_slot = inverse.get(comm.rank, comm.rank)
        old_world = comm.world_size + len(change.lost_slots) - len(change.promoted) if change else comm.world_size
        row = ReportRow.of(old_slot, old_world, self.own.versions(), self.ward.versions())
        rows = torch.empty(comm.world_size * ROW_LEN, dtype=torch.int64)
        dist.all_gather_into_tensor(rows, torch.tensor(row.to_ints(), dtype=torch.int64))
        table = [ReportRow.from_ints(r) for r in rows.view(comm.world_size, ROW_LEN).tolist()]
        return plan_restore(table, old_world, snapshots), old_slot

    def own_tree(self, step: int) -> StateDict:
        """This slot's own snapshot of ``step``."""
        buf = self.own.get(step)
        if buf is None:
            raise UnrecoverableStateError(f"no own snapshot of step {step}")
        return decode_tree(buf)  # type: ignore[no-any-return]

    def held_trees(self, step: int, old_slot: int, plan: RestorePlan) -> list[tuple[int, StateDict]]:
        """Every snapshot of ``step`` this member holds, by old slot: its own first, then its wards'."""
        mine = [(old_slot, self.own_tree(step))] if old_slot >= 0 else []
        for lost, holder in plan.holders.items():
            if holder == self.comm.rank:
                buf = self.ward.get(step)
                if buf is None:
                    raise UnrecoverableStateError(f"no copy of lost slot {lost} at step {step}")
                mine.append((lost, decode_tree(buf)))
        return mine

    def fetch(self, step: int, old_slot: int, plan: RestorePlan) -> StateDict:
        """This rank's snapshot of ``step`` under hot-swap: its own, or sent by the buddy of a lost slot. Collective."""
        comm = self.comm
        size = torch.zeros(1, dtype=torch.int64)
        received: StateDict | None = None
        for lost, holder in sorted(plan.holders.items()):
            target = lost  # hot-swap: the lost slot's new holder has the same rank
            buf: torch.Tensor | None = None
            if comm.rank == holder:
                buf = self.ward.get(step)
                assert buf is not None
                size[0] = buf.numel()
            dist.broadcast(size, src=holder)
            if buf is not None:
                dist.send(buf, dst=target)
            elif comm.rank == target:
                recv = torch.empty(int(size[0]), dtype=torch.uint8)
                dist.recv(recv, src=holder)
                received = decode_tree(recv)
        if received is not None:
            return received
        if old_slot < 0:
            raise UnrecoverableStateError(f"rank {comm.rank} of {comm.world_size}: no snapshot of step {step}")
        return self.own_tree(step)
