"""Datagram heartbeats (resilient_comm.beacon) over real UDP sockets on loopback, and Heartbeats.touch."""

from __future__ import annotations

import socket
import time

import pytest

from resilient_comm.auth import JobSecret
from resilient_comm.beacon import BeaconListener, BeaconSender, decode, encode
from resilient_comm.heartbeats import Heartbeats

SECRET = JobSecret(b"0123456789abcdef0123456789abcdef")
OTHER = JobSecret(b"fedcba9876543210fedcba9876543210")


@pytest.mark.parametrize("secret", [None, SECRET])
def test_a_datagram_reads_back_only_in_its_own_job(secret: JobSecret | None) -> None:
    data = encode("job1", 7, 42, secret)
    assert decode(data, "job1", secret) == (7, 42)
    assert decode(data, "job2", secret) is None
    assert decode(b"junk", "job1", secret) is None
    assert decode(b"job1\x007", "job1", secret) is None
    assert decode(b"x" * 10_000, "job1", secret) is None


def test_a_signed_job_drops_unsigned_forged_and_foreign_datagrams() -> None:
    assert decode(encode("job1", 1, 5, None), "job1", SECRET) is None
    assert decode(encode("job1", 1, 5, OTHER), "job1", SECRET) is None
    forged = encode("job1", 1, 5, SECRET).replace(b"\x005", b"\x009")
    assert decode(forged, "job1", SECRET) is None
    assert decode(encode("job1", -1, 5, None), "job1", None) is None  # not a member index


def _poll_until(listener: BeaconListener, want: set[int], timeout: float = 5.0) -> set[int]:
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not want <= seen:
        seen |= listener.poll()
        time.sleep(0.01)
    return seen


def test_senders_reach_the_listener_and_a_replay_moves_nothing() -> None:
    listener = BeaconListener("127.0.0.1", "job1", SECRET)
    senders = [BeaconSender("job1", m, 0.01, SECRET) for m in (0, 3)]
    stray = BeaconSender("job2", 5, 0.01, SECRET)
    try:
        for s in (*senders, stray):
            s.aim("127.0.0.1", listener.port)
        assert _poll_until(listener, {0, 3}) >= {0, 3}
        for s in senders:
            s.stop()
        stray.stop()
        time.sleep(0.05)
        listener.poll()  # drain what was in flight
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as raw:
            for _ in range(3):  # an old datagram sent again: its count is not newer
                raw.sendto(encode("job1", 0, 1, SECRET), ("127.0.0.1", listener.port))
            raw.sendto(encode("job1", 0, 10**9, OTHER), ("127.0.0.1", listener.port))
        time.sleep(0.05)
        assert listener.poll() == set()
    finally:
        listener.close()


def test_a_sender_aimed_nowhere_or_at_a_closed_port_keeps_going() -> None:
    sender = BeaconSender("job1", 0, 0.01, None)
    try:
        time.sleep(0.05)  # not aimed: sends nothing, raises nothing
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        sender.aim("127.0.0.1", port)  # nobody listens: ICMP errors are swallowed
        time.sleep(0.05)
        listener = BeaconListener("127.0.0.1", "job1", None)
        try:
            sender.aim("127.0.0.1", listener.port)
            assert _poll_until(listener, {0}) == {0}
        finally:
            listener.close()
    finally:
        sender.stop()


def test_touch_keeps_a_member_alive_whose_store_counter_is_stuck() -> None:
    hb = Heartbeats(1.0)
    hb.register(0, now=0.0)
    assert hb.observe(0, b"1", now=0.5) is None
    hb.touch(0, now=1.2)  # a datagram arrived
    assert hb.observe(0, b"1", now=2.0) is None  # quiet on the store for 1.5 s, but alive
    assert hb.observe(0, b"1", now=2.3) == pytest.approx(1.1)
    hb.touch(99, now=2.3)  # unknown member: ignored
    assert hb.age(99, 3.0) == 0.0
