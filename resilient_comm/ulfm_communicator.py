"""``UlfmCommunicator``: the fault-aware communicator over MPI ULFM, with no coordinator.

The MPI counterpart of :class:`~resilient_comm.fault_aware.FaultAwareCommunicator`:
both satisfy :class:`~resilient_comm.protocol.ResilientCommunicator`, so
callers written against it can use either. Membership lives in MPI itself
(Open MPI 5 started with ``mpirun --with-ft ulfm``):

* the **universe** is a duplicate of ``COMM_WORLD``: every live process,
  actives and spares; the last ``spares`` ranks of ``COMM_WORLD`` start as spares;
* each **epoch** is a communicator split off the universe for the actives
  (``color=0, key=slot``), wrapped in a :class:`~bindings.mpi_backend.MPICommunicator`
  that runs the collectives;
* a spare waits in :meth:`UlfmCommunicator.wait_for_promotion` on a
  non-blocking barrier of the universe; the actives complete that barrier in
  :meth:`~UlfmCommunicator.close` (job end: the spare is released);
* on a failure a member revokes its epoch and the universe (the revoke: peers
  and spares fail fast); :meth:`~UlfmCommunicator.reconfigure` then shrinks
  the universe, every live process gathers who is who over it and computes the
  next epoch deterministically with :func:`~resilient_comm.plan.plan_next_epoch`,
  the coordinator's rule (hot-swap: survivors keep their slots and the
  lowest-ranked spares fill the dead ones; shrink: survivors renumbered in slot
  order), and splits again. Epochs increase by one per reconfiguration on
  every process alike;
* :meth:`~UlfmCommunicator.commit` is ``MPIX_Comm_agree`` (a fault-tolerant AND).

Every mpi4py call lives in :mod:`bindings.ulfm` / :mod:`bindings.mpi_backend`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch

from bindings.base import RawWork
from bindings.communicator import BaseCommunicator
from bindings.errors import CommError, CommTimeoutError, PeerFailureError
from bindings.mpi_backend import MPICommunicator
from bindings.ops import ReduceOp
from bindings.ulfm import FtComm, ulfm_support
from bindings.validate import check_int
from resilient_comm.errors import MembershipError
from resilient_comm.plan import EpochPlan, plan_next_epoch
from resilient_comm.protocol import Reconfiguration
from resilient_comm.view import MODES

__all__ = ["UlfmCommunicator", "ulfm_support"]

logger = logging.getLogger(__name__)

# columns of the table every live process shares after a shrink
_MEMBER, _SLOT, _EPOCH, _WORLD, _CLOSING, _COMMITTED = range(6)


def _plan_from_table(rows: list[list[int]], mode: str, min_world_size: int) -> tuple[EpochPlan, int] | None:
    """The next epoch and the newest committed step, from the shared table; ``None``: the actives are closing.

    Every live process computes the same result from the same table.
    """
    if any(r[_CLOSING] for r in rows):
        return None
    old_world = max(r[_WORLD] for r in rows)
    actives = {r[_SLOT]: r[_MEMBER] for r in rows if r[_SLOT] >= 0}
    plan = plan_next_epoch(
        max(r[_EPOCH] for r in rows),
        [actives.get(s) for s in range(old_world)],
        (),
        sorted(r[_MEMBER] for r in rows if r[_SLOT] < 0),  # the lowest-ranked spares first
        mode=mode,
        min_world_size=min_world_size,
    )
    return plan, max(r[_COMMITTED] for r in rows)


class _Work:
    """Raw work of one epoch: any failure (or a missed deadline) revokes the epoch."""

    def __init__(self, comm: UlfmCommunicator, op: str, epoch: int, raw: RawWork) -> None:
        self._comm, self._op, self._epoch, self._raw = comm, op, epoch, raw

    def wait(self, timeout_s: float | None) -> None:
        comm = self._comm
        limit = comm.timeout.total_seconds() if timeout_s is None else timeout_s
        try:
            self._raw.wait(limit)
        except CommTimeoutError as exc:
            comm._fail(f"{self._op}: {exc}")
            raise comm._failure(f"{self._op}: no progress before the deadline (hung peer?)") from exc
        except CommError as exc:
            comm._fail(f"{self._op}: {exc}")
            raise comm._failure(f"{self._op}: {exc}") from exc

    def is_completed(self) -> bool:
        return self._raw.is_completed()


class UlfmCommunicator(BaseCommunicator):
    """A communicator whose membership survives dead peers, over MPI ULFM.

    Build one per process with :meth:`connect` (collective over
    ``COMM_WORLD``). Actives hold a slot at once; spares call
    :meth:`wait_for_promotion`. Satisfies
    :class:`~resilient_comm.protocol.ResilientCommunicator` (its call order is
    documented there); :attr:`mode` and :meth:`from_world` are its own.

    Args:
        universe: The universe communicator (a handle from :mod:`bindings.ulfm`).
        spares: How many of the universe's last ranks start as spares.
        mode: ``hotswap`` (a spare takes a dead slot; shrink when none is left) or ``shrink``.
        timeout: Deadline of every operation.
        reconfigure_timeout: Deadline of one reconfiguration.
        min_world_size: No epoch with fewer members forms (:class:`MembershipError`).
        check_collectives: See :class:`~bindings.communicator.BaseCommunicator`.
    """

    def __init__(
        self,
        universe: FtComm,
        *,
        spares: int = 0,
        mode: str = "hotswap",
        timeout: timedelta = timedelta(seconds=30),
        reconfigure_timeout: timedelta = timedelta(seconds=60),
        min_world_size: int = 1,
        check_collectives: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode: must be one of {MODES}, got {mode!r}")
        if not isinstance(reconfigure_timeout, timedelta) or reconfigure_timeout.total_seconds() <= 0:
            raise ValueError(f"reconfigure_timeout: must be a positive datetime.timedelta, got {reconfigure_timeout!r}")
        actives = universe.size - spares
        if spares < 0 or actives < 1:
            raise ValueError(f"spares: must be in [0, {universe.size - 1}] for {universe.size} ranks, got {spares}")
        super().__init__(0, 1, timeout=timeout, check_collectives=check_collectives)
        self._universe = universe
        self._mode = mode
        self._reconfigure_timeout = reconfigure_timeout
        self._min_world_size = min_world_size
        self._member = universe.rank
        self._slot: int | None = universe.rank if universe.rank < actives else None
        self._epoch = 0
        self._members_count = actives  # world size of the current epoch (spares track it too)
        self._inner: MPICommunicator | None = None
        self._failed = False
        self._committed = -1
        self._standby: RawWork | None = None
        self._released = False
        self._reconfiguring = threading.Lock()
        sub = universe.split(0 if self._slot is not None else None, self._slot or 0)
        if sub is not None:
            self._inner = sub.communicator(timeout, check_collectives)
            self._rank, self._world_size = self._slot or 0, actives
        logger.info("ulfm member %d: %s in epoch 0 of %d", self._member, f"slot {self._slot}", actives)

    @classmethod
    def connect(
        cls,
        *,
        spares: int = 0,
        mode: str = "hotswap",
        timeout: timedelta = timedelta(seconds=30),
        reconfigure_timeout: timedelta = timedelta(seconds=60),
        min_world_size: int = 1,
        check_collectives: bool = False,
    ) -> UlfmCommunicator:
        """Join the job, collective over ``COMM_WORLD``: its last ``spares`` ranks become spares.

        MPI's ``COMM_WORLD`` is the membership; there is no coordinator. See the
        class for the arguments.

        Raises:
            RuntimeError: ULFM is unavailable (no mpi4py, not Open MPI, or not
                started with ``mpirun --with-ft ulfm``).
        """
        why = ulfm_support()
        if why is not None:
            raise RuntimeError(f"UlfmCommunicator: ULFM unavailable: {why}")
        return cls(
            FtComm.world(),
            spares=spares,
            mode=mode,
            timeout=timeout,
            reconfigure_timeout=reconfigure_timeout,
            min_world_size=min_world_size,
            check_collectives=check_collectives,
        )

    #: :meth:`connect` under the name that says what it is collective over.
    from_world = connect

    # ------------------------------------------------------------------ properties
    @property
    def backend(self) -> str:
        """``mpi`` (the data plane)."""
        return "mpi"

    @property
    def epoch(self) -> int:
        """The current epoch (``-1`` for a spare not yet promoted)."""
        return self._epoch if self._slot is not None else -1

    @property
    def member(self) -> int:
        """This process's member index (its ``COMM_WORLD`` rank)."""
        return self._member

    @property
    def slot(self) -> int | None:
        """This process's slot (= rank) in the current epoch; ``None`` for a spare."""
        return self._slot

    @property
    def mode(self) -> str:
        """``hotswap`` or ``shrink``."""
        return self._mode

    @property
    def healthy(self) -> bool:
        """Whether the current epoch is usable (no failure seen in it)."""
        return self._inner is not None and not self._failed

    # ------------------------------------------------------------------ failures
    def _fail(self, reason: str) -> None:
        """Revoke the epoch and the universe here (peers and spares fail fast). Once per epoch."""
        if self._failed:
            return
        self._failed = True
        logger.info("ulfm member %d: epoch %d failed: %s", self._member, self._epoch, reason)
        if self._inner is not None:
            FtComm.of(self._inner).revoke()
        self._universe.revoke()

    def _failure(self, message: str) -> PeerFailureError:
        failed = FtComm.of(self._inner).failed_ranks() if self._inner is not None else frozenset()
        return PeerFailureError(f"{message} (epoch {self._epoch}; call reconfigure())", failed_ranks=failed)

    # ------------------------------------------------------------------ epochs
    def _round(self, deadline: float, *, closing: bool) -> EpochPlan | None:
        """Shrink the universe, share who is who, and install the next epoch (``None``: job closing)."""
        while True:
            self._universe.revoke()
            try:
                universe = self._universe.shrink()
            except PeerFailureError as exc:  # another failure during the shrink: again
                logger.info("ulfm member %d: shrink failed (%s); retrying", self._member, exc)
                continue
            self._universe.free()
            self._universe = universe
            row = [
                self._member, -1 if self._slot is None else self._slot, self._epoch,
                self._members_count, int(closing), self._committed,
            ]  # fmt: skip
            try:
                table = _plan_from_table(
                    universe.allgather(row, self._left(deadline)), self._mode, self._min_world_size
                )
            except PeerFailureError:
                continue
            if table is None:
                return None
            plan, committed = table
            slot = plan.slot_of(self._member)
            try:
                sub = universe.split(0 if slot is not None else None, slot or 0)
            except PeerFailureError:
                continue
            try:
                universe.agree(1, self._left(deadline))
            except PeerFailureError:
                if sub is not None:
                    sub.revoke()
                    sub.free()
                continue
            self._install(plan, committed, slot, sub)
            return plan

    def _install(self, plan: EpochPlan, committed: int, slot: int | None, sub: FtComm | None) -> None:
        old = self._inner
        self._inner = sub.communicator(self.timeout, self.check_collectives) if sub is not None else None
        if old is not None:
            old.abort()  # revoke (already) + free
        self._epoch, self._members_count, self._slot = plan.epoch, len(plan.members), slot
        self._committed = max(self._committed, committed)
        self._failed = False
        if slot is not None:
            self._rank, self._world_size = slot, len(plan.members)
        logger.info(
            "ulfm member %d: epoch %d (%s), slot %s of %d", self._member, plan.epoch, plan.mode, slot, len(plan.members)
        )

    @staticmethod
    def _left(deadline: float) -> float:
        return max(0.0, deadline - time.monotonic())

    def _result(self, old_epoch: int, plan: EpochPlan) -> Reconfiguration:
        return Reconfiguration(
            old_epoch=old_epoch,
            epoch=plan.epoch,
            rank=self._rank,
            world_size=len(plan.members),
            rank_map=dict(plan.rank_map),
            promoted=dict(plan.promoted),
            lost_slots=plan.lost_slots,
            mode=plan.mode,
            committed_step=self._committed,  # the round's: it was at least this process's own
            promoted_here=self._member in plan.promoted.values(),
        )

    def reconfigure(self, timeout: timedelta | None = None) -> Reconfiguration:
        """Move every live process to the next epoch and say what changed.

        Collective: every surviving active must call this after a failure
        (spares join from :meth:`wait_for_promotion`); calling it without a
        failure revokes the epoch and forms a new one with the same members.

        Raises:
            MembershipError: Not an active, already reconfiguring, no quorum,
                fewer than ``min_world_size`` members left, or the job is closing.
            CommTimeoutError: Not every live process joined in time.
        """
        if self._slot is None:
            raise MembershipError("reconfigure: this process holds no slot (a spare calls wait_for_promotion())")
        if not self._reconfiguring.acquire(blocking=False):
            raise MembershipError("reconfigure: already reconfiguring")
        try:
            old_epoch = self._epoch
            self._fail("reconfigure requested")
            limit = self._reconfigure_timeout if timeout is None else timeout
            plan = self._round(time.monotonic() + limit.total_seconds(), closing=False)
            if plan is None:
                raise MembershipError("reconfigure: the job is closing")
            if self._slot is None:  # cannot happen: survivors keep a slot
                raise MembershipError("reconfigure: this process lost its slot")
            return self._result(old_epoch, plan)
        finally:
            self._reconfiguring.release()

    def wait_for_promotion(self, timeout: timedelta | None = None) -> Reconfiguration | None:
        """Spare: wait until a reconfiguration gives this process a slot.

        Returns:
            What changed, or ``None`` if the actives closed the job without needing this spare.

        Raises:
            MembershipError: Not a spare, or no quorum after a failure.
            CommTimeoutError: ``timeout`` passed first (call again to keep waiting).
        """
        if self._slot is not None:
            raise MembershipError("wait_for_promotion: this process already holds a slot")
        if self._released:
            return None
        limit = timedelta(days=365) if timeout is None else timeout
        deadline = time.monotonic() + limit.total_seconds()
        while True:
            if self._standby is None:
                self._standby = self._universe.ibarrier()
            try:
                self._standby.wait(self._left(deadline))
            except CommTimeoutError as exc:
                raise CommTimeoutError(f"wait_for_promotion: not promoted within {limit.total_seconds():g} s") from exc
            except PeerFailureError:  # a failure (or a revoke by the actives): reconfigure
                self._standby = None
                old_epoch = self._epoch
                round_deadline = time.monotonic() + self._reconfigure_timeout.total_seconds()
                plan = self._round(round_deadline, closing=False)
                if plan is None:
                    self._released = True
                    return None
                if self._slot is not None:
                    return self._result(old_epoch, plan)
                continue
            self._standby = None
            self._released = True
            return None

    def commit(self, step: int, ok: bool = True, timeout: timedelta | None = None) -> bool:
        """The step-commit vote (``MPIX_Comm_agree``): ``True`` on every member, or ``False`` on every member.

        Collective over the epoch's members.

        Raises:
            PeerFailureError: A member failed (the epoch is revoked; call :meth:`reconfigure`).
        """
        check_int("step", step, low=0)
        inner = self._inner
        if inner is None:
            raise MembershipError("commit: this process holds no slot")
        limit = self.timeout if timeout is None else timeout
        flag = int(bool(ok) and not self._failed)
        try:
            agreed = FtComm.of(inner).agree(flag, limit.total_seconds())
        except CommError as exc:
            self._fail(f"commit: {exc}")
            raise self._failure(f"commit of step {step}: {exc}") from exc
        if agreed & 1:
            self._committed = max(self._committed, step)
            return True
        return False

    @property
    def committed_step(self) -> int:
        """The last step committed here (``-1``: none)."""
        return self._committed

    # ------------------------------------------------------------------ transport hooks
    def _guard(self, op: str, call: Callable[[MPICommunicator], RawWork]) -> RawWork:
        inner = self._inner
        if inner is None:
            raise PeerFailureError(f"{op}: this process holds no slot")
        if self._failed:
            raise self._failure(f"{op}: epoch {self._epoch} has failed")
        try:
            raw = call(inner)
        except CommError as exc:
            self._fail(f"{op}: {exc}")
            raise self._failure(f"{op}: {exc}") from exc
        return _Work(self, op, self._epoch, raw)

    def _raw_all_reduce(self, buf: torch.Tensor, op: ReduceOp) -> RawWork:
        return self._guard("all_reduce", lambda c: c._raw_all_reduce(buf, op))

    def _raw_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp) -> RawWork:
        return self._guard("reduce_scatter", lambda c: c._raw_reduce_scatter(out, inp, op))

    def _raw_all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> RawWork:
        return self._guard("all_gather", lambda c: c._raw_all_gather(out, inp))

    def _raw_broadcast(self, buf: torch.Tensor, src: int) -> RawWork:
        return self._guard("broadcast", lambda c: c._raw_broadcast(buf, src))

    def _raw_barrier(self) -> RawWork:
        return self._guard("barrier", lambda c: c._raw_barrier())

    def _raw_send(self, buf: torch.Tensor, dst: int, tag: int) -> RawWork:
        return self._guard("send", lambda c: c._raw_send(buf, dst, tag))

    def _raw_recv(self, buf: torch.Tensor, src: int | None, tag: int) -> tuple[RawWork, Callable[[], int]]:
        sources: list[Callable[[], int]] = []

        def post(c: MPICommunicator) -> RawWork:
            raw, source = c._raw_recv(buf, src, tag)
            sources.append(source)
            return raw

        work = self._guard("recv", post)
        return work, sources[0]

    def _raw_split(self, members: list[int]) -> BaseCommunicator | None:
        raise NotImplementedError("split: a ULFM communicator cannot be split; its epochs change its ranks")

    def _wire_bytes(self, op: str, nbytes: int) -> tuple[int, int]:
        inner = self._inner
        return super()._wire_bytes(op, nbytes) if inner is None else inner._wire_bytes(op, nbytes)

    def abort(self) -> None:
        """Revoke the current epoch (and the universe): peers fail fast; call :meth:`reconfigure` to go on."""
        self._fail("aborted by the application")

    def _raw_abort(self) -> None:  # pragma: no cover - abort() is overridden
        pass

    def close(self, timeout: timedelta | None = None) -> None:
        """Leave the job: actives release the spares (collective over the live processes). Idempotent.

        Actives complete the universe barrier the spares wait on; if that
        fails (a spare died, or this epoch failed), they run a closing round
        instead, which also ends every spare's :meth:`wait_for_promotion`.
        """
        if self._closed:
            return
        self._closed = True
        limit = (self.timeout if timeout is None else timeout).total_seconds()
        if self._slot is not None:
            try:
                if self._failed:
                    raise PeerFailureError("epoch failed")
                self._universe.ibarrier().wait(limit)
            except PeerFailureError:
                try:
                    self._round(time.monotonic() + limit, closing=True)
                except CommError as exc:
                    logger.warning("ulfm member %d: closing round failed: %s", self._member, exc)
            except CommTimeoutError as exc:
                logger.warning("ulfm member %d: spares not released: %s", self._member, exc)
        inner, self._inner = self._inner, None
        if inner is not None:
            if self._failed:
                inner.abort()
            else:
                try:
                    inner.close()
                except CommError as exc:
                    logger.debug("ulfm member %d: close raised %s", self._member, exc)
        self._universe.free()

    def _raw_close(self) -> None:  # pragma: no cover - close() is overridden
        pass
