"""Failure-recovery benchmark for torchft, for side-by-side comparison with our own recovery path.

The benchmark starts a torchft lighthouse in the calling process and ``n`` replica groups as real OS processes
(multiprocessing ``spawn``, one rank per replica group, each with its own ``TCPStore``).  Every replica loops over
``manager.start_quorum()`` -> ``manager.allreduce(t).wait()`` -> ``manager.should_commit()`` and appends one JSON line
per event, stamped with ``time.time()``, to its own file.  When the replica with index ``victim`` (2 by default)
has committed ``kill_step`` steps, the parent SIGKILLs it and immediately spawns a replacement process with the same
replica index, which joins the next quorum and heals (fetches the live state from a peer over torchft's HTTP
checkpoint transport).  The phase timings are then computed from the event files, relative to the SIGKILL
(:mod:`optim.apps.benchmarks.torchft_phases`).

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
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optim.apps.benchmarks.torchft_phases import analyse, last_committed_step, read_replica_events
from resilient_comm.events import EventWriter

if TYPE_CHECKING:
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager

logger = logging.getLogger(__name__)

_POLL_S = 0.005
_STOP_MARGIN_STEPS = 10


def _emit(events: EventWriter, kind: str, **fields: Any) -> None:
    """Appends one timestamped event to this replica's event file.

    Args:
        events: Event file of this replica process.
        kind: Event name.
        **fields: Extra JSON-serialisable fields.
    """
    events.write({"t": time.time(), "kind": kind, **fields})


def _read_stop_step(path: Path, default: int) -> int:
    """Reads the step at which replicas stop; the parent may move it forward while a replacement catches up.

    Args:
        path: File holding the stop step as decimal text.
        default: Value used when the file is missing or unreadable.

    Returns:
        The stop step.
    """
    try:
        return int(path.read_text(encoding="utf-8").strip())
    except (OSError, ValueError):
        return default


def _write_stop_step(path: Path, step: int) -> None:
    """Atomically writes the stop step.

    Args:
        path: File holding the stop step.
        step: New stop step.
    """
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_text(str(step), encoding="utf-8")
    os.replace(tmp, path)


@dataclass(frozen=True, kw_only=True)
class ReplicaSettings:
    """What one replica-group process gets from the parent; pickled across the ``spawn`` boundary.

    Attributes:
        index: Replica-group index; its replica id is ``replica_{index}``.
        events: This process's JSON-lines event file.
        stop_file: File holding the step at which the replicas stop (the parent moves it forward).
        steps: Stop step while ``stop_file`` is missing or unreadable.
        numel: Float32 elements allreduced per step.
        lighthouse_addr: Address of the torchft lighthouse.
        min_replica_size: Manager ``min_replica_size``.
        manager_timeout: Manager ``timeout``.
        quorum_timeout: Manager ``quorum_timeout``.
        connect_timeout: Manager ``connect_timeout``.
        pg_timeout: ``ProcessGroupGloo(timeout=...)``, the collective timeout.
        heartbeat_interval: Manager heartbeat period to the lighthouse.
        step_sleep: Sleep between quorum and allreduce that stands in for compute.
        deadline: Absolute ``time.time()`` after which the process stops.
        rust_log: ``RUST_LOG`` of the process unless already set.
        go_file: A pre-warmed spare waits, imports done, until this file exists; None: no waiting.
    """

    index: int
    events: Path
    stop_file: Path
    steps: int
    numel: int
    lighthouse_addr: str
    min_replica_size: int
    manager_timeout: timedelta
    quorum_timeout: timedelta
    connect_timeout: timedelta
    pg_timeout: timedelta
    heartbeat_interval: timedelta
    step_sleep: timedelta
    deadline: float
    rust_log: str
    go_file: Path | None = None


@dataclass(frozen=True, kw_only=True)
class _Replica:
    """The live objects of one replica process.

    Attributes:
        manager: Its torchft manager.
        store: Its ``TCPStore`` master, referenced here so that it lives as long as the manager.
        weights: The replicated state, one float32 vector.
    """

    manager: Manager
    store: TCPStore
    weights: torch.Tensor


def _replica_main(settings: ReplicaSettings) -> None:
    """Body of one replica-group process (rank 0 of a replica group of size 1).

    Args:
        settings: This replica's settings from the parent.
    """
    events = EventWriter(settings.events)
    _emit(events, "process_start", pid=os.getpid())
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("RUST_LOG", settings.rust_log)
    _import_torchft()
    _emit(events, "imported")
    if settings.go_file is not None and not _wait_for_go(settings.go_file, settings.deadline, events):
        return
    replica = _start_replica(settings, events)
    try:
        _train(replica, settings, events)
    finally:
        with contextlib.suppress(Exception):
            replica.manager.shutdown(wait=False)


def _import_torchft() -> None:
    """Imports torch and torchft (a replica's ``imported`` event comes after this) and pins torch to one thread."""
    import torch
    import torch.distributed  # noqa: F401 - its import time is part of the measured start-up
    import torchft  # noqa: F401 - its import time is part of the measured start-up

    torch.set_num_threads(1)


def _wait_for_go(go_file: Path, deadline: float, events: EventWriter) -> bool:
    """Holds a pre-warmed spare (interpreter and imports paid) until the parent's go signal.

    Args:
        go_file: The parent creates this file to release the spare.
        deadline: Absolute ``time.time()`` after which the spare gives up.
        events: The spare's event file.

    Returns:
        True once the signal is seen; False (after a ``fatal`` event) when the deadline passed first.
    """
    while not go_file.exists():
        if time.time() >= deadline:
            _emit(events, "fatal", where="prewarm", error="no go signal before the deadline")
            return False
        time.sleep(_POLL_S)
    _emit(events, "go_seen")
    return True


def _start_replica(settings: ReplicaSettings, events: EventWriter) -> _Replica:
    """Starts this replica's store and torchft manager (it heals through ``load_state_dict``).

    Args:
        settings: This replica's settings.
        events: Its event file (``healed`` and ``ready`` events).

    Returns:
        The manager, the store it uses and the weights it replicates.
    """
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    weights = torch.zeros(settings.numel, dtype=torch.float32)

    def load_state_dict(state: dict[str, torch.Tensor]) -> None:
        weights.copy_(state["weights"])
        _emit(events, "healed")

    def state_dict() -> dict[str, torch.Tensor]:
        return {"weights": weights}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=settings.pg_timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=settings.min_replica_size,
        use_async_quorum=False,
        timeout=settings.manager_timeout,
        quorum_timeout=settings.quorum_timeout,
        connect_timeout=settings.connect_timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=settings.lighthouse_addr,
        replica_id=f"replica_{settings.index}",
        hostname="127.0.0.1",
        heartbeat_interval=settings.heartbeat_interval,
    )
    _emit(events, "ready")
    return _Replica(manager=manager, store=store, weights=weights)


def _train(replica: _Replica, settings: ReplicaSettings, events: EventWriter) -> None:
    """Runs steps until the stop step or the deadline, then records the final step and checksum.

    Args:
        replica: The replica's manager and weights.
        settings: This replica's settings.
        events: Its event file.
    """
    import torch

    manager, weights = replica.manager, replica.weights
    grad = torch.empty_like(weights)
    while time.time() < settings.deadline:
        step = manager.current_step()
        if step >= _read_stop_step(settings.stop_file, settings.steps):
            break
        if not _quorum(manager, step, events):
            return
        time.sleep(settings.step_sleep.total_seconds())  # stand-in for forward/backward
        grad.fill_(float(settings.index + 1))
        _allreduce_and_commit(manager, weights, grad, events)
    _emit(events, "done", step=manager.current_step(), checksum=float(weights.double().sum()))


def _quorum(manager: Manager, step: int, events: EventWriter) -> bool:
    """Starts the quorum of the next step.

    Args:
        manager: The replica's manager.
        step: The step about to run.
        events: The replica's event file (``quorum_start``, then ``quorum_done`` or ``fatal``).

    Returns:
        False when the quorum failed, which torchft treats as fatal for the process.
    """
    _emit(events, "quorum_start", step=step)
    try:
        manager.start_quorum()
    except Exception as exc:  # torchft treats a failed quorum as fatal for the process
        _emit(events, "fatal", where="start_quorum", error=repr(exc)[:300])
        return False
    _emit(
        events,
        "quorum_done",
        step=manager.current_step(),
        quorum_id=getattr(manager, "_quorum_id", None),
        participants=manager.num_participants(),
        errored=manager.errored() is not None,
    )
    return True


def _allreduce_and_commit(manager: Manager, weights: torch.Tensor, grad: torch.Tensor, events: EventWriter) -> None:
    """Averages ``grad`` over the quorum and applies it to ``weights`` if the step commits.

    Args:
        manager: The replica's manager.
        weights: The replicated state.
        grad: This replica's gradient; averaged in place.
        events: The replica's event file (``allreduce`` and ``commit``).
    """
    ok = bool(manager.allreduce(grad).wait())
    err = manager.errored()
    _emit(
        events,
        "allreduce",
        step=manager.current_step(),
        ok=ok and err is None,
        error=None if err is None else repr(err.original_exception)[:300],
    )
    committed = manager.should_commit()
    if committed:
        weights.add_(grad, alpha=-1e-3)
    _emit(events, "commit", committed=bool(committed), step=manager.current_step())


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
) -> dict[str, Any]:
    """Kills one torchft replica group mid-training and measures how the rest and a replacement recover.

    Args:
        n: Number of replica groups (one process and one rank each).
        kill_step: The victim is SIGKILLed once it has committed this many steps.
        steps: Steps every replica runs; moved forward while the replacement has not committed yet.
        numel: Float32 elements allreduced per step.
        timeout_s: Hard wall-clock deadline for the whole run, children included.
        victim: Index of the replica group that is killed.
        restart: Whether to start a replacement for the victim right after the kill.
        prewarm: If True the replacement process is spawned at the start, imports torch/torchft and waits; the
            kill releases it (a warm spare).  If False it is spawned cold right after the kill.
        kill_phase: ``"compute"`` kills the victim once it has finished the quorum of step ``kill_step`` (it is in
            the simulated compute, so the survivors hit the dead peer inside the allreduce); ``"quorum"`` kills it
            right after its commit of step ``kill_step`` (it is entering the next quorum, so the survivors only
            see it missing from the lighthouse quorum).
        rust_log: ``RUST_LOG`` for the children and the lighthouse unless already set (torchft's Rust side logs
            every quorum at INFO).
        min_replicas: Lighthouse ``min_replicas`` and Manager ``min_replica_size``; None means ``n - 1`` (the
            survivors alone form a valid quorum).
        events_dir: If set, the raw per-replica JSON-lines event files are copied into this directory.
        step_sleep_s: Sleep between quorum and allreduce that stands in for compute.
        heartbeat_timeout_ms: Lighthouse: heartbeat age after which a replica counts as dead.
        join_timeout_ms: Lighthouse: how long a valid quorum waits for heartbeating stragglers.
        quorum_tick_ms: Lighthouse: quorum re-evaluation period.
        heartbeat_interval_ms: Manager: heartbeat period to the lighthouse.
        manager_timeout_s: Manager ``timeout`` (should_commit RPC, checkpoint transfer, futures).
        quorum_timeout_s: Manager ``quorum_timeout``.
        connect_timeout_s: Manager ``connect_timeout``.
        pg_timeout_s: ``ProcessGroupGloo(timeout=...)``, the collective timeout.

    Returns:
        The settings used, the kill/restart timestamps and phase timings in seconds relative to the SIGKILL.

    Raises:
        ValueError: On inconsistent arguments.
    """
    if n < 3 or not 0 <= victim < n or not 0 < kill_step < steps:
        raise ValueError(f"need n >= 3, 0 <= victim < n and 0 < kill_step < steps (n={n}, victim={victim})")
    if kill_phase not in ("compute", "quorum"):
        raise ValueError(f"kill_phase must be 'compute' or 'quorum', got {kill_phase!r}")

    os.environ.setdefault("RUST_LOG", rust_log)
    import torchft
    from torchft.coordination import LighthouseServer

    t_start = time.time()
    deadline = t_start + timeout_s
    min_replicas = n - 1 if min_replicas is None else min_replicas
    settings: dict[str, Any] = {
        "torchft_version": getattr(torchft, "__version__", None) or _dist_version("torchft"),
        "n": n,
        "kill_step": kill_step,
        "steps": steps,
        "numel": numel,
        "timeout_s": timeout_s,
        "victim": victim,
        "restart": restart,
        "prewarm": prewarm,
        "kill_phase": kill_phase,
        "rust_log": os.environ.get("RUST_LOG"),
        "step_sleep_s": step_sleep_s,
        "lighthouse": {
            "min_replicas": min_replicas,
            "heartbeat_timeout_ms": heartbeat_timeout_ms,
            "join_timeout_ms": join_timeout_ms,
            "quorum_tick_ms": quorum_tick_ms,
        },
        "manager": {
            "min_replica_size": min_replicas,
            "use_async_quorum": False,
            "timeout_s": manager_timeout_s,
            "quorum_timeout_s": quorum_timeout_s,
            "connect_timeout_s": connect_timeout_s,
            "heartbeat_interval_ms": heartbeat_interval_ms,
            "world_size": 1,
            "checkpoint_transport": "HTTPTransport (default)",
            "init_sync": True,
        },
        "process_group": {"class": "torchft.ProcessGroupGloo", "timeout_s": pg_timeout_s},
        "processes": "multiprocessing spawn, 1 rank per replica group, own TCPStore each",
    }

    workdir = Path(tempfile.mkdtemp(prefix="torchft_bench_"))
    stop_file = workdir / "stop_step"
    _write_stop_step(stop_file, steps)
    lighthouse = LighthouseServer(
        bind="[::]:0",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    ctx = mp.get_context("spawn")
    procs: dict[str, Any] = {}
    files: dict[str, Path] = {}

    go_file = workdir / "go"

    def spawn(label: str, index: int, go: Path | None = None) -> None:
        files[label] = workdir / f"{label}.jsonl"
        replica_settings = ReplicaSettings(
            index=index,
            events=files[label],
            stop_file=stop_file,
            steps=steps,
            numel=numel,
            lighthouse_addr=lighthouse.address(),
            min_replica_size=min_replicas,
            manager_timeout=timedelta(seconds=manager_timeout_s),
            quorum_timeout=timedelta(seconds=quorum_timeout_s),
            connect_timeout=timedelta(seconds=connect_timeout_s),
            pg_timeout=timedelta(seconds=pg_timeout_s),
            heartbeat_interval=timedelta(milliseconds=heartbeat_interval_ms),
            step_sleep=timedelta(seconds=step_sleep_s),
            deadline=deadline,
            rust_log=rust_log,
            go_file=go,
        )
        proc = ctx.Process(target=_replica_main, args=(replica_settings,), name=f"torchft-{label}", daemon=True)
        proc.start()
        procs[label] = proc

    result: dict[str, Any] = {"settings": settings, "lighthouse_addr": lighthouse.address()}
    labels = [f"replica_{i}" for i in range(n)]
    victim_label = labels[victim]
    survivors = [lb for lb in labels if lb != victim_label]
    replacement = f"{victim_label}_replacement" if restart else None
    t_kill: float | None = None
    t_spawn: float | None = None
    try:
        for i, label in enumerate(labels):
            spawn(label, i)
        if replacement is not None and prewarm:
            spawn(replacement, victim, go=go_file)

        # Phase 1: wait until the victim has committed kill_step steps (quorum size is recorded), then SIGKILL it.
        while time.time() < deadline:
            ev = read_replica_events(files[victim_label])
            if any(e["kind"] == "fatal" for e in ev):
                raise RuntimeError(f"{victim_label} failed before the kill: {ev[-1]}")
            armed = last_committed_step(ev) >= kill_step
            if armed and kill_phase == "compute":
                armed = ev[-1]["kind"] == "quorum_done"
            if armed:
                last_q = [e for e in ev if e["kind"] == "quorum_done"]
                result["victim_last_quorum_participants"] = last_q[-1]["participants"] if last_q else None
                result["victim_last_event_before_kill"] = ev[-1]["kind"]
                os.kill(procs[victim_label].pid, signal.SIGKILL)
                t_kill = time.time()
                break
            time.sleep(_POLL_S)
        if t_kill is None:
            raise TimeoutError(f"victim did not reach step {kill_step} before the deadline")
        result["kill_at_step"] = last_committed_step(read_replica_events(files[victim_label]))
        if replacement is not None:
            t_spawn = time.time()
            if prewarm:
                go_file.touch()
            else:
                spawn(replacement, victim)

        # Phase 2: keep the survivors running until the replacement has committed (bounded by the deadline).
        stop = steps
        while time.time() < deadline:
            surv_steps = [last_committed_step(read_replica_events(files[s])) for s in survivors]
            rep_done = replacement is None or any(
                e["kind"] == "commit" and e["committed"] for e in read_replica_events(files[replacement])
            )
            if not rep_done and max(surv_steps) >= stop - _STOP_MARGIN_STEPS:
                stop = max(surv_steps) + 2 * _STOP_MARGIN_STEPS
                _write_stop_step(stop_file, stop)
            alive = [lb for lb, p in procs.items() if lb != victim_label and p.is_alive()]
            if not alive:
                break
            time.sleep(_POLL_S)
        result["final_stop_step"] = stop
        for proc in procs.values():
            proc.join(timeout=max(0.0, min(5.0, deadline - time.time())))
    except (RuntimeError, TimeoutError) as exc:
        logger.error("torchft recovery benchmark aborted: %s", exc)
        result["error"] = repr(exc)
    finally:
        for label, proc in procs.items():
            if proc.is_alive():
                logger.warning("killing %s (pid %s) still alive at the end", label, proc.pid)
                proc.kill()
                proc.join(timeout=5.0)
        with contextlib.suppress(Exception):
            lighthouse.shutdown()
        result["exitcodes"] = {label: proc.exitcode for label, proc in procs.items()}
        result["wall_s"] = round(time.time() - t_start, 3)
        if t_kill is not None:
            result.update(
                analyse(files, survivors, replacement, t_kill, t_spawn, n, result.get("kill_at_step", kill_step))
            )
        result["final_checksums"] = {
            label: next((e["checksum"] for e in read_replica_events(path) if e["kind"] == "done"), None)
            for label, path in files.items()
        }
        result["fatal_events"] = [
            {"replica": label, **e}
            for label, path in files.items()
            for e in read_replica_events(path)
            if e["kind"] == "fatal"
        ]
        if events_dir is not None:
            Path(events_dir).mkdir(parents=True, exist_ok=True)
            for path in files.values():
                if path.exists():
                    shutil.copy2(path, Path(events_dir) / path.name)
            result["events_dir"] = events_dir
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def _dist_version(name: str) -> str | None:
    """Returns the installed distribution version of ``name`` or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None
