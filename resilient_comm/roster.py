"""The coordinator's membership half: who registered, who is alive, who left, which spares wait.

:class:`Roster` reads the evidence the members leave in the job's store
(:mod:`resilient_comm.keys`): registrations (refusing records that are not the
job's), heartbeat counters and datagram beats, clean leaves, suspicion and
straggler reports, plus the process exits the launcher reports. From them it
keeps what the epoch half of the coordinator (:mod:`resilient_comm.coordinator`)
decides on: the members, the dead, the members gone cleanly, the live spares in
promotion order and the epochs suspected to have failed.

It never forms an epoch. Where silence alone would leave the current epoch
without a majority it holds off declaring anyone dead (:meth:`Roster.hold_off`,
step 3 of the protocol in :mod:`resilient_comm.coordinator`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from resilient_comm import keys
from resilient_comm.auth import ControlStore, RecordError
from resilient_comm.beacon import BeaconListener
from resilient_comm.config import CoordinatorConfig
from resilient_comm.events import EventLog
from resilient_comm.evidence import Suspicion, refusal_fields
from resilient_comm.heartbeats import Heartbeats
from resilient_comm.inbox import Inbox
from resilient_comm.plan import majority
from resilient_comm.view import MemberInfo, View

__all__ = ["Roster"]

logger = logging.getLogger(__name__)

#: Refused processes logged one by one; past this only a count is kept.
_MAX_REFUSALS_LOGGED = 1000


class Roster:
    """What the coordinator knows about the job's processes, read from the store on every :meth:`refresh`.

    Only the coordinator's control thread calls the methods that change it;
    :meth:`known` and :meth:`live_spares` may be called from any thread.

    Args:
        config: The job's settings.
        log: The job's event log (``member_*``, ``failure_*``, ``straggler_detected``, ``stall_suspected``).
        view: Returns the current epoch's view (``None`` before the first epoch).
        exits: Process exits ``(pid, returncode)`` reported by the launcher.

    Attributes:
        members: Every member that registered, by index.
        dead: Members declared failed.
        left: Members that left cleanly (their work is done).
        suspected: Epochs a member reported a failure of, not yet acted on.
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        log: EventLog,
        view: Callable[[], View | None],
        exits: queue.Queue[tuple[int, int]],
    ) -> None:
        self.config, self.log = config, log
        self._view, self._exits = view, exits
        self._lock = threading.Lock()  # members and spares, read by other threads
        self.members: dict[int, MemberInfo] = {}
        self._spares: list[int] = []
        self.dead: set[int] = set()
        self.left: set[int] = set()
        self.suspected: set[int] = set()
        self._hb = Heartbeats(config.heartbeat_timeout.total_seconds())
        self._silenced: set[int] = set()  # dead for silence alone before the job started: revived if they beat
        self._left_count = 0  # the members' leave counter when it was last read
        self._stalled: set[str] = set()  # kinds of silence without quorum being waited out (logged once each)
        self._patience_s = (config.heartbeat_timeout + config.stall_grace).total_seconds()
        self._refusal_count = 0
        self._store: ControlStore | None = None
        self._registrations: Inbox | None = None
        self._suspicions: Inbox | None = None
        self._refusals: Inbox | None = None

    # ------------------------------------------------------------------ reading
    def open(self, store: ControlStore) -> None:
        """Start reading ``store``'s registrations, suspicions and refusals from their first record."""
        patience = self._patience_s
        self._store = store
        self._registrations = Inbox(store, keys.MEMBERS_NEXT, lambda i: store.private(keys.member(i)), patience)
        self._suspicions = Inbox(store, keys.SUSPECT_NEXT, lambda i: store.private(keys.suspect(i)), patience)
        self._refusals = Inbox(store, keys.REFUSED_NEXT, keys.refused, patience, read=store.unverified)

    @property
    def opened(self) -> bool:
        """Whether :meth:`open` was called."""
        return self._store is not None

    def _opened(self) -> ControlStore:
        if self._store is None:
            raise RuntimeError("roster: not opened")
        return self._store

    def adopt(self, now: float) -> None:
        """Take in the registrations so far without logging them (a coordinator taking over a running job)."""
        assert self._registrations is not None
        for idx, record in self._registrations.poll():
            self._register(idx, record, now, announce=False)

    def restore(self, dead: Iterable[int], left: Iterable[int], spares: Iterable[int]) -> None:
        """Take the sets a previous coordinator saved (:class:`~resilient_comm.standby.Handover`)."""
        self.dead, self.left = set(dead), set(left)
        with self._lock:
            self._spares = list(spares)

    def skip_refusals(self) -> None:
        """Pass over the refusals recorded so far (the coordinator they came to logged them)."""
        assert self._refusals is not None
        self._refusals.poll()

    def refresh(self, beacon: BeaconListener | None) -> None:
        """Read registrations, refusals, beats, leaves, heartbeats, exits and suspicions; update the sets."""
        store = self._opened()
        now = time.monotonic()
        assert self._registrations is not None and self._suspicions is not None and self._refusals is not None
        for idx, record in self._registrations.poll():
            self._register(idx, record, now)
        for _, record in self._refusals.poll():
            self._refused(None, record)
        if beacon is not None:
            for i in beacon.poll():
                self._hb.touch(i, now)
        self._read_leaves()
        live = self.live()
        if self._silenced and self._view() is None:
            self._revive(now)
        if live:
            self._read_heartbeats(store, live, now)
        while True:
            try:
                pid, code = self._exits.get_nowait()
            except queue.Empty:
                break
            self._on_exit(pid, code)
        for i, record in self._suspicions.poll():
            try:
                sus = Suspicion.parse(record, self.members)
            except ValueError as exc:
                logger.warning("ignoring suspicion %d: %s", i, exc)
                continue
            if sus.evict is not None:
                self._on_evict(sus.epoch, sus.evict, sus.reason)
                continue
            view = self._view()
            slot = view.slot_of(sus.member) if view is not None else None
            self.log.emit("failure_suspected", epoch=sus.epoch, slot=slot, member=sus.member, reason=sus.reason)
            if view is not None and sus.epoch == view.epoch:
                self.suspected.add(sus.epoch)

    def _read_heartbeats(self, store: ControlStore, live: list[int], now: float) -> None:
        """Declare dead the ``live`` members whose heartbeat stopped, unless a stall is being waited out."""
        silent: dict[int, float] = {}
        for i, raw in zip(live, store.multi_get([keys.heartbeat(i) for i in live]), strict=True):
            if (quiet_s := self._hb.observe(i, raw, now)) is None:
                continue
            if (ok := self._left_status(i)) is not None:
                self._on_left(i, ok)
            else:
                silent[i] = quiet_s
        if not silent:
            self._stalled.discard("heartbeats stopped")
        elif self.hold_off(set(silent), min(silent.values()), "heartbeats stopped"):
            silent = {}
        elif "heartbeats stopped" in self._stalled and max(silent.values()) <= self._patience_s:
            self._stalled.discard("heartbeats stopped")  # a stall ended; the rest get one timeout from now
            self._hb.restart(silent, now)
            silent = {}
        for i, silent_s in silent.items():
            self.mark_dead(i, "heartbeat", silent_s=round(silent_s, 3))
            if self._view() is None:
                self._silenced.add(i)

    def _register(self, idx: int, record: bytes | RecordError, now: float, announce: bool = True) -> None:
        """Take in registration ``idx`` (logged if ``announce``), or refuse (and log) one that is not the job's."""
        try:
            if isinstance(record, RecordError):
                raise record
            info = MemberInfo.from_json(record)
            if info.job != self.config.job or info.index != idx:
                raise ValueError(f"registered for job {info.job!r} as member {info.index}")
        except ValueError as exc:
            self._refused(idx, record if isinstance(record, bytes) else b"", str(exc))
            return
        with self._lock:
            self.members[idx] = info
            self._hb.register(idx, now)
            if info.role == "spare" or self._view() is not None:
                self._spares.append(idx)
        if announce:
            slot = info.slot if info.slot >= 0 else None
            self.log.emit("member_started", slot=slot, pid=info.pid, member=idx, role=info.role)

    def _refused(self, idx: int | None, record: bytes | RecordError, why: str = "") -> None:
        """Log a process that was refused: what it claims to be (unchecked) and why."""
        self._refusal_count += 1
        if self._refusal_count > _MAX_REFUSALS_LOGGED:
            if self._refusal_count == _MAX_REFUSALS_LOGGED + 1:
                logger.warning("more than %d processes refused: no longer logging each", _MAX_REFUSALS_LOGGED)
            return
        self.log.emit("member_refused", **refusal_fields(idx, record, why))

    def _on_evict(self, epoch: int, member: int, reason: str) -> None:
        """A member asks for ``member`` of ``epoch`` to be replaced (a straggler): only by a live spare."""
        view = self._view()
        if view is None or epoch != view.epoch or member not in view.members or member in self.dead:
            return
        with self._lock:
            replace = self.config.mode == "hotswap" and bool(self._spares)
        info = self.members.get(member)
        self.log.emit(
            "straggler_detected",
            epoch=epoch,
            slot=view.slot_of(member),
            pid=info.pid if info else None,
            member=member,
            replaced=replace,
            reason=reason,
        )
        if replace:
            self.mark_dead(member, "straggler")

    def _on_exit(self, pid: int, code: int) -> None:
        match = [i for i, info in self.members.items() if info.pid == pid]
        view = self._view()
        for i in match:
            slot = view.slot_of(i) if view is not None else None
            self.log.emit("member_exited", epoch=view.epoch if view else None, slot=slot, pid=pid, returncode=code)
            self._silenced.discard(i)  # gone for good
            if code == 0 and self._left_status(i):
                self._member_left(i)
            else:
                self.mark_dead(i, "exit", returncode=code)

    def _revive(self, now: float) -> None:
        """Count again the members found silent before the job started whose heartbeat moved since.

        Nothing was decided without them yet (no epoch exists), so a process that
        was only slow to start (a busy machine) joins the first epoch after all
        instead of leaving the job short of members until ``start_timeout``.
        """
        store = self._opened()
        quiet = sorted(self._silenced - self.left)
        for i, raw in zip(quiet, store.multi_get([keys.heartbeat(i) for i in quiet]), strict=True):
            if self._hb.observe(i, raw, now) is not None:
                continue  # still silent
            info = self.members[i]
            with self._lock:
                self.dead.discard(i)
                self._silenced.discard(i)
                if info.role == "spare":
                    self._spares.append(i)
            logger.info("coordinator: member %d (pid %d) beats again; counted before the job starts", i, info.pid)
            self.log.emit("member_revived", slot=info.slot if info.slot >= 0 else None, pid=info.pid, member=i)

    def _left_status(self, i: int) -> bool | None:
        """Whether member ``i`` left cleanly (``True``), after an error (``False``), or not at all (``None``)."""
        store = self._opened()
        if not store.raw.check([keys.left(i)]):
            return None
        try:
            return store.get(keys.left(i)) == b"1"
        except RecordError as exc:  # not the job's record: the member did not leave
            store.reject(keys.left(i), exc)
            return None

    def _read_leaves(self) -> None:
        """Look for members that left, when the leave counter moved (one read per poll otherwise)."""
        store = self._opened()
        if not store.raw.check([keys.LEFT_NEXT]):
            return
        raw = bytes(store.raw.get(keys.LEFT_NEXT))
        count = int(raw) if raw.isdigit() and len(raw) < 20 else self._left_count
        if count == self._left_count:
            return
        self._left_count = count
        for i in self.live():
            if (ok := self._left_status(i)) is not None:
                self._on_left(i, ok)

    def _on_left(self, i: int, ok: bool) -> None:
        if ok:
            self._member_left(i)
        else:
            self.mark_dead(i, "left after an error")

    def _member_left(self, i: int) -> None:
        with self._lock:
            self.left.add(i)
            if i in self._spares:
                self._spares.remove(i)

    # ------------------------------------------------------------------ verdicts
    def mark_dead(self, i: int, reason: str, **extra: Any) -> None:
        """Declare member ``i`` failed (once; a member that left cleanly stays left) and log why."""
        if i in self.dead or i in self.left:
            return
        with self._lock:
            self.dead.add(i)
            if i in self._spares:
                self._spares.remove(i)
        view, info = self._view(), self.members.get(i)
        epoch, slot = (view.epoch, view.slot_of(i)) if view is not None else (None, None)
        pid = info.pid if info else None
        self.log.emit("failure_detected", epoch=epoch, slot=slot, pid=pid, member=i, reason=reason, **extra)

    def hold_off(self, silent: set[int], silent_s: float, what: str) -> bool:
        """Whether to wait before declaring ``silent`` dead on silence alone (step 3 of the protocol).

        True while the current epoch would keep no majority without them and the
        silence is shorter than ``heartbeat_timeout + stall_grace``. Members that
        have been quiet for half a heartbeat timeout are not counted as the
        majority either: a stall does not silence everyone in the same instant.
        The first wait for each kind of silence (``what``) is logged; call
        :meth:`stall_over` once it is decided.
        """
        view = self._view()
        if view is None:
            return False
        now, gone = time.monotonic(), self.dead | silent
        quiet = self._hb.timeout_s / 2
        survivors = sum(1 for m in view.members if m not in gone and self._hb.age(m, now) < quiet)
        if majority(survivors, view.world_size) is None or silent_s > self._patience_s:
            return False
        if what not in self._stalled:
            self._stalled.add(what)
            n, grace = len(silent & set(view.members)), self.config.stall_grace.total_seconds()
            msg = "%s for %d of epoch %d's %d members at once: waiting up to %.0f s before declaring them dead"
            logger.warning(msg, what, n, view.epoch, view.world_size, grace)
            self.log.emit("stall_suspected", epoch=view.epoch, members=sorted(silent), reason=what)
        return True

    def stall_over(self, what: str) -> None:
        """The silence ``what`` was decided on: a later one is logged again."""
        self._stalled.discard(what)

    # ------------------------------------------------------------------ views of the sets
    def live(self) -> list[int]:
        """Registered members neither dead nor gone, by index."""
        return [i for i in self.members if i not in self.dead and i not in self.left]

    def live_actives(self) -> int:
        """How many registered active (not spare) members are neither dead nor gone."""
        gone = self.dead | self.left
        return sum(1 for i, m in self.members.items() if m.role == "active" and i not in gone)

    def known(self) -> dict[int, MemberInfo]:
        """A copy of :attr:`members` (thread-safe)."""
        with self._lock:
            return dict(self.members)

    def live_spares(self) -> list[int]:
        """Member indices of the live spares, in promotion order (thread-safe)."""
        with self._lock:
            return list(self._spares)

    def add_spares(self, members: Iterable[int]) -> None:
        """Put ``members`` at the end of the promotion order (extra actives of the first epoch)."""
        with self._lock:
            self._spares.extend(members)

    def take_spares(self, members: Iterable[int]) -> None:
        """Remove ``members`` (promoted into an epoch) from the spares."""
        with self._lock:
            for m in members:
                self._spares.remove(m)
