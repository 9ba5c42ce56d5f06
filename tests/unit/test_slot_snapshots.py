"""SlotSnapshots.put never lets the replication fall more than one version behind, and never waits forever."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch

from optim.state.restore import SlotSnapshots


class _SlowBuddy:
    """Stands in for the replicator: records what is submitted; ``replicated`` moves only when told."""

    def __init__(self) -> None:
        self.replicated = -1
        self.failed: str | None = None
        self.submitted: list[tuple[int, float]] = []

    def submit_tree(self, version: int, tree: Any, ring: Any, persist: Any) -> None:
        self.submitted.append((version, time.monotonic()))

    def ack_later(self, version: int, delay_s: float) -> float:
        """Acknowledge ``version`` after ``delay_s`` on a thread; returns when that will be."""
        at = time.monotonic() + delay_s

        def ack() -> None:
            time.sleep(delay_s)
            self.replicated = version

        threading.Thread(target=ack, daemon=True).start()
        return at


def _slots(timeout_s: float) -> tuple[SlotSnapshots, _SlowBuddy]:
    slots = SlotSnapshots(comm=None, timeout=timedelta(seconds=timeout_s))  # type: ignore[arg-type]
    buddy = _SlowBuddy()
    slots.replicator = buddy  # type: ignore[assignment]
    return slots, buddy


def test_a_snapshot_waits_until_the_buddy_acknowledged_the_previous_one() -> None:
    slots, buddy = _slots(timeout_s=10.0)
    tree = {"w": torch.zeros(4)}
    slots.put(1, tree)  # nothing outstanding: submitted at once
    acked_at = buddy.ack_later(1, 0.3)
    slots.put(2, tree)
    assert [v for v, _ in buddy.submitted] == [1, 2]
    assert buddy.submitted[1][1] >= acked_at  # version 2 left only after the ack of version 1
    assert slots.put_s[-1] >= 0.25  # the wait is on the critical path, and counted


def test_a_buddy_that_never_acknowledges_holds_a_snapshot_for_the_timeout_only() -> None:
    slots, buddy = _slots(timeout_s=0.4)
    tree = {"w": torch.zeros(4)}
    slots.put(1, tree)
    t0 = time.monotonic()
    slots.put(2, tree)
    waited = time.monotonic() - t0
    assert 0.35 <= waited < 5.0
    assert [v for v, _ in buddy.submitted] == [1, 2]


def test_a_failed_replication_does_not_hold_the_step() -> None:
    slots, buddy = _slots(timeout_s=10.0)
    tree = {"w": torch.zeros(4)}
    slots.put(1, tree)
    buddy.failed = "peer lost"
    t0 = time.monotonic()
    slots.put(2, tree)
    assert time.monotonic() - t0 < 1.0
