"""``sparsecomm bench recovery`` end to end on 3 + 1 local gloo ranks (one SIGKILL)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from optim.apps.benchmarks.recovery import PHASES, RecoveryBenchConfig, run_recovery_bench
from optim.apps.cli.bench_recovery import format_recovery_table
from optim.testing.etcd_cluster import etcd_unavailable
from optim.testing.hosts import unavailable


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="nprocs"):
        RecoveryBenchConfig(nprocs=(1,))
    with pytest.raises(ValueError, match="faults"):
        RecoveryBenchConfig(faults=("sighup",))
    with pytest.raises(ValueError, match="spares"):
        RecoveryBenchConfig(spares=-1)


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_recovery_bench_sigkill_hotswap(tmp_path: Path) -> None:
    config = RecoveryBenchConfig(nprocs=(3,), faults=("sigkill",), repeats=1, fault_step=3, steps_after=3)
    bench = run_recovery_bench(config)
    (row,) = bench["rows"]
    (run,) = row["runs"]
    assert run["hot_swap"] and run["survivors"] == 2 and run["survivors_raised"] == 2
    for phase in PHASES:
        if phase not in ("ended_s", "failover_s"):  # only a lost coordinator ends the job, or is replaced
            assert run[phase] is not None and run[phase] > 0, phase
    assert run.get("ended_s") is None and run.get("failover_s") is None
    # the order of the protocol: detection and raising come before the epoch, the epoch before the commit
    assert run["raised_first_s"] <= run["raised_s"] < run["first_commit_s"]
    assert run["detected_s"] < run["configured_s"] < run["first_commit_s"]
    table = format_recovery_table(bench)
    assert "sparsecomm" in table and "sigkill" in table
    json.dumps(bench)  # the CLI writes it as JSON


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_recovery_bench_reports_a_failed_job_at_once() -> None:
    """2 workers lose 1: no majority survives, the job fails and the benchmark says so (no hang)."""
    config = RecoveryBenchConfig(nprocs=(2,), faults=("sigkill",), repeats=1, fault_step=2, steps_after=2)
    with pytest.raises(RuntimeError, match="no quorum"):
        run_recovery_bench(config)


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.skipif(unavailable() is not None, reason=f"no network namespaces: {unavailable()}")
def test_recovery_bench_partition_and_lost_coordinator() -> None:
    config = RecoveryBenchConfig(
        nprocs=(3,), faults=("partition", "coordinator"), repeats=1, fault_step=3, steps_after=3
    )
    bench = run_recovery_bench(config)
    cut, lost = bench["rows"]
    (run,) = cut["runs"]
    assert cut["fault"] == "partition" and run["hot_swap"] and run["survivors"] == 2
    hb = config.heartbeat_timeout_s
    assert hb * 0.9 < run["detected_s"] < run["configured_s"] < run["first_commit_s"], run  # silence: not before hb
    (run,) = lost["runs"]
    assert lost["fault"] == "coordinator" and 0 < run["ended_s"] < hb, run
    table = format_recovery_table(bench)
    assert "partition" in table and "all gave up" in table


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.skipif(etcd_unavailable() is not None, reason=str(etcd_unavailable()))
def test_recovery_bench_coordinator_failover() -> None:
    config = RecoveryBenchConfig(nprocs=(2,), faults=("failover",), repeats=1, fault_step=3, steps_after=3)
    bench = run_recovery_bench(config)
    (row,) = bench["rows"]
    (run,) = row["runs"]
    # the standby waits out the lease (at least 2 s, etcd's shortest); training goes on meanwhile
    assert row["fault"] == "failover" and 1.0 < run["failover_s"] < 10.0, run
    assert 0 < run["first_commit_s"] < run["failover_s"] and run["steps_during_failover"] >= 1, run
    assert "standby active" in format_recovery_table(bench)
