"""One held-out setting of the convergence suite for a handful of steps on 2 ranks: it builds, trains and reports."""

from __future__ import annotations

import pytest

from optim.apps.benchmarks.suite import run_suite
from tests.dist.harness import clear_launcher_env

pytestmark = pytest.mark.dist


@pytest.mark.timeout(240)
def test_heldout_gru_setting_runs_on_two_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_launcher_env(monkeypatch)
    overrides = {"nproc": 2, "eval_interval": 5, "eval_batches": 2, "max_corpus_bytes": 200_000, "job_timeout_s": 120}
    suite = run_suite(
        ["torchdoc-gru-const"],
        split="heldout",
        horizons=(5, 10),
        densities=(0.25,),
        methods=("local",),
        seeds=(100,),
        overrides=overrides,
    )
    assert suite["split"] == "heldout" and suite["split_seeds"] == {"heldout": [100]}
    cells = {(r["horizon"], r["name"]): r for r in suite["rows"]}
    assert set(cells) == {(h, n) for h in (5, 10) for n in ("adamw", "adams", "local@0.25")}
    assert all(r["trained_steps"] == 10 for r in suite["rows"])  # constant LR: one run, read at both horizons
    for r in suite["rows"]:
        assert r["ratio_to_best_dense"] == pytest.approx(
            r["val_loss"] / min(cells[(r["horizon"], d)]["val_loss"] for d in ("adams", "adamw"))
        )
    config = suite["settings"]["torchdoc-gru-const"]
    assert (config["arch"], config["corpus"], config["nproc"]) == ("gru", "torchdoc", 2)
    first = [r for r in suite["seed_rows"] if r["name"] == "adams"][0]["evals"]
    assert first[-1]["val_loss"] < first[0]["val_loss"]
