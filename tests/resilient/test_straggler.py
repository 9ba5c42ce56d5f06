"""A straggler for real: one worker SIGSTOPped for most of every step is found from the step timings and
replaced by the spare (hot-swap), and the run stays bit-identical to one without it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from optim.apps.train_job.job_config import TrainConfig
from optim.apps.train_job.resilient_job import ResilienceConfig, run_resilient_training

pytestmark = pytest.mark.dist


def _slot_pid(events: Path, slot: int, stop: threading.Event) -> int | None:
    while not stop.is_set():
        if events.exists():
            for line in events.read_text().splitlines():
                rec = json.loads(line) if line.endswith("}") else {}
                if rec.get("event") == "member_started" and rec.get("role") == "active" and rec.get("slot") == slot:
                    return int(rec["pid"])
        time.sleep(0.01)
    return None


def _bursts(events: Path, slot: int, stop: threading.Event, stopped_s: float, running_s: float) -> None:
    """SIGSTOP the worker of ``slot`` for ``stopped_s`` of every ``stopped_s + running_s`` until it is gone."""
    pid = _slot_pid(events, slot, stop)
    try:
        while pid is not None and not stop.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped_s)
            os.kill(pid, signal.SIGCONT)
            time.sleep(running_s)
    except ProcessLookupError:
        pass
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


@pytest.mark.timeout(300)
def test_a_straggler_is_replaced_by_the_spare_and_the_run_stays_exact(tmp_path: Path) -> None:
    config = TrainConfig(
        steps=120, nproc=3, optimizer="adams", d_model=64, n_layers=1, batch=8, context=32, eval_interval=0,
        eval_batches=1, threads=1, job_timeout_s=240, out=str(tmp_path),
    )  # fmt: skip
    res = ResilienceConfig(spares=1, heartbeat_timeout_s=5.0)
    stop = threading.Event()
    out = tmp_path / "run"
    out.mkdir()
    thread = threading.Thread(target=_bursts, args=(out / "coordinator.events", 1, stop, 0.1, 0.01), daemon=True)
    thread.start()
    try:
        run = run_resilient_training(config, res, out)
    finally:
        stop.set()
        thread.join(10)
    assert run["status"] == 0, run["events"][-10:]
    found = [e for e in run["events"] if e["event"] == "straggler_detected"]
    assert found and found[0]["slot"] == 1 and found[0]["replaced"], found
    assert any(e["event"] == "spare_promoted" and e["slot"] == 1 for e in run["events"])
    lost = [e for e in run["events"] if e["event"] == "failure_detected"]
    assert [e["reason"] for e in lost] == ["straggler"], lost  # nothing else was declared failed
    reference = run_resilient_training(config, ResilienceConfig(spares=1, heartbeat_timeout_s=5.0), tmp_path / "ref")
    assert reference["status"] == 0
    assert not [e for e in reference["events"] if e["event"] == "straggler_detected"]
    assert run["losses"] == reference["losses"] and run["params_digest"] == reference["params_digest"]
