"""The member side of the control plane: registration, heartbeat, abort watch, views, votes.

One :class:`StoreMembership` per process. It speaks to the coordinator only
through the job's ``TCPStore`` (key names in :mod:`resilient_comm.keys`), with
records signed by the job secret where the job has one
(:class:`~resilient_comm.auth.ControlStore`).
A background thread with its own store client beats the heartbeat and watches
for the abort of the epoch this process is in; when it sees one it calls the
owner's callback (which aborts the epoch's transport) and then acknowledges.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

from bindings.errors import CommTimeoutError
from bindings.store import BoundedStore, Store, check_address, connect_store, is_etcd, parse_address, prefix_store
from bindings.validate import check_choice, check_int
from resilient_comm import keys
from resilient_comm.auth import ENV_SECRET, ENV_SECRET_FILE, ControlStore, JobSecret, RecordError
from resilient_comm.beacon import BeaconSender
from resilient_comm.errors import MembershipError
from resilient_comm.view import ROLES, MemberInfo, View, decode_json

__all__ = ["StoreMembership", "parse_address"]  # parse_address: re-exported from bindings.store

logger = logging.getLogger(__name__)


def _bounded(address: str, timeout: timedelta, secret: JobSecret | None) -> ControlStore:
    """A client connection whose every call ends by ``timeout``, even when the link to the store goes silent."""
    return ControlStore(BoundedStore(connect_store(address, timeout), timeout, address), secret)


class StoreMembership:
    """Registers this process with the coordinator and keeps it alive there.

    Args:
        address: The coordinator's ``host:port``, or the job's etcd store
            (``etcd://HOST:PORT,...[/PREFIX/JOB]``, what the coordinator's
            ``address`` says).
        job: The job id the process was started for (a mismatch is refused).
        role: ``active`` (takes a slot of the first epoch) or ``spare``.
        slot: The slot an active member asks for (``-1``: any).
        heartbeat_interval: Period of heartbeats and of the abort watch.
        timeout: Deadline of each store operation (a silent link to the
            coordinator ends it too: :class:`~bindings.errors.CommTimeoutError`).
        secret: The job secret, where the job has one (``None``: read it from
            ``SPARSECOMM_JOB_SECRET`` / ``SPARSECOMM_JOB_SECRET_FILE`` if set).

    Raises:
        ValueError: Bad arguments.
        MembershipError: The store belongs to another job, or the coordinator
            refuses this process's secret (or its lack of one); the refusal is
            in the coordinator's log too.
    """

    def __init__(
        self,
        address: str,
        job: str,
        *,
        role: str = "active",
        slot: int = -1,
        heartbeat_interval: timedelta = timedelta(milliseconds=50),
        timeout: timedelta = timedelta(seconds=30),
        secret: JobSecret | None = None,
    ) -> None:
        check_address(address)
        if secret is not None and not isinstance(secret, JobSecret):
            raise TypeError(f"secret: expected a JobSecret or None, got {type(secret).__name__}")
        secret = secret if secret is not None else JobSecret.from_env()
        check_choice("role", role, ROLES)
        check_int("slot", slot, low=-1)
        if role == "spare" and slot != -1:
            raise ValueError("slot: a spare cannot ask for a slot")
        if not isinstance(job, str) or not job:
            raise ValueError(f"job: must be a non-empty string, got {job!r}")
        for name, v in (("heartbeat_interval", heartbeat_interval), ("timeout", timeout)):
            if not isinstance(v, timedelta) or v.total_seconds() <= 0:
                raise ValueError(f"{name}: must be a positive datetime.timedelta, got {v!r}")
        self.role = role
        self.job = job
        self._interval = heartbeat_interval.total_seconds()
        self._address, self._timeout = address, timeout
        self._transport_stores: dict[int, list[Store]] = {}  # Python-side stores kept alive for their epoch
        self._store = _bounded(address, timeout, secret)
        refusal = self._admission(job)
        if refusal is not None:  # an unsigned note, read only to log who was refused
            note = {"host": socket.gethostname(), "pid": os.getpid(), "reason": refusal}
            self._store.raw.set(keys.refused(self._store.add(keys.REFUSED_NEXT, 1) - 1), json.dumps(note))
            self._store.close()
            raise MembershipError(refusal)
        self._secret = secret
        self._watch_store = _bounded(address, timeout, secret)
        self._lost: str | None = None  # why the coordinator counts as lost
        self._last_commit: tuple[int, int] | None = None  # (epoch, step) of this member's last committed vote
        self._watch_epoch = -1  # the epoch whose abort the watcher looks for (-1: none)
        self._aborted_upto = -1  # newest epoch whose abort was seen
        self._on_abort: Callable[[int], None] | None = None
        self._lock = threading.Lock()
        self.rejoins = 0  # times this process registered again as a spare after it was evicted
        self._register(role, slot)

    def _register(self, role: str, slot: int) -> None:
        """Take a fresh member index, write the registration, start the heartbeats (store and datagram)."""
        self.role = role
        self.index = int(self._store.add(keys.MEMBERS_NEXT, 1)) - 1
        self._beats = 0
        self._store.set(keys.heartbeat(self.index), "0")
        self.info = MemberInfo(
            index=self.index,
            member_id=f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}",
            pid=os.getpid(),
            host=socket.gethostname(),
            role=role,
            slot=slot,
            job=self.job,
        )
        self._store.set(self._store.private(keys.member(self.index)), self.info.to_json())
        self._beacon = BeaconSender(self.job, self.index, self._interval, self._secret)
        self._aim_beacon(self._store)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, args=(self._stop,), name=f"sparsecomm-heartbeat-{self.index}", daemon=True
        )
        self._thread.start()

    def _aim_beacon(self, store: ControlStore) -> None:
        """Point the datagram heartbeat at the port the active coordinator published (none published: no change)."""
        if not store.raw.check([keys.BEACON]):
            return
        try:
            host, port = parse_address(store.get(keys.BEACON).decode(errors="replace"))
        except ValueError as exc:  # RecordError too
            store.reject(keys.BEACON, exc)
            return
        if not is_etcd(self._address):  # the host this process reaches the store by is the coordinator's
            host = parse_address(self._address)[0]
        self._beacon.aim(host, port)

    def rejoin_as_spare(self) -> None:
        """Register again, as a spare with a fresh member index, after this member was evicted while alive.

        The old index stays dead to the coordinator (its heartbeats stop here);
        the new one waits for a slot like any spare. Not for a member whose
        coordinator is lost.

        Raises:
            MembershipError: The coordinator is lost.
        """
        if self._lost is not None:
            raise MembershipError(self._lost)
        old = self.index
        self._stop.set()
        self._beacon.stop()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._lock:
            self._watch_epoch, self._on_abort = -1, None
        self._last_commit = None
        try:
            self._register("spare", -1)
        except (RuntimeError, CommTimeoutError) as exc:
            raise self._lose(exc) from exc
        self.rejoins += 1
        logger.warning("member %d was evicted while alive: registered again as spare member %d", old, self.index)

    def _admission(self, job: str) -> str | None:
        """Why the coordinator will refuse this process (``None``: it will not); raises for a foreign job."""
        store = self._store
        deadline = time.monotonic() + self._timeout.total_seconds()
        while not store.raw.check([keys.JOB]):  # an etcd store may be there before any coordinator
            if time.monotonic() > deadline:
                raise MembershipError(
                    f"no coordinator began a job in the store at {self._address} within {self._timeout}"
                )
            time.sleep(0.05)
        signed = store.raw.check([keys.AUTH]) and store.raw.get(keys.AUTH) == keys.AUTH_HMAC
        if signed and not store.signed:
            return f"refused: job {job!r} requires its job secret (set {ENV_SECRET} or {ENV_SECRET_FILE})"
        if store.signed and not signed:
            return "refused: this coordinator runs without a job secret, but this process was given one"
        try:
            have = store.get(keys.JOB).decode(errors="replace")
        except RecordError:
            return f"refused: this process's job secret is not the one of the job at {self._address}"
        if have != job:
            raise MembershipError(f"job: this coordinator runs job {have!r}, not {job!r}")
        return None

    # ------------------------------------------------------------------ watch
    def watch(self, epoch: int, on_abort: Callable[[int], None]) -> None:
        """From now on, call ``on_abort(epoch)`` (from the watcher thread) when ``epoch`` is aborted, then ack."""
        with self._lock:
            self._watch_epoch = epoch
            self._on_abort = on_abort

    def aborted(self, epoch: int) -> bool:
        """Whether the abort of ``epoch`` (or a later one) was seen, or the coordinator was lost."""
        return self._aborted_upto >= epoch or self._lost is not None

    @property
    def lost(self) -> str | None:
        """Why the coordinator counts as lost; ``None``: it does not.

        A coordinator that dies is lost at the next heartbeat (its connections
        reset). One that goes silent (its host hung, or a cut between here and
        there) is lost only when a call to it passes the ``timeout``: until
        then the link may come back, and a member on the far side of a short
        cut learns it was replaced (:class:`~resilient_comm.errors.StaleEpochError`).
        """
        return self._lost

    @property
    def _where(self) -> str:
        if is_etcd(self._address):
            return f"control-plane store at {self._address}"
        return f"coordinator at {self._address}"

    def _lose(self, exc: BaseException) -> MembershipError:
        """Count the coordinator as lost (once); abort the watched epoch so that its collectives end now."""
        with self._lock:
            first = self._lost is None
            lost = self._lost = self._lost or f"lost the {self._where} ({exc})"
            epoch, cb = self._watch_epoch, self._on_abort
        if first:
            logger.error("member %d: %s", self.index, lost)
            for store in (self._store, self._watch_store):
                if isinstance(store.raw, BoundedStore):
                    store.raw.give_up(lost)  # a vote waiting on the silent link ends now
            if cb is not None and epoch >= 0:
                cb(epoch)
        return MembershipError(lost)

    def _beat(self, stop: threading.Event) -> None:
        store, index = self._watch_store, self.index
        while not stop.wait(self._interval):
            try:
                self._beats += 1
                store.set(keys.heartbeat(index), str(self._beats))
                if self._beats % 20 == 1:  # a coordinator taking over publishes its own datagram port
                    self._aim_beacon(store)
                with self._lock:
                    epoch, cb = self._watch_epoch, self._on_abort
                if epoch > self._aborted_upto and store.check([keys.abort(epoch)]):
                    self._aborted_upto = epoch
                    if cb is not None:
                        cb(epoch)
                    store.set(keys.ack(epoch, index), "1")
            except Exception as exc:  # noqa: BLE001 - the coordinator went away: nothing to beat for
                if not stop.is_set():
                    self._lose(exc)
                return

    # ------------------------------------------------------------------ views
    def transport_store(self, epoch: int, channel: str = "") -> Store:
        """The store of ``epoch``'s data-plane rendezvous (a fresh prefix per epoch and channel).

        On its own connection: a rendezvous that waits for a member that died
        must not queue this process's reports and votes behind it.
        """
        base = connect_store(self._address, self._timeout)
        self._transport_stores = {e: v for e, v in self._transport_stores.items() if e >= epoch - 1}
        self._transport_stores.setdefault(epoch, []).append(base)
        return prefix_store(keys.transport_prefix(epoch) + channel, base)

    def abort_info(self, epoch: int) -> dict[str, object]:
        """What the coordinator said when it aborted ``epoch`` (empty if it has not, or cannot be asked)."""
        try:
            if not self._store.check([keys.abort(epoch)]):
                return {}
            raw = self._store.get(keys.abort(epoch))
        except (RuntimeError, CommTimeoutError) as exc:
            self._lose(exc)
            return {}
        try:
            return decode_json(raw, "abort record")
        except ValueError:
            return {"reason": raw.decode(errors="replace")}

    def wait_view(self, after_epoch: int, deadline: float) -> View | None:
        """Block until an epoch newer than ``after_epoch`` is published; return its view.

        Returns ``None`` when the job shut down first.

        Raises:
            MembershipError: The job failed (no quorum, too few members).
            CommTimeoutError: ``deadline`` (``time.monotonic()``) passed.
        """
        store = self._store
        delay = 0.001
        while True:
            if self._lost is not None:
                raise MembershipError(self._lost)
            try:
                view = self._newer_view(after_epoch)
                failed = store.check([keys.FAILED])
                shutdown = not failed and store.check([keys.SHUTDOWN])
            except (RuntimeError, CommTimeoutError) as exc:  # the store went away (DistError is a RuntimeError)
                raise self._lose(exc) from exc
            if view is not None:
                return view
            if failed:
                raise MembershipError(f"the job failed: {store.get(keys.FAILED).decode(errors='replace')}")
            if shutdown:
                return None
            if time.monotonic() > deadline:
                raise CommTimeoutError(f"no epoch after {after_epoch} was formed in time")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def _newer_view(self, after_epoch: int) -> View | None:
        """The published view if it is newer than ``after_epoch``; a record that fails its checks is skipped."""
        store = self._store
        try:
            epoch = int(store.get(keys.EPOCH))
            if epoch <= after_epoch or not store.raw.check([keys.view(epoch)]):
                return None
            view = View.from_json(store.get(keys.view(epoch)))
        except ValueError as exc:  # RecordError too: not the job's, wait for the real one
            store.reject(keys.EPOCH, exc)
            return None
        if view.epoch != epoch or view.job != self.job:
            store.reject(keys.view(epoch), ValueError(f"view of epoch {view.epoch} (job {view.job!r}) at {epoch}"))
            return None
        return view

    def report(self, epoch: int, reason: str) -> None:
        """Tell the coordinator that ``epoch``'s transport failed here."""
        try:
            n = int(self._store.add(keys.SUSPECT_NEXT, 1)) - 1
            rec = {"member": self.index, "epoch": epoch, "reason": reason[:500]}
            self._store.set(self._store.private(keys.suspect(n)), json.dumps(rec))
        except Exception as exc:  # noqa: BLE001 - the coordinator also sees exits and heartbeats
            logger.warning("could not report a failure of epoch %d: %s", epoch, exc)

    def evict(self, epoch: int, member: int, reason: str) -> None:
        """Ask the coordinator to replace ``member`` of ``epoch`` by a spare (a straggler); it decides."""
        try:
            n = int(self._store.add(keys.SUSPECT_NEXT, 1)) - 1
            rec = {"member": self.index, "epoch": epoch, "reason": reason[:500], "evict": int(member)}
            self._store.set(self._store.private(keys.suspect(n)), json.dumps(rec))
        except Exception as exc:  # noqa: BLE001 - a lost request only keeps the straggler
            logger.warning("could not ask for the eviction of member %d: %s", member, exc)

    def configured(self, epoch: int) -> None:
        """Tell the coordinator this member built ``epoch``'s transport."""
        try:
            self._store.set(keys.configured(epoch, self.index), "1")
        except (RuntimeError, CommTimeoutError) as exc:
            raise self._lose(exc) from exc

    def vote(self, epoch: int, step: int, members: tuple[int, ...], ok: bool, deadline: float) -> bool:
        """The AND-vote of ``step`` over ``epoch``'s ``members``; the same answer on every member.

        Each member writes its (signed) ok-vote, then looks for every member's:
        the last to write finds them all, reads them and, when all are the
        job's and ok, writes the decision ``1``. A not-ok vote, the abort of
        the epoch, or the deadline writes ``0``. The decision key is written once
        (compare-and-set), so every member reads the same value; a decision
        record that is not the job's reads as ``0`` on every member.

        A committed step retires the records of the one this member committed
        before it in the epoch (its ballot; slot 0 also the decision): every
        member wrote a ballot for this step, so every member has read that
        decision. The store stays the same size however long the job runs.
        """
        store = self._store
        key = store.private(keys.decision(epoch, step))  # nobody else can write it first
        try:
            if ok and not self.aborted(epoch):
                store.set(keys.vote(epoch, step, self.index), "1")
                names = [keys.vote(epoch, step, m) for m in members]
                ballots = store.multi_get(names) if store.raw.check(names) else []
                if ballots and all(b == b"1" for b in ballots) and store.create(key, "1") == b"1":
                    store.set(keys.COMMITTED, str(step))
            else:
                store.create(key, "0")
            delay = 0.0002
            while not store.raw.check([key]):  # presence only: the value is checked once, below
                if self.aborted(epoch) or time.monotonic() > deadline:
                    store.create(key, "0")
                    break
                time.sleep(delay)
                delay = min(delay * 2, 0.005)
            committed = store.get(key) == b"1"
            if committed:
                self._retire(epoch, step, members)
            return committed
        except RecordError as exc:
            store.reject(key, exc)
            return False
        except (RuntimeError, CommTimeoutError) as exc:  # no decision can be read: nobody commits without one
            raise self._lose(exc) from exc

    def _retire(self, epoch: int, step: int, members: tuple[int, ...]) -> None:
        last, self._last_commit = self._last_commit, (epoch, step)
        if last is None or last[0] != epoch:
            return
        self._store.raw.delete_key(keys.vote(epoch, last[1], self.index))
        if members and members[0] == self.index:
            self._store.raw.delete_key(self._store.private(keys.decision(epoch, last[1])))

    # ------------------------------------------------------------------ end
    def leave(self, ok: bool = True) -> None:
        """Leave (``ok``: cleanly, the work done; otherwise after an error) and stop the heartbeat. Idempotent.

        A member that leaves with ``ok=False`` counts as failed, as if it had
        exited with an error: the coordinator replaces it or shrinks.
        """
        if self._stop.is_set():
            return
        try:
            self._store.set(keys.left(self.index), "1" if ok else "error")
            self._store.add(keys.LEFT_NEXT, 1)
        except Exception as exc:  # noqa: BLE001
            logger.debug("could not mark member %d as left: %s", self.index, exc)
        self._stop.set()
        self._beacon.stop()
        self._thread.join(timeout=5)
        self._store.close()
        self._watch_store.close()

    def stop_heartbeat(self) -> None:
        """Stop heartbeating without leaving (tests use this to look hung)."""
        self._stop.set()
        self._beacon.stop()
