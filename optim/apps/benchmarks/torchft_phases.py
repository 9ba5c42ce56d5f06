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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bindings.json_object import JsonObject
from resilient_comm.events import read_events

__all__ = [
    "SurvivorPhases",
    "analyse",
    "last_committed_step",
    "read_replica_events",
    "replacement_timeline",
    "survivor_phases",
]


def read_replica_events(path: Path) -> list[JsonObject]:
    """Reads one replica's event file (none yet: no events; a torn last line is ignored)."""
    return read_events(path, missing_ok=True)


def last_committed_step(events: Sequence[JsonObject]) -> int:
    """Returns the highest step reported by a committed step (0 when none)."""
    steps = [e["step"] for e in events if e["kind"] == "commit" and e["committed"]]
    return max(steps, default=0)


def _first_after(events: Sequence[JsonObject], t0: float, pred: Callable[[JsonObject], bool]) -> JsonObject | None:
    """Returns the first event at or after ``t0`` that satisfies ``pred``."""
    for e in events:
        if e["t"] >= t0 and pred(e):
            return e
    return None


def _rel(e: JsonObject | None, t0: float) -> float | None:
    """Returns the event time relative to ``t0`` in seconds, rounded to 0.1 ms, or None."""
    return None if e is None else round(e["t"] - t0, 4)


def _spread(values: list[float | None]) -> JsonObject:
    """Summarises per-replica latencies: min, max (the time until *every* replica got there) and missing count."""
    seen = [v for v in values if v is not None]
    return {
        "min": min(seen) if seen else None,
        "max": max(seen) if len(seen) == len(values) and seen else None,
        "missing": len(values) - len(seen),
    }


@dataclass(frozen=True, kw_only=True)
class SurvivorPhases:
    """One survivor's recovery, in seconds after the SIGKILL (None: it did not happen).

    Attributes:
        error_seen_s: First error seen: a failed allreduce or a rejected commit.
        error: That error's text, if the event carries one.
        new_quorum_s: First quorum with a new id (any membership).
        new_quorum_participants: Its size.
        new_quorum_includes_replacement: Whether the replacement took part in it.
        quorum_without_victim_s: First quorum of exactly the ``n - 1`` survivors.
        first_commit_after_kill_s: First committed step beyond the victim's last committed step.
        first_commit_step: Its step.
        full_quorum_again_s: First quorum of ``n`` replicas again.
        first_commit_in_full_quorum_s: First committed step after that quorum.
        failed_commits_after_kill: Commits rejected after the kill.
        final_step: The survivor's last committed step.
    """

    error_seen_s: float | None
    error: str | None
    new_quorum_s: float | None
    new_quorum_participants: int | None
    new_quorum_includes_replacement: bool | None
    quorum_without_victim_s: float | None
    first_commit_after_kill_s: float | None
    first_commit_step: int | None
    full_quorum_again_s: float | None
    first_commit_in_full_quorum_s: float | None
    failed_commits_after_kill: int
    final_step: int

    def to_json(self) -> JsonObject:
        """Returns the phases as a JSON object, one key per attribute."""
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class _Marks:
    """The first events of each phase a survivor recorded after the kill (None: none such).

    Attributes:
        error: First failed allreduce or rejected commit.
        new_quorum: First quorum with a new id.
        without_victim: First quorum of exactly the survivors.
        commit: First committed step beyond the victim's last one.
        full: First quorum of all ``n`` replicas.
        full_commit: First such commit after ``full``.
        failed: Number of rejected commits.
    """

    error: JsonObject | None
    new_quorum: JsonObject | None
    without_victim: JsonObject | None
    commit: JsonObject | None
    full: JsonObject | None
    full_commit: JsonObject | None
    failed: int


def _marks_after_kill(
    after: Sequence[JsonObject], old_qid: object, n: int, rep_qids: set[int], kill_step: int
) -> _Marks:
    """Scans a survivor's events after the kill, in file order, for the first event of each phase.

    Args:
        after: The survivor's events at or after the kill.
        old_qid: Id of its last quorum before the kill (None: none).
        n: Number of replica groups.
        rep_qids: Quorum ids the replacement took part in.
        kill_step: Last step the victim committed.

    Returns:
        The first event of each phase and the count of rejected commits.
    """
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
    return _Marks(
        error=err,
        new_quorum=new_q,
        without_victim=without,
        commit=commit,
        full=full,
        full_commit=full_commit,
        failed=failed,
    )


def survivor_phases(ev: list[JsonObject], t_kill: float, n: int, rep_qids: set[int], kill_step: int) -> SurvivorPhases:
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
    m = _marks_after_kill([e for e in ev if e["t"] >= t_kill], old_qid, n, rep_qids, kill_step)
    return SurvivorPhases(
        error_seen_s=_rel(m.error, t_kill),
        error=None if m.error is None else m.error.get("error"),
        new_quorum_s=_rel(m.new_quorum, t_kill),
        new_quorum_participants=None if m.new_quorum is None else m.new_quorum["participants"],
        new_quorum_includes_replacement=None if m.new_quorum is None else m.new_quorum["quorum_id"] in rep_qids,
        quorum_without_victim_s=_rel(m.without_victim, t_kill),
        first_commit_after_kill_s=_rel(m.commit, t_kill),
        first_commit_step=None if m.commit is None else m.commit["step"],
        full_quorum_again_s=_rel(m.full, t_kill),
        first_commit_in_full_quorum_s=_rel(m.full_commit, t_kill),
        failed_commits_after_kill=m.failed,
        final_step=last_committed_step(ev),
    )


def _pre_kill_step_times(ev: Sequence[JsonObject], t_kill: float) -> list[float]:
    """Returns the intervals between a replica's last ten committed steps before the kill (nine at most)."""
    commits = [e for e in ev if e["kind"] == "commit" and e["committed"] and e["t"] < t_kill]
    return [b["t"] - a["t"] for a, b in zip(commits[-10:], commits[-9:], strict=False)]


def _every_survivor(phases: Sequence[SurvivorPhases]) -> JsonObject:
    """Returns the spread over the survivors (:func:`_spread`) of each phase they all go through."""
    return {
        "every_survivor_error_seen_s": _spread([p.error_seen_s for p in phases]),
        "every_survivor_new_quorum_s": _spread([p.new_quorum_s for p in phases]),
        "every_survivor_quorum_without_victim_s": _spread([p.quorum_without_victim_s for p in phases]),
        "every_survivor_first_commit_after_kill_s": _spread([p.first_commit_after_kill_s for p in phases]),
        "every_survivor_full_quorum_again_s": _spread([p.full_quorum_again_s for p in phases]),
    }


def replacement_timeline(ev: Sequence[JsonObject], t_kill: float, t_spawn: float | None) -> JsonObject:
    """Turns the replacement's events into its timeline relative to the SIGKILL.

    Args:
        ev: The replacement's events in file order.
        t_kill: ``time.time()`` right after ``os.kill``.
        t_spawn: ``time.time()`` right before the replacement is started (spawned, or released when pre-warmed).

    Returns:
        Seconds after the kill of each of its start-up events, its first quorum and commit (with their step and
        size), its final step and, when both happened, the time from manager ready to first commit.
    """

    def first(kind: str, pred: Callable[[JsonObject], bool] = lambda e: True) -> JsonObject | None:
        return _first_after(ev, 0.0, lambda e: e["kind"] == kind and pred(e))

    commit = first("commit", lambda e: e["committed"])
    quorum = first("quorum_done")
    rep: JsonObject = {
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
    return rep


def analyse(
    files: Mapping[str, Path],
    survivors: list[str],
    replacement: str | None,
    t_kill: float,
    t_spawn: float | None,
    n: int,
    kill_step: int,
) -> JsonObject:
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
    per: dict[str, SurvivorPhases] = {}
    pre_step_times: list[float] = []
    for label in survivors:
        ev = read_replica_events(files[label])
        pre_step_times += _pre_kill_step_times(ev, t_kill)
        per[label] = survivor_phases(ev, t_kill, n, rep_qids, kill_step)
    out: JsonObject = {
        "pre_kill_step_time_s_median": round(statistics.median(pre_step_times), 4) if pre_step_times else None,
        "survivors": {label: p.to_json() for label, p in per.items()},
        **_every_survivor(list(per.values())),
    }
    if replacement is not None:
        out["replacement"] = replacement_timeline(rep_events, t_kill, t_spawn)
    return out
