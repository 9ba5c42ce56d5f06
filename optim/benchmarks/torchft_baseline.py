"""Failure-recovery benchmark for torchft, for side-by-side comparison with our own recovery path.

The benchmark starts a torchft lighthouse in the calling process and ``n`` replica groups as real OS processes
(multiprocessing ``spawn``, one rank per replica group, each with its own ``TCPStore``).  Every replica loops over
``manager.start_quorum()`` -> ``manager.allreduce(t).wait()`` -> ``manager.should_commit()`` and appends one JSON line
per event, stamped with ``time.time()``, to its own file.  When the replica with index ``victim`` (2 by default)
has committed ``kill_step`` steps, the parent SIGKILLs it and immediately spawns a replacement process with the same
replica index, which joins the next quorum and heals (fetches the live state from a peer over torchft's HTTP
checkpoint transport).  The phase timings are then computed from the event files, relative to the SIGKILL.

torchft is imported lazily inside the functions so that importing this module never requires torchft.

Example::

    python -c "from optim.benchmarks.torchft_baseline import run_torchft_recovery as r; import json; \
        print(json.dumps(r(), indent=1))"
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from resilient_comm.events import EventWriter, read_events

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


def _read_stop_step(path: str, default: int) -> int:
    """Reads the step at which replicas stop; the parent may move it forward while a replacement catches up.

    Args:
        path: File holding the stop step as decimal text.
        default: Value used when the file is missing or unreadable.

    Returns:
        The stop step.
    """
    try:
        return int(Path(path).read_text(encoding="utf-8").strip())
    except (OSError, ValueError):
        return default


def _write_stop_step(path: str, step: int) -> None:
    """Atomically writes the stop step.

    Args:
        path: File holding the stop step.
        step: New stop step.
    """
    tmp = f"{path}.tmp"
    Path(tmp).write_text(str(step), encoding="utf-8")
    os.replace(tmp, path)


def _replica_main(cfg: dict[str, Any]) -> None:
    """Body of one replica-group process (rank 0 of a replica group of size 1).

    Args:
        cfg: Settings from the parent: ``index``, ``events``, ``stop_file``, ``steps``, ``numel``,
            ``lighthouse_addr``, ``min_replica_size``, ``timeout_s``, ``quorum_timeout_s``, ``connect_timeout_s``,
            ``pg_timeout_s``, ``heartbeat_interval_ms``, ``step_sleep_s``, ``deadline`` (absolute ``time.time()``).
    """
    events = EventWriter(cfg["events"])
    _emit(events, "process_start", pid=os.getpid())
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("RUST_LOG", cfg["rust_log"])

    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    torch.set_num_threads(1)
    index = int(cfg["index"])
    _emit(events, "imported")
    go_file = cfg.get("go_file")
    if go_file:  # pre-warmed spare: interpreter and imports are paid, wait for the parent's go signal
        while not os.path.exists(go_file):
            if time.time() >= cfg["deadline"]:
                _emit(events, "fatal", where="prewarm", error="no go signal before the deadline")
                return
            time.sleep(_POLL_S)
        _emit(events, "go_seen")

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    weights = torch.zeros(int(cfg["numel"]), dtype=torch.float32)

    def load_state_dict(state: dict[str, torch.Tensor]) -> None:
        weights.copy_(state["weights"])
        _emit(events, "healed")

    def state_dict() -> dict[str, torch.Tensor]:
        return {"weights": weights}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=cfg["pg_timeout_s"])),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=int(cfg["min_replica_size"]),
        use_async_quorum=False,
        timeout=timedelta(seconds=cfg["timeout_s"]),
        quorum_timeout=timedelta(seconds=cfg["quorum_timeout_s"]),
        connect_timeout=timedelta(seconds=cfg["connect_timeout_s"]),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=cfg["lighthouse_addr"],
        replica_id=f"replica_{index}",
        hostname="127.0.0.1",
        heartbeat_interval=timedelta(milliseconds=cfg["heartbeat_interval_ms"]),
    )
    _emit(events, "ready")

    grad = torch.empty_like(weights)
    try:
        while time.time() < cfg["deadline"]:
            step = manager.current_step()
            if step >= _read_stop_step(cfg["stop_file"], int(cfg["steps"])):
                break
            _emit(events, "quorum_start", step=step)
            try:
                manager.start_quorum()
            except Exception as exc:  # torchft treats a failed quorum as fatal for the process
                _emit(events, "fatal", where="start_quorum", error=repr(exc)[:300])
                return
            _emit(
                events,
                "quorum_done",
                step=manager.current_step(),
                quorum_id=getattr(manager, "_quorum_id", None),
                participants=manager.num_participants(),
                errored=manager.errored() is not None,
            )
            time.sleep(cfg["step_sleep_s"])  # stand-in for forward/backward
            grad.fill_(float(index + 1))
            work = manager.allreduce(grad)
            ok = bool(work.wait())
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
        _emit(events, "done", step=manager.current_step(), checksum=float(weights.double().sum()))
    finally:
        with contextlib.suppress(Exception):
            manager.shutdown(wait=False)


def _read_events(path: Path) -> list[dict[str, Any]]:
    """Reads one replica's event file (none yet: no events; a torn last line is ignored)."""
    return read_events(path, missing_ok=True)


def _last_committed_step(events: list[dict[str, Any]]) -> int:
    """Returns the highest step reported by a committed step (0 when none)."""
    steps = [e["step"] for e in events if e["kind"] == "commit" and e["committed"]]
    return max(steps, default=0)


def _first_after(
    events: list[dict[str, Any]], t0: float, pred: Callable[[dict[str, Any]], bool]
) -> dict[str, Any] | None:
    """Returns the first event at or after ``t0`` that satisfies ``pred``."""
    for e in events:
        if e["t"] >= t0 and pred(e):
            return e
    return None


def _rel(e: dict[str, Any] | None, t0: float) -> float | None:
    """Returns the event time relative to ``t0`` in seconds, rounded to 0.1 ms, or None."""
    return None if e is None else round(e["t"] - t0, 4)


def _spread(values: list[float | None]) -> dict[str, float | None]:
    """Summarises per-replica latencies: min, max (the time until *every* replica got there) and missing count."""
    seen = [v for v in values if v is not None]
    return {
        "min": min(seen) if seen else None,
        "max": max(seen) if len(seen) == len(values) and seen else None,
        "missing": len(values) - len(seen),
    }


def _survivor_phases(
    ev: list[dict[str, Any]], t_kill: float, n: int, rep_qids: set[int], kill_step: int
) -> dict[str, Any]:
    """Extracts one survivor's recovery phases from its events.

    Args:
        ev: The survivor's events in file order.
        t_kill: ``time.time()`` of the SIGKILL.
        n: Number of replica groups.
        rep_qids: Quorum ids the replacement took part in (a quorum with one of these ids included it).
        kill_step: Last step the victim committed; survivor commits of steps up to it were already in flight.

    Returns:
        Times in seconds after the kill: first error seen (failed allreduce or rejected commit), first new quorum
        (any membership), first quorum of exactly the ``n - 1`` survivors, first committed step beyond
        ``kill_step``, first quorum of ``n`` again and its first commit; plus counts and the error text.
    """
    pre = [e for e in ev if e["kind"] == "quorum_done" and e["t"] < t_kill]
    old_qid = pre[-1]["quorum_id"] if pre else None
    after = [e for e in ev if e["t"] >= t_kill]
    err = new_q = without = commit = full = full_commit = None
    failed = 0
    for e in after:
        kind = e["kind"]
        if kind == "allreduce" and not e["ok"] and err is None:
            err = e
        elif kind == "commit" and not e["committed"]:
            failed += 1
            err = err or e
        elif kind == "commit" and e["committed"] and e["step"] > kill_step:
            commit = commit or e
            if full is not None and full_commit is None:
                full_commit = e
        elif kind == "quorum_done" and e["quorum_id"] != old_qid:
            new_q = new_q or e
            if without is None and e["participants"] == n - 1 and e["quorum_id"] not in rep_qids:
                without = e
            if full is None and e["participants"] == n:
                full = e
    return {
        "error_seen_s": _rel(err, t_kill),
        "error": None if err is None else err.get("error"),
        "new_quorum_s": _rel(new_q, t_kill),
        "new_quorum_participants": None if new_q is None else new_q["participants"],
        "new_quorum_includes_replacement": None if new_q is None else new_q["quorum_id"] in rep_qids,
        "quorum_without_victim_s": _rel(without, t_kill),
        "first_commit_after_kill_s": _rel(commit, t_kill),
        "first_commit_step": None if commit is None else commit["step"],
        "full_quorum_again_s": _rel(full, t_kill),
        "first_commit_in_full_quorum_s": _rel(full_commit, t_kill),
        "failed_commits_after_kill": failed,
        "final_step": _last_committed_step(ev),
    }


def _analyse(
    files: dict[str, Path],
    survivors: list[str],
    replacement: str | None,
    t_kill: float,
    t_spawn: float | None,
    n: int,
    kill_step: int,
) -> dict[str, Any]:
    """Turns the per-replica event files into phase timings relative to the SIGKILL.

    Args:
        files: Event file per replica label.
        survivors: Labels of the replicas that were not killed.
        replacement: Label of the replacement process, if one was started.
        t_kill: ``time.time()`` right after ``os.kill``.
        t_spawn: ``time.time()`` right before the replacement is started (spawned, or released when pre-warmed).
        n: Number of replica groups.
        kill_step: Last step the victim committed before it was killed.

    Returns:
        Per-survivor and aggregated phase timings, plus the replacement's timeline.
    """
    rep_events = _read_events(files[replacement]) if replacement is not None else []
    rep_qids = {e["quorum_id"] for e in rep_events if e["kind"] == "quorum_done"}
    per: dict[str, Any] = {}
    pre_step_times: list[float] = []
    for label in survivors:
        ev = _read_events(files[label])
        commits = [e for e in ev if e["kind"] == "commit" and e["committed"] and e["t"] < t_kill]
        pre_step_times += [b["t"] - a["t"] for a, b in zip(commits[-10:], commits[-9:], strict=False)]
        per[label] = _survivor_phases(ev, t_kill, n, rep_qids, kill_step)
    out: dict[str, Any] = {
        "pre_kill_step_time_s_median": round(statistics.median(pre_step_times), 4) if pre_step_times else None,
        "survivors": per,
        "every_survivor_error_seen_s": _spread([p["error_seen_s"] for p in per.values()]),
        "every_survivor_new_quorum_s": _spread([p["new_quorum_s"] for p in per.values()]),
        "every_survivor_quorum_without_victim_s": _spread([p["quorum_without_victim_s"] for p in per.values()]),
        "every_survivor_first_commit_after_kill_s": _spread([p["first_commit_after_kill_s"] for p in per.values()]),
        "every_survivor_full_quorum_again_s": _spread([p["full_quorum_again_s"] for p in per.values()]),
    }
    if replacement is not None:
        ev = rep_events

        def first(kind: str, pred: Callable[[dict[str, Any]], bool] = lambda e: True) -> dict[str, Any] | None:
            return _first_after(ev, 0.0, lambda e: e["kind"] == kind and pred(e))

        commit = first("commit", lambda e: e["committed"])
        quorum = first("quorum_done")
        rep = {
            "start_signal_s": None if t_spawn is None else round(t_spawn - t_kill, 4),
            "process_start_s": _rel(first("process_start"), t_kill),
            "imports_done_s": _rel(first("imported"), t_kill),
            "go_seen_s": _rel(first("go_seen"), t_kill),
            "manager_ready_s": _rel(first("ready"), t_kill),
            "first_quorum_s": _rel(quorum, t_kill),
            "first_quorum_step": None if quorum is None else quorum["step"],
            "first_quorum_participants": None if quorum is None else quorum["participants"],
            "healed_s": _rel(first("healed"), t_kill),
            "first_commit_s": _rel(commit, t_kill),
            "first_commit_step": None if commit is None else commit["step"],
            "final_step": _last_committed_step(ev),
        }
        ready = first("ready")
        if ready is not None and commit is not None:
            rep["manager_ready_to_first_commit_s"] = round(commit["t"] - ready["t"], 4)
        out["replacement"] = rep
    return out


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
    stop_file = str(workdir / "stop_step")
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

    go_file = str(workdir / "go")

    def spawn(label: str, index: int, go: str | None = None) -> None:
        files[label] = workdir / f"{label}.jsonl"
        cfg = {
            "index": index,
            "events": str(files[label]),
            "stop_file": stop_file,
            "steps": steps,
            "numel": numel,
            "lighthouse_addr": lighthouse.address(),
            "min_replica_size": min_replicas,
            "timeout_s": manager_timeout_s,
            "quorum_timeout_s": quorum_timeout_s,
            "connect_timeout_s": connect_timeout_s,
            "pg_timeout_s": pg_timeout_s,
            "heartbeat_interval_ms": heartbeat_interval_ms,
            "step_sleep_s": step_sleep_s,
            "deadline": deadline,
            "go_file": go,
            "rust_log": rust_log,
        }
        proc = ctx.Process(target=_replica_main, args=(cfg,), name=f"torchft-{label}", daemon=True)
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
            ev = _read_events(files[victim_label])
            if any(e["kind"] == "fatal" for e in ev):
                raise RuntimeError(f"{victim_label} failed before the kill: {ev[-1]}")
            armed = _last_committed_step(ev) >= kill_step
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
        result["kill_at_step"] = _last_committed_step(_read_events(files[victim_label]))
        if replacement is not None:
            t_spawn = time.time()
            if prewarm:
                Path(go_file).touch()
            else:
                spawn(replacement, victim)

        # Phase 2: keep the survivors running until the replacement has committed (bounded by the deadline).
        stop = steps
        while time.time() < deadline:
            surv_steps = [_last_committed_step(_read_events(files[s])) for s in survivors]
            rep_done = replacement is None or any(
                e["kind"] == "commit" and e["committed"] for e in _read_events(files[replacement])
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
                _analyse(files, survivors, replacement, t_kill, t_spawn, n, result.get("kill_at_step", kill_step))
            )
        result["final_checksums"] = {
            label: next((e["checksum"] for e in _read_events(path) if e["kind"] == "done"), None)
            for label, path in files.items()
        }
        result["fatal_events"] = [
            {"replica": label, **e} for label, path in files.items() for e in _read_events(path) if e["kind"] == "fatal"
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
