"""Real-process fault tests of the fault-aware communicator (``resilient_comm``).

Each test runs ``python -m optim.testing.drill`` workers and spares under a
launcher hosted in the test process, kills or stops them by pid, and checks
the coordinator's events, the workers' own logs and the exit statuses. The
drill checks every all_reduce sum itself (a wrong sum exits 2), so a job that
ends with status 0 also computed every sum right.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.resilient.harness import DrillJob, check_contiguous, wait_until

pytestmark = pytest.mark.dist


def _first_after(records: list[dict], name: str, t: float) -> dict | None:
    return next((r for r in records if r["event"] == name and r["time"] >= t), None)


def _check_finished(job: DrillJob) -> list[int]:
    """Every final member logged ``done`` at the last step; return their pids."""
    final = job.member_pids()
    for pid in final:
        done = job.drill_events(pid, "done")
        assert done and done[-1]["step"] == job.steps, (pid, job.drill_log(pid)[-3:])
    return final


@pytest.mark.timeout(120)
def test_sigkill_mid_collective_survivors_raise_and_spare_takes_the_slot(tmp_path) -> None:
    steps = 14
    with DrillJob(tmp_path, nproc=4, spares=1, steps=steps, numel=16 << 20, sleep=0.02) as job:
        job.wait_epoch()
        wait_until(job.launcher.spare_pids, 60, "the spare to register")
        spare = job.launcher.spare_pids()[0]
        pids = job.member_pids()
        victim, survivors = pids[2], [p for s, p in enumerate(pids) if s != 2]
        job.wait_progress(victim, 2)
        t_kill = job.signal(victim)  # the next all_reduce (64 MB) is running now

        # every survivor fails fast: its all_reduce raises within 1 s of the kill
        wait_until(lambda: all(_first_after(job.drill_log(p), "raised", t_kill) for p in survivors), 15, "raised")
        delays = {p: _first_after(job.drill_log(p), "raised", t_kill)["time"] - t_kill for p in survivors}
        print(f"\nkill -> raised per survivor: { {p: round(d, 3) for p, d in delays.items()} }")
        assert all(d < 1.0 for d in delays.values()), delays

        # hot swap: epoch 1 keeps 4 members, the spare holds slot 2
        proposed = job.wait_event("epoch_proposed", 15, epoch=1)
        assert proposed["mode"] == "hotswap" and proposed["lost_slots"] == [2], proposed
        assert proposed["world_size"] == 4
        promoted = job.events("spare_promoted", epoch=1)
        assert [(e["slot"], e["pid"]) for e in promoted] == [(2, spare)], promoted
        configured = job.wait_event("epoch_configured", 30, epoch=1)
        print(f"kill -> epoch 1 configured: {configured['time'] - t_kill:.3f} s")
        wait_until(lambda: job.drill_events(spare, "promoted"), 15, "the spare to log its promotion")

        assert job.finish(90) == 0, job.describe()
        final = _check_finished(job)
        assert final == [*survivors[:2], spare, survivors[2]]
        assert [e["epoch"] for e in job.events("epoch_proposed")] == [0, 1]

        # no committed step lost: contiguous per process, all steps covered by the final members
        covered: set[int] = set()
        for pid in final:
            covered |= set(check_contiguous(job.drill_log(pid)))
        assert covered == set(range(steps))
        for pid in survivors:
            (change,) = job.drill_events(pid, "reconfigured")
            assert change["mode"] == "hotswap" and change["epoch"] == 1 and change["world_size"] == 4
        (change,) = job.drill_events(spare, "promoted")
        assert change["rank"] == 2 and change["promoted_here"]
        check_contiguous(job.drill_log(victim))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["shrink", "hotswap"])  # hotswap without a spare falls back to shrink
def test_shrink_without_spares_renumbers_the_survivors(tmp_path, mode: str) -> None:
    steps = 30
    with DrillJob(tmp_path, nproc=4, spares=0, mode=mode, steps=steps, sleep=0.03) as job:
        job.wait_epoch()
        pids = job.member_pids()
        job.wait_progress(pids[1], 3)
        t_kill = job.signal(pids[1])
        proposed = job.wait_event("epoch_proposed", 15, epoch=1)
        assert proposed["mode"] == "shrink" and proposed["world_size"] == 3 and proposed["lost_slots"] == [1]
        configured = job.wait_event("epoch_configured", 30, epoch=1)
        print(f"\n[{mode}] kill -> epoch 1 configured: {configured['time'] - t_kill:.3f} s")
        # the drill checks every sum against the membership (a wrong sum exits 2)
        assert job.finish(90) == 0, job.describe()
        survivors = [pids[0], pids[2], pids[3]]
        assert _check_finished(job) == survivors
        for new_rank, pid in enumerate(survivors):
            (change,) = job.drill_events(pid, "reconfigured")
            assert change["rank_map"] == {"0": 0, "2": 1, "3": 2}, change
            assert change["rank"] == new_rank and change["world_size"] == 3 and change["mode"] == "shrink"
            after = [r for r in job.drill_events(pid, "committed") if r["epoch"] == 1]
            assert after and all(r["world_size"] == 3 and r["rank"] == new_rank for r in after)
            assert set(check_contiguous(job.drill_log(pid))) == set(range(steps))


@pytest.mark.timeout(120)
def test_sigstop_is_caught_by_the_heartbeat_and_the_resumed_process_is_stale(tmp_path) -> None:
    hb = 1.0
    with DrillJob(tmp_path, nproc=4, spares=1, steps=80, sleep=0.05, heartbeat_timeout=hb) as job:
        job.wait_epoch()
        wait_until(job.launcher.spare_pids, 60, "the spare to register")
        pids = job.member_pids()
        hung, survivors = pids[3], pids[:3]
        job.wait_progress(hung, 3)
        t_stop = job.signal(hung, signal.SIGSTOP)  # alive, sockets open: only the heartbeat can tell

        detected = job.wait_event("failure_detected", 10, pid=hung)
        detect_s = detected["time"] - t_stop
        print(f"\nSIGSTOP -> failure_detected ({detected['reason']}): {detect_s:.3f} s")
        assert detected["reason"] in ("heartbeat", "no ack"), detected
        assert detect_s <= hb + 0.5, detect_s
        wait_until(lambda: all(_first_after(job.drill_log(p), "raised", t_stop) for p in survivors), 15, "raised")
        raised = {p: round(_first_after(job.drill_log(p), "raised", t_stop)["time"] - t_stop, 3) for p in survivors}
        print(f"SIGSTOP -> raised per survivor: {raised}")
        configured = job.wait_event("epoch_configured", 30, epoch=1)
        print(f"SIGSTOP -> epoch 1 configured: {configured['time'] - t_stop:.3f} s")
        assert hung not in job.member_pids()
        assert job.events("epoch_proposed", epoch=1)[0]["mode"] == "hotswap"

        # resumed, the hung process finds itself declared failed and registers again as a spare (it is alive
        # and the job still runs); the job ends without needing it, and it exits 0 with the job
        job.signal(hung, signal.SIGCONT)
        wait_until(lambda: job.drill_events(hung, "rejoined"), 30, "the resumed process to rejoin as a spare")
        rejoined = job.drill_events(hung, "rejoined")[-1]
        print(f"resumed process rejoined: {rejoined['reason']}")
        assert "registered again as spare" in rejoined["reason"], rejoined
        assert job.finish(90) == 0, job.describe()
        assert job.wait_exit(hung, 15) == 0 and job.drill_events(hung, "done"), job.drill_log(hung)[-3:]
        _check_finished(job)
        assert job.coordinator.view.epoch == 1


@pytest.mark.timeout(120)
def test_a_process_evicted_more_often_than_max_rejoins_leaves(tmp_path) -> None:
    """With ``max_rejoins=0`` the resumed process does not come back as a spare: StaleEpochError, exit 3."""
    with DrillJob(tmp_path, nproc=3, spares=1, steps=60, sleep=0.05, max_rejoins=0) as job:
        job.wait_epoch()
        wait_until(job.launcher.spare_pids, 60, "the spare to register")
        hung = job.member_pids()[2]
        job.wait_progress(hung, 3)
        job.signal(hung, signal.SIGSTOP)
        job.wait_event("epoch_configured", 30, epoch=1)
        job.signal(hung, signal.SIGCONT)
        code = job.wait_exit(hung, 30)
        # not `== 3`: now and then the process aborts (-6) while exiting after main() returned 3, with the
        # aborted epoch-0 gloo group still alive
        assert code in (3, -signal.SIGABRT), code
        errors = job.drill_events(hung, "error")
        assert errors and "more than max_rejoins" in errors[-1]["reason"], job.drill_log(hung)[-3:]
        assert not job.drill_events(hung, "rejoined")
        assert job.finish(90) == 0, job.describe()


@pytest.mark.timeout(150)
def test_second_failure_during_reconfiguration_forms_a_later_epoch(tmp_path) -> None:
    with DrillJob(tmp_path, nproc=4, spares=2, steps=60, sleep=0.03) as job:
        job.wait_epoch()
        wait_until(lambda: len(job.launcher.spare_pids()) == 2, 60, "two spares to register")
        pids = job.member_pids()
        job.wait_progress(pids[1], 3)
        t_kill = job.signal(pids[1])
        job.wait_event("epoch_proposed", 15, epoch=1)
        (promoted,) = job.events("spare_promoted", epoch=1)
        second = promoted["pid"]  # the promoted spare dies while epoch 1 is being built
        t_second = job.signal(second)
        lag = t_second - job.events("epoch_proposed", epoch=1)[0]["time"]
        configured_1 = job.events("epoch_configured", epoch=1)
        print(f"\nsecond kill {lag * 1000:.1f} ms after epoch 1 was proposed (configured first: {bool(configured_1)})")

        proposed = job.wait_event("epoch_proposed", 60, epoch=2)
        assert proposed["world_size"] == 4 and proposed["mode"] == "hotswap", proposed
        configured = job.wait_event("epoch_configured", 60, epoch=2)
        print(f"first kill -> epoch 2 configured: {configured['time'] - t_kill:.3f} s")
        assert job.finish(120) == 0, job.describe()
        final = _check_finished(job)
        assert pids[1] not in final and second not in final and len(final) == 4
        last = job.coordinator.view.epoch
        assert last >= 2
        # no split view: every final member ended in the same epoch, at the same rank the view gives it
        for slot, pid in enumerate(final):
            (done,) = job.drill_events(pid, "done")
            assert (done["epoch"], done["rank"]) == (last, slot), done
            check_contiguous(job.drill_log(pid))


@pytest.mark.timeout(120)
def test_majority_guard_fails_the_job_when_most_members_die(tmp_path) -> None:
    with DrillJob(tmp_path, nproc=5, spares=0, mode="shrink", steps=200, sleep=0.03) as job:
        job.wait_epoch()
        pids = job.member_pids()
        job.wait_progress(pids[0], 3)
        for pid in pids[2:]:
            job.signal(pid)
        assert job.finish(60) != 0, job.describe()
        (failed,) = job.events("job_failed")
        assert "no quorum" in failed["reason"], failed
        assert [e["epoch"] for e in job.events("epoch_proposed")] == [0]
        for pid in pids[:2]:  # the minority does not go on alone
            assert job.wait_exit(pid, 20) == 3
            (error,) = job.drill_events(pid, "error")
            assert "MembershipError" in error["reason"] and "no quorum" in error["reason"], error
            assert not job.drill_events(pid, "done")


@pytest.mark.timeout(120)
def test_a_stall_of_every_member_at_once_is_waited_out(tmp_path) -> None:
    """Every worker paused past the heartbeat timeout (an overloaded host): nobody is declared dead."""
    hb = 1.0
    with DrillJob(tmp_path, nproc=3, steps=60, sleep=0.03, heartbeat_timeout=hb, stall_grace=20) as job:
        job.wait_epoch()
        pids = job.member_pids()
        job.wait_progress(pids[0], 3)
        for pid in pids:
            job.signal(pid, signal.SIGSTOP)
        job.wait_event("stall_suspected", 10, epoch=0)
        time.sleep(3 * hb)  # three heartbeat timeouts of silence from everyone
        for pid in pids:
            job.signal(pid, signal.SIGCONT)
        assert job.finish(60) == 0, job.describe()
        assert not job.events("failure_detected"), job.events("failure_detected")
        assert [e["epoch"] for e in job.events("epoch_proposed")] == [0]
        assert _check_finished(job) == pids
        for pid in pids:
            assert check_contiguous(job.drill_log(pid)) == list(range(job.steps))


@pytest.mark.timeout(120)
def test_a_majority_hung_for_good_fails_the_job_after_the_grace(tmp_path) -> None:
    """Silence that takes the majority away is believed after heartbeat timeout + grace: a clear failure."""
    hb, grace = 1.0, 2.0
    with DrillJob(tmp_path, nproc=3, steps=400, sleep=0.03, heartbeat_timeout=hb, stall_grace=grace) as job:
        job.wait_epoch()
        pids = job.member_pids()
        job.wait_progress(pids[0], 3)
        t_stop = 0.0
        for pid in pids[1:]:
            t_stop = job.signal(pid, signal.SIGSTOP)
        assert job.finish(60) != 0, job.describe()
        (failed,) = job.events("job_failed")
        assert "no quorum" in failed["reason"], failed
        waited = failed["time"] - t_stop
        print(f"\nmajority SIGSTOPped -> job_failed: {waited:.3f} s")
        # silence counts from the last beat the coordinator saw: up to a beat interval (50 ms) before the stop
        assert hb + grace - 0.1 <= waited <= 2 * hb + grace + 5, waited
        assert job.wait_exit(pids[0], 20) == 3
        (error,) = job.drill_events(pids[0], "error")
        assert "no quorum" in error["reason"], error


@pytest.mark.timeout(120)
def test_a_dead_spare_leaves_the_pool_and_the_other_one_is_promoted(tmp_path) -> None:
    with DrillJob(tmp_path, nproc=3, spares=2, steps=50, sleep=0.03) as job:
        job.wait_epoch()
        wait_until(lambda: len(job.launcher.spare_pids()) == 2, 60, "two spares to register")
        dead_spare, live_spare = job.launcher.spare_pids()
        job.signal(dead_spare)
        detected = job.wait_event("failure_detected", 10, pid=dead_spare)
        assert detected["reason"] == "exit" and detected["slot"] is None, detected
        assert job.launcher.spare_pids() == [live_spare]
        assert detected["member"] not in job.coordinator.spares()
        assert not job.events("epoch_proposed", epoch=1)  # a spare's death does not disturb the epoch

        pids = job.member_pids()
        job.wait_progress(pids[0], 3)
        job.signal(pids[0])  # slot 0 hosts nothing: recovery works without it
        job.wait_event("epoch_proposed", 15, epoch=1)
        assert [(e["slot"], e["pid"]) for e in job.events("spare_promoted")] == [(0, live_spare)]
        assert job.finish(90) == 0, job.describe()
        assert _check_finished(job) == [live_spare, *pids[1:]]
        assert job.launcher.spare_pids() == []
