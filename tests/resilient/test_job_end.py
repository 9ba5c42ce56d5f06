"""A job ends everywhere when its work ends: the README's torchrun/srun recipe with a standalone coordinator.

``sparsecomm coordinator`` is started on its own, then two workers and a spare
running ``examples/resilient_loop.py`` with the variables it prints, as a user
(or torchrun / srun) starts them. No launcher tells anyone that the job ended:
the coordinator learns it from the workers leaving, records it, and the spare
and the coordinator exit 0 by themselves. A job that fails ends the same way,
with a non-zero status.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from optim.testing.hosts import kill_all
from resilient_comm.events import read_events
from tests.resilient.harness import REPO_ROOT, wait_until

pytestmark = [pytest.mark.dist]

EXAMPLE = Path(REPO_ROOT) / "examples" / "resilient_loop.py"
ENDED_WITHIN_S = 5.0  # after the last worker exits, everything else has exited too


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}


def _coordinator(tmp: Path, world_size: int, grace: float = 20.0) -> tuple[subprocess.Popen[str], dict[str, str]]:
    argv = [sys.executable, "-m", "optim", "coordinator", "--world-size", str(world_size), "--heartbeat-timeout", "2"]
    argv += ["--stall-grace", str(grace)]
    argv += ["--events", str(tmp / "events.jsonl"), "--secret-file", str(tmp / "job.secret")]
    proc = subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    banner = proc.stdout.readline()
    fields = dict(kv.split("=", 1) for kv in banner.split())
    assert "SPARSECOMM_COORDINATOR" in fields, banner
    return proc, fields


def _start(tmp: Path, fields: dict[str, str], role: str, slot: int, name: str, steps: int) -> subprocess.Popen[str]:
    env = {**_env(), **fields, "SPARSECOMM_ROLE": role, "SPARSECOMM_SLOT": str(slot)}
    argv = [sys.executable, str(EXAMPLE), "--optimizer", "adamw", "--steps", str(steps), "--out", str(tmp / name)]
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 - the child holds it; closed when the test ends
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def _spare_started(tmp: Path) -> bool:
    events = read_events(tmp / "events.jsonl", missing_ok=True)
    return any(e["event"] == "member_started" and e.get("role") == "spare" for e in events)


@pytest.mark.timeout(180)
def test_workers_finish_and_the_spare_and_the_standalone_coordinator_exit_0(tmp_path: Path) -> None:
    coord, fields = _coordinator(tmp_path, 2)
    spare = _start(tmp_path, fields, "spare", -1, "s.json", 30)
    procs = [spare]
    try:  # the spare is registered before the work starts (so it is one when the work ends, however slow its start)
        wait_until(lambda: _spare_started(tmp_path), 60, "the spare to register")
        workers = [_start(tmp_path, fields, "active", s, f"w{s}.json", 30) for s in (0, 1)]
        procs += workers
        for w in workers:
            assert w.wait(timeout=150) == 0, (tmp_path / "w0.json.log").read_text()[-2000:]
        last_worker = time.monotonic()
        assert spare.wait(timeout=30) == 0, (tmp_path / "s.json.log").read_text()[-2000:]
        assert coord.wait(timeout=30) == 0, coord.stdout.read() if coord.stdout else ""
        ended_s = time.monotonic() - last_worker
        print(f"\nlast worker exited -> spare and coordinator exited: {ended_s:.2f} s")
        assert ended_s <= ENDED_WITHIN_S, ended_s
    finally:
        kill_all([*procs, coord])  # type: ignore[list-item]
    events = read_events(tmp_path / "events.jsonl")
    (completed,) = [e for e in events if e["event"] == "job_completed"]
    assert completed["epoch"] == 0 and completed["committed_step"] == 30 and completed["spares"] == 1, completed
    assert not [e for e in events if e["event"] in ("job_failed", "failure_detected")], events
    assert (tmp_path / "w0.json").exists() and not (tmp_path / "s.json").exists()  # rank 0 reports; the spare not


@pytest.mark.timeout(120)
def test_a_failed_job_ends_the_spare_and_the_coordinator_with_an_error(tmp_path: Path) -> None:
    """Both workers SIGKILLed: no majority is left, the job fails; the waiting spare and the coordinator exit 1."""
    coord, fields = _coordinator(tmp_path, 2, grace=1.0)  # silence of everyone is believed after 1 s more
    procs = [
        _start(tmp_path, fields, "active", 0, "w0.json", 100_000),
        _start(tmp_path, fields, "active", 1, "w1.json", 100_000),
        _start(tmp_path, fields, "spare", -1, "s.json", 100_000),
    ]
    try:
        path = tmp_path / "events.jsonl"
        wait_until(lambda: any(e["event"] == "epoch_configured" for e in read_events(path, missing_ok=True)), 90, "")
        wait_until(
            lambda: sum(e["event"] == "member_started" for e in read_events(path, missing_ok=True)) == 3, 60, "spare"
        )
        time.sleep(1.0)
        for w in procs[:2]:
            os.kill(w.pid, signal.SIGKILL)
        t0 = time.monotonic()
        code = procs[2].wait(timeout=60)
        assert code != 0, (tmp_path / "s.json.log").read_text()[-2000:]
        assert "the job failed" in (tmp_path / "s.json.log").read_text()
        assert coord.wait(timeout=30) == 1
        print(f"\nboth workers killed -> spare and coordinator exited: {time.monotonic() - t0:.2f} s")
    finally:
        kill_all([*procs, coord])  # type: ignore[list-item]
    events = read_events(tmp_path / "events.jsonl")
    kinds = [e["event"] for e in events]
    assert "job_failed" in kinds and "job_completed" not in kinds, kinds


@pytest.mark.timeout(150)
def test_a_worker_stalled_before_the_job_starts_is_counted_again_when_it_beats(tmp_path: Path) -> None:
    """A registered worker SIGSTOPped past the heartbeat timeout before the job starts is declared dead; once it
    runs again it is counted again, so the job starts when the second worker registers and ends cleanly (without
    that, the coordinator waits ``start_timeout`` for a member it will never count and fails the job)."""
    coord, fields = _coordinator(tmp_path, 2)
    path = tmp_path / "events.jsonl"

    def events(kind: str) -> list[dict[str, object]]:
        return [e for e in read_events(path, missing_ok=True) if e["event"] == kind]

    first = _start(tmp_path, fields, "active", 0, "w0.json", 10)
    procs = [first]
    try:
        wait_until(lambda: events("member_started"), 60, "the first worker to register")
        os.kill(first.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: events("failure_detected"), 30, "the stalled worker to be declared dead")
        finally:
            os.kill(first.pid, signal.SIGCONT)
        (revived,) = wait_until(lambda: events("member_revived"), 30, "the worker to be counted again")
        assert revived["pid"] == first.pid and not events("epoch_proposed")
        procs.append(_start(tmp_path, fields, "active", 1, "w1.json", 10))
        for w in procs:
            assert w.wait(timeout=120) == 0, (tmp_path / f"w{procs.index(w)}.json.log").read_text()[-2000:]
        assert coord.wait(timeout=30) == 0, coord.stdout.read() if coord.stdout else ""
    finally:
        kill_all([*procs, coord])  # type: ignore[list-item]
    (completed,) = events("job_completed")
    assert completed["epoch"] == 0 and completed["committed_step"] == 10, completed
    assert not events("job_failed")
