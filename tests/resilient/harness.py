"""Run ``optim.testing.drill`` jobs under an in-process :class:`Launcher` and read what happened.

The test process hosts the coordinator (through the launcher); the workers and
spares are real OS processes, killed or stopped by pid. :class:`DrillJob` is a
context manager whose exit kills whatever is left (SIGCONT, then SIGKILL), so
a failing test never leaves processes behind. Every wait takes a deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from bindings.spawn import ForkedPython
from bindings.store import connect_store
from optim.apps.paths import REPO_ROOT
from optim.testing.hosts import kill_all, wait_for
from resilient_comm import keys
from resilient_comm.auth import ControlStore, JobSecret
from resilient_comm.events import read_event_dir, read_events
from resilient_comm.keys import COMMITTED
from resilient_comm.launcher import LaunchConfig, Launcher
from resilient_comm.membership import StoreMembership
from resilient_comm.view import MemberInfo, View

__all__ = [
    "DrillJob",
    "JobWatch",
    "REPO_ROOT",
    "check_contiguous",
    "kill_all",
    "run_job",
    "vote_in_threads",
    "wait_until",
]


T = TypeVar("T")


def wait_until(pred: Callable[[], T], timeout: float, what: str, interval: float = 0.005) -> T:
    """Poll ``pred`` until it returns something truthy; fail the test after ``timeout`` seconds."""
    try:
        return wait_for(pred, timeout, what, interval)
    except TimeoutError as exc:
        raise AssertionError(str(exc)) from None


def vote_in_threads(
    members: list[StoreMembership], epoch: int, step: int, view_members: tuple[int, ...], oks: list[bool] | None = None
) -> list[bool]:
    """Every member votes ``step`` at once, each in a thread of its own (ok unless ``oks`` says not); the answers."""
    oks = [True] * len(members) if oks is None else oks
    out = [False] * len(members)

    def run(i: int) -> None:
        out[i] = members[i].vote(epoch, step, view_members, oks[i], time.monotonic() + 10)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(members))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), "a vote did not end by its deadline"
    return out


class JobWatch:
    """What a test outside a ``sparsecomm launch`` job reads of it: the job gets this secret through ``env``."""

    def __init__(self) -> None:
        self.secret = JobSecret.generate()
        self.env = self.secret.env()
        self._store: ControlStore | None = None

    def connect(self, port: int | str, alive: Callable[[], bool], timeout: float) -> None:
        """Connect to the job's store (a loopback ``port``, or its address) once it is up (while ``alive()``)."""
        deadline = time.monotonic() + timeout
        address = f"127.0.0.1:{port}" if isinstance(port, int) else port
        while self._store is None and time.monotonic() < deadline and alive():
            try:
                raw = connect_store(address, timedelta(seconds=5))
                self._store = ControlStore(raw, self.secret)
            except (RuntimeError, OSError):
                time.sleep(0.05)
        assert self._store is not None, "the job's store never came up"

    def committed(self) -> int:
        """The newest step the job committed (``-1``: none yet)."""
        assert self._store is not None
        return int(self._store.get(COMMITTED)) if self._store.check([COMMITTED]) else -1

    def pid_of_slot(self, slot: int) -> int:
        """The pid of the process holding ``slot`` in the job's current epoch (from its view and registrations)."""
        store = self._store
        assert store is not None
        view = View.from_json(store.get(keys.view(int(store.get(keys.EPOCH)))))
        member = view.members[slot]
        return MemberInfo.from_json(store.get(store.private(keys.member(member)))).pid


def run_job(cmd: list[str], log_dir: Path, **config: Any) -> tuple[int, str]:
    """Run ``cmd`` as a job under a launcher in this process (``LaunchConfig(**config)``): its processes fork
    from the suite's warm fork server. Returns the job's status and every process's output (from ``log_dir``)."""
    launcher = Launcher(cmd, LaunchConfig(log_dir=str(log_dir), **config))
    launcher.start()
    code = launcher.wait()
    return code, "".join(p.read_text(errors="replace") for p in sorted(Path(log_dir).glob("*.log")))


def check_contiguous(records: list[dict[str, Any]]) -> list[int]:
    """Check one process's committed steps: +1 each, or resume at ``committed_step + 1`` after a change.

    Returns the committed steps in order.
    """
    expected: int | None = None
    steps = []
    for rec in records:
        ev = rec["event"]
        if ev == "joined":
            expected = 0
        elif ev in ("promoted", "reconfigured"):
            expected = rec["committed_step"] + 1
        elif ev == "committed":
            assert expected is not None, f"pid {rec['pid']}: committed before joining"
            assert rec["step"] == expected, f"pid {rec['pid']}: committed step {rec['step']}, expected {expected}"
            steps.append(rec["step"])
            expected += 1
    return steps


class DrillJob:
    """One drill job: ``nproc`` workers and ``spares`` spares under a launcher hosted here.

    Args:
        log_dir: Directory of the per-process drill logs.
        nproc, spares, mode: See :class:`LaunchConfig`.
        steps, numel, sleep, resource_every: Drill arguments.
        heartbeat_timeout: Seconds of silence after which a process counts as hung.
        stall_grace: Seconds more before silence alone may take away the majority.
        job_timeout: Seconds after which the launcher kills the job (status 124).
    """

    def __init__(
        self,
        log_dir: Path,
        *,
        nproc: int,
        spares: int = 0,
        steps: int = 40,
        numel: int = 1024,
        sleep: float = 0.03,
        mode: str = "hotswap",
        resource_every: int = 0,
        heartbeat_timeout: float = 1.0,
        stall_grace: float = 20.0,
        job_timeout: float = 120.0,
        max_rejoins: int = 3,
    ) -> None:
        self.log_dir = Path(log_dir)
        self.steps = steps
        cmd = [sys.executable, "-m", "optim.testing.drill", "--steps", str(steps), "--numel", str(numel)]
        cmd += ["--sleep", str(sleep), "--log", str(self.log_dir), "--resource-every", str(resource_every)]
        cmd += ["--max-rejoins", str(max_rejoins)]
        config = LaunchConfig(
            nproc=nproc,
            spares=spares,
            mode=mode,
            heartbeat_timeout=timedelta(seconds=heartbeat_timeout),
            stall_grace=timedelta(seconds=stall_grace),
            job_timeout=timedelta(seconds=job_timeout),
            env={"PYTHONPATH": REPO_ROOT},
        )
        self.launcher = Launcher(cmd, config)
        self.coordinator = self.launcher.coordinator
        self._thread: threading.Thread | None = None
        self._rc: int | None = None
        self._error: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> DrillJob:
        self.launcher.start()
        self._thread = threading.Thread(target=self._wait, name="drill-launcher-wait", daemon=True)
        self._thread.start()
        return self

    def _wait(self) -> None:
        try:
            self._rc = self.launcher.wait()
        except BaseException as exc:  # noqa: BLE001 - reported by finish()
            self._error = exc

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def cleanup(self) -> None:
        """Resume stopped processes and kill every process still running; stop the coordinator."""
        kill_all(self.processes())
        if self._thread is not None:
            self._thread.join(timeout=20)
        self.coordinator.stop()

    def finish(self, timeout: float) -> int:
        """Wait (at most ``timeout`` s) for ``Launcher.wait()``; return the job's exit status."""
        assert self._thread is not None, "job not started"
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"the job did not finish within {timeout} s\n{self.describe()}")
        if self._error is not None:
            raise self._error
        assert self._rc is not None
        return self._rc

    # ------------------------------------------------------------------ processes
    def processes(self) -> list[subprocess.Popen[bytes] | ForkedPython]:
        """Every process the launcher started (it keeps no public list)."""
        with self.launcher._lock:
            return [p for p, _ in self.launcher._procs]

    def exit_codes(self) -> dict[int, int | None]:
        """pid -> exit status (``None``: still running)."""
        return {p.pid: p.poll() for p in self.processes()}

    def wait_exit(self, pid: int, timeout: float) -> int:
        """Wait for process ``pid`` to exit; return its status."""
        proc = next(p for p in self.processes() if p.pid == pid)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"pid {pid} did not exit within {timeout} s") from None

    @staticmethod
    def signal(pid: int, sig: int = signal.SIGKILL) -> float:
        """Send ``sig`` to ``pid``; return ``time.time()`` just before."""
        t = time.time()
        os.kill(pid, sig)
        return t

    def member_pids(self) -> list[int]:
        """pids of the current epoch's members, by slot."""
        view = self.coordinator.view
        assert view is not None
        members = self.coordinator.members()
        return [members[m].pid for m in view.members]

    # ------------------------------------------------------------------ events
    def events(self, name: str | None = None, **match: Any) -> list[dict[str, Any]]:
        """Coordinator events (of kind ``name``, with the given field values)."""
        return [
            e
            for e in self.coordinator.log.events
            if (name is None or e["event"] == name) and all(e.get(k) == v for k, v in match.items())
        ]

    def drill_log(self, pid: int) -> list[dict[str, Any]]:
        """The drill records of process ``pid``."""
        return read_events(self.log_dir / f"{pid}.jsonl", missing_ok=True)

    def drill_logs(self) -> dict[int, list[dict[str, Any]]]:
        """Every process's drill records, by pid."""
        return {int(p.stem): recs for p, recs in read_event_dir(self.log_dir).items()}

    def drill_events(self, pid: int, name: str) -> list[dict[str, Any]]:
        return [r for r in self.drill_log(pid) if r["event"] == name]

    def last_committed(self, pid: int) -> int:
        steps = [r["step"] for r in self.drill_events(pid, "committed")]
        return max(steps, default=-1)

    def wait_progress(self, pid: int, step: int, timeout: float = 60.0) -> None:
        """Wait until process ``pid`` committed ``step``."""
        try:
            wait_until(lambda: self.last_committed(pid) >= step, timeout, f"pid {pid} to commit step {step}", 0.002)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.describe()}") from None

    def wait_event(self, name: str, timeout: float, **match: Any) -> dict[str, Any]:
        """Wait for a coordinator event; return the first that matches."""
        try:
            found = wait_until(lambda: self.events(name, **match), timeout, f"event {name} {match}", 0.001)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.describe()}") from None
        return found[0]

    def describe(self) -> str:
        """What happened so far (for failure messages): coordinator events, exit codes, last drill records."""
        lines = ["coordinator events:"]
        for e in self.coordinator.log.events:
            extra = {k: v for k, v in e.items() if k not in ("time", "event", "members") and v is not None}
            lines.append(f"  {e['time']:.3f} {e['event']} {extra}"[:300])
        lines.append(f"exit codes: {self.exit_codes()}")
        for pid, records in self.drill_logs().items():
            tail = [r for r in records if r["event"] != "committed"][-3:]
            lines.append(f"pid {pid}: last committed {self.last_committed(pid)}, {tail}"[:600])
        return "\n".join(lines)

    def wait_epoch(self, timeout: float = 60.0) -> None:
        """Wait until epoch 0 is configured."""
        self.wait_event("epoch_configured", timeout, epoch=0)
