"""Drill jobs across several "hosts" (network namespaces on one bridge), with real link cuts.

The coordinator runs in host 0 (``sparsecomm coordinator``), each worker in a
host of its own, every one reaching the others through the bridge only.
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

from bindings.spawn import ForkedPython
from optim.testing.hosts import DEFAULT_PORT, HostProcess, Hosts, HostsJob, unavailable, wait_for
from tests.resilient.harness import check_contiguous

pytestmark = [
    pytest.mark.dist,
    pytest.mark.skipif(unavailable() is not None, reason=f"no network namespaces: {unavailable()}"),
]


@pytest.mark.timeout(60)
def test_hosts_reach_each_other_only_through_the_bridge(tmp_path: Path) -> None:
    """Each host has its own loopback: a port open on the test's 127.0.0.1 is not reachable from a host,
    whether the process runs under ``ip netns exec`` (``python -c``) or is forked into the host (a script)."""
    with socket.socket() as listener, Hosts(2) as hosts:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        probe = (
            "import socket, sys\n"
            "def reach(h, p):\n"
            "    try:\n"
            "        socket.create_connection((h, p), timeout=1).close(); return 1\n"
            "    except OSError:\n"
            "        return 0\n"
            f"sys.exit(10 * reach('127.0.0.1', {port}) + reach('{hosts.address(0)}', {DEFAULT_PORT}))\n"
        )
        bind = f"('{hosts.address(0)}', {DEFAULT_PORT})"
        listen = f"import socket, time\ns = socket.socket()\ns.bind({bind})\ns.listen()\n"
        server = hosts.run(0, [sys.executable, "-c", listen + "time.sleep(30)"])
        time.sleep(1.0)
        code = hosts.run(1, [sys.executable, "-c", probe]).wait(timeout=30)
        script = tmp_path / "probe.py"
        script.write_text(probe)
        forked = hosts.run(1, [sys.executable, str(script)])
        assert isinstance(forked, ForkedPython)
        forked_code = forked.wait(timeout=30)
        server.kill()
    assert code == 1, code  # host 0 reachable through the bridge; the test's loopback not
    assert forked_code == 1, forked_code


@pytest.mark.timeout(180)
def test_worker_host_cut_off_mid_run_majority_goes_on(tmp_path: Path) -> None:
    """A worker's host goes dark mid-run: detected by its silence, the majority shrinks and finishes every step;
    when the link comes back the cut-off process learns it was replaced and registers again as a spare, which
    the job never needs: when the majority finishes, the spare and the coordinator exit 0."""
    hb = 1.0
    with Hosts(4) as hosts:
        job = HostsJob(hosts, tmp_path, workers=3, steps=80, hb=hb)
        try:
            cut_pid, survivors = job.workers[2].pid, [w.pid for w in job.workers[:2]]
            job.wait_training(cut_pid)
            t_cut = time.time()
            hosts.cut(3)  # the third worker's host: alive, silent
            t_dark = time.time()  # the link is down (the cut is an `ip` command: on a busy machine, a while)
            detected = job.wait_event("failure_detected", 15, pid=cut_pid)
            detect_s = detected["time"] - t_cut
            print(f"\nlink cut -> failure_detected ({detected['reason']}): {detect_s:.3f} s")
            configured = job.wait_event("epoch_configured", 30, epoch=1)
            print(f"link cut -> epoch 1 configured: {configured['time'] - t_cut:.3f} s")
            job.wait_progress(survivors[0], max(job.committed(survivors[0])) + 3)
            hosts.restore(3)  # the link comes back while the majority is still training
            for w in job.workers[:2]:
                assert w.wait(timeout=90) == 0, job.describe()
            code = job.workers[2].wait(timeout=30)
            print(f"link restored -> the cut-off process exited {code} when the job ended")
            assert job.coordinator.wait(timeout=30) == 0, job.describe()
            first_after = min(
                r["time"]
                for p in survivors
                for r in job.log(p)
                if r["event"] == "committed" and r["time"] > t_cut and r.get("epoch") == 1
            )
            print(f"link cut -> first committed step in epoch 1: {first_after - t_cut:.3f} s")
        finally:
            print(job.describe())
        assert detected["reason"] in ("heartbeat", "no ack"), detected
        assert detect_s <= hb + 0.5, detect_s
        for p in survivors:  # every step committed once, in order, ending at the last one
            assert check_contiguous(job.log(p)) == list(range(job.steps))
        # the cut-off side committed nothing the majority did not also commit, and nothing after the cut
        lost = job.committed(cut_pid)
        assert set(lost) <= set(job.committed(survivors[0])), lost
        late = job.committed_after(cut_pid, t_dark)
        assert late in ([], [max(lost) if lost else 0]), late  # at most the step in flight at the cut
        # back on the network it finds itself replaced, waits as a spare, and leaves with the job
        assert code == 0, (code, job.log(cut_pid)[-3:])
        assert [r["event"] for r in job.log(cut_pid)][-2:] == ["rejoined", "done"], job.log(cut_pid)[-3:]
        assert job.events("job_completed", epoch=1), job.describe()


@pytest.mark.timeout(180)
def test_partition_without_a_majority_fails_the_job_and_nobody_commits(tmp_path: Path) -> None:
    """Two of three workers' hosts go dark: no side has a majority; nobody commits, the job fails naming the
    lost slots, and every process ends by its deadlines."""
    hb, grace = 1.0, 2.0
    with Hosts(4) as hosts:
        job = HostsJob(hosts, tmp_path, workers=3, steps=400, hb=hb, grace=grace)
        try:
            pids = [w.pid for w in job.workers]
            job.wait_training(pids[0])
            t_cut = time.time()
            hosts.cut(2)
            hosts.cut(3)
            t_dark = time.time()  # both links down (each cut is an `ip` command: on a busy machine, a while)
            failed = job.wait_event("job_failed", hb + grace + 10)
            print(f"\nno-majority cut -> job_failed: {failed['time'] - t_cut:.3f} s: {failed['reason']}")
            codes = [w.wait(timeout=90) for w in job.workers]
            print(f"exit codes {codes}, {time.time() - t_cut:.1f} s after the cut")
        finally:
            print(job.describe())
        assert "no quorum" in failed["reason"] and "slots [1, 2] lost" in failed["reason"], failed
        assert hb + grace - 0.1 <= failed["time"] - t_cut <= 2 * hb + grace + 5  # silence: from the last beat seen
        assert all(c != 0 for c in codes), codes
        for p in pids:  # after the cut nobody commits, but the step every member had already voted for
            late = job.committed_after(p, t_dark)
            before = [r["step"] for r in job.log(p) if r["event"] == "committed" and r["time"] <= t_dark]
            assert late in ([], [max(before) + 1]), (p, late)


@pytest.mark.timeout(180)
def test_coordinator_host_cut_off_from_every_worker_ends_the_job_by_its_deadlines(tmp_path: Path) -> None:
    """The coordinator's host goes dark (the embedded store has no standby): the coordinator fails the job for
    want of a majority, each worker gives up at its timeout with a clear error, and nobody commits meanwhile.
    (The coordinator cut off from a minority is the worker-host cut above.)"""
    hb, grace, timeout = 1.0, 2.0, 6.0
    with Hosts(4) as hosts:
        job = HostsJob(hosts, tmp_path, workers=3, steps=2000, hb=hb, grace=grace, timeout=timeout)
        try:
            pids = [w.pid for w in job.workers]
            job.wait_training(pids[0])
            t_cut = time.time()
            hosts.cut(0)
            t_dark = time.time()
            codes = [w.wait(timeout=60) for w in job.workers]
            print(f"\ncoordinator host cut -> workers exited {codes} by {time.time() - t_cut:.1f} s")
            failed = job.wait_event("job_failed", hb + grace + 10)
            print(f"coordinator host cut -> job_failed: {failed['time'] - t_cut:.3f} s: {failed['reason']}")
        finally:
            print(job.describe())
        assert "no quorum" in failed["reason"] and "slots [0, 1, 2] lost" in failed["reason"], failed
        for p, code in zip(pids, codes, strict=True):
            errors = [r for r in job.log(p) if r["event"] == "error"]
            assert code == 3 and errors and "lost the coordinator" in errors[-1]["reason"], (code, job.log(p)[-3:])
            assert errors[-1]["time"] - t_cut <= timeout + 3.0, errors[-1]["time"] - t_cut
            late = job.committed_after(p, t_dark)
            assert len(late) <= 1, (p, late)  # at most the step every member had already voted for


def _exit_all(job: HostsJob, timeout: float, killed: tuple[int, ...] = ()) -> float:
    """Wait for every worker (those in ``killed``: any status) and spare, then the coordinator, each to exit 0;
    return how long after the last worker the others took."""
    for w in job.workers:
        code = w.wait(timeout=timeout)
        assert code == 0 or w.pid in killed, (code, job.describe())
    last_worker = time.monotonic()
    for p in job.spares:
        assert p.wait(timeout=30) == 0, job.describe()
    assert job.coordinator.wait(timeout=30) == 0, job.describe()
    return time.monotonic() - last_worker


@pytest.mark.timeout(120)
def test_a_job_with_an_unused_spare_ends_on_every_host(tmp_path: Path) -> None:
    """3 workers and a spare, each on its own host, no failure: when the workers finish, the spare and the
    standalone coordinator exit 0 within seconds (nothing tells them but the workers leaving)."""
    with Hosts(5) as hosts:
        job = HostsJob(hosts, tmp_path, workers=3, spares=1, steps=40, hb=2.0, mode="hotswap")
        try:
            ended_s = _exit_all(job, 90)
        finally:
            print(job.describe())
        print(f"\nlast worker exited -> spare and coordinator exited: {ended_s:.2f} s")
        assert ended_s <= 5.0, ended_s
        (completed,) = job.events("job_completed")
        assert completed["epoch"] == 0 and completed["committed_step"] == job.steps - 1, completed
        assert [r["event"] for r in job.log(job.spares[0].pid)] == ["done"]


@pytest.mark.timeout(240)
def test_a_worker_cut_off_comes_back_as_a_spare_and_is_promoted_at_the_next_failure(tmp_path: Path) -> None:
    """A worker's link is down for longer than the heartbeat timeout: the spare takes its slot. When the link
    returns, the cut-off process (alive all along) registers again as a spare; a later SIGKILL of another
    worker promotes it, and every step is still committed once, in order."""
    hb = 1.0
    with Hosts(5) as hosts:
        job = HostsJob(hosts, tmp_path, workers=3, spares=1, steps=400, sleep=0.05, hb=hb, mode="hotswap")
        try:
            cut, spare = job.workers[2], job.spares[0]
            job.wait_training(cut.pid)
            hosts.cut(3)
            job.wait_event("failure_detected", 15, pid=cut.pid)
            job.wait_event("epoch_configured", 30, epoch=1)  # the spare in the cut worker's slot
            time.sleep(hb)
            hosts.restore(3)
            wait_for(lambda: "rejoined" in [r["event"] for r in job.log(cut.pid)], 30, "the cut-off process to rejoin")
            job.wait_event("member_started", 15, pid=cut.pid, role="spare")
            victim = job.workers[0]
            job.wait_progress(spare.pid, max(job.committed(spare.pid)) + 3)
            victim.kill()
            promoted = job.wait_event("spare_promoted", 30, epoch=2)
            assert promoted["pid"] == cut.pid, job.describe()
            ended_s = _exit_all(job, 150, killed=(victim.pid,))
        finally:
            print(job.describe())
        print(f"\nlast worker exited -> coordinator exited: {ended_s:.2f} s")
        events = [r["event"] for r in job.log(cut.pid)]
        assert events.index("rejoined") < events.index("promoted") < events.index("done"), events
        for p in (job.workers[1], cut, spare):
            steps = check_contiguous(job.log(p.pid))
            assert steps[-1] == job.steps - 1, steps[-5:]
        assert job.events("job_completed", epoch=2)


def _job_with_a_spare(hosts: Hosts, tmp: Path, steps: int) -> tuple[HostsJob, HostProcess]:
    """3 workers and a spare at a 1 s heartbeat timeout, training; and the worker on host 2 (5 steps done)."""
    job = HostsJob(hosts, tmp, workers=3, spares=1, steps=steps, sleep=0.05, hb=1.0, mode="hotswap")
    job.wait_training(job.workers[1].pid)
    return job, job.workers[1]


@pytest.mark.timeout(180)
def test_link_blips_shorter_than_the_heartbeat_timeout_evict_nobody(tmp_path: Path) -> None:
    """A worker's host drops off the switch, three times for 0.3 s and three times for 0.7 s, at a 1 s
    heartbeat timeout: nobody is declared failed and the spare is never used. After a 0.7 s outage TCP's
    retransmission back-off (0.2 s, 0.4 s, 0.8 s) holds the next heartbeat through the store until about
    1.4 s; the datagram heartbeats arrive as soon as the host is back."""
    with Hosts(5) as hosts:
        job, flapping = _job_with_a_spare(hosts, tmp_path, 200)
        try:
            for outage_s in (0.3, 0.7, 0.3, 0.7, 0.3, 0.7):
                hosts.detach(2)
                time.sleep(outage_s)
                hosts.attach(2)
                time.sleep(1.0)
            ended_s = _exit_all(job, 120)
        finally:
            print(job.describe())
        assert not job.events("failure_detected"), job.describe()
        assert not job.events("spare_promoted") and len(job.events("epoch_proposed")) == 1
        assert check_contiguous(job.log(flapping.pid)) == list(range(job.steps))
        assert ended_s <= 5.0, ended_s


@pytest.mark.timeout(180)
def test_a_flapping_link_does_not_drain_the_spares(tmp_path: Path) -> None:
    """A worker's link goes down for 0.3 s every second, six times, at a 1 s heartbeat timeout (the kernel
    keeps the carrier down for about a second each time, so the worker is silent for seconds and is
    evicted): the spare takes its slot, and the evicted process, alive, comes back as a spare. The job
    still has a spare afterwards and ends with every process exiting 0."""
    with Hosts(5) as hosts:
        job, flapping = _job_with_a_spare(hosts, tmp_path, 250)
        try:
            for _ in range(6):
                hosts.cut(2)
                time.sleep(0.3)
                hosts.restore(2)
                time.sleep(0.7)
            evicted = {e["pid"] for e in job.events("failure_detected")}
            assert evicted == {flapping.pid}, job.describe()
            wait_for(lambda: job.events("member_started", pid=flapping.pid, role="spare"), 30, "the evicted to rejoin")
            spares_left = len(job.events("member_started", role="spare")) - len(job.events("spare_promoted"))
            assert spares_left == 1, job.describe()
            ended_s = _exit_all(job, 120)
        finally:
            print(job.describe())
        assert ended_s <= 5.0, ended_s
        assert "rejoined" in [r["event"] for r in job.log(flapping.pid)]
