"""Failure-recovery benchmark for torchft, for side-by-side comparison with our own recovery path.

The benchmark starts a torchft lighthouse in the calling process and ``n`` replica groups as real OS processes
(multiprocessing ``spawn``, one rank per replica group, each with its own ``TCPStore``).  Every replica loops over
``manager.start_quorum()`` -> ``manager.allreduce(t).wait()`` -> ``manager.should_commit()`` and appends one JSON line
per event, stamped with ``time.time()``, to its own file.  When the replica with index ``victim`` (2 by default)
has committed ``kill_step`` steps, the parent SIGKILLs it and immediately spawns a replacement process with the same
replica index, which joins the next quorum and heals (fetches the live state from a peer over torchft's HTTP
checkpoint transport).  The phase timings are then computed from the event files, relative to the SIGKILL
(:mod:`optim.apps.benchmarks.torchft_phases`).

:func:`run_torchft_recovery_from` takes its settings as a
:class:`~optim.apps.benchmarks.torchft_config.TorchftRecoveryConfig`; :func:`run_torchft_recovery` takes them as
the benchmark's options (durations in seconds or milliseconds).  Each
replica process gets a :class:`~optim.apps.benchmarks.torchft_replica.ReplicaSettings`
(:mod:`optim.apps.benchmarks.torchft_replica`).

torchft is imported lazily inside the functions so that importing this module never requires torchft.

Example::

    python -c "from optim.apps.benchmarks.torchft_baseline import run_torchft_recovery as r; import json; \
        print(json.dumps(r(), indent=1))"
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path

from bindings.json_object import JsonObject
from optim.apps.benchmarks.torchft_config import TorchftRecoveryConfig, settings_json, whole_ms
from optim.apps.benchmarks.torchft_phases import analyse, last_committed_step, read_replica_events
from optim.apps.benchmarks.torchft_replica import POLL_S, ReplicaSettings, replica_main, write_stop_step

__all__ = ["run_torchft_recovery", "run_torchft_recovery_from"]

logger = logging.getLogger(__name__)

_STOP_MARGIN_STEPS = 10
_STOP_FILE = "stop_step"


@dataclass(frozen=True, kw_only=True)
class _Roles:
    """Who is who in a run, by process label.

    Attributes:
        labels: The ``n`` original replicas, ``replica_{index}``.
        victim: The replica that is killed.
        survivors: The others.
        replacement: The victim's replacement; None without a restart.
    """

    labels: tuple[str, ...]
    victim: str
    survivors: tuple[str, ...]
    replacement: str | None

    @classmethod
    def of(cls, config: TorchftRecoveryConfig) -> _Roles:
        """Returns the roles of ``config``'s run."""
        labels = tuple(f"replica_{i}" for i in range(config.n))
        victim = labels[config.victim]
        return cls(
            labels=labels,
            victim=victim,
            survivors=tuple(lb for lb in labels if lb != victim),
            replacement=f"{victim}_replacement" if config.restart else None,
        )


def _replica_settings(
    config: TorchftRecoveryConfig, *, index: int, events: Path, workdir: Path, lighthouse_addr: str, deadline: float
) -> ReplicaSettings:
    """Returns what the replica process with ``index`` gets.

    Args:
        config: The run's settings.
        index: The replica-group index.
        events: The process's event file.
        workdir: The run's directory, with the stop file.
        lighthouse_addr: The lighthouse's address.
        deadline: Absolute ``time.time()`` at which the run ends.

    Returns:
        Its settings, without a go file.
    """
    return ReplicaSettings(
        index=index,
        events=events,
        stop_file=workdir / _STOP_FILE,
        steps=config.steps,
        numel=config.numel,
        lighthouse_addr=lighthouse_addr,
        min_replica_size=config.quorum_min,
        manager_timeout=config.manager_timeout,
        quorum_timeout=config.quorum_timeout,
        connect_timeout=config.connect_timeout,
        pg_timeout=config.pg_timeout,
        heartbeat_interval=config.heartbeat_interval,
        step_sleep=config.step_sleep,
        deadline=deadline,
        rust_log=config.rust_log,
    )


class _Replicas:
    """The replica processes of one run and their event files, by label."""

    def __init__(self, config: TorchftRecoveryConfig, workdir: Path, lighthouse_addr: str, deadline: float) -> None:
        """Prepares the run's directory; no process starts yet.

        Args:
            config: The run's settings.
            workdir: The run's directory: event files, stop file and go file.
            lighthouse_addr: The lighthouse's address.
            deadline: Absolute ``time.time()`` at which the run ends.
        """
        self._config = config
        self._workdir = workdir
        self._lighthouse_addr = lighthouse_addr
        self.deadline = deadline
        self.stop_file = workdir / _STOP_FILE
        self.go_file = workdir / "go"
        self.procs: dict[str, BaseProcess] = {}
        self.files: dict[str, Path] = {}
        self._ctx = mp.get_context("spawn")
        write_stop_step(self.stop_file, config.steps)

    def spawn(self, label: str, index: int, *, prewarmed: bool = False) -> None:
        """Starts the process ``label`` as replica group ``index``.

        Args:
            label: Process label; its events go to ``<label>.jsonl``.
            index: Replica-group index.
            prewarmed: The process waits for the go file after its imports (a warm spare).
        """
        self.files[label] = self._workdir / f"{label}.jsonl"
        settings = _replica_settings(
            self._config,
            index=index,
            events=self.files[label],
            workdir=self._workdir,
            lighthouse_addr=self._lighthouse_addr,
            deadline=self.deadline,
        )
        if prewarmed:
            settings = replace(settings, go_file=self.go_file)
        proc = self._ctx.Process(target=replica_main, args=(settings,), name=f"torchft-{label}", daemon=True)
        proc.start()
        self.procs[label] = proc

    def sigkill(self, label: str) -> None:
        """Kills process ``label`` with SIGKILL.

        Raises:
            RuntimeError: It was never started.
        """
        pid = self.procs[label].pid
        if pid is None:
            raise RuntimeError(f"{label} was never started")
        os.kill(pid, signal.SIGKILL)

    def events(self, label: str) -> list[JsonObject]:
        """Returns the events process ``label`` has written so far."""
        return read_replica_events(self.files[label])

    def any_alive(self, *, besides: str) -> bool:
        """Whether a process other than ``besides`` is still running."""
        return any(p.is_alive() for lb, p in self.procs.items() if lb != besides)

    def join(self) -> None:
        """Waits for every process to end, up to 5 s each and not past the deadline."""
        for proc in self.procs.values():
            proc.join(timeout=max(0.0, min(5.0, self.deadline - time.time())))

    def kill_leftovers(self) -> None:
        """Kills the processes still running (a warning each)."""
        for label, proc in self.procs.items():
            if proc.is_alive():
                logger.warning("killing %s (pid %s) still alive at the end", label, proc.pid)
                proc.kill()
                proc.join(timeout=5.0)

    def exitcodes(self) -> dict[str, int | None]:
        """Returns each process's exit code (negative: killed by that signal; None: still running)."""
        return {label: proc.exitcode for label, proc in self.procs.items()}


@dataclass(frozen=True, kw_only=True)
class _Kill:
    """The SIGKILL of the victim.

    Attributes:
        t_kill: ``time.time()`` right after ``os.kill``.
        last_quorum_participants: Size of the victim's last quorum before the kill (None: it had none).
        last_event_before_kill: Kind of the victim's last event before the kill.
        kill_at_step: The victim's last committed step, read after the kill.
    """

    t_kill: float
    last_quorum_participants: int | None
    last_event_before_kill: str
    kill_at_step: int

    def to_json(self) -> JsonObject:
        """Returns the kill's entries of the benchmark's result."""
        return {
            "victim_last_quorum_participants": self.last_quorum_participants,
            "victim_last_event_before_kill": self.last_event_before_kill,
            "kill_at_step": self.kill_at_step,
        }


def _ready_to_kill(events: Sequence[JsonObject], kill_step: int, kill_phase: str) -> bool:
    """Whether the victim has reached the point where it is to be killed.

    Args:
        events: The victim's events so far.
        kill_step: The step it must have committed.
        kill_phase: ``"compute"``: also, its last event is a finished quorum; ``"quorum"``: the commit is enough.

    Returns:
        True when it is to be killed now.
    """
    if last_committed_step(events) < kill_step:
        return False
    return kill_phase != "compute" or events[-1]["kind"] == "quorum_done"


def _kill_victim(config: TorchftRecoveryConfig, replicas: _Replicas, victim: str) -> _Kill:
    """Waits until the victim reaches the kill point (:func:`_ready_to_kill`), then SIGKILLs it.

    Args:
        config: The run's settings.
        replicas: The running processes.
        victim: The victim's label.

    Returns:
        When it was killed and where it was.

    Raises:
        RuntimeError: The victim recorded a fatal error first.
        TimeoutError: It did not get there before the deadline.
    """
    while time.time() < replicas.deadline:
        ev = replicas.events(victim)
        if any(e["kind"] == "fatal" for e in ev):
            raise RuntimeError(f"{victim} failed before the kill: {ev[-1]}")
        if _ready_to_kill(ev, config.kill_step, config.kill_phase):
            quorums = [e for e in ev if e["kind"] == "quorum_done"]
            participants = quorums[-1]["participants"] if quorums else None
            replicas.sigkill(victim)
            t_kill = time.time()
            return _Kill(
                t_kill=t_kill,
                last_quorum_participants=participants,
                last_event_before_kill=ev[-1]["kind"],
                kill_at_step=last_committed_step(replicas.events(victim)),
            )
        time.sleep(POLL_S)
    raise TimeoutError(f"victim did not reach step {config.kill_step} before the deadline")


def _start_replacement(config: TorchftRecoveryConfig, replicas: _Replicas, roles: _Roles) -> float | None:
    """Starts the victim's replacement: releases the warm spare, or spawns it cold.

    Args:
        config: The run's settings.
        replicas: The running processes.
        roles: Who is who.

    Returns:
        ``time.time()`` right before the start; None without a replacement.
    """
    if roles.replacement is None:
        return None
    t_spawn = time.time()
    if config.prewarm:
        replicas.go_file.touch()
    else:
        replicas.spawn(roles.replacement, config.victim)
    return t_spawn


def _moved_stop_step(stop: int, survivor_steps: Sequence[int], replacement_committed: bool) -> int:
    """Returns the stop step, moved forward while the replacement has not committed and the survivors near it.

    Args:
        stop: The current stop step.
        survivor_steps: Each survivor's last committed step.
        replacement_committed: Whether the replacement has committed a step (or there is none).

    Returns:
        ``stop``, or ``2 * _STOP_MARGIN_STEPS`` past the furthest survivor once it is within
        ``_STOP_MARGIN_STEPS`` of ``stop``.
    """
    furthest = max(survivor_steps)
    if not replacement_committed and furthest >= stop - _STOP_MARGIN_STEPS:
        return furthest + 2 * _STOP_MARGIN_STEPS
    return stop


def _await_replacement(config: TorchftRecoveryConfig, replicas: _Replicas, roles: _Roles) -> int:
    """Keeps the survivors running until the replacement has committed, then lets every process finish.

    Args:
        config: The run's settings.
        replicas: The running processes.
        roles: Who is who.

    Returns:
        The final stop step.
    """
    stop = config.steps
    while time.time() < replicas.deadline:
        survivor_steps = [last_committed_step(replicas.events(s)) for s in roles.survivors]
        committed = roles.replacement is None or any(
            e["kind"] == "commit" and e["committed"] for e in replicas.events(roles.replacement)
        )
        moved = _moved_stop_step(stop, survivor_steps, committed)
        if moved != stop:
            stop = moved
            write_stop_step(replicas.stop_file, stop)
        if not replicas.any_alive(besides=roles.victim):
            break
        time.sleep(POLL_S)
    return stop


def _outcome(
    config: TorchftRecoveryConfig, replicas: _Replicas, roles: _Roles, kill: _Kill | None, t_spawn: float | None
) -> JsonObject:
    """Reads the event files once the processes have ended: phase timings, checksums and fatal errors.

    Args:
        config: The run's settings.
        replicas: The ended processes.
        roles: Who is who.
        kill: The victim's kill; None when it never happened (no phases then).
        t_spawn: ``time.time()`` right before the replacement was started, if it was.

    Returns:
        The phases (:func:`~optim.apps.benchmarks.torchft_phases.analyse`), ``final_checksums`` and ``fatal_events``.
    """
    out: JsonObject = {}
    if kill is not None:
        survivors = list(roles.survivors)
        out.update(
            analyse(replicas.files, survivors, roles.replacement, kill.t_kill, t_spawn, config.n, kill.kill_at_step)
        )
    events = {label: read_replica_events(path) for label, path in replicas.files.items()}
    out["final_checksums"] = {
        label: next((e["checksum"] for e in ev if e["kind"] == "done"), None) for label, ev in events.items()
    }
    out["fatal_events"] = [{"replica": label, **e} for label, ev in events.items() for e in ev if e["kind"] == "fatal"]
    return out


def _copy_events(files: Iterable[Path], events_dir: str) -> None:
    """Copies the event files that exist into ``events_dir`` (created if needed)."""
    Path(events_dir).mkdir(parents=True, exist_ok=True)
    for path in files:
        if path.exists():
            shutil.copy2(path, Path(events_dir) / path.name)


def _torchft_version() -> str | None:
    """Imports torchft and returns its version (None when it has none)."""
    import torchft

    return getattr(torchft, "__version__", None) or _dist_version("torchft")


def run_torchft_recovery_from(config: TorchftRecoveryConfig) -> JsonObject:
    """Kills one torchft replica group mid-training and measures how the rest and a replacement recover.

    Args:
        config: The run's settings.

    Returns:
        The settings used, the kill/restart timestamps and phase timings in seconds relative to the SIGKILL; on a
        failure before the kill, ``error`` and no phases.
    """
    os.environ.setdefault("RUST_LOG", config.rust_log)
    version = _torchft_version()
    from torchft.coordination import LighthouseServer

    t_start = time.time()
    settings = settings_json(config, torchft_version=version, rust_log=os.environ.get("RUST_LOG"))
    workdir = Path(tempfile.mkdtemp(prefix="torchft_bench_"))
    lighthouse = LighthouseServer(
        bind="[::]:0",
        min_replicas=config.quorum_min,
        join_timeout_ms=whole_ms(config.join_timeout),
        quorum_tick_ms=whole_ms(config.quorum_tick),
        heartbeat_timeout_ms=whole_ms(config.heartbeat_timeout),
    )
    replicas = _Replicas(config, workdir, lighthouse.address(), t_start + config.timeout.total_seconds())
    result: JsonObject = {"settings": settings, "lighthouse_addr": lighthouse.address()}
    roles = _Roles.of(config)
    kill: _Kill | None = None
    t_spawn: float | None = None
    try:
        for i, label in enumerate(roles.labels):
            replicas.spawn(label, i)
        if roles.replacement is not None and config.prewarm:
            replicas.spawn(roles.replacement, config.victim, prewarmed=True)
        kill = _kill_victim(config, replicas, roles.victim)
        result.update(kill.to_json())
        t_spawn = _start_replacement(config, replicas, roles)
        result["final_stop_step"] = _await_replacement(config, replicas, roles)
        replicas.join()
    except (RuntimeError, TimeoutError) as exc:
        logger.error("torchft recovery benchmark aborted: %s", exc)
        result["error"] = repr(exc)
    finally:
        replicas.kill_leftovers()
        with contextlib.suppress(Exception):
            lighthouse.shutdown()
        result["exitcodes"] = replicas.exitcodes()
        result["wall_s"] = round(time.time() - t_start, 3)
        result.update(_outcome(config, replicas, roles, kill, t_spawn))
        if config.events_dir is not None:
            _copy_events(replicas.files.values(), config.events_dir)
            result["events_dir"] = config.events_dir
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def run_torchft_recovery(
    n: int = 4,
    kill_step: int = 20,
    steps: int = 40,
    numel: int = 1 << 16,
    timeout_s: float = 120.0,
    *,
    victim: int = 2,
    restart: bool = True,
    prewarm: bool = False,
    kill_phase: str = "compute",
    step_sleep_s: float = 0.05,
    heartbeat_timeout_ms: int = 1000,
    join_timeout_ms: int = 1000,
    quorum_tick_ms: int = 50,
    heartbeat_interval_ms: int = 100,
    manager_timeout_s: float = 5.0,
    quorum_timeout_s: float = 30.0,
    connect_timeout_s: float = 5.0,
    pg_timeout_s: float = 5.0,
    rust_log: str = "warn",
    min_replicas: int | None = None,
    events_dir: str | None = None,
) -> JsonObject:
    """:func:`run_torchft_recovery_from` with the benchmark's options, durations in seconds or milliseconds.

    Args:
        n, kill_step, steps, numel, victim, restart, prewarm, kill_phase, rust_log, min_replicas, events_dir: The
            :class:`TorchftRecoveryConfig` attributes of the same name.
        timeout_s, step_sleep_s, manager_timeout_s, quorum_timeout_s, connect_timeout_s, pg_timeout_s: Its
            ``timeout``, ``step_sleep``, ``manager_timeout``, ... in seconds.
        heartbeat_timeout_ms, join_timeout_ms, quorum_tick_ms, heartbeat_interval_ms: Its ``heartbeat_timeout``,
            ``join_timeout``, ``quorum_tick`` and ``heartbeat_interval`` in milliseconds.

    Returns:
        The run's result (:func:`run_torchft_recovery_from`).

    Raises:
        ValueError: On inconsistent arguments.
    """
    config = TorchftRecoveryConfig(
        n=n,
        kill_step=kill_step,
        steps=steps,
        numel=numel,
        timeout=timedelta(seconds=timeout_s),
        victim=victim,
        restart=restart,
        prewarm=prewarm,
        kill_phase=kill_phase,
        step_sleep=timedelta(seconds=step_sleep_s),
        heartbeat_timeout=timedelta(milliseconds=heartbeat_timeout_ms),
        join_timeout=timedelta(milliseconds=join_timeout_ms),
        quorum_tick=timedelta(milliseconds=quorum_tick_ms),
        heartbeat_interval=timedelta(milliseconds=heartbeat_interval_ms),
        manager_timeout=timedelta(seconds=manager_timeout_s),
        quorum_timeout=timedelta(seconds=quorum_timeout_s),
        connect_timeout=timedelta(seconds=connect_timeout_s),
        pg_timeout=timedelta(seconds=pg_timeout_s),
        rust_log=rust_log,
        min_replicas=min_replicas,
        events_dir=events_dir,
    )
    return run_torchft_recovery_from(config)


def _dist_version(name: str) -> str | None:
    """Returns the installed distribution version of ``name`` or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None
