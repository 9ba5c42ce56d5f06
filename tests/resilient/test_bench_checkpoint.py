"""``sparsecomm bench checkpoint`` end to end on a tiny configuration (3 + 1 local gloo ranks, one SIGKILL)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from optim.benchmarks.checkpoint import (
    RECOVERY_PHASES,
    CheckpointBenchConfig,
    overhead_from_events,
    run_checkpoint_bench,
)
from optim.cli.bench_checkpoint import format_checkpoint_table
from optim.train_job.resilient import ResilienceConfig


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="optimizers"):
        CheckpointBenchConfig(optimizers=("adamw",))
    with pytest.raises(ValueError, match="nproc"):
        CheckpointBenchConfig(nproc=2)
    with pytest.raises(ValueError, match="block"):
        CheckpointBenchConfig(block=1)
    with pytest.raises(ValueError, match="models"):
        CheckpointBenchConfig(models=((32, 1, 6),))  # no full on/off block pair after the skipped steps
    with pytest.raises(ValueError, match="snapshot_block"):
        ResilienceConfig(snapshot_block=-1)


def test_overhead_uses_steady_block_steps_only() -> None:
    # block 2: steps 1-2 on, 3-4 off, 5-6 on, 7-8 off; the second step of each block counts
    events = [
        {
            "event": "committed",
            "step": s,
            "step_s": (0.2 if ((s - 1) // 2) % 2 == 0 else 0.1) + r * 0.001,
            "snapshot": ((s - 1) // 2) % 2 == 0,
        }
        for s in range(1, 10)
        for r in range(2)
    ]
    events.append({"event": "committed", "step": 2, "step_s": 9.0, "snapshot": True})  # max over ranks
    got = overhead_from_events(events, block=2, skip_steps=0, last_step=9)
    assert got["steps_on"] == 2 and got["steps_off"] == 2  # steps 2, 6 and 4, 8
    assert got["step_ms_off"] == pytest.approx(101.0)
    assert got["step_ms_on"] == pytest.approx((9.0 + 0.201) / 2 * 1e3)
    assert got["block_pairs"] == 2  # (steps 2, 4) and (6, 8)
    assert got["overhead_paired_median"] == pytest.approx(((9.0 / 0.101 - 1) + (0.201 / 0.101 - 1)) / 2)


@pytest.mark.timeout(420)
def test_checkpoint_bench_tiny(tmp_path: Path) -> None:
    config = CheckpointBenchConfig(
        optimizers=("scape",),
        models=((32, 1, 11),),
        block=2,
        skip_steps=2,
        sparse_warmup_steps=2,
        kill_step=4,
        steps_after_kill=2,
        batch=2,
        context=16,
        loopback_bytes=1 << 20,
        loopback_iters=2,
        timeout_s=240.0,
        out=str(tmp_path),
    )
    bench = run_checkpoint_bench(config)
    (row,) = bench["rows"]
    assert row["model"] == "32x1" and row["num_parameters"] > 0
    assert row["steps_on"] >= 2 and row["steps_off"] >= 2
    assert row["step_ms_on"] > 0 and row["step_ms_off"] > 0 and row["overhead_fraction"] is not None
    assert row["block_pairs"] >= 1 and row["overhead_paired_median"] is not None
    assert row["own_ring_bytes"] > 0 and row["ward_ring_bytes"] > 0
    assert row["ring_bytes_per_rank"] == row["own_ring_bytes"] + row["ward_ring_bytes"]
    assert row["replicated_bytes_per_rank"] > 0 and row["replication_GBps"] > 0
    rec = row["recovery"]
    assert rec["ok"] and rec["status"] == 0 and rec["digests_agree"]
    for phase in RECOVERY_PHASES:
        assert rec[phase] is not None and rec[phase] >= 0, phase
    assert rec["detect_s"] > 0 and rec["total_s"] > rec["detect_s"] + rec["reconfigure_s"]
    assert 0 <= rec["restore_step"] < config.kill_step
    lb = bench["loopback"]
    assert lb["exchange_correct"] and lb["one_way_GBps"] > 0 and lb["exchange_GBps"] > 0
    table = format_checkpoint_table(bench)
    assert "scape-0.01" in table and "loopback" in table and "overhead" in table
    json.dumps(bench)  # the CLI writes it as JSON
