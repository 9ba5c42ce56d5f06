"""The control plane: one coordinator per job, never a training rank.

The coordinator hosts the job's ``TCPStore`` and decides membership: it reads
registrations and heartbeat counters from the store, learns about process exits
from the launcher (:meth:`Coordinator.notify_exit`) and about transport errors
from the members (suspicion records), and forms each new epoch's
:class:`~resilient_comm.view.View`. Members talk to it only through store keys
(:mod:`resilient_comm.keys`); the data plane (one process group per epoch)
never passes through it. What the coordinator knows about the processes
(registrations, heartbeats, leaves, exits, suspicions, the spares) is kept by
its :class:`~resilient_comm.roster.Roster`; this module forms the epochs from it.

Protocol of one reconfiguration, from epoch ``e``:

1. evidence of a failure (an exit, a stale heartbeat, a suspicion for ``e``);
2. ``abort/e`` is set: every member's watcher aborts its epoch-``e`` transport
   (so collectives blocked on a hung peer fail at once) and acknowledges;
3. members that acknowledge within ``ack_timeout`` and still heartbeat survive;
   where silence alone (stale heartbeats, missing acknowledgements) would
   leave no majority, the coordinator waits up to ``stall_grace`` longer
   before it believes it: a loaded host or a paused process silences everyone
   at once, and declaring a majority dead on that would end the job for
   nothing (exits are hard evidence and never wait);
4. majority guard: unless more than half of epoch ``e``'s members survived, no
   epoch forms and the job fails (a minority never continues on its own);
5. the view of ``e + 1``: dead slots go to spares (``hotswap``) or are dropped
   and the rest renumbered in slot order (``shrink``, also the fallback when no
   spare is left), never below ``min_world_size``; steps 4 and 5 are
   :func:`~resilient_comm.plan.plan_next_epoch`;
6. members build the new transport under the store prefix ``ep{e+1}/`` and
   report ``configured``; a failure meanwhile starts the next round (``e + 2``).

The job ends when every member of the current epoch has left cleanly (its
work is done): the coordinator records it as completed and sets ``shutdown``,
so that waiting spares return. Where a member of the final epoch failed
instead, the job fails. Either way the control loop then waits (a bounded
time) for every other process to leave and stops: :attr:`Coordinator.done`.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
import time
from datetime import timedelta

from bindings.errors import CommError
from bindings.etcd_store import EtcdStore
from bindings.json_object import JsonObject
from bindings.store import open_store
from resilient_comm import keys
from resilient_comm.auth import ControlStore
from resilient_comm.beacon import BeaconListener
from resilient_comm.config import CoordinatorConfig
from resilient_comm.errors import MembershipError
from resilient_comm.events import EventLog
from resilient_comm.plan import plan_first_epoch, plan_next_epoch
from resilient_comm.roster import Roster
from resilient_comm.standby import FencedError, Handover, Leadership
from resilient_comm.view import MemberInfo, View

__all__ = ["Coordinator", "CoordinatorConfig"]

logger = logging.getLogger(__name__)


class _JobFailed(Exception):
    """Internal: the job cannot continue (reason in the message)."""


class _JobEnded(Exception):
    """Internal: a standby saw the job end (nothing left to take over)."""


class Coordinator:
    """Hosts the store and runs the membership protocol in a background thread.

    Args:
        config: The job's settings.

    Example::

        coord = Coordinator(CoordinatorConfig(world_size=4, events="events.jsonl"))
        coord.start()          # members connect to coord.address with coord.job
        ...
        coord.stop()
    """

    def __init__(self, config: CoordinatorConfig) -> None:
        if not isinstance(config, CoordinatorConfig):
            raise TypeError(f"config: expected a CoordinatorConfig, got {type(config).__name__}")
        self.config = config
        self.log = EventLog(config.events)
        self._store: ControlStore | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._exits: queue.Queue[tuple[int, int]] = queue.Queue()
        self._lock = threading.Lock()
        self._leadership: Leadership | None = None
        self._beacon: BeaconListener | None = None
        self._done = threading.Event()
        self._completed = False
        self._failed: str | None = None
        self._roster = self._new_roster()
        self._view: View | None = None
        self._saved: str | None = None  # the state last kept in the store (etcd only)
        self._shutdown = False

    def _new_roster(self) -> Roster:
        return Roster(self.config, self.log, lambda: self.view, self._exits)

    def _reset(self) -> None:
        """Forget everything learnt about the job (a coordinator taking over reads it back from the store)."""
        self._roster = self._new_roster()
        with self._lock:
            self._view = None
        self._saved, self._shutdown = None, False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Open the store and start the control loop."""
        if self._store is not None:
            raise RuntimeError("coordinator: already started")
        cfg = self.config
        self._beacon = BeaconListener(cfg.host, cfg.job, cfg.secret)
        if cfg.store == "tcp":
            self._store = ControlStore(
                open_store(cfg.host, cfg.port, server=True, timeout=timedelta(seconds=30)), cfg.secret
            )
            self._begin_job()
        else:  # a candidate: the control thread waits for the lease first
            raw = EtcdStore(cfg.store_address, cfg.heartbeat_timeout + cfg.ack_timeout)
            self._leadership = Leadership(raw, cfg.heartbeat_timeout)
            self._store = ControlStore(raw, cfg.secret)
        self._thread = threading.Thread(target=self._run, name="sparsecomm-coordinator", daemon=True)
        self._thread.start()
        logger.info("coordinator for job %s on %s", cfg.job, self.address)

    def _begin_job(self) -> None:
        """Write a new job's first records (the job id last: members wait for it)."""
        store = self._store
        assert store is not None
        self._roster.open(store)
        if self.config.secret is not None:
            store.raw.set(keys.AUTH, keys.AUTH_HMAC.decode())
        store.set(keys.EPOCH, "-1")
        self._publish_beacon()
        store.set(keys.JOB, self.config.job)

    def _publish_beacon(self) -> None:
        """Tell members where this coordinator takes datagram heartbeats."""
        if self._store is not None and self._beacon is not None:
            self._store.set(keys.BEACON, f"{self._host()}:{self._beacon.port}")

    def _take_over(self, observe: bool = False) -> None:
        """Begin as the active coordinator of a job kept in etcd: a new one, or one whose coordinator was lost.

        With ``observe`` (a standby), only follow the job's members and view, writing nothing.
        """
        store, t0 = self._store, time.monotonic()
        assert store is not None
        if not store.raw.check([keys.JOB]):
            if not observe:
                self._reset()
                self._begin_job()
                self.log.emit("coordinator_elected", epoch=None, resumed=False)
            return
        if not observe or not self._roster.opened:
            self._reset()
            self._roster.open(store)
        roster = self._roster
        roster.adopt(t0)
        try:
            state = Handover.read(store, self.config.job, roster.members)
        except ValueError as exc:
            raise _JobFailed(str(exc)) from exc
        roster.restore(state.dead, state.left, state.spares)
        self._shutdown = state.shutdown
        if observe:
            if state.shutdown:
                raise _JobEnded()
            if state.view is None or all(m in roster.members for m in state.view.members):
                with self._lock:  # a view whose members' registrations are not read yet waits for the next poll
                    self._view = state.view
            return
        with self._lock:
            self._view = state.view
        roster.skip_refusals()  # logged by the coordinator they came to
        self._publish_beacon()
        if state.shutdown:  # the job ended under the coordinator before: see the last processes out
            self._completed = self._store.raw.check([keys.COMPLETED]) if self._store is not None else False
        if state.reconfiguring:
            roster.suspected.add(state.epoch)  # a reconfiguration was under way: finish it
        took = {"members": sorted(roster.members), "spares": list(state.spares), "restore_s": time.monotonic() - t0}
        self.log.emit("coordinator_elected", epoch=state.epoch, resumed=True, **took)  # type: ignore[arg-type]
        if state.view is not None and not state.reconfiguring:
            self._await_configured(state.view)

    def _save_state(self) -> None:
        """Keep what a coordinator taking over cannot read elsewhere (etcd only)."""
        if self._leadership is not None and self._store is not None:
            roster = self._roster
            self._saved = Handover.save(self._store, roster.dead, roster.left, roster.live_spares(), self._saved)

    def stop(self) -> None:
        """Stop the control loop and close the store (an etcd lease is given up: a standby takes over). Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._thread = None
        if self._leadership is not None:
            self._leadership.release()
        if self._beacon is not None:
            self._beacon.close()
        self._store = None
        self.log.close()

    def shutdown(self) -> None:
        """Tell spares (and anyone waiting for an epoch) that the job is over. Idempotent."""
        if self._shutdown:
            return
        self._shutdown = True
        if self._store is not None:
            try:
                self._store.set(keys.SHUTDOWN, "1")
            except CommError as exc:  # FencedError too: another coordinator runs the job now
                logger.warning("coordinator: could not publish the job's end: %s", exc)

    @property
    def address(self) -> str:
        """What members connect to: ``host:port`` of the store, or the job's etcd address."""
        if self._store is None:
            raise RuntimeError("coordinator: not started")
        if self.config.store != "tcp":
            return self.config.store_address
        return f"{self._host()}:{self._store.raw.port}"  # type: ignore[attr-defined]

    def _host(self) -> str:
        host = self.config.host
        return socket.gethostname() if host in ("", "0.0.0.0", "::") else host

    @property
    def job(self) -> str:
        """The job id."""
        return self.config.job

    @property
    def view(self) -> View | None:
        """The current view (``None`` before the first epoch)."""
        with self._lock:
            return self._view

    def committed_step(self) -> int:
        """The newest step committed everywhere, as the members recorded it (``-1``: none yet)."""
        if (store := self._store) is None or not store.check([keys.COMMITTED]):
            return -1
        try:
            return int(store.get(keys.COMMITTED))
        except ValueError as exc:
            store.reject(keys.COMMITTED, exc)
            return -1

    @property
    def failed(self) -> str | None:
        """Why the job failed, or ``None``."""
        return self._failed

    @property
    def completed(self) -> bool:
        """Whether the job ended because every member of its final epoch finished its work."""
        return self._completed

    @property
    def done(self) -> bool:
        """Whether the control loop is over: the job completed or failed and its processes left (or the time
        allowed for them to leave passed), or, for a standby, the job it stood by for ended."""
        return self._done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until :attr:`done` (or ``timeout``); return :attr:`done`."""
        return self._done.wait(None if timeout is None else timeout.total_seconds())

    def members(self) -> dict[int, MemberInfo]:
        """Every member that registered so far, by index."""
        return self._roster.known()

    def spares(self) -> list[int]:
        """Member indices of the live spares, in promotion order."""
        return self._roster.live_spares()

    def notify_exit(self, pid: int, returncode: int) -> None:
        """Tell the coordinator a process it may know has exited (thread-safe)."""
        self._exits.put((int(pid), int(returncode)))

    # ------------------------------------------------------------------ loop
    @property
    def active(self) -> bool:
        """Whether this coordinator runs the job now (with etcd: while it holds the lease)."""
        return self._thread is not None and (self._leadership is None or self._leadership.active)

    def _run(self) -> None:
        try:
            if self._leadership is None:
                self._loop()
            while self._leadership is not None and not self._stop.is_set() and not self._done.is_set():
                leading = False
                try:
                    if not self._leadership.acquire(
                        self._stop, self.config.poll_interval, lambda: self._take_over(True)
                    ):
                        return
                    leading = True
                    self._take_over()
                    self._loop()
                    break  # the job ended (or this coordinator was stopped)
                except (FencedError, CommError) as exc:  # lost the lease or the store: back to standby
                    if leading:
                        self.log.emit("coordinator_deposed", reason=str(exc)[:500])
                    self._leadership.release()
                    logger.warning("coordinator %s: %s; standing by", self._leadership.id, exc)
                    self._stop.wait(self.config.poll_interval.total_seconds())
        except _JobEnded:
            logger.info("coordinator: job %s ended; nothing to stand by for", self.config.job)
        except _JobFailed as exc:
            self._fail(str(exc))
            self._see_out()
        except Exception:  # noqa: BLE001 - the control thread must report, not vanish
            logger.exception("coordinator loop crashed")
            self._fail("coordinator error (see log)")
        self._done.set()

    def _loop(self) -> None:
        """Run the job until it ends and its processes are gone (returns), or until stopped."""
        started = time.monotonic()
        poll = self.config.poll_interval.total_seconds()
        while not self._stop.is_set():
            self._refresh()
            view = self.view
            if view is None:
                self._maybe_start(time.monotonic() - started)
                if self.view is None and time.monotonic() - started > self.config.start_timeout.total_seconds():
                    raise _JobFailed(
                        f"only {self._roster.live_actives()} of {self.config.world_size} members registered"
                    )
            elif self._shutdown:
                if self._completed or self._leadership is not None:
                    self._see_out()
                    return
            elif any(m in self._roster.left for m in view.members) and all(
                m in self._roster.dead or m in self._roster.left for m in view.members
            ):
                self._end(view)
            elif any(m in self._roster.dead for m in view.members) or view.epoch in self._roster.suspected:
                self._reconfigure(view)
            time.sleep(poll)

    def _end(self, view: View) -> None:
        """No member of ``view`` is left running: the job completed, or failed if one of them failed."""
        failed = [view.slot_of(m) for m in view.members if m in self._roster.dead]
        if failed:
            raise _JobFailed(f"slots {failed} of epoch {view.epoch} failed after the others finished")
        self._completed = True
        spares = len(self._roster.live_spares())
        committed = self.committed_step()
        self.log.emit(
            "job_completed", epoch=view.epoch, world_size=view.world_size, committed_step=committed, spares=spares
        )
        assert self._store is not None
        self._store.set(keys.COMPLETED, json.dumps({"epoch": view.epoch, "committed_step": committed}))
        self.shutdown()

    def _see_out(self) -> None:
        """After the job ended: wait until every process still registered has left or is counted dead.

        Spares return from their wait at once (``shutdown``, or ``failed``);
        one that neither leaves nor heartbeats is dead after the heartbeat
        timeout. Bounded by that timeout plus ``ack_timeout`` either way.
        """
        cfg = self.config
        deadline = time.monotonic() + (cfg.heartbeat_timeout + cfg.ack_timeout).total_seconds() + 1.0
        poll = cfg.poll_interval.total_seconds()
        while not self._stop.is_set():
            try:
                self._refresh()
            except Exception as exc:  # noqa: BLE001 - the job is over: nothing more to learn
                logger.warning("coordinator: while the last processes leave: %s", exc)
                return
            live = self._roster.live()
            if not live:
                return
            if time.monotonic() > deadline:
                logger.warning("coordinator: members %s neither left nor went silent after the job ended", live)
                return
            time.sleep(poll)

    def _fail(self, reason: str) -> None:
        if self._failed is not None:
            return
        self._failed = reason
        epoch = self._view.epoch if self._view is not None else None
        self.log.emit("job_failed", epoch=epoch, reason=reason)
        if self._store is not None:
            try:
                self._store.set(keys.FAILED, reason)
                if self._view is not None:
                    self._store.set(keys.abort(self._view.epoch), json.dumps({"reason": reason, "dead_slots": []}))
            except Exception as exc:  # noqa: BLE001
                logger.warning("could not publish the job failure: %s", exc)

    # ------------------------------------------------------------------ evidence
    def _refresh(self) -> None:
        """Keep the lease, let the roster read the members' evidence, and save what a successor needs."""
        if self._leadership is not None:
            self._leadership.keep()
        self._roster.refresh(self._beacon)
        self._save_state()

    # ------------------------------------------------------------------ epochs
    def _maybe_start(self, waited_s: float) -> None:
        n = self.config.world_size
        actives = [
            i for i, m in sorted(self._roster.members.items()) if m.role == "active" and i not in self._roster.dead
        ]
        if len(actives) < n:
            return
        spares = sum(1 for i, m in self._roster.members.items() if m.role == "spare" and i not in self._roster.dead)
        if spares < self.config.spares and waited_s < self.config.spare_wait.total_seconds():
            return  # the job's own spares are still starting
        members, rest = plan_first_epoch({i: self._roster.members[i].slot for i in actives}, n)
        self._roster.add_spares(rest)  # extra actives wait as spares
        self._publish(View(epoch=0, job=self.config.job, members=members))

    def _publish(self, view: View) -> None:
        store = self._store
        assert store is not None
        self._save_state()
        store.set(keys.view(view.epoch), view.to_json())
        with self._lock:
            self._view = view
        store.set(keys.EPOCH, str(view.epoch))
        shape: JsonObject = {"members": list(view.members), "world_size": view.world_size}
        self.log.emit("epoch_proposed", epoch=view.epoch, mode=view.mode, lost_slots=list(view.lost_slots), **shape)
        for slot, m in sorted(view.promoted.items()):
            self.log.emit("spare_promoted", epoch=view.epoch, slot=slot, pid=self._roster.members[m].pid, member=m)
        self._await_configured(view)

    def _await_configured(self, view: View) -> None:
        """Wait until every member built the epoch's transport; a failure meanwhile is handled by the loop."""
        store = self._store
        assert store is not None
        t0 = time.monotonic()
        poll = self.config.poll_interval.total_seconds()
        while not self._stop.is_set():
            self._refresh()
            if any(m in self._roster.dead for m in view.members) or view.epoch in self._roster.suspected:
                return  # the loop reconfigures from this epoch
            if all(store.check([keys.configured(view.epoch, m)]) for m in view.members):
                self.log.emit(
                    "epoch_configured",
                    epoch=view.epoch,
                    world_size=view.world_size,
                    members=list(view.members),
                    configure_s=round(time.monotonic() - t0, 4),
                )
                return
            if time.monotonic() - t0 > self.config.configure_timeout.total_seconds():
                late = [m for m in view.members if not store.check([keys.configured(view.epoch, m)])]
                for m in late:
                    self._roster.mark_dead(m, "configure timeout")
                return
            time.sleep(poll)

    def _reconfigure(self, view: View) -> None:
        store = self._store
        assert store is not None
        cfg = self.config
        e = view.epoch
        self._roster.suspected.discard(e)
        dead_slots = [s for s, m in enumerate(view.members) if m in self._roster.dead]
        store.set(keys.abort(e), json.dumps({"reason": "failure", "dead_slots": dead_slots}))
        t0 = time.monotonic()
        poll = cfg.poll_interval.total_seconds()
        acked: set[int] = set()
        while True:
            self._refresh()
            expected = {m for m in view.members if m not in self._roster.dead and m not in self._roster.left}
            acked = {m for m in expected if store.check([keys.ack(e, m)])}
            waited = time.monotonic() - t0
            if acked == expected or (
                waited > cfg.ack_timeout.total_seconds()
                and not self._roster.hold_off(
                    expected - acked, waited - cfg.ack_timeout.total_seconds(), "no acknowledgement"
                )
            ):
                break
            time.sleep(poll)
        self._roster.stall_over("no acknowledgement")
        for m in view.members:
            if m not in acked:
                self._roster.mark_dead(m, "no ack")
        spares = self._roster.live_spares()
        try:
            plan = plan_next_epoch(
                e,
                view.members,
                set(view.members) - acked,
                spares,
                mode=cfg.mode,
                min_world_size=cfg.min_world_size,
            )
        except MembershipError as exc:
            raise _JobFailed(str(exc)) from exc
        self._roster.take_spares(plan.promoted.values())
        committed = self.committed_step()
        self._publish(
            View(
                epoch=plan.epoch,
                job=cfg.job,
                members=plan.members,
                lost_slots=plan.lost_slots,
                promoted=dict(plan.promoted),
                rank_map=dict(plan.rank_map),
                committed_step=committed,
                mode=plan.mode,
            )
        )
