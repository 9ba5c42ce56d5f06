"""Replaceable coordinators: the active one holds an etcd lease, standbys wait to take it over.

With the job's store in etcd (``CoordinatorConfig.store = "etcd://..."``) any
number of coordinators may run for one job. Each is a candidate:
:meth:`Leadership.acquire` waits until no coordinator holds the job's leader
key (:data:`resilient_comm.keys.LEADER`), then writes its own id there, bound
to a lease of about the heartbeat timeout, and *fences* its store: from then
on every write it makes goes through only while the key still holds its id
(:meth:`bindings.etcd_store.EtcdStore.fence`). The active coordinator keeps
the lease alive from its control loop (:meth:`Leadership.keep`). When it dies,
or hangs, or is cut off, the lease runs out, etcd deletes the key, and a
standby takes over from the state in the store. If the old one comes back, its
next write or lease refresh raises :class:`~bindings.etcd_store.FencedError`:
it is deposed and becomes a standby itself; it never writes over its
successor.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

from bindings.errors import CommError, CommTimeoutError
from bindings.etcd_store import FencedError
from resilient_comm import keys
from resilient_comm.auth import ControlStore
from resilient_comm.view import MemberInfo, View, decode_json

__all__ = ["FencedError", "Handover", "LeaseStore", "Leadership", "MIN_TTL_S"]

logger = logging.getLogger(__name__)

#: How often a standby reads the job's view and members (seconds).
FOLLOW_S = 0.25

#: etcd's shortest lease at its default election timeout (a shorter TTL is raised to it).
MIN_TTL_S = 2

#: How often a standby looks for the leader key (seconds, or the coordinator's poll interval if longer). A
#: standby can take over only once the active coordinator's lease (at least MIN_TTL_S) has lapsed, so this
#: adds at most a twentieth of that to a takeover, where polling every 10 ms kept a core a quarter busy and
#: sent etcd 100 requests a second per standby.
STANDBY_POLL_S = 0.1


class LeaseStore(Protocol):
    """What a store must offer for replaceable coordinators (:class:`~bindings.etcd_store.EtcdStore` does).

    Beside a torch ``Store``'s ``check`` and ``get``: leases, a create bound
    to one, and a fence on every later write.
    """

    def check(self, keys: list[str]) -> bool: ...

    def get(self, key: str) -> bytes: ...

    def grant(self, ttl: timedelta) -> int: ...

    def refresh(self, lease: int) -> bool: ...

    def revoke(self, lease: int) -> None: ...

    def create_leased(self, key: str, value: str | bytes, lease: int) -> bool: ...

    def fence(self, key: str | None, value: str | bytes = b"") -> None: ...


class Leadership:
    """One coordinator's candidacy for a job kept in etcd.

    Args:
        store: The job's etcd store (its fence is set and cleared here).
        ttl: Lease time: how long the job may go without a live coordinator
            before a standby takes over (rounded up to whole seconds, at least
            :data:`MIN_TTL_S`).
    """

    def __init__(self, store: LeaseStore, ttl: timedelta) -> None:
        self.store = store
        self.ttl_s = max(MIN_TTL_S, math.ceil(ttl.total_seconds()))
        self.id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._lease: int | None = None
        self._refreshed = 0.0

    @property
    def active(self) -> bool:
        """Whether this candidate holds the lease (as far as it last knew)."""
        return self._lease is not None

    def acquire(self, stop: threading.Event, poll: timedelta, follow: Callable[[], None] | None = None) -> bool:
        """Wait until this candidate is the active coordinator (``True``), or ``stop`` is set (``False``).

        ``follow`` is called at every poll while another coordinator is active
        (at most every :data:`FOLLOW_S`), so that a standby knows the job.
        """
        store, wait = self.store, max(poll.total_seconds(), STANDBY_POLL_S)
        store.fence(None)
        logged, followed = False, 0.0
        while not stop.is_set():
            if follow is not None and time.monotonic() - followed >= FOLLOW_S:
                follow()
                followed = time.monotonic()
            if not store.check([keys.LEADER]):
                lease = store.grant(timedelta(seconds=self.ttl_s))
                if store.create_leased(keys.LEADER, self.id, lease):
                    self._lease, self._refreshed = lease, time.monotonic()
                    store.fence(keys.LEADER, self.id)
                    logger.info("coordinator %s is active (lease %x, %d s)", self.id, lease, self.ttl_s)
                    return True
                store.revoke(lease)
            elif not logged:
                logged = True
                holder = bytes(store.get(keys.LEADER)).decode(errors="replace")
                logger.info("coordinator %s is standby (active: %s)", self.id, holder[:200])
            stop.wait(wait)
        return False

    def keep(self) -> None:
        """Refresh the lease when a third of it has passed; :class:`FencedError` if it was lost meanwhile."""
        if self._lease is None:
            raise FencedError("this coordinator holds no lease")
        if time.monotonic() - self._refreshed < self.ttl_s / 3:
            return
        try:
            alive = self.store.refresh(self._lease)
        except CommTimeoutError:
            raise
        except CommError as exc:  # etcd answered, but not about a live lease
            alive = False
            logger.warning("coordinator %s: lease refresh refused: %s", self.id, exc)
        if not alive:
            self._lease = None
            raise FencedError(f"coordinator {self.id}: its lease ran out (another coordinator may be active)")
        self._refreshed = time.monotonic()

    def release(self) -> None:
        """Give the lease up now (a standby takes over at once); quietly, if it is gone already."""
        lease, self._lease = self._lease, None
        self.store.fence(None)
        if lease is not None:
            try:
                self.store.revoke(lease)
            except Exception as exc:  # noqa: BLE001 - it runs out by itself
                logger.warning("could not revoke the coordinator lease: %s", exc)


@dataclass(frozen=True, kw_only=True)
class Handover:
    """What a coordinator taking over a job reads from the store, beside the registrations.

    Attributes:
        epoch: The newest published epoch (``-1``: none yet).
        view: Its view.
        dead: Members the previous coordinator declared dead.
        left: Members that left cleanly.
        spares: Live spares in promotion order (the saved order, then any
            registered since that hold no slot).
        shutdown: The job is over.
        reconfiguring: The newest epoch was aborted, and no next one published.
    """

    epoch: int
    view: View | None
    dead: frozenset[int]
    left: frozenset[int]
    spares: tuple[int, ...]
    shutdown: bool
    reconfiguring: bool

    @classmethod
    def read(cls, store: ControlStore, job: str, members: Mapping[int, MemberInfo]) -> Handover:
        """Read it, given the members registered so far; ``ValueError`` if the job is another or has failed."""
        if store.get(keys.JOB).decode(errors="replace") != job:
            raise ValueError(f"the store holds another job than {job!r}")
        if store.check([keys.FAILED]):
            raise ValueError(store.get(keys.FAILED).decode(errors="replace"))
        saved: dict[str, list[int]] = {}
        if store.check([keys.COORDINATOR_STATE]):
            saved = decode_json(store.get(keys.COORDINATOR_STATE), "coordinator state")

        def known(name: str) -> list[int]:
            return [int(i) for i in saved.get(name, []) if int(i) in members]

        dead, left = frozenset(known("dead")), frozenset(known("left"))
        epoch = int(store.get(keys.EPOCH))
        view = View.from_json(store.get(keys.view(epoch))) if epoch >= 0 else None
        taken = dead | left | (set(view.members) if view is not None else set())
        spares = [i for i in known("spares") if i not in taken]
        spares += [
            i
            for i in sorted(members)
            if i not in spares and i not in taken and (view is not None or members[i].role == "spare")
        ]
        return cls(
            epoch=epoch,
            view=view,
            dead=dead,
            left=left,
            spares=tuple(spares),
            shutdown=store.raw.check([keys.SHUTDOWN]),
            reconfiguring=view is not None and store.raw.check([keys.abort(epoch)]),
        )

    @staticmethod
    def save(
        store: ControlStore, dead: Iterable[int], left: Iterable[int], spares: Iterable[int], last: str | None
    ) -> str:
        """Write the state a successor needs if it differs from ``last`` (what the previous call returned)."""
        record = json.dumps({"dead": sorted(dead), "left": sorted(left), "spares": list(spares)})
        if record != last:
            store.set(keys.COORDINATOR_STATE, record)
        return record
