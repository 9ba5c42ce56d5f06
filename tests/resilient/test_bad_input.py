"""Bad settings and misuse of the fault-aware membership, in-process with a real coordinator and store."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import pytest
import torch

from resilient_comm.coordinator import Coordinator, CoordinatorConfig
from resilient_comm.errors import MembershipError
from resilient_comm.fault_aware import FaultAwareCommunicator
from resilient_comm.launcher import LaunchConfig, Launcher
from resilient_comm.membership import StoreMembership
from tests.resilient.harness import wait_until


def _in_threads(fns, timeout: float) -> list:
    """Run each callable in its own thread; return the results (an exception is re-raised)."""
    results: list = [None] * len(fns)
    errors: list = []

    def run(i, fn):
        try:
            results[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), f"not done within {timeout} s"
    if errors:
        raise errors[0]
    return results


def test_config_values_are_checked() -> None:
    with pytest.raises(ValueError, match="spares"):
        LaunchConfig(nproc=2, spares=-1)
    with pytest.raises(ValueError, match="min_world_size"):
        CoordinatorConfig(world_size=2, min_world_size=3)
    with pytest.raises(ValueError, match="min_world_size"):
        LaunchConfig(nproc=2, min_world_size=3)
    with pytest.raises(ValueError, match="slot"):
        StoreMembership("127.0.0.1:1", "job", slot=-2)  # checked before connecting
    with pytest.raises(ValueError, match="address"):
        StoreMembership("no-port", "job")


@pytest.mark.timeout(60)
def test_wrong_job_is_refused() -> None:
    coord = Coordinator(CoordinatorConfig(world_size=1, start_timeout=timedelta(seconds=30)))
    coord.start()
    try:
        with pytest.raises(MembershipError, match="wrong-job"):
            StoreMembership(coord.address, "wrong-job")
        assert coord.members() == {}  # nothing registered
    finally:
        coord.stop()


@pytest.mark.timeout(90)
def test_pid_of_slot_and_concurrent_reconfigure() -> None:
    # a 2-member job whose members are two communicators of this process (the launcher starts no process)
    launcher = Launcher(["true"], LaunchConfig(nproc=2))
    coord = launcher.coordinator
    coord.start()
    comms: list[FaultAwareCommunicator] = []
    try:
        with pytest.raises(RuntimeError, match="no epoch"):
            launcher.pid_of_slot(0)

        def member(slot: int) -> FaultAwareCommunicator:
            m = StoreMembership(coord.address, coord.job, slot=slot, secret=launcher.secret)
            comms.append(FaultAwareCommunicator(m, join_timeout=timedelta(seconds=30)))
            return comms[-1]

        a, b = _in_threads([lambda: member(0), lambda: member(1)], 60)
        assert (a.epoch, a.rank, b.rank, a.world_size) == (0, 0, 1, 2)
        assert (a.slot, b.slot, a.committed_step) == (0, 1, -1)
        assert _in_threads([lambda: a.commit(0), lambda: b.commit(0)], 30) == [True, True]
        assert a.committed_step == b.committed_step == 0
        assert launcher.pid_of_slot(0) == launcher.pid_of_slot(1) == os.getpid()
        for bad in (99, -1, 2):
            with pytest.raises(ValueError, match="slot"):
                launcher.pid_of_slot(bad)

        # a's reconfigure holds the lock until b joins epoch 1 (a waits for b in the epoch-1 rendezvous)
        result: dict = {}
        first = threading.Thread(target=lambda: result.setdefault("a", a.reconfigure()), daemon=True)
        first.start()
        try:
            wait_until(lambda: coord.view is not None and coord.view.epoch == 1, 15, "epoch 1")
            with pytest.raises(MembershipError, match="already reconfiguring"):
                a.reconfigure()
            assert first.is_alive()
        finally:
            change_b = b.reconfigure(timedelta(seconds=30))
            first.join(30)
        assert not first.is_alive() and "a" in result
        change_a = result["a"]
        assert (change_a.epoch, change_b.epoch) == (1, 1)
        assert change_a.mode == change_b.mode == "same" and change_a.rank_map == {0: 0, 1: 1}
        assert change_a.committed_step == 0 and (a.slot, b.slot, a.committed_step) == (0, 1, 0)

        # epoch 1 works: both ranks get the right sum
        bufs = [torch.full((8,), 1.0), torch.full((8,), 2.0)]
        _in_threads([lambda: a.all_reduce(bufs[0]), lambda: b.all_reduce(bufs[1])], 30)
        assert all(bool(torch.all(buf == 3.0)) for buf in bufs)
    finally:
        for c in comms:
            c.close()
        coord.shutdown()
        coord.stop()


@pytest.mark.timeout(60)
def test_the_first_epoch_waits_for_the_jobs_spares() -> None:
    """With ``spares=1`` the first epoch forms only once the spare registered (or after ``spare_wait``)."""
    coord = Coordinator(CoordinatorConfig(world_size=1, spares=1, spare_wait=timedelta(seconds=30)))
    coord.start()
    members = []
    try:
        members.append(StoreMembership(coord.address, coord.job, slot=0))
        time.sleep(0.5)
        assert coord.view is None  # the active member alone: not yet
        members.append(StoreMembership(coord.address, coord.job, role="spare"))
        wait_until(lambda: coord.view is not None, 10, "the first epoch")
        assert coord.spares() == [members[1].index]
    finally:
        for m in members:
            m.leave()
        coord.stop()
    late = Coordinator(CoordinatorConfig(world_size=1, spares=1, spare_wait=timedelta(seconds=1)))
    late.start()
    try:
        alone = StoreMembership(late.address, late.job, slot=0)
        wait_until(lambda: late.view is not None, 10, "the first epoch without its spare")  # after spare_wait
        alone.leave()
    finally:
        late.stop()
    with pytest.raises(ValueError, match="spares"):
        CoordinatorConfig(world_size=1, spares=-1)
