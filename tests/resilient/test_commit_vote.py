"""The commit vote over a real coordinator and store, members in threads of this process."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from bindings.store import open_store
from resilient_comm.auth import JobSecret
from resilient_comm.coordinator import Coordinator, CoordinatorConfig
from resilient_comm.membership import StoreMembership, parse_address
from tests.resilient.harness import vote_in_threads, wait_until


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signed", [False, True])
def test_votes_agree_and_the_store_does_not_grow_with_the_steps(signed: bool) -> None:
    secret = JobSecret.generate() if signed else None
    coord = Coordinator(CoordinatorConfig(world_size=3, secret=secret))
    coord.start()
    members: list[StoreMembership] = []
    try:
        members = [StoreMembership(coord.address, coord.job, secret=secret, slot=s) for s in range(3)]
        view = members[0].wait_view(-1, time.monotonic() + 10)
        assert view is not None
        for m in members:
            m.configured(0)
        wait_until(lambda: any(e["event"] == "epoch_configured" for e in coord.log.events), 10, "epoch 0")
        probe = open_store(*parse_address(coord.address), server=False, timeout=timedelta(seconds=5))
        sizes = []
        for step in range(60):
            assert vote_in_threads(members, 0, step, view.members) == [True] * 3
            if step in (9, 59):
                sizes.append(probe.num_keys())
        assert coord.committed_step() == 59
        assert sizes[1] <= sizes[0], sizes  # 50 more steps, no more keys
        # one member votes no: nobody commits, on every member; the next step commits again
        assert vote_in_threads(members, 0, 60, view.members, [True, False, True]) == [False] * 3
        assert vote_in_threads(members, 0, 61, view.members) == [True] * 3
    finally:
        for m in members:
            m.leave()
        coord.stop()
