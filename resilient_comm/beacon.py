"""Heartbeats as datagrams: a second channel of life that a short link outage cannot hold up.

A member's heartbeat through the store is a TCP request. When a link goes
down for a moment, TCP's retransmission back-off (200 ms, 400 ms, 800 ms, ...)
can keep the next request from arriving for longer than the outage itself, so a
0.3 s blip can silence a member past a 1 s heartbeat timeout. Datagrams have no
back-off and no connection: the first one sent after the link returns arrives.

Each member sends ``job, member, count`` to the port the active coordinator
publishes in the store (:data:`~resilient_comm.keys.BEACON`), once per
heartbeat interval, signed with the job secret where the job has one. The
coordinator drains its socket in each poll (:meth:`BeaconListener.poll`) and
counts a member as alive when its count moved, just as for the store
counter. A datagram that is lost, forged, replayed or from another job is
dropped; the store heartbeat stays, so a network that drops every datagram
works as before.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

from resilient_comm.auth import JobSecret, RecordError

__all__ = ["BeaconListener", "BeaconSender", "encode", "decode"]

logger = logging.getLogger(__name__)

_KEY = "beacon"  # what the signature is bound to
_MAX_DATAGRAM = 512


def encode(job: str, member: int, count: int, secret: JobSecret | None) -> bytes:
    """The datagram of ``member``'s beat number ``count`` in ``job``."""
    body = f"{job}\0{member}\0{count}".encode()
    return body if secret is None else secret.sign(_KEY, body)


def decode(data: bytes, job: str, secret: JobSecret | None) -> tuple[int, int] | None:
    """``(member, count)`` of a datagram of ``job``; ``None`` for one that is not the job's or not well formed."""
    if len(data) > _MAX_DATAGRAM:
        return None
    try:
        body = data if secret is None else secret.open(_KEY, data)
        their_job, member, count = body.decode().split("\0")
        if their_job != job or not member.isdigit() or not count.isdigit() or len(member) + len(count) > 30:
            return None
        return int(member), int(count)
    except (RecordError, UnicodeDecodeError, ValueError):
        return None


class BeaconListener:
    """The coordinator's datagram socket (non-blocking; read in the control loop, no thread).

    Args:
        host: Address to bind (the coordinator's own).
        job: The job id datagrams must carry.
        secret: The job secret (``None``: unsigned datagrams).
    """

    def __init__(self, host: str, job: str, secret: JobSecret | None) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_DGRAM)
        self._sock.bind((host, 0))
        self._sock.setblocking(False)
        self._job, self._secret = job, secret
        self._best: dict[int, int] = {}  # member -> highest count seen

    @property
    def port(self) -> int:
        """The UDP port members send to."""
        return int(self._sock.getsockname()[1])

    def poll(self, limit: int = 10_000) -> set[int]:
        """Members whose count moved since the last poll (reads at most ``limit`` datagrams)."""
        moved: set[int] = set()
        for _ in range(limit):
            try:
                data = self._sock.recv(_MAX_DATAGRAM + 1)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:  # e.g. an ICMP error reported on the socket: nothing to read
                logger.debug("beacon socket: %s", exc)
                break
            got = decode(data, self._job, self._secret)
            if got is None:
                continue
            member, count = got
            if count > self._best.get(member, -1):  # a replayed or reordered datagram moves nothing
                self._best[member] = count
                moved.add(member)
        return moved

    def close(self) -> None:
        """Close the socket. Idempotent."""
        self._sock.close()


class BeaconSender:
    """A member's datagram heartbeat: a daemon thread sending one datagram per interval.

    It never blocks on the network (a send that fails, e.g. while the link is
    down, is simply lost). :meth:`aim` sets or changes the destination.

    Args:
        job: The job id.
        member: This process's member index.
        interval_s: Seconds between datagrams.
        secret: The job secret (``None``: unsigned).
    """

    def __init__(self, job: str, member: int, interval_s: float, secret: JobSecret | None) -> None:
        self._job, self._member, self._secret = job, member, secret
        self._interval = interval_s
        self._aimed: tuple[str, int] | None = None
        self._target: tuple[socket.socket, Any] | None = None
        self._socks: dict[int, socket.socket] = {}
        self._count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"sparsecomm-beacon-{member}", daemon=True)
        self._thread.start()

    def aim(self, host: str, port: int) -> None:
        """Send to ``host:port`` from now on (the name is resolved here, once)."""
        if self._aimed == (host, int(port)):
            return
        try:
            family, _, _, _, addr = socket.getaddrinfo(host, int(port), type=socket.SOCK_DGRAM)[0]
        except OSError as exc:
            logger.warning("member %d: no datagram heartbeats to %s:%s (%s)", self._member, host, port, exc)
            return
        if family not in self._socks:
            self._socks[family] = socket.socket(family, socket.SOCK_DGRAM)
        self._aimed = (host, int(port))
        self._target = (self._socks[family], addr)
        logger.debug("member %d: datagram heartbeats to %s:%d", self._member, host, port)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            target = self._target
            if target is None:
                continue
            self._count += 1
            try:
                target[0].sendto(encode(self._job, self._member, self._count, self._secret), target[1])
            except OSError:  # link down, no route: this beat is lost, the next one is sent on time
                pass
        for s in list(self._socks.values()):
            s.close()

    def stop(self) -> None:
        """Stop sending (waits for the thread, at most one interval). Idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
