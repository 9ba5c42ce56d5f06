"""The resilient communicator surface, shared by both fault-aware communicators.

:class:`ResilientCommunicator` is what training code may rely on whichever
implementation runs underneath:
:class:`~resilient_comm.fault_aware.FaultAwareCommunicator` (a coordinator
and one gloo / NCCL transport per epoch) or
:class:`~resilient_comm.ulfm_communicator.UlfmCommunicator` (MPI ULFM, no coordinator).
:class:`Reconfiguration` is what either reports when a process moves to a new
epoch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from bindings.base import Communicator

__all__ = ["Reconfiguration", "ResilientCommunicator"]


@dataclass(frozen=True, kw_only=True)
class Reconfiguration:
    """What changed when this member moved to a new epoch.

    Attributes:
        old_epoch: The epoch left (``-1`` for a spare's first epoch).
        epoch: The epoch joined.
        rank: This member's rank (= slot) in it.
        world_size: Members of the new epoch.
        rank_map: Old rank -> new rank of every member that stayed.
        promoted: Slot -> member index of each spare promoted into the epoch.
        lost_slots: Slots of the old epoch whose member failed.
        mode: ``hotswap``, ``shrink``, ``same`` (nobody lost) or ``start``.
        committed_step: Last step committed everywhere before the epoch formed.
        promoted_here: Whether this process is one of the promoted spares.
    """

    old_epoch: int
    epoch: int
    rank: int
    world_size: int
    rank_map: dict[int, int] = field(default_factory=dict)
    promoted: dict[int, int] = field(default_factory=dict)
    lost_slots: tuple[int, ...] = ()
    mode: str = "start"
    committed_step: int = -1
    promoted_here: bool = False


@runtime_checkable
class ResilientCommunicator(Communicator, Protocol):
    """A :class:`~bindings.base.Communicator` whose membership survives dead peers.

    Call order of one process:

    1. **connect**: :meth:`connect` registers the process. An active process
       holds a slot at once (:attr:`slot` is its rank); a spare holds none.
    2. **wait for promotion** (spares only): :meth:`wait_for_promotion` blocks
       until a reconfiguration gives this process a slot (it then returns the
       :class:`Reconfiguration`; resume at its ``committed_step + 1``) or the
       job ended without it (``None``: close and exit).
    3. **collectives**: the :class:`~bindings.base.Communicator` operations.
       A dead or hung peer makes them raise
       :class:`~bindings.errors.PeerFailureError` within their deadline, on
       every survivor; after that every call raises until step 5.
    4. **commit**: :meth:`commit` votes each step over the epoch's members;
       apply the step's effects (optimizer step, snapshot) only when it
       returns ``True``, which it does on every member or on none.
    5. **reconfigure**: after a ``PeerFailureError`` every survivor calls
       :meth:`reconfigure`; it returns the :class:`Reconfiguration` (a spare
       in a dead slot, or a smaller world) and the process redoes the steps
       after ``committed_step``. Then back to step 3.
    6. :meth:`~bindings.base.Communicator.close` leaves the job.

    Membership errors (no quorum, too few members, misuse) raise
    :class:`~resilient_comm.errors.MembershipError`.
    """

    @classmethod
    def connect(cls, *, timeout: timedelta = timedelta(seconds=30)) -> ResilientCommunicator:
        """Join the job; ``timeout`` is the deadline of every operation.

        Each implementation takes further keyword arguments of its own.
        """
        ...

    @property
    def epoch(self) -> int:
        """The current epoch (``-1`` before this process holds a slot)."""
        ...

    @property
    def member(self) -> int:
        """This process's member index, unique in the job."""
        ...

    @property
    def slot(self) -> int | None:
        """This process's slot (= rank) in the current epoch; ``None`` for a spare."""
        ...

    @property
    def healthy(self) -> bool:
        """Whether the current epoch is usable (no failure seen in it)."""
        ...

    @property
    def committed_step(self) -> int:
        """The newest step this process knows to be committed everywhere (``-1``: none)."""
        ...

    def wait_for_promotion(self, timeout: timedelta | None = None) -> Reconfiguration | None:
        """Spare: wait until an epoch gives this process a slot; ``None`` if the job ended without it."""
        ...

    def commit(self, step: int, ok: bool = True, timeout: timedelta | None = None) -> bool:
        """Vote ``step``: ``True`` on every member of the epoch, or ``False`` on every member."""
        ...

    def reconfigure(self, timeout: timedelta | None = None) -> Reconfiguration:
        """Collective over the survivors: move to the next epoch and say what changed."""
        ...


if TYPE_CHECKING:  # both implementations satisfy the protocol (checked statically)
    from resilient_comm.fault_aware import FaultAwareCommunicator
    from resilient_comm.ulfm_communicator import UlfmCommunicator

    _FAULT_AWARE: type[ResilientCommunicator] = FaultAwareCommunicator
    _ULFM: type[ResilientCommunicator] = UlfmCommunicator
