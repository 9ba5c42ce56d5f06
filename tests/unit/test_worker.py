"""sparsecomm.worker.SerialWorker: jobs in order on one daemon thread, results and errors through futures."""

from __future__ import annotations

import functools
import threading
import time

import pytest

from sparsecomm.worker import SerialWorker


def test_jobs_run_in_submission_order_on_one_thread() -> None:
    worker: SerialWorker[tuple[int, str]] = SerialWorker("test-worker")
    seen: list[int] = []

    def job(i: int) -> tuple[int, str]:
        time.sleep(0.001 * (5 - i))  # later jobs are quicker: only the order of submission orders them
        seen.append(i)
        return i, threading.current_thread().name

    futures = [worker.submit(functools.partial(job, i)) for i in range(5)]
    results = [f.wait() for f in futures]
    assert seen == list(range(5))
    assert [r[0] for r in results] == list(range(5))
    assert {r[1] for r in results} == {"test-worker"}
    worker.stop()


def test_an_error_reaches_the_caller_through_the_future_and_the_next_job_still_runs() -> None:
    worker: SerialWorker[int] = SerialWorker("test-worker")

    def bad() -> int:
        raise ValueError("boom")

    failed = worker.submit(bad)
    ok = worker.submit(lambda: 7)
    with pytest.raises(ValueError, match="boom"):
        failed.wait()
    assert ok.wait() == 7
    worker.stop()


def test_drain_waits_for_every_job_submitted() -> None:
    worker: SerialWorker[None] = SerialWorker("test-worker")
    done: list[int] = []

    def job(i: int) -> None:
        time.sleep(0.01)
        done.append(i)

    for i in range(3):
        worker.submit(functools.partial(job, i))
    worker.drain()
    assert done == [0, 1, 2]
    worker.stop()


def test_retire_returns_at_once_while_a_job_is_blocked_and_the_thread_ends_after_it() -> None:
    worker: SerialWorker[int] = SerialWorker("test-worker")
    release = threading.Event()
    blocked = worker.submit(lambda: int(release.wait(10.0)))
    t0 = time.monotonic()
    worker.retire()
    assert time.monotonic() - t0 < 1.0  # no join
    thread = worker._thread
    assert thread.daemon and thread.is_alive()  # a daemon: a job stuck on a dead transport never holds exit
    release.set()
    assert blocked.wait() == 1
    thread.join(5.0)
    assert not thread.is_alive()
