"""The coordinator's heartbeat bookkeeping: silence counted from the last change of a member's counter."""

from __future__ import annotations

import pytest

from resilient_comm.heartbeats import Heartbeats


def test_silence_is_reported_past_the_timeout_and_restarts() -> None:
    hb = Heartbeats(timeout_s=1.0)
    hb.register(0, now=10.0)
    assert hb.observe(0, b"1", now=10.5) is None  # the counter moved
    assert hb.observe(0, b"1", now=11.4) is None  # 0.9 s of silence: within the timeout
    assert hb.observe(0, b"1", now=11.75) == pytest.approx(1.25)
    assert hb.observe(0, b"garbage", now=11.8) == pytest.approx(1.3)  # an unreadable counter is no sign of life
    hb.restart([0], now=12.0)
    assert hb.observe(0, None, now=12.5) is None
    assert hb.age(0, now=12.5) == pytest.approx(0.5)
    assert hb.age(7, now=12.5) == 0.0  # never registered
    assert hb.observe(0, "2", now=14.0) is None  # a new count, as str too
