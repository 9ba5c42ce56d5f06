"""``UlfmCommunicator`` under ``mpirun --with-ft ulfm``: shrink, hot-swap, and the commit vote.

A rank SIGKILLs itself, so mpirun's exit status means little; every process
writes its own result to a temporary folder and the tests check those files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.mpi._launch import run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(90)]

#: Survivors must raise, and finish reconfiguring, this soon after the kill
#: (the failure detector's timeout is 1 s; measured here: ~0.05 s).
MAX_RAISE_S = 5.0
MAX_RECONFIGURE_S = 5.0


def _run(scenario: str, nprocs: int, tmp_path: Path) -> dict[int, dict[str, Any]]:
    pytest.importorskip("mpi4py")
    proc = run_mpi("ulfm_recover", nprocs, scenario, str(tmp_path), timeout=60, ulfm=True)
    output = f"mpirun exited {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    results = {int(f.stem[4:]): json.loads(f.read_text()) for f in tmp_path.glob("rank*.json")}
    skips = [r["skip"] for r in results.values() if "skip" in r]
    if skips:
        pytest.skip(f"ULFM unavailable: {skips[0]}")
    assert sorted(results) == list(range(nprocs)), f"missing results: {sorted(results)}\n{output}"
    for member, r in results.items():
        assert r.get("victim") or r.get("ok"), f"rank {member} failed:\n{r.get('traceback')}\n{output}"
    return results


def _check_recovery(results: dict[int, dict[str, Any]], world: int, mode: str) -> None:
    kill = results[2]["kill_time"]
    for m in (0, 1, 3):
        r = results[m]
        (ev,) = r["events"]
        assert ev["step"] == 5
        assert ev["raise"] - kill < MAX_RAISE_S, ev
        assert ev["reconfigured"] - kill < MAX_RECONFIGURE_S, ev
        rec = ev["rec"]
        assert (rec["old_epoch"], rec["epoch"], rec["world_size"], rec["mode"]) == (0, 1, world, mode)
        assert rec["lost_slots"] == [2] and rec["committed_step"] == 4
        assert [s[0] for s in r["sums"]] == list(range(10)), r["sums"]
        assert all(got == exp for _, got, exp, _, _ in r["sums"])
        assert all(ws == (4 if step < 5 else world) for step, _, _, ws, _ in r["sums"])
        assert r["final"]["epoch"] == 1 and r["final"]["world_size"] == world


def test_ulfm_shrink(tmp_path: Path) -> None:
    results = _run("shrink", 4, tmp_path)
    _check_recovery(results, 3, "shrink")
    ranks = {m: results[m]["final"]["rank"] for m in (0, 1, 3)}
    assert ranks == {0: 0, 1: 1, 3: 2}
    assert results[0]["events"][0]["rec"]["rank_map"] == {"0": 0, "1": 1, "3": 2}


def test_ulfm_hotswap(tmp_path: Path) -> None:
    results = _run("hotswap", 5, tmp_path)
    _check_recovery(results, 4, "hotswap")
    assert {m: results[m]["final"]["rank"] for m in (0, 1, 3, 4)} == {0: 0, 1: 1, 3: 3, 4: 2}
    spare = results[4]
    assert spare["start_slot"] is None
    promo = spare["promotion"]
    assert promo["promoted_here"] and promo["rank"] == 2 and promo["epoch"] == 1 and promo["promoted"] == {"2": 4}
    assert [s[0] for s in spare["sums"]] == list(range(5, 10))
    assert all(got == exp == 10 for _, got, exp, _, _ in spare["sums"])


def test_ulfm_commit_vote_and_release(tmp_path: Path) -> None:
    results = _run("commit", 4, tmp_path)
    for m in (0, 1, 2):
        assert results[m]["votes"] == [True, True, False, True], results[m]
        assert results[m]["committed"] == 3
    spare = results[3]
    assert spare["start_slot"] is None and spare["promotion"] is None  # released at close
