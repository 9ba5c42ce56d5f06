"""``FaultAwareCommunicator``: collectives that fail fast and a membership that heals.

The communicator implements the ``bindings`` :class:`~bindings.base.Communicator`
protocol, so the drop-in API, the sparse collectives and the optimizers run
over it unchanged. Underneath, each epoch has its own disposable transport (a
standalone gloo / NCCL process group under the store prefix ``ep{epoch}/``).

Guarantees:

* every operation completes or raises :class:`~bindings.errors.PeerFailureError`
  within its deadline: the wait polls the transport and gives up as soon as the
  epoch is aborted (by this member or by the coordinator; :mod:`resilient_comm.guard`);
* on any failure this member aborts its own transport at once (the revoke), so
  peers blocked on it fail fast too, and reports to the coordinator;
* after a failure every call raises until :meth:`FaultAwareCommunicator.reconfigure`
  moved the member to the next epoch: nothing is issued on a half-dead epoch.

The first two are :class:`~resilient_comm.failfast.FailFastCommunicator`'s, which
forwards every operation to the current epoch's transport. This module moves the
member between epochs: the first join, :meth:`~FaultAwareCommunicator.reconfigure`,
a spare's promotion, coming back as a spare after an eviction, and the step-commit
vote.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from typing import NoReturn

from bindings.errors import CommError
from bindings.torch_backend import TorchCommunicator, standalone_process_group
from bindings.validate import check_int
from resilient_comm.errors import MembershipError, StaleEpochError
from resilient_comm.failfast import FailFastCommunicator, SideChannel
from resilient_comm.guard import REAPER, call_unless_aborted, join_helpers
from resilient_comm.membership import StoreMembership
from resilient_comm.protocol import Reconfiguration
from resilient_comm.view import View

__all__ = ["FaultAwareCommunicator", "SideChannel", "ENV_ADDRESS", "ENV_JOB", "ENV_ROLE", "ENV_SLOT"]

logger = logging.getLogger(__name__)

#: Environment the launcher sets for every process it starts.
ENV_ADDRESS = "SPARSECOMM_COORDINATOR"
ENV_JOB = "SPARSECOMM_JOB_ID"
ENV_ROLE = "SPARSECOMM_ROLE"
ENV_SLOT = "SPARSECOMM_SLOT"

_BACKENDS = ("gloo", "nccl")


class FaultAwareCommunicator(FailFastCommunicator):
    """A communicator whose membership survives dead and hung peers.

    Build one per process with :meth:`connect` (reads the launcher's
    environment) or from a :class:`~resilient_comm.membership.StoreMembership`.
    An active member joins the first epoch in the constructor; a spare waits in
    :meth:`wait_for_promotion`. Satisfies
    :class:`~resilient_comm.protocol.ResilientCommunicator` (its call order is
    documented there); :attr:`view`, :attr:`membership` and
    :attr:`side_channel` are its own.

    Args:
        membership: This process's registration with the coordinator.
        backend: ``gloo`` (CPU) or ``nccl`` (CUDA).
        timeout: Deadline of every operation.
        configure_timeout: Deadline of building one epoch's transport.
        join_timeout: How long an active member waits for its first epoch.
        check_collectives: See :class:`~bindings.communicator.BaseCommunicator`.
        side_channel: Also build a second transport per epoch (:attr:`side_channel`)
            for background traffic (snapshot replication) that must not be
            ordered with the main thread's collectives.
        max_rejoins: A member declared failed while it was alive (cut off
            longer than the heartbeat timeout, hung, or a straggler replaced)
            learns so at its next :meth:`reconfigure`; if the job still runs it
            registers again as a spare (:class:`StaleEpochError` with
            ``rejoined=True``), up to this many times in the life of the
            process. Past that it leaves the job (``rejoined=False``).
    """

    def __init__(
        self,
        membership: StoreMembership,
        *,
        backend: str = "gloo",
        timeout: timedelta = timedelta(seconds=30),
        configure_timeout: timedelta = timedelta(seconds=30),
        join_timeout: timedelta = timedelta(seconds=120),
        check_collectives: bool = False,
        side_channel: bool = False,
        max_rejoins: int = 3,
    ) -> None:
        if not isinstance(membership, StoreMembership):
            raise TypeError(f"membership: expected a StoreMembership, got {type(membership).__name__}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend: must be one of {_BACKENDS}, got {backend!r}")
        for name, v in (("configure_timeout", configure_timeout), ("join_timeout", join_timeout)):
            if not isinstance(v, timedelta) or v.total_seconds() <= 0:
                raise ValueError(f"{name}: must be a positive datetime.timedelta, got {v!r}")
        check_int("max_rejoins", max_rejoins, low=0)
        super().__init__(membership, timeout=timeout, check_collectives=check_collectives)
        self._max_rejoins = max_rejoins
        self._backend_name = backend
        self._configure_timeout = configure_timeout
        self._join_timeout = join_timeout
        self._want_side = bool(side_channel)
        self._committed = -1  # newest step known committed everywhere
        self._reconfiguring = threading.Lock()
        if membership.role == "active":
            self._join(-1, time.monotonic() + join_timeout.total_seconds())

    @classmethod
    def connect(
        cls,
        *,
        address: str | None = None,
        job: str | None = None,
        role: str | None = None,
        slot: int | None = None,
        backend: str = "gloo",
        timeout: timedelta = timedelta(seconds=30),
        heartbeat_interval: timedelta = timedelta(milliseconds=50),
        configure_timeout: timedelta = timedelta(seconds=30),
        join_timeout: timedelta = timedelta(seconds=120),
        side_channel: bool = False,
        max_rejoins: int = 3,
    ) -> FaultAwareCommunicator:
        """Register with the coordinator and (for an active member) join the first epoch.

        Arguments left ``None`` come from the environment the launcher sets:
        ``SPARSECOMM_COORDINATOR`` (``host:port``), ``SPARSECOMM_JOB_ID``,
        ``SPARSECOMM_ROLE`` (default ``active``) and ``SPARSECOMM_SLOT`` (or
        torchrun's / Open MPI's / Slurm's rank variable).

        Raises:
            ValueError: Missing or bad settings.
            MembershipError: The coordinator runs another job, or the job failed.
        """
        address = address if address is not None else os.environ.get(ENV_ADDRESS)
        job = job if job is not None else os.environ.get(ENV_JOB)
        if not address or not job:
            raise ValueError(f"connect: set address and job (or {ENV_ADDRESS} and {ENV_JOB})")
        role = role if role is not None else os.environ.get(ENV_ROLE, "active")
        if slot is None:
            names = (ENV_SLOT, "RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
            env = next((os.environ[v] for v in names if v in os.environ), None)
            slot = int(env) if env is not None and role == "active" else -1
        beat = heartbeat_interval
        membership = StoreMembership(address, job, role=role, slot=slot, heartbeat_interval=beat, timeout=timeout)
        try:
            return cls(
                membership,
                backend=backend,
                timeout=timeout,
                configure_timeout=configure_timeout,
                join_timeout=join_timeout,
                side_channel=side_channel,
                max_rejoins=max_rejoins,
            )
        except BaseException:
            membership.leave()
            raise

    # ------------------------------------------------------------------ properties
    @property
    def backend(self) -> str:
        """The data-plane backend (``gloo`` or ``nccl``)."""
        return self._backend_name

    @property
    def epoch(self) -> int:
        """The current epoch (``-1`` before this member joined one)."""
        return self._view.epoch if self._view is not None else -1

    @property
    def view(self) -> View | None:
        """The current epoch's view."""
        return self._view

    @property
    def member(self) -> int:
        """This process's member index (unique per process start)."""
        return self._m.index

    @property
    def slot(self) -> int | None:
        """This member's slot (= rank) in the current epoch; ``None`` for a spare not yet promoted."""
        return self._rank if self._view is not None else None

    @property
    def committed_step(self) -> int:
        """The newest step this member knows to be committed everywhere (``-1``: none).

        A step this member's :meth:`commit` accepted, or the epoch's ``committed_step`` when it joined.
        """
        return self._committed

    @property
    def membership(self) -> StoreMembership:
        """This process's registration."""
        return self._m

    @property
    def side_channel(self) -> SideChannel | None:
        """The current epoch's second transport (``side_channel=True``), or ``None``.

        Its operations fail fast exactly like this communicator's when the
        epoch fails; use it from one background thread.
        """
        return self._side

    # ------------------------------------------------------------------ epochs
    def _join(self, after_epoch: int, deadline: float) -> View | None:
        """Wait for a view after ``after_epoch`` that holds this member and build its transport."""
        was_member = self._view is not None
        while True:
            view = self._m.wait_view(after_epoch, deadline)
            if view is None:
                return None
            slot = view.slot_of(self._m.index)
            if slot is None:
                if was_member:
                    self._evicted(view)
                after_epoch = view.epoch  # a spare not (yet) promoted
                continue
            self._m.watch(view.epoch, self._on_abort)
            try:
                inner = self._build(view, slot)
                side = SideChannel(self, view.epoch, self._build(view, slot, "side/")) if self._want_side else None
            except CommError as exc:
                self._failed_epoch = max(self._failed_epoch, view.epoch)
                self._m.report(view.epoch, f"configure failed: {exc}")
                after_epoch = view.epoch
                continue
            self._install(inner, side, view, slot, view.world_size)
            if self._epoch_failed(view.epoch):
                self._abort_transports(view.epoch)
                after_epoch = view.epoch
                continue
            self._committed = max(self._committed, view.committed_step)
            self._m.configured(view.epoch)
            logger.info("member %d: epoch %d, rank %d of %d", self._m.index, view.epoch, slot, view.world_size)
            return view

    def _evicted(self, view: View) -> NoReturn:
        """This member is not in ``view``: it was declared failed. Come back as a spare if allowed; always raises."""
        old = self._m.index
        what = f"member {old} was declared failed and is not part of epoch {view.epoch}"
        if self._m.rejoins >= self._max_rejoins:
            raise StaleEpochError(
                f"{what}; evicted {self._m.rejoins + 1} times, more than max_rejoins: leaving the job"
            )
        self._install(None, None, None, 0, 1)
        self._m.rejoin_as_spare()
        raise StaleEpochError(
            f"{what}; registered again as spare member {self._m.index} (rejoin {self._m.rejoins} of "
            f"{self._max_rejoins}): call wait_for_promotion()",
            rejoined=True,
        )

    def _build(self, view: View, slot: int, channel: str = "") -> TorchCommunicator:
        """Build ``view``'s transport; give up at once if the epoch is aborted meanwhile.

        The rendezvous runs in a helper thread: a member that died after the
        view was published never joins it, and the coordinator aborts the epoch
        long before the rendezvous would time out. The abandoned helper ends
        with that timeout.
        """
        pg = call_unless_aborted(
            lambda: standalone_process_group(
                self._m.transport_store(view.epoch, channel),
                slot,
                view.world_size,
                self._backend_name,
                self._configure_timeout,
            ),
            lambda: self._epoch_failed(view.epoch),
            name=f"sparsecomm-rendezvous-{view.epoch}",
            what=f"building the transport of epoch {view.epoch}",
        )
        return TorchCommunicator(pg, timeout=self.timeout, check_collectives=False, standalone=True)

    def reconfigure(self, timeout: timedelta | None = None) -> Reconfiguration:
        """Move to the next epoch and say what changed.

        Collective: every surviving member must call this after a failure (a
        member that calls it without one asks for a new epoch with the same
        members).

        Args:
            timeout: How long to wait for the new epoch (default: the join timeout).

        Raises:
            MembershipError: Already reconfiguring in another thread, no quorum,
                too few members left, or the job failed.
            StaleEpochError: This member was declared failed (e.g. it was hung
                or cut off); with ``rejoined`` it is a spare again
                (:attr:`slot` is ``None``; go on with :meth:`wait_for_promotion`).
            CommTimeoutError: No epoch formed in time.
        """
        if self._view is None:
            raise MembershipError("reconfigure: this member is not in an epoch (a spare calls wait_for_promotion())")
        if not self._reconfiguring.acquire(blocking=False):
            raise MembershipError("reconfigure: already reconfiguring")
        try:
            old = self._view
            if not self._epoch_failed(old.epoch):
                self._fail(old.epoch, "reconfigure requested")
            limit = self._join_timeout if timeout is None else timeout
            view = self._join(old.epoch, time.monotonic() + limit.total_seconds())
            if view is None:
                raise MembershipError("reconfigure: the job shut down")
            return self._result(old.epoch, view)
        finally:
            self._reconfiguring.release()

    def wait_for_promotion(self, timeout: timedelta | None = None) -> Reconfiguration | None:
        """Spare: wait, heartbeating, until an epoch gives this process a slot.

        Returns:
            What changed, or ``None`` if the job ended without needing this spare.

        Raises:
            MembershipError: Not a spare, or the job failed.
            CommTimeoutError: ``timeout`` passed first.
        """
        if self._view is not None:
            raise MembershipError("wait_for_promotion: this member already holds a slot")
        limit = timedelta(days=365) if timeout is None else timeout
        view = self._join(-1, time.monotonic() + limit.total_seconds())
        return None if view is None else self._result(-1, view)

    def _result(self, old_epoch: int, view: View) -> Reconfiguration:
        return Reconfiguration(
            old_epoch=old_epoch,
            epoch=view.epoch,
            rank=self._rank,
            world_size=view.world_size,
            rank_map=dict(view.rank_map),
            promoted=dict(view.promoted),
            lost_slots=view.lost_slots,
            mode=view.mode,
            committed_step=view.committed_step,
            promoted_here=self._m.index in view.promoted.values(),
        )

    def report_straggler(self, rank: int, reason: str) -> None:
        """Ask the coordinator to replace the member at ``rank`` by a spare, if one is free.

        Not collective (one rank asking is enough). The coordinator replaces
        it only under hot-swap with a live spare: then the current epoch is
        aborted as for a failure, and the replaced process gets
        :class:`StaleEpochError` at its next reconfiguration.

        Raises:
            ValueError: ``rank`` is not a rank of the current epoch.
        """
        view = self._view
        if view is None:
            raise ValueError(f"rank: not a rank of the current epoch: {rank!r}")
        check_int("rank", rank, low=0, high=view.world_size - 1)
        self._m.evict(view.epoch, view.members[rank], reason)

    def commit(self, step: int, ok: bool = True, timeout: timedelta | None = None) -> bool:
        """The step-commit vote: ``True`` on every member, or ``False`` on every member.

        Collective: every member of the epoch must call this for ``step``. A
        step counts only when every member voted ok and no failure hit the epoch
        first. The order is: run the whole step (the optimizer step included),
        vote, and only on ``True`` record the step as done (its loss, a snapshot
        of the state after it). On ``False`` the step's changes do not count:
        reconfigure and restore the last committed state, as
        :class:`optim.resilient.ResilientTraining` does.
        """
        check_int("step", step, low=0)
        view = self._view
        if view is None:
            raise MembershipError("commit: this member is not in an epoch")
        limit = self.timeout if timeout is None else timeout
        ok = bool(ok) and not self._epoch_failed(view.epoch)
        if not self._m.vote(view.epoch, step, view.members, ok, time.monotonic() + limit.total_seconds()):
            return False
        self._committed = max(self._committed, step)
        return True

    def close(self, *, ok: bool = True) -> None:
        """Leave the job and release the transport. Idempotent.

        Args:
            ok: The work is done (the default); ``False``: leaving after an
                error, which the coordinator treats as this member's failure.
        """
        if self._closed:
            return
        self._closed = True
        self._m.leave(ok)
        inner, side = self._inner, self._side
        groups = []
        if side is not None:
            side.transport.close()
            groups.append(side.transport.release())
        if inner is not None:
            inner.close()
            groups.append(inner.release())
        # Every group must be destroyed while the interpreter is whole: gloo's worker threads run as long
        # as their group object, and teardown with them alive aborts the process (SIGABRT). The last
        # epoch's groups go now, the failed epochs' are already on the reaper thread: wait for both.
        REAPER.bury(*groups, grace_s=0.0)
        del groups
        if not (REAPER.drain(self.timeout.total_seconds()) and join_helpers(self.timeout.total_seconds())):
            logger.warning("close: transports or their waits still busy after %s", self.timeout)

    def _raw_close(self) -> None:  # pragma: no cover - close() is overridden
        pass
