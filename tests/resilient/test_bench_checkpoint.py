"""``sparsecomm bench checkpoint`` end to end on a tiny configuration (3 + 1 local gloo ranks, one SIGKILL)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest

from optim.apps.benchmarks.snapshots import (
    RECOVERY_PHASES,
    CheckpointBenchConfig,
    overhead_from_events,
    run_checkpoint_bench,
)
from optim.apps.cli.bench_checkpoint import format_checkpoint_table
from optim.apps.train_job.resilient_job import ResilienceConfig


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


@pytest.mark.dist
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
    _check_bench(bench, config)
    json.dumps(bench)  # the CLI writes it as JSON


def _check_bench(bench: dict[str, Any], config: CheckpointBenchConfig) -> None:
    """The tiny run's numbers: types, ranges, and how they follow from each other and the configuration."""
    (row,) = bench["rows"]
    (d_model, layers, steps) = config.models[0]
    assert row["model"] == "32x1" and (row["d_model"], row["n_layers"], row["steps"]) == (d_model, layers, steps)
    assert isinstance(row["num_parameters"], int) and row["num_parameters"] > 0

    # overhead run, 11 steps in blocks of 2 (on: 1-2, 5-6, 9-10), steps 1-2 skipped, step 11 left out:
    # the second step of each block counts, on = {6, 10}, off = {4, 8}; one pair (blocks of 5-6 and 7-8)
    assert (row["steps_on"], row["steps_off"], row["block_pairs"]) == (2, 2, 1)
    on, off = row["step_ms_on"], row["step_ms_off"]
    assert isinstance(on, float) and isinstance(off, float) and on > 0 and off > 0
    assert row["overhead_fraction"] == pytest.approx((on - off) / off)
    paired = row["overhead_paired_median"]
    assert isinstance(paired, float) and math.isfinite(paired) and paired > -1.0  # a ratio of positive times, less 1
    assert row["iqr_ms_on"] is None and row["iqr_ms_off"] is None  # fewer than 4 steps each
    assert row["step_ms_on_all"] > 0 and row["step_ms_off_all"] > 0 and row["snapshot_ms_median"] > 0

    # rings: three buffers each; a ward buffer is the replication capacity (largest own snapshot + slack),
    # an own buffer one encoded snapshot, at least the rank's fp32 master shard and SCAPE's first moment
    shard_bytes = 4 * math.ceil(row["num_parameters"] / config.nproc)
    own, ward = row["own_ring_bytes"], row["ward_ring_bytes"]
    assert ward % 3 == 0
    capacity = ward // 3
    assert 3 * 2 * shard_bytes <= own <= ward
    assert capacity >= 2 * shard_bytes + (64 << 10)
    assert row["ring_bytes_per_rank"] == own + ward
    # every rank sends the whole capacity per replicated version: the initial state and each snapshot step
    snapshot_steps = sum(1 for s in range(1, steps + 1) if ((s - 1) // config.block) % 2 == 0)
    assert row["replicated_bytes_per_rank"] == (1 + snapshot_steps) * capacity
    busy = row["replication_busy_s_per_rank"]
    assert busy > 0 and row["replication_GBps"] == pytest.approx(row["replicated_bytes_per_rank"] / busy / 1e9)
    assert 0 < row["wall_time_s"] < config.timeout_s

    rec = row["recovery"]
    assert rec["ok"] and rec["status"] == 0 and rec["digests_agree"] and rec["errors"] == []
    assert (rec["slot"], rec["kill_step"]) == (1, config.kill_step)
    for phase in RECOVERY_PHASES:
        assert isinstance(rec[phase], float) and rec[phase] >= 0, (phase, rec[phase])
    assert rec["detect_s"] > 0
    # kill -> detected -> new epoch configured -> restored -> resumed, on one clock
    timeline = rec["timeline"]
    assert 0 < timeline["detected_s"] <= timeline["epoch_configured_s"] <= timeline["restored_s"] <= rec["total_s"]
    assert rec["detect_s"] + rec["reconfigure_s"] == pytest.approx(timeline["epoch_configured_s"])
    assert rec["total_s"] - rec["resume_s"] == pytest.approx(timeline["restored_s"])
    assert rec["gap_s"] == pytest.approx(rec["total_s"] - sum(rec[p] for p in RECOVERY_PHASES[:-1]))
    # a snapshot after every step: it restores a step before the kill and recomputes up to the last committed one
    assert 0 <= rec["restore_step"] < config.kill_step
    assert rec["restore_step"] + rec["steps_recomputed"] >= config.kill_step - 1

    lb = bench["loopback"]
    assert (lb["nbytes"], lb["iters"]) == (config.loopback_bytes, config.loopback_iters)
    assert lb["exchange_correct"] and set(lb["ranks"]) == {0, 1}
    for r in lb["ranks"].values():
        assert len(r["one_way_s"]) == len(r["exchange_s"]) == config.loopback_iters
        assert min(r["one_way_s"]) > 0 and min(r["exchange_s"]) > 0
        assert r["bytes_sent"] == (config.loopback_iters + 1) * config.loopback_bytes  # the warm-up exchange too
    assert lb["one_way_s_median"] == statistics.median(lb["ranks"][0]["one_way_s"])
    assert lb["one_way_GBps"] == pytest.approx(config.loopback_bytes / lb["one_way_s_median"] / 1e9)
    assert lb["exchange_s_median"] == max(statistics.median(r["exchange_s"]) for r in lb["ranks"].values())
    assert lb["exchange_GBps"] == pytest.approx(config.loopback_bytes / lb["exchange_s_median"] / 1e9)

    table = format_checkpoint_table(bench)
    assert "scape-0.01" in table and "loopback" in table and "overhead" in table
