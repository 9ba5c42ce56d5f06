"""``sparsecomm launch``: a coordinator, N workers and S spares on this machine.

The launcher hosts the coordinator (so no training process holds the store),
starts every process with the environment :meth:`FaultAwareCommunicator.connect`
reads, tells the coordinator at once when a process exits (faster than any
heartbeat), forwards SIGINT / SIGTERM, and exits with the workers' status.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from types import FrameType

from bindings.spawn import ForkedPython
from bindings.validate import check_choice, check_int
from resilient_comm.auth import ENV_SECRET_FILE, JobSecret
from resilient_comm.coordinator import Coordinator, CoordinatorConfig
from resilient_comm.fault_aware import ENV_ADDRESS, ENV_JOB, ENV_ROLE, ENV_SLOT

__all__ = ["LaunchConfig", "Launcher", "launch", "ENV_BACKEND", "ENV_PRELOAD"]

logger = logging.getLogger(__name__)

#: The data-plane backend the launcher asks for (``gloo``, ``nccl``).
ENV_BACKEND = "SPARSECOMM_BACKEND"
#: Comma-separated modules to preload when :attr:`LaunchConfig.preload` is ``None``.
ENV_PRELOAD = "SPARSECOMM_LAUNCH_PRELOAD"


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """What to start.

    Attributes:
        nproc: Workers (the first epoch's world size).
        spares: Spare processes waiting in standby.
        backend: Data plane of the workers (``gloo`` or ``nccl``), passed as ``SPARSECOMM_BACKEND``.
        mode: ``hotswap`` (a spare takes a dead slot; shrink when none is left) or ``shrink``.
        min_world_size: The job fails rather than run with fewer workers.
        heartbeat_timeout: Silence after which a process counts as hung.
        stall_grace: Extra wait before silence alone may take away the majority
            (see :class:`~resilient_comm.coordinator.CoordinatorConfig`).
        events: JSON-lines events file (``None``: none).
        host: Address the coordinator binds to.
        port: Coordinator port (0: any free port).
        job_timeout: Deadline of the whole job (``None``: none); past it everything is killed.
        env: Extra environment of every process.
        store: ``tcp`` or ``etcd://HOST:PORT,...[/PREFIX]`` (see
            :class:`~resilient_comm.coordinator.CoordinatorConfig`): with etcd,
            this launcher's coordinator is one candidate of the job's, and a
            standby (e.g. ``sparsecomm coordinator --store ... --job JOB``)
            can take over from it, or it from one.
        job: The job id (``None``: a fresh one); with etcd, the id the job's
            coordinators share.
        preload: Start the processes from a fork server that imported these
            modules once (:class:`bindings.spawn.ForkedPython`): each starts
            in milliseconds instead of importing torch itself. Only for a
            command that runs this Python on a module or a script (others are
            started as usual); the processes' standard streams are then the
            launcher's from the moment the first one started. ``None``: the
            comma-separated list in ``$SPARSECOMM_LAUNCH_PRELOAD``, if set;
            ``()``: never.
        log_dir: Write each process's standard output and error to a file of
            its own there, ``<role>-<n>.log`` (``n`` counts the processes of
            the job from 0); ``None``: they share the launcher's.
    """

    nproc: int
    spares: int = 0
    backend: str = "gloo"
    mode: str = "hotswap"
    min_world_size: int = 1
    heartbeat_timeout: timedelta = timedelta(seconds=2)
    stall_grace: timedelta = timedelta(seconds=20)
    events: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    job_timeout: timedelta | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    store: str = "tcp"
    job: str | None = None
    preload: tuple[str, ...] | None = None
    log_dir: str | None = None

    def __post_init__(self) -> None:
        check_int("nproc", self.nproc, low=1)
        check_int("spares", self.spares, low=0)
        check_choice("backend", self.backend, ("gloo", "nccl"))
        if self.job_timeout is not None and (
            not isinstance(self.job_timeout, timedelta) or self.job_timeout.total_seconds() <= 0
        ):
            raise ValueError(f"job_timeout: must be a positive datetime.timedelta, got {self.job_timeout!r}")
        if self.preload is not None and (
            not isinstance(self.preload, tuple) or not all(isinstance(m, str) and m for m in self.preload)
        ):
            raise ValueError(f"preload: must be a tuple of module names or None, got {self.preload!r}")
        self.coordinator_config(secret=JobSecret.generate())  # validates mode, heartbeat_timeout, host, port...

    def preload_modules(self) -> tuple[str, ...]:
        """The modules to preload (``preload``, else ``$SPARSECOMM_LAUNCH_PRELOAD``); empty: start as usual."""
        if self.preload is not None:
            return self.preload
        return tuple(m.strip() for m in os.environ.get(ENV_PRELOAD, "").split(",") if m.strip())

    def coordinator_config(self, job: str | None = None, secret: JobSecret | None = None) -> CoordinatorConfig:
        """The coordinator settings of this launch, with the job secret ``secret``."""
        job = job if job is not None else self.job
        config = CoordinatorConfig(
            world_size=self.nproc,
            host=self.host,
            port=self.port,
            mode=self.mode,
            min_world_size=self.min_world_size,
            heartbeat_timeout=self.heartbeat_timeout,
            ack_timeout=self.heartbeat_timeout,
            stall_grace=self.stall_grace,
            spares=self.spares,
            events=self.events,
            secret=secret,
            store=self.store,
        )
        return config if job is None else dataclasses.replace(config, job=job)


class Launcher:
    """Runs one job: ``start()``, then ``wait()``; tests also use :meth:`pid_of_slot` and :meth:`add_spare`.

    Every job has a secret (see :mod:`resilient_comm.auth`): the one the
    environment names (``SPARSECOMM_JOB_SECRET`` or ``..._FILE``), else a fresh
    random one. It reaches the workers and spares through their environment.

    Args:
        cmd: The worker command line (every process runs the same one).
        config: What to start.
        secret: The job secret (``None``: from the environment, else a fresh one).
    """

    def __init__(self, cmd: Sequence[str], config: LaunchConfig, secret: JobSecret | None = None) -> None:
        if isinstance(cmd, str) or not cmd or not all(isinstance(a, str) for a in cmd):
            raise ValueError("cmd: expected a non-empty list of strings")
        if not isinstance(config, LaunchConfig):
            raise TypeError(f"config: expected a LaunchConfig, got {type(config).__name__}")
        self.cmd = list(cmd)
        self.config = config
        if secret is not None and not isinstance(secret, JobSecret):
            raise TypeError(f"secret: expected a JobSecret or None, got {type(secret).__name__}")
        self.secret = secret or JobSecret.from_env() or JobSecret.generate()
        self.coordinator = Coordinator(config.coordinator_config(secret=self.secret))
        self._procs: list[tuple[subprocess.Popen[bytes] | ForkedPython, str]] = []
        preload = config.preload_modules()
        self._preload = preload if preload and ForkedPython.supports(self.cmd) else None
        self._reported: set[int] = set()
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the coordinator, the workers and the spares."""
        self.coordinator.start()
        for slot in range(self.config.nproc):
            self._spawn("active", slot)
        for _ in range(self.config.spares):
            self._spawn("spare", -1)

    def _spawn(self, role: str, slot: int) -> subprocess.Popen[bytes] | ForkedPython:
        env = dict(os.environ)
        env.update(self.config.env)
        env.pop(ENV_SECRET_FILE, None)
        env.update(self.secret.env())
        env.update(
            {
                ENV_ADDRESS: self.coordinator.address,
                ENV_JOB: self.coordinator.job,
                ENV_ROLE: role,
                ENV_SLOT: str(slot),
                ENV_BACKEND: self.config.backend,
            }
        )
        proc: subprocess.Popen[bytes] | ForkedPython
        with self._lock:
            log = self._log_path(role)
            if self._preload is not None:
                proc = ForkedPython(self.cmd, env, self._preload, output=log)
            elif log is not None:
                with open(log, "ab") as out:
                    proc = subprocess.Popen(self.cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
            else:
                proc = subprocess.Popen(self.cmd, env=env)
            self._procs.append((proc, role))
        logger.info("started %s pid %d%s", role, proc.pid, f" for slot {slot}" if slot >= 0 else "")
        return proc

    def _log_path(self, role: str) -> str | None:
        if self.config.log_dir is None:
            return None
        os.makedirs(self.config.log_dir, exist_ok=True)
        return os.path.join(self.config.log_dir, f"{role}-{len(self._procs)}.log")

    def add_spare(self) -> int:
        """Start one more spare while the job runs; returns its pid."""
        return self._spawn("spare", -1).pid

    def pid_of_slot(self, slot: int) -> int:
        """The pid of the process holding ``slot`` in the current epoch."""
        view = self.coordinator.view
        if view is None:
            raise RuntimeError("no epoch has formed yet")
        check_int("slot", slot, low=0, high=view.world_size - 1)
        return self.coordinator.members()[view.members[slot]].pid

    def spare_pids(self) -> list[int]:
        """The pids of the live spares."""
        members = self.coordinator.members()
        return [members[i].pid for i in self.coordinator.spares()]

    def signal_all(self, sig: int) -> None:
        """Send ``sig`` to every process still running."""
        with self._lock:
            procs = [p for p, _ in self._procs]
        for p in procs:
            if p.poll() is None:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass

    def _poll(self) -> None:
        with self._lock:
            procs = list(self._procs)
        for p, _ in procs:
            code = p.poll()
            if code is not None and p.pid not in self._reported:
                self._reported.add(p.pid)
                self.coordinator.notify_exit(p.pid, code)

    def wait(self, poll_interval: float = 0.01) -> int:
        """Supervise until the job ends; return its exit status.

        The job ends when every member of the current epoch has exited (status:
        0 if they all exited 0, else the first non-zero status), when the
        coordinator declares it failed (status 1), or at ``job_timeout`` (124).
        """
        limit = self.config.job_timeout
        deadline = None if limit is None else time.monotonic() + limit.total_seconds()
        code = 0
        try:
            while True:
                self._poll()
                if self.coordinator.failed is not None:
                    logger.error("job failed: %s", self.coordinator.failed)
                    code = 1
                    break
                done = self._members_done()
                if done is not None:
                    code = done
                    break
                if deadline is not None and time.monotonic() > deadline:
                    logger.error("job timed out")
                    code = 124
                    break
                time.sleep(poll_interval)
        finally:
            self._finish()
        return code

    def _members_done(self) -> int | None:
        view = self.coordinator.view
        if view is None:
            return None
        members = self.coordinator.members()
        if any(m not in members for m in view.members):
            return None  # a standby coordinator read the view before those registrations
        pids = {members[m].pid for m in view.members}
        with self._lock:
            procs = {p.pid: p for p, _ in self._procs}
        codes = [procs[pid].poll() if pid in procs else 0 for pid in pids]
        if any(c is None for c in codes):
            return None
        # A member that died and was not replaced yet is the coordinator's to handle.
        time.sleep(0.05)
        self._poll()
        if self.coordinator.view is not view:
            return None
        bad = [c for c in codes if c]
        return bad[0] if bad else 0

    def _finish(self, grace: float = 10.0) -> None:
        self.coordinator.shutdown()
        end = time.monotonic() + grace
        with self._lock:
            procs = [p for p, _ in self._procs]
        for p in procs:
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._poll()
        time.sleep(0.05)  # let the coordinator log the last exits
        self.coordinator.stop()


def launch(cmd: Sequence[str], config: LaunchConfig) -> int:
    """Run ``cmd`` as a fault-tolerant job (see :class:`Launcher`), forwarding SIGINT and SIGTERM.

    Returns:
        The job's exit status.
    """
    launcher = Launcher(cmd, config)
    previous: dict[int, object] = {}

    def forward(signum: int, frame: FrameType | None) -> None:
        logger.warning("forwarding signal %d to the job", signum)
        launcher.signal_all(signum)

    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[int(sig)] = signal.signal(sig, forward)
    try:
        launcher.start()
        return launcher.wait()
    finally:
        if in_main:
            for signum, handler in previous.items():
                signal.signal(signum, handler)  # type: ignore[arg-type]
        sys.stdout.flush()
