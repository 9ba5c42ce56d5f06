"""Phase timings of the torchft recovery benchmark (:mod:`optim.apps.benchmarks.torchft_phases`) on synthetic events."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from optim.apps.benchmarks.torchft_phases import (
    analyse,
    last_committed_step,
    read_replica_events,
    replacement_timeline,
    survivor_phases,
)
from resilient_comm.events import EventWriter

T_KILL = 100.0


def _write(path: Path, events: list[dict[str, Any]], torn: bytes = b"") -> Path:
    with EventWriter(path) as w:
        for e in events:
            w.write(e)
    with open(path, "ab") as f:
        f.write(torn)
    return path


def _survivor(offset: float) -> list[dict[str, Any]]:
    before = [{"t": 88.0 + step, "kind": "commit", "committed": True, "step": step} for step in range(12)]
    return [
        {"t": 80.0, "kind": "quorum_done", "quorum_id": 1, "participants": 3, "step": 0},
        *before,  # the median of the last ten commits' intervals: 1 s
        {"t": T_KILL + 0.1 + offset, "kind": "allreduce", "ok": False, "error": "peer died", "step": 12},
        {"t": T_KILL + 0.2 + offset, "kind": "commit", "committed": False, "step": 12},
        {"t": T_KILL + 1.0 + offset, "kind": "quorum_done", "quorum_id": 2, "participants": 2, "step": 12},
        {"t": T_KILL + 1.5 + offset, "kind": "commit", "committed": True, "step": 12},
        {"t": T_KILL + 3.0 + offset, "kind": "quorum_done", "quorum_id": 3, "participants": 3, "step": 13},
        {"t": T_KILL + 3.5 + offset, "kind": "commit", "committed": True, "step": 14},
    ]


def test_phases_of_survivors_and_replacement(tmp_path: Path) -> None:
    files = {
        "replica_0": _write(tmp_path / "replica_0.jsonl", _survivor(0.0), torn=b'{"t": 200'),
        "replica_1": _write(tmp_path / "replica_1.jsonl", _survivor(0.5)),
        "replica_1_replacement": _write(
            tmp_path / "replica_1_replacement.jsonl",
            [
                {"t": T_KILL + 0.3, "kind": "process_start", "pid": 7},
                {"t": T_KILL + 2.0, "kind": "ready"},
                {"t": T_KILL + 3.0, "kind": "quorum_done", "quorum_id": 3, "participants": 3, "step": 0},
                {"t": T_KILL + 3.2, "kind": "healed"},
                {"t": T_KILL + 3.5, "kind": "commit", "committed": True, "step": 14},
            ],
        ),
    }
    out = analyse(files, ["replica_0", "replica_1"], "replica_1_replacement", T_KILL, T_KILL + 0.01, 3, 11)
    s0 = out["survivors"]["replica_0"]
    assert s0["error_seen_s"] == 0.1 and s0["error"] == "peer died"
    assert s0["quorum_without_victim_s"] == 1.0 and s0["new_quorum_participants"] == 2
    assert s0["first_commit_after_kill_s"] == 1.5 and s0["first_commit_step"] == 12
    assert s0["full_quorum_again_s"] == 3.0 and s0["first_commit_in_full_quorum_s"] == 3.5
    assert s0["failed_commits_after_kill"] == 1 and s0["final_step"] == 14
    assert out["every_survivor_error_seen_s"] == {"min": 0.1, "max": 0.6, "missing": 0}
    assert out["pre_kill_step_time_s_median"] == 1.0
    rep = out["replacement"]
    assert rep["start_signal_s"] == 0.01 and rep["process_start_s"] == 0.3 and rep["go_seen_s"] is None
    assert rep["first_quorum_participants"] == 3 and rep["healed_s"] == 3.2 and rep["first_commit_step"] == 14
    assert rep["manager_ready_to_first_commit_s"] == 1.5


def test_reading_before_a_replica_wrote_anything(tmp_path: Path) -> None:
    assert read_replica_events(tmp_path / "not-yet.jsonl") == []
    assert last_committed_step([]) == 0
    out = analyse({"a": tmp_path / "a.jsonl"}, ["a"], None, T_KILL, None, 3, 5)
    assert out["every_survivor_error_seen_s"] == {"min": None, "max": None, "missing": 1}
    assert "replacement" not in out


def test_survivor_phases_record_and_replacement_without_ready() -> None:
    phases = survivor_phases(_survivor(0.0), T_KILL, 3, {3}, 11)
    assert phases.quorum_without_victim_s == 1.0 and phases.new_quorum_includes_replacement is False
    assert list(phases.to_json())[:3] == ["error_seen_s", "error", "new_quorum_s"]
    assert phases.to_json()["final_step"] == 14
    rep = replacement_timeline([{"t": T_KILL + 1.0, "kind": "commit", "committed": True, "step": 3}], T_KILL, None)
    assert rep["start_signal_s"] is None and rep["first_commit_s"] == 1.0 and rep["final_step"] == 3
    assert "manager_ready_to_first_commit_s" not in rep
