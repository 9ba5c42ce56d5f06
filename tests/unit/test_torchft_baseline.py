"""The torchft recovery benchmark's settings and decisions (:mod:`optim.apps.benchmarks.torchft_baseline` and
:mod:`optim.apps.benchmarks.torchft_replica`), without torchft: the runs themselves need it."""

from __future__ import annotations

import pickle
import time
from datetime import timedelta
from pathlib import Path

import pytest

from bindings.json_object import JsonObject
from optim.apps.benchmarks import torchft_baseline
from optim.apps.benchmarks.torchft_baseline import (
    _copy_events,
    _Kill,
    _moved_stop_step,
    _ready_to_kill,
    _replica_settings,
    _Roles,
    run_torchft_recovery,
)
from optim.apps.benchmarks.torchft_config import TorchftRecoveryConfig, settings_json
from optim.apps.benchmarks.torchft_phases import read_replica_events
from optim.apps.benchmarks.torchft_replica import _wait_for_go, read_stop_step, write_stop_step
from resilient_comm.events import EventWriter


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"n": 2}, "need n >= 3"),
        ({"victim": 4}, "need n >= 3"),
        ({"kill_step": 0}, "need n >= 3"),
        ({"kill_step": 40}, "need n >= 3"),
        ({"kill_phase": "allreduce"}, "kill_phase must be"),
    ],
)
def test_inconsistent_settings_are_refused(fields: JsonObject, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TorchftRecoveryConfig(**fields)
    with pytest.raises(ValueError, match=message):  # before torchft is imported
        run_torchft_recovery(**fields)


def test_options_become_the_config_and_thesettings_json(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[TorchftRecoveryConfig] = []
    monkeypatch.setattr(torchft_baseline, "run_torchft_recovery_from", lambda c: seen.append(c) or {})
    run_torchft_recovery(3, 5, 15, 1024, 30.0, step_sleep_s=0.02, heartbeat_timeout_ms=1500, pg_timeout_s=2.5)
    (config,) = seen
    assert config.heartbeat_timeout == timedelta(milliseconds=1500) and config.quorum_min == 2
    settings = settings_json(config, torchft_version="0.2.0", rust_log="warn")
    assert settings == {
        "torchft_version": "0.2.0",
        "n": 3,
        "kill_step": 5,
        "steps": 15,
        "numel": 1024,
        "timeout_s": 30.0,
        "victim": 2,
        "restart": True,
        "prewarm": False,
        "kill_phase": "compute",
        "rust_log": "warn",
        "step_sleep_s": 0.02,
        "lighthouse": {"min_replicas": 2, "heartbeat_timeout_ms": 1500, "join_timeout_ms": 1000, "quorum_tick_ms": 50},
        "manager": {
            "min_replica_size": 2,
            "use_async_quorum": False,
            "timeout_s": 5.0,
            "quorum_timeout_s": 30.0,
            "connect_timeout_s": 5.0,
            "heartbeat_interval_ms": 100,
            "world_size": 1,
            "checkpoint_transport": "HTTPTransport (default)",
            "init_sync": True,
        },
        "process_group": {"class": "torchft.ProcessGroupGloo", "timeout_s": 2.5},
        "processes": "multiprocessing spawn, 1 rank per replica group, own TCPStore each",
    }


def test_roles_and_replica_settings(tmp_path: Path) -> None:
    config = TorchftRecoveryConfig(n=4, victim=1, min_replicas=2)
    roles = _Roles.of(config)
    assert roles.victim == "replica_1" and roles.replacement == "replica_1_replacement"
    assert roles.survivors == ("replica_0", "replica_2", "replica_3")
    assert _Roles.of(TorchftRecoveryConfig(restart=False)).replacement is None
    settings = _replica_settings(
        config, index=1, events=tmp_path / "e.jsonl", workdir=tmp_path, lighthouse_addr="http://lh", deadline=9.0
    )
    assert settings.min_replica_size == 2 and settings.stop_file.parent == tmp_path and settings.go_file is None
    assert settings.manager_timeout == timedelta(seconds=5) and settings.heartbeat_interval == timedelta(seconds=0.1)
    assert pickle.loads(pickle.dumps(settings)) == settings  # it crosses the spawn boundary


def test_kill_point() -> None:
    committed = [{"kind": "commit", "committed": True, "step": 5}]
    in_compute = [*committed, {"kind": "quorum_start", "step": 5}, {"kind": "quorum_done", "step": 5}]
    assert not _ready_to_kill([], 5, "compute")
    assert not _ready_to_kill(committed, 6, "quorum")
    assert _ready_to_kill(committed, 5, "quorum") and not _ready_to_kill(committed, 5, "compute")
    assert _ready_to_kill(in_compute, 5, "compute")
    kill = _Kill(t_kill=1.0, last_quorum_participants=3, last_event_before_kill="quorum_done", kill_at_step=5)
    assert list(kill.to_json()) == ["victim_last_quorum_participants", "victim_last_event_before_kill", "kill_at_step"]


def test_stop_step_moves_until_the_replacement_committed(tmp_path: Path) -> None:
    assert _moved_stop_step(40, [20, 29], replacement_committed=False) == 40
    assert _moved_stop_step(40, [20, 30], replacement_committed=False) == 50
    assert _moved_stop_step(40, [20, 35], replacement_committed=True) == 40
    stop_file = tmp_path / "stop_step"
    assert read_stop_step(stop_file, 7) == 7
    write_stop_step(stop_file, 50)
    assert read_stop_step(stop_file, 7) == 50
    stop_file.write_text("torn", encoding="utf-8")
    assert read_stop_step(stop_file, 7) == 7


def test_prewarmed_spare_waits_for_go(tmp_path: Path) -> None:
    go = tmp_path / "go"
    with EventWriter(tmp_path / "late.jsonl") as events:
        assert not _wait_for_go(go, time.time() - 1.0, events)
    go.touch()
    with EventWriter(tmp_path / "go.jsonl") as events:
        assert _wait_for_go(go, time.time() + 60.0, events)
    assert [e["kind"] for e in read_replica_events(tmp_path / "late.jsonl")] == ["fatal"]
    assert [e["kind"] for e in read_replica_events(tmp_path / "go.jsonl")] == ["go_seen"]


def test_copy_events_skips_missing_files(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("{}\n", encoding="utf-8")
    _copy_events([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], str(tmp_path / "out"))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.jsonl"]
