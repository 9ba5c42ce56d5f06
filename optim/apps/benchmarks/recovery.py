"""Recovery benchmark: how fast a fault-aware job gets back to committed steps after a failure.

Each scenario runs :mod:`optim.testing.drill` (an all_reduce loop with a
commit vote) under :class:`resilient_comm.launcher.Launcher` with ``nproc``
workers and ``spares`` spares on local gloo ranks, waits until step
``fault_step`` is committed, then SIGKILLs (or SIGSTOPs) the worker in slot 1
from outside and measures, from the signal:

* ``raised_s``: until every survivor's collective raised (``raised_first_s``:
  the first one, a direct ring neighbour);
* ``detected_s``: until the coordinator declared the failure (process exit,
  or for SIGSTOP the heartbeat timeout);
* ``configured_s``: until every member built the new epoch's transport;
* ``first_commit_s``: until every member of the new epoch committed its first step.

Two more faults run over :mod:`optim.testing.hosts` (``sparsecomm
coordinator`` in a process of its own): ``partition`` takes the link of slot
1's host down (network namespaces; needs root), the same phases measured from
the cut; ``coordinator`` SIGKILLs the coordinator (the embedded store has no
standby) and measures ``ended_s``, until every worker gave up with a clear
error. ``failover`` keeps the job in a 3-member etcd cluster
(:mod:`optim.testing.etcd_cluster`) with two coordinators, a standalone
active one and the launcher's standby, SIGKILLs the active one and measures
``failover_s`` (until the standby took over) and ``first_commit_s`` (until
every worker committed a step after the kill: training does not wait for a
coordinator), and counts the steps committed meanwhile.

Times come from ``time.time()`` in the processes (one machine, one clock). Each
scenario is repeated and the median reported. Nothing prints here; the CLI does.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

from bindings.json_object import JsonObject
from bindings.validate import check_int
from optim.apps.paths import pythonpath_env
from optim.testing.drill import command as drill_command
from optim.testing.etcd_cluster import EtcdCluster, etcd_unavailable
from optim.testing.hosts import DEFAULT_PORT, Hosts, HostsJob, Loopback, unavailable
from resilient_comm.auth import JobSecret
from resilient_comm.events import read_event_dir, read_events
from resilient_comm.launcher import LaunchConfig, Launcher

__all__ = ["RecoveryBenchConfig", "run_recovery_scenario", "run_recovery_bench", "PHASES"]

logger = logging.getLogger(__name__)

#: Measured phases, in order.
PHASES = ("raised_first_s", "raised_s", "detected_s", "configured_s", "first_commit_s", "ended_s", "failover_s")
_FAULTS = {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP}
#: Every fault the benchmark injects.
FAULTS = (*_FAULTS, "partition", "coordinator", "failover")


@dataclass(frozen=True, kw_only=True)
class RecoveryBenchConfig:
    """What to measure.

    Attributes:
        nprocs: Worker counts to run.
        spares: Spares per job (``>= 1``: hot-swap; 0: shrink).
        faults: Any of :data:`FAULTS`.
        repeats: Runs per (nproc, fault); the median is reported.
        numel: float32 elements per all_reduce.
        sleep_s: Seconds of "compute" per step.
        fault_step: The fault comes once this step is committed.
        steps_after: Committed steps to run after the fault.
        heartbeat_timeout_s: Silence after which a process counts as hung.
        timeout_s: Deadline of one scenario.
    """

    nprocs: tuple[int, ...] = (4, 8)
    spares: int = 1
    faults: tuple[str, ...] = ("sigkill", "sigstop")
    repeats: int = 3
    numel: int = 1 << 16
    sleep_s: float = 0.02
    fault_step: int = 10
    steps_after: int = 10
    heartbeat_timeout_s: float = 1.0
    timeout_s: float = 180.0

    def __post_init__(self) -> None:
        if not self.nprocs:
            raise ValueError(f"nprocs: give at least one world size, got {self.nprocs!r}")
        for n in self.nprocs:
            check_int("nprocs entry", n, low=2)
        if not self.faults or any(f not in FAULTS for f in self.faults):
            raise ValueError(f"faults: choose from {list(FAULTS)}, got {self.faults!r}")
        for name in ("spares", "numel", "fault_step", "steps_after", "repeats"):
            check_int(name, getattr(self, name), low=0 if name in ("spares", "fault_step") else 1)
        for name in ("sleep_s", "heartbeat_timeout_s", "timeout_s"):
            if getattr(self, name) < 0 or (name != "sleep_s" and getattr(self, name) == 0):
                raise ValueError(f"{name}: bad value {getattr(self, name)!r}")


def _read_logs(directory: Path) -> dict[int, list[JsonObject]]:
    """The drill processes' event files, by pid."""
    return {int(path.stem): recs for path, recs in read_event_dir(directory).items()}


def _committed(logs: dict[int, list[JsonObject]], pid: int) -> int:
    return max((r["step"] for r in logs.get(pid, []) if r["event"] == "committed"), default=-1)


def run_recovery_scenario(
    nproc: int, fault: str, config: RecoveryBenchConfig, *, workdir: str | Path | None = None
) -> JsonObject:
    """Run one job, inject one fault, return the phase times (seconds from the signal)."""
    if fault not in FAULTS:
        raise ValueError(f"fault: choose from {list(FAULTS)}, got {fault!r}")
    root = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="sparsecomm-recovery-"))
    if fault == "failover":
        return _failover_scenario(nproc, config, root) | {"nproc": nproc, "fault": fault, "spares": config.spares}
    if fault not in _FAULTS:
        return _hosts_scenario(nproc, fault, config, root) | {"nproc": nproc, "fault": fault, "spares": config.spares}
    logdir = root / f"n{nproc}-{fault}-{time.monotonic_ns()}"
    logdir.mkdir(parents=True)
    steps = config.fault_step + config.steps_after + 1
    cmd, env = _drill(config, logdir, steps)
    launcher = Launcher(
        cmd,
        LaunchConfig(
            nproc=nproc,
            spares=config.spares,
            mode="hotswap" if config.spares else "shrink",
            heartbeat_timeout=timedelta(seconds=config.heartbeat_timeout_s),
            job_timeout=timedelta(seconds=config.timeout_s),
            events=str(root / f"{logdir.name}.events.jsonl"),
            env=env,
        ),
    )
    status: list[int] = []
    deadline = time.monotonic() + config.timeout_s
    victim = -1
    launcher.start()
    waiter = threading.Thread(target=lambda: status.append(launcher.wait()), daemon=True)
    waiter.start()
    try:
        _until(lambda: launcher.coordinator.view is not None, deadline, "the first epoch", launcher)
        slot0 = launcher.pid_of_slot(0)
        _until(lambda: _committed(_read_logs(logdir), slot0) >= config.fault_step, deadline, "the fault step", launcher)
        victim = launcher.pid_of_slot(1)
        t_fault = time.time()
        os.kill(victim, _FAULTS[fault])
        _until(lambda: _new_epoch_configured(launcher), deadline, "the new epoch", launcher)
        if fault == "sigstop":
            os.kill(victim, signal.SIGKILL)  # measured; let the job end without the grace period
        waiter.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        if victim > 0:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if waiter.is_alive():
            launcher.signal_all(signal.SIGKILL)
            waiter.join(timeout=30)
    if not status or status[0] != 0:
        raise RuntimeError(f"recovery scenario n={nproc} {fault}: job exited with {status or 'nothing'} ({logdir})")
    return _phases(_read_logs(logdir), launcher.coordinator.log.events, victim, t_fault) | {
        "nproc": nproc,
        "fault": fault,
        "spares": config.spares,
    }


def _drill(config: RecoveryBenchConfig, logdir: Path, steps: int) -> tuple[list[str], dict[str, str]]:
    """The drill worker's command line and environment."""
    return drill_command(steps=steps, numel=config.numel, sleep=config.sleep_s, log=logdir), pythonpath_env()


def _failover_scenario(nproc: int, config: RecoveryBenchConfig, root: Path) -> JsonObject:
    """The active coordinator SIGKILLed, the job kept in etcd; the launcher's coordinator stands by."""
    if (why := etcd_unavailable()) is not None:
        raise RuntimeError(f"recovery scenario failover: {why}")
    logdir = root / f"n{nproc}-failover-{time.monotonic_ns()}"
    logdir.mkdir(parents=True)
    # the job must outlast the lease (training does not stop while no coordinator is active)
    cmd, env = _drill(config, logdir, config.fault_step + config.steps_after + 61)
    secret, job, hb = JobSecret.generate(), f"failover{time.monotonic_ns() % 10**9}", config.heartbeat_timeout_s
    mode, deadline = "hotswap" if config.spares else "shrink", time.monotonic() + config.timeout_s
    with EtcdCluster(3, root) as cluster:
        events = root / f"{logdir.name}.active.jsonl"
        argv = [sys.executable, "-m", "optim", "coordinator", "--store", cluster.address, "--job", job, "--mode", mode]
        argv += ["--world-size", str(nproc), "--heartbeat-timeout", str(hb), "--events", str(events)]
        active = subprocess.Popen(argv, env={**os.environ, **env, **secret.env()}, stdout=subprocess.DEVNULL)
        launcher = Launcher(
            cmd,
            LaunchConfig(
                nproc=nproc,
                spares=config.spares,
                mode=mode,
                heartbeat_timeout=timedelta(seconds=hb),
                job_timeout=timedelta(seconds=config.timeout_s),
                events=str(root / f"{logdir.name}.events.jsonl"),
                env=env,
                store=cluster.address,
                job=job,
            ),
            secret=secret,
        )
        status: list[int] = []
        waiter = threading.Thread(target=lambda: status.append(launcher.wait()), daemon=True)
        try:
            while not any(e["event"] == "coordinator_elected" for e in read_events(events, missing_ok=True)):
                if time.monotonic() > deadline or active.poll() is not None:
                    raise RuntimeError(
                        f"recovery scenario failover: the first coordinator never became active ({root})"
                    )
                time.sleep(0.05)
            launcher.start()
            waiter.start()
            _until(lambda: launcher.coordinator.view is not None, deadline, "the first epoch", launcher)
            slot0 = launcher.pid_of_slot(0)
            _until(
                lambda: _committed(_read_logs(logdir), slot0) >= config.fault_step, deadline, "the fault step", launcher
            )
            t_fault = time.time()
            active.send_signal(signal.SIGKILL)
            active.wait()
            waiter.join(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            if active.poll() is None:
                active.kill()
                active.wait()
            if waiter.is_alive():
                launcher.signal_all(signal.SIGKILL)
                waiter.join(timeout=30)
    if not status or status[0] != 0:
        raise RuntimeError(f"recovery scenario failover n={nproc}: job exited with {status or 'nothing'} ({logdir})")
    took = [e for e in launcher.coordinator.log.events if e["event"] == "coordinator_elected" and e.get("resumed")]
    if not took:
        raise RuntimeError(f"recovery scenario failover n={nproc}: the standby never took over ({logdir})")
    logs = _read_logs(logdir)
    after = [[r["time"] for r in recs if r["event"] == "committed" and r["time"] >= t_fault] for recs in logs.values()]
    firsts = [min(times) for times in after if times]
    if len(firsts) < nproc:
        raise RuntimeError(
            f"recovery scenario failover n={nproc}: a worker committed nothing after the kill ({logdir})"
        )
    meanwhile = [
        r["step"] for r in logs[slot0] if r["event"] == "committed" and t_fault <= r["time"] <= took[0]["time"]
    ]
    return {
        "survivors": nproc,
        "failover_s": took[0]["time"] - t_fault,
        "first_commit_s": max(firsts) - t_fault,
        "steps_during_failover": len(meanwhile),
    }


def _hosts_scenario(nproc: int, fault: str, config: RecoveryBenchConfig, root: Path) -> JsonObject:
    """A job over :class:`~optim.testing.hosts.Hosts` (``partition``) or the loopback (``coordinator``)."""
    if fault == "partition" and (why := unavailable()) is not None:
        raise RuntimeError(f"recovery scenario partition: no network namespaces here ({why})")
    steps = config.fault_step + config.steps_after + 1
    with Hosts(1 + nproc + config.spares) if fault == "partition" else Loopback() as hosts:
        job = HostsJob(
            hosts,
            root / f"n{nproc}-{fault}-{time.monotonic_ns()}",
            workers=nproc,
            spares=config.spares,
            steps=steps if fault == "partition" else 100 * steps,
            numel=config.numel,
            sleep=config.sleep_s,
            hb=config.heartbeat_timeout_s,
            mode="hotswap" if config.spares else "shrink",
            port=_free_port() if fault == "coordinator" else DEFAULT_PORT,
        )
        limit = config.timeout_s
        try:
            job.wait_event("epoch_configured", limit, epoch=0)
            job.wait_progress(job.workers[0].pid, config.fault_step, limit)
            victim = job.workers[1].pid
            t_fault = time.time()
            if fault == "coordinator":
                job.coordinator.send_signal(signal.SIGKILL)
                for w in job.workers:
                    w.wait(timeout=limit)
                ends = [r["time"] for w in job.workers for r in job.log(w.pid) if r["event"] == "error"]
                if len(ends) < nproc:
                    raise RuntimeError(f"recovery scenario coordinator: a worker ended without an error ({job.tmp})")
                return {"survivors": nproc, "ended_s": max(ends) - t_fault}
            assert isinstance(hosts, Hosts)
            hosts.cut(2)  # slot 1's host
            job.wait_event("epoch_configured", limit, epoch=1)
            os.kill(victim, signal.SIGKILL)  # measured: let the job end without waiting for its deadlines
            for p in [*job.workers, *job.spares]:
                if p.pid != victim and p.wait(timeout=limit) != 0:
                    raise RuntimeError(f"recovery scenario partition: pid {p.pid} exited {p.returncode} ({job.tmp})")
        except (TimeoutError, subprocess.TimeoutExpired) as exc:
            raise TimeoutError(f"recovery scenario {fault}: {exc}\n{job.describe()}") from None
        logs = {int(path.stem): recs for path, recs in read_event_dir(job.log_dir).items()}
        return _phases(logs, read_events(job.events_path), victim, t_fault)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _until(cond: Callable[[], bool], deadline: float, what: str, launcher: Launcher) -> None:
    while not cond():
        if launcher.coordinator.failed is not None:
            raise RuntimeError(f"recovery scenario: the job failed: {launcher.coordinator.failed}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"recovery scenario: timed out waiting for {what}")
        time.sleep(0.01)


def _new_epoch_configured(launcher: Launcher) -> bool:
    return any(e["event"] == "epoch_configured" and (e["epoch"] or 0) >= 1 for e in launcher.coordinator.log.events)


def _phases(logs: dict[int, list[JsonObject]], events: list[JsonObject], victim: int, t_fault: float) -> JsonObject:
    raised = [
        min(r["time"] for r in recs if r["event"] == "raised" and r["time"] >= t_fault)
        for pid, recs in logs.items()
        if pid != victim and any(r["event"] == "raised" and r["time"] >= t_fault for r in recs)
    ]
    survivors = [pid for pid, recs in logs.items() if pid != victim and any(r["event"] == "joined" for r in recs)]
    detected = min(e["time"] for e in events if e["event"] == "failure_detected" and e["pid"] == victim)
    # an overloaded machine can lose a member before the fault (a heartbeat silent past its timeout while
    # every process starts): the phases belong to the first epoch formed after the fault
    before = max(e["epoch"] for e in events if e["event"] == "epoch_proposed" and e["time"] < t_fault)
    configured = min(e["time"] for e in events if e["event"] == "epoch_configured" and (e["epoch"] or 0) > before)
    members = [pid for pid, recs in logs.items() if pid != victim and any(r["event"] == "done" for r in recs)]

    def after(r: JsonObject) -> bool:
        return r["event"] == "committed" and r["epoch"] > before and r["time"] >= t_fault

    first_commit = [min(r["time"] for r in logs[p] if after(r)) for p in members if any(after(r) for r in logs[p])]
    promoted = any(r["event"] == "promoted" and r["time"] >= t_fault for recs in logs.values() for r in recs)
    return {
        "survivors": len(survivors),
        "survivors_raised": len(raised),
        "raised_first_s": min(raised) - t_fault if raised else None,
        "raised_s": max(raised) - t_fault if len(raised) == len(survivors) else None,
        "detected_s": detected - t_fault,
        "configured_s": configured - t_fault,
        "first_commit_s": max(first_commit) - t_fault if first_commit else None,
        "hot_swap": promoted,
        "epochs_before_fault": before,
    }


def run_recovery_bench(
    config: RecoveryBenchConfig,
    *,
    torchft: bool = False,
    on_run: Callable[[JsonObject], None] | None = None,
) -> JsonObject:
    """Every (nproc, fault) scenario ``repeats`` times; medians per phase (plus torchft's where asked)."""
    rows = []
    for nproc in config.nprocs:
        for fault in config.faults:
            runs = []
            for _ in range(config.repeats):
                run = run_recovery_scenario(nproc, fault, config)
                runs.append(run)
                if on_run is not None:
                    on_run(run)
            rows.append({"system": "sparsecomm", "nproc": nproc, "fault": fault, "runs": runs, **_medians(runs)})
    if torchft:
        rows.extend(_torchft_rows(config, on_run))
    return {"config": asdict(config), "rows": rows}


def _medians(runs: list[JsonObject]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for phase in PHASES:
        values = [r[phase] for r in runs if r.get(phase) is not None]
        out[phase] = statistics.median(values) if values else None
    return out


def _torchft_rows(config: RecoveryBenchConfig, on_run: Callable[[JsonObject], None] | None) -> list[JsonObject]:
    try:
        from optim.apps.benchmarks.torchft_baseline import run_torchft_recovery
    except ImportError as exc:  # pragma: no cover - optional
        logger.warning("torchft comparison skipped: %s", exc)
        return []
    rows = []
    for nproc in config.nprocs:
        runs = []
        for _ in range(config.repeats):
            try:
                raw = run_torchft_recovery(
                    n=nproc,
                    kill_step=config.fault_step,
                    steps=config.fault_step + config.steps_after + 1,
                    numel=config.numel,
                    prewarm=config.spares > 0,  # like our spares: a process already started, waiting
                    restart=config.spares > 0,
                    step_sleep_s=config.sleep_s,
                    heartbeat_timeout_ms=int(config.heartbeat_timeout_s * 1000),
                )
            except Exception as exc:  # noqa: BLE001 - a baseline that fails is reported, not fatal
                logger.warning("torchft run failed: %s", exc)
                continue
            run = {"nproc": nproc, "fault": "sigkill", **torchft_phases(raw), "raw": raw}
            runs.append(run)
            if on_run is not None:
                on_run({"system": "torchft", **run})
        rows.append({"system": "torchft", "nproc": nproc, "fault": "sigkill", "runs": runs, **_medians(runs)})
    return rows


def torchft_phases(raw: JsonObject) -> dict[str, float | None]:
    """Map a torchft run onto :data:`PHASES` (torchft has no separate detection event)."""
    err = raw.get("every_survivor_error_seen_s") or {}
    quorum = raw.get("every_survivor_new_quorum_s") or {}
    commit = raw.get("every_survivor_first_commit_after_kill_s") or {}
    rep = raw.get("replacement") or {}
    commits = [c for c in (commit.get("max"), rep.get("first_commit_s")) if c is not None]
    return {
        "raised_first_s": err.get("min"),
        "raised_s": err.get("max"),
        "detected_s": None,
        "configured_s": quorum.get("max"),
        "first_commit_s": max(commits) if commits and commit.get("max") is not None else None,
    }
