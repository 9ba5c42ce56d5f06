"""Losing the coordinator (the embedded TCPStore is the single point of failure): every worker ends, clearly, in time.

The coordinator runs as ``sparsecomm coordinator``, the workers are drill
processes, all on this machine's loopback; the coordinator's host cut off
from every worker is in ``test_partitions.py``.
"""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import pytest

from optim.testing.hosts import HostsJob, Loopback

pytestmark = pytest.mark.dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _check_ended(job: HostsJob, t_fault: float, codes: list[int], within: float, why: str) -> None:
    for w, code in zip(job.workers, codes, strict=True):
        errors = [r for r in job.log(w.pid) if r["event"] == "error"]
        assert code == 3 and errors and why in errors[-1]["reason"], (code, job.log(w.pid)[-3:])
        assert errors[-1]["time"] - t_fault <= within, errors[-1]["time"] - t_fault
        # nothing is committed without the coordinator: at most the step every member had voted for
        late = [r["step"] for r in job.log(w.pid) if r["event"] == "committed" and r["time"] > t_fault]
        assert len(late) <= 1, late


@pytest.mark.timeout(120)
def test_a_killed_coordinator_ends_every_worker_within_the_heartbeat_timeout(tmp_path: Path) -> None:
    hb = 2.0
    with Loopback() as hosts:
        job = HostsJob(hosts, tmp_path, workers=3, steps=2000, hb=hb, port=_free_port())
        job.wait_training(job.workers[0].pid)
        t_kill = time.time()
        job.coordinator.send_signal(signal.SIGKILL)
        codes = [w.wait(timeout=30) for w in job.workers]
        ended = max(r["time"] for w in job.workers for r in job.log(w.pid) if r["event"] == "error")
        print(f"\ncoordinator SIGKILL -> last worker gave up: {ended - t_kill:.3f} s, codes {codes}")
        _check_ended(job, t_kill, codes, hb, "lost the coordinator")


@pytest.mark.timeout(120)
def test_a_hung_coordinator_ends_every_worker_by_the_deadline(tmp_path: Path) -> None:
    """A SIGSTOPped coordinator answers nothing and resets nothing: each worker gives up at its timeout."""
    timeout = 6.0
    with Loopback() as hosts:
        job = HostsJob(hosts, tmp_path, workers=2, steps=2000, hb=1.0, port=_free_port(), timeout=timeout)
        job.wait_training(job.workers[0].pid)
        t_stop = time.time()
        job.coordinator.send_signal(signal.SIGSTOP)
        try:
            codes = [w.wait(timeout=60) for w in job.workers]
        finally:
            job.coordinator.send_signal(signal.SIGCONT)
        ended = max(r["time"] for w in job.workers for r in job.log(w.pid) if r["event"] == "error")
        print(f"\ncoordinator SIGSTOP -> last worker gave up: {ended - t_stop:.3f} s, codes {codes}")
        _check_ended(job, t_stop, codes, timeout + 3.0, "lost the coordinator")
