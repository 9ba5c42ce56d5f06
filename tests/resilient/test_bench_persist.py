"""``sparsecomm bench checkpoint --persistent``: the rows measure what they say, on a tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from optim.apps.benchmarks.persist import PersistBenchConfig, run_persist_bench
from optim.apps.cli.bench_persist import format_persist_table

pytestmark = pytest.mark.dist


@pytest.mark.timeout(400)
def test_persist_bench_rows(tmp_path: Path) -> None:
    config = PersistBenchConfig(
        densities=(0.01,), d_model=32, n_layers=1, steps=31, every=5, full_every=4, nproc=2, skip_steps=5,
        batch=4, context=32, resume_steps=6, eval_batches=2, out=str(tmp_path),
    )  # fmt: skip
    bench = run_persist_bench(config)
    scape, dense = bench["rows"]
    assert [scape["name"], dense["name"]] == ["scape-0.01", "adams"]
    for row in (scape, dense):
        assert row["losses_agree"], row  # checkpoints change nothing of the training
        assert row["checkpoints"] == 6 and row["write_ms_full"] > 0 and row["restore_ms"] > 0
    # SCAPE: a full file every 4 checkpoints of a slot, deltas between, far smaller; dense AdamS: no deltas
    assert scape["files_full"] == 2 * 2 and scape["files_delta"] == 2 * 4
    assert scape["delta_ratio"] > 5 and scape["chain_files"] == 2
    assert dense["files_delta"] == 0 and dense["delta_ratio"] is None
    for row in (scape, dense):  # lossy: the first moment in bfloat16 in full files, a resume close to the run
        assert row["bytes_lossy"] < 0.9 * row["bytes_full"], row
        assert abs(row["val_loss_ratio"] - 1) < 0.01 and row["val_loss_lossless"] > 0, row
    table = format_persist_table(bench)
    assert "scape-0.01" in table and "adams" in table and "val_lossy" in table


def test_persist_bench_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match="steps"):
        PersistBenchConfig(steps=10, every=10)
    with pytest.raises(ValueError, match="densities"):
        PersistBenchConfig(densities=(1.5,))
    with pytest.raises(ValueError, match="resume_steps"):
        PersistBenchConfig(resume_steps=0)
