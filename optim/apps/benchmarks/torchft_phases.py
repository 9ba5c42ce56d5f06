"""Phase timings of the torchft recovery benchmark, from its replicas' event files.

:func:`optim.apps.benchmarks.torchft_baseline.run_torchft_recovery` runs the
replicas; each appends ``{"t": time.time(), "kind": ..., ...}`` records to its
own JSON-lines file (:class:`~resilient_comm.events.EventWriter`). The
functions here turn those records into times relative to the SIGKILL of the
victim: when each survivor saw the error, formed a quorum without the victim,
committed again, and what the replacement did when.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from resilient_comm.events import read_events

__all__ = ["analyse", "last_committed_step", "read_replica_events", "survivor_phases"]


def read_replica_events(path: Path) -> list[dict[str, Any]]:
    """Reads one replica's event file (none yet: no events; a torn last line is ignored)."""
    return read_events(path, missing_ok=True)


def last_committed_step(events: list[dict[str, Any]]) -> int:
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


def survivor_phases(
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
        "final_step": last_committed_step(ev),
    }


def analyse(
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
    rep_events = read_replica_events(files[replacement]) if replacement is not None else []
    rep_qids = {e["quorum_id"] for e in rep_events if e["kind"] == "quorum_done"}
    per: dict[str, Any] = {}
    pre_step_times: list[float] = []
    for label in survivors:
        ev = read_replica_events(files[label])
        commits = [e for e in ev if e["kind"] == "commit" and e["committed"] and e["t"] < t_kill]
        pre_step_times += [b["t"] - a["t"] for a, b in zip(commits[-10:], commits[-9:], strict=False)]
        per[label] = survivor_phases(ev, t_kill, n, rep_qids, kill_step)
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
            "final_step": last_committed_step(ev),
        }
        ready = first("ready")
        if ready is not None and commit is not None:
            rep["manager_ready_to_first_commit_s"] = round(commit["t"] - ready["t"], 4)
        out["replacement"] = rep
    return out
