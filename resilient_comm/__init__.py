"""Fault-aware communication: membership epochs, fail-fast collectives, hot-swap and shrink.

* :class:`Coordinator` (control plane, hosted by the launcher or standalone)
  owns the job's store, the membership view, the epochs, the spares and the
  committed step;
* :class:`FaultAwareCommunicator` (one per training process) is a ``bindings``
  communicator whose collectives fail fast on a dead or hung peer and whose
  :meth:`~FaultAwareCommunicator.reconfigure` moves every survivor to the next
  epoch (a spare in the dead slot, or a smaller world);
* :class:`ResilientCommunicator` is the surface (and call order) both
  fault-aware communicators offer: :class:`FaultAwareCommunicator` and
  :class:`~resilient_comm.ulfm_communicator.UlfmCommunicator` (MPI ULFM, no coordinator);
* :func:`~resilient_comm.launcher.launch` starts a coordinator, the workers and
  the spares on this machine.
"""

from __future__ import annotations

from resilient_comm.coordinator import Coordinator, CoordinatorConfig
from resilient_comm.errors import MembershipError, StaleEpochError
from resilient_comm.events import (
    EVENTS,
    EventFileError,
    EventLog,
    EventWriter,
    ProcessEvents,
    read_event_dir,
    read_events,
)
from resilient_comm.fault_aware import FaultAwareCommunicator
from resilient_comm.membership import StoreMembership
from resilient_comm.protocol import Reconfiguration, ResilientCommunicator
from resilient_comm.view import MODES, MemberInfo, View

__all__ = [
    "EVENTS",
    "MODES",
    "Coordinator",
    "CoordinatorConfig",
    "EventFileError",
    "EventLog",
    "EventWriter",
    "FaultAwareCommunicator",
    "MemberInfo",
    "MembershipError",
    "ProcessEvents",
    "Reconfiguration",
    "ResilientCommunicator",
    "StaleEpochError",
    "StoreMembership",
    "View",
    "read_event_dir",
    "read_events",
]
