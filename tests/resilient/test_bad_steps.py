"""Bad steps are skipped, not fatal (optim.resilient.loop): a NaN gradient or an infinite loss injected for real on one
worker of a launched job."""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.resilient.harness import run_job

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "resilient" / "workers" / "bad_step.py"


def _run(tmp: Path, *args: str, nproc: int = 3) -> tuple[int, list[dict[str, Any]], str]:
    tmp.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(WORKER), "--out", str(tmp), *args]
    rc, log = run_job(cmd, tmp / "logs", nproc=nproc, job_timeout=timedelta(seconds=150))
    reports = [
        json.loads((tmp / f"slot{s}.json").read_text()) for s in range(nproc) if (tmp / f"slot{s}.json").exists()
    ]
    return rc, reports, log[-6000:]


@pytest.mark.parametrize("optimizer", ["scape", "adamw"])
def test_a_nan_anywhere_skips_that_step_everywhere(tmp_path: Path, optimizer: str) -> None:
    rc0, clean, log0 = _run(tmp_path / "clean", "--optimizer", optimizer)
    rc1, nan, log1 = _run(tmp_path / "nan", "--optimizer", optimizer, "--nan-grad", "1@7")
    rc2, inf, log2 = _run(tmp_path / "inf", "--optimizer", optimizer, "--inf-loss", "2@7")
    rc3, fwd, log3 = _run(tmp_path / "input", "--optimizer", optimizer, "--nan-input", "0@7")
    assert rc0 == rc1 == rc2 == rc3 == 0, log0 + log1 + log2 + log3
    assert len(clean) == len(nan) == len(inf) == len(fwd) == 3
    for reports in (nan, inf, fwd):
        for r in reports:
            assert r["skipped"] == [7] and r["error"] is None and r["finite_buffers"]
            assert "7" not in r["losses"] and len(r["losses"]) == 29
            assert r["digest"] == reports[0]["digest"]  # replicas agree
    # where the bad value came from does not matter: the step is skipped the same way
    assert nan[0]["digest"] == inf[0]["digest"] and nan[0]["losses"] == inf[0]["losses"]
    # a NaN in the forward poisons BatchNorm's running statistics: undone, the run is the same again
    assert [r["buffers"] for r in nan] == [r["buffers"] for r in inf] == [r["buffers"] for r in fwd]
    assert fwd[0]["digest"] == nan[0]["digest"] and fwd[0]["losses"] == nan[0]["losses"]
    # before it, the run is the clean one; after it, it goes on from the state before step 7
    ref = clean[0]["losses"]
    assert all(nan[0]["losses"][str(s)] == ref[str(s)] for s in range(1, 7))
    assert nan[0]["losses"]["8"] != ref["8"] and nan[0]["digest"] != clean[0]["digest"]
    assert nan[0]["losses"]["30"] < nan[0]["losses"]["1"]


def test_too_many_bad_steps_in_a_row_end_the_run(tmp_path: Path) -> None:
    bad = [arg for s in range(5, 10) for arg in ("--nan-grad", f"0@{s}")]
    rc, reports, log = _run(tmp_path, "--max-bad-steps", "3", *bad)
    assert rc != 0
    assert len(reports) == 3, log
    for r in reports:
        assert r["skipped"] == [5, 6, 7]
        assert r["error"] and "step 8" in r["error"] and "3 skipped steps in a row" in r["error"], r["error"]
        assert "ranks [0]" in r["error"]
