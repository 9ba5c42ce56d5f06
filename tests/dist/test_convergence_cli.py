"""``sparsecomm bench convergence`` end to end: 2 ranks, a tiny model, 10 steps, 2 densities."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from optim.apps.benchmarks.convergence import convergence_variants, largest_loss_rise
from optim.apps.benchmarks.output import git_commit
from optim.apps.cli.main import main
from tests.dist.harness import clear_launcher_env

pytestmark = pytest.mark.dist


@pytest.mark.timeout(180)
def test_convergence_cli_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clear_launcher_env(monkeypatch)
    out = tmp_path / "conv"
    argv = [
        "bench", "convergence", "--steps", "10", "--nproc", "2", "--densities", "0.1,0.01",
        "--out", str(out), "--d-model", "32", "--layers", "1", "--heads", "2", "--context", "32",
        "--batch", "8", "--lr", "1e-2", "--warmup", "2", "--warmup-steps", "3", "--eval-interval", "5",
        "--eval-batches", "2", "--max-corpus-bytes", "300000", "--timeout", "90",
    ]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    for name in ("adamw", "adams", "scape@0.1", "scape@0.01", "vs_adams", "wire/step"):
        assert name in printed, printed

    data = json.loads((out / "convergence.json").read_text())
    assert (out / "convergence.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert data["reference"] == "adams" and data["base_config"]["steps"] == 10
    runs = {r["name"]: r for r in data["runs"]}
    assert list(runs) == ["adamw", "adams", "scape@0.1", "scape@0.01"]
    assert runs["adams"]["ratio_to_adams"] == 1.0
    for r in runs.values():
        for key in (
            "config",
            "optimizer",
            "train_loss",
            "evals",
            "final_val_loss",
            "ratio_to_adams",
            "wire_bytes_per_step",
            "wire_bytes_by_op",
            "mean_step_time_s",
            "largest_loss_rise",
        ):
            assert key in r, (r["name"], key)
        assert len(r["train_loss"]) == 10 and [e["step"] for e in r["evals"]] == [0, 5, 10]
        assert r["final_val_loss"] == r["evals"][-1]["val_loss"] < r["initial_val_loss"]
        assert r["mean_step_time_s"] > 0
        assert r["config"]["seed"] == 0 and r["config"]["nproc"] == 2
        # the largest rise of the recorded curve after the warm-up (the LR's; SCAPE's dense steps too)
        cfg = r["config"]
        assert (cfg["warmup_steps"], cfg["sparse_warmup_steps"]) == (2, 3)  # --warmup, --warmup-steps
        warm = 3 if r["name"].startswith("scape") else 2
        assert r["warmup_steps"] == warm, (r["name"], r["warmup_steps"])
        loss = r["train_loss"]
        rises = {s: loss[s - 1] - loss[s - 2] for s in range(warm + 1, len(loss) + 1)}
        top = max(rises, key=rises.__getitem__)
        if rises[top] > 0:
            assert (r["largest_loss_rise"], r["largest_loss_rise_step"]) == (rises[top], top), (r["name"], loss)
        else:
            assert (r["largest_loss_rise"], r["largest_loss_rise_step"]) == (0.0, None), (r["name"], loss)
    # Same init and data order: identical initial validation loss everywhere.
    assert len({r["initial_val_loss"] for r in runs.values()}) == 1
    assert runs["scape@0.1"]["optimizer"]["density"] == 0.1 and runs["scape@0.1"]["sparse_steps"] == 7
    assert runs["scape@0.01"]["wire_bytes_per_step"] < runs["adams"]["wire_bytes_per_step"]
    assert set(data["targets"]) == {"scape@0.1", "scape@0.01"}
    assert data["targets"]["scape@0.1"]["max_ratio"] == 1.02


def test_variants_and_loss_rise() -> None:
    names = [n for n, _ in convergence_variants((0.1, 0.001))]
    assert names == ["adamw", "adams", "scape@0.1", "scape@0.001"]
    with pytest.raises(ValueError):
        convergence_variants((0.0,))
    assert largest_loss_rise([5.0, 4.0, 4.5, 3.0, 3.2], 0) == (0.5, 3)
    assert largest_loss_rise([5.0, 4.0, 4.5, 3.0, 3.2], 3) == pytest.approx((0.2, 5))
    assert largest_loss_rise([3.0, 2.0, 1.0], 0) == (0.0, None)


@pytest.mark.timeout(300)
def test_convergence_suite_cli_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two digits settings (one constant LR, read at both horizons from one run; one cosine, run per horizon)."""
    clear_launcher_env(monkeypatch)
    out = tmp_path / "suite"
    argv = [
        "bench", "convergence", "--suite", "--settings", "digits-mlp-const,digits-mlp-cosine",
        "--horizons", "100,200", "--methods", "local,topk", "--densities", "0.25", "--nproc", "2",
        "--out", str(out), "--timeout", "120",
    ]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    for word in ("digits-mlp-const", "digits-mlp-cosine", "local@0.25", "topk@0.25", "worst at 200", "wire bytes"):
        assert word in printed, printed
    data = json.loads((out / "suite.json").read_text())
    assert (out / "suite.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cells = {(r["setting"], r["horizon"], r["name"]) for r in data["rows"]}
    names = ("adamw", "adams", "local@0.25", "topk@0.25")
    assert cells == {(s, h, n) for s in ("digits-mlp-const", "digits-mlp-cosine") for h in (100, 200) for n in names}
    trained = {(r["setting"], r["horizon"]): r["trained_steps"] for r in data["rows"]}
    assert trained[("digits-mlp-const", 100)] == 200  # read from the 200-step run (constant LR)
    assert trained[("digits-mlp-cosine", 100)] == 100  # its own run (the schedule depends on the length)
    for r in data["rows"]:
        if r["name"] == "adams":
            assert r["ratio_to_adams"] == 1.0
        if "@" in r["name"]:
            assert 0.25 < r["wire_ratio_to_adams"] < 0.6, r  # a quarter of the bytes plus the dense warm-up
    worst = data["worst"]["local@0.25"]
    assert set(worst["by_horizon"]) == {"100", "200"} and worst["max_ratio"] is None  # no target at 0.25
    assert data["settings"]["digits-mlp-const"]["nproc"] == 2
    # every run wrote its own file; run again, the suite takes them (same commit) and trains nothing
    assert len(list((out / "runs").glob("*.json"))) == 12
    stamps = {f: f.stat().st_mtime_ns for f in (out / "runs").glob("*.json")}
    assert main(argv) == 0
    capsys.readouterr()
    again = json.loads((out / "suite.json").read_text())
    assert [r["val_loss"] for r in again["rows"]] == [r["val_loss"] for r in data["rows"]]
    if git_commit() != "unknown":  # outside a git checkout no run file is taken: trained again
        assert {f: f.stat().st_mtime_ns for f in (out / "runs").glob("*.json")} == stamps


def test_suite_rejects_unknown_settings(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "convergence", "--suite", "--settings", "imagenet"])
    assert "expected a comma list" in capsys.readouterr().err
