"""``sparsecomm bench wallclock``: cells over shaped links, each its own file, resumed where a sweep stopped;
time to the target loss read from the validation curves."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from optim.apps.benchmarks.wallclock import WallclockConfig, cell_name, summarize
from optim.apps.cli.main import main as cli_main
from optim.testing.hosts import unavailable

WHY = unavailable(shaped=True)


def test_bad_sweeps_raise_before_anything_runs() -> None:
    with pytest.raises(ValueError, match="methods"):
        WallclockConfig(methods=("scape@0.1",))  # no dense reference
    with pytest.raises(ValueError, match="methods"):
        WallclockConfig(methods=("adams", "sgd"))
    with pytest.raises(ValueError, match="link rate"):
        WallclockConfig(link_rates=("fast",))
    with pytest.raises(ValueError, match="target_step"):
        WallclockConfig(steps=100, target_step=110)
    with pytest.raises(ValueError, match="target_step"):
        WallclockConfig(steps=100, target_step=90, eval_interval=25)
    with pytest.raises(ValueError, match="hosts"):
        WallclockConfig(hosts=1)
    assert WallclockConfig().train_config("scape@0.01", 3)["density"] == 0.01


def _cell(out: Path, rate: str, method: str, step_s: float, losses: list[float]) -> None:
    steps = [{"step": s, "step_time_s": step_s, "comm_time_s": step_s / 2, "bytes_sent": 1000} for s in range(1, 41)]
    evals = [{"step": 10 * i, "val_loss": loss} for i, loss in enumerate(losses)]
    result = {"steps": steps, "evals": evals, "num_parameters": 123}
    cell = {"link_rate": rate, "method": method, "seed": 0, "settings": {}, "result": result, "wall_s": 1.0}
    (out / f"{cell_name(rate, method, 0)}.json").write_text(json.dumps(cell))


def test_time_to_target_is_read_from_the_curves(tmp_path: Path) -> None:
    config = WallclockConfig(
        methods=("adams", "scape@0.1"), link_rates=("1gbit",), steps=40, target_step=40, eval_interval=10
    )
    (tmp_path / "config.json").write_text(json.dumps(config.__dict__))
    _cell(tmp_path, "1gbit", "adams", 1.0, [5.0, 4.0, 3.0, 2.5, 2.0])  # reaches 2.0 at step 40: 40 s
    _cell(tmp_path, "1gbit", "scape@0.1", 0.25, [5.0, 3.5, 2.6, 2.0, 1.9])  # reaches it at step 30: 7.5 s
    rows = {r["method"]: r for r in summarize(tmp_path)["rows"]}
    assert rows["adams"]["target_loss"] == 2.0 and rows["adams"]["time_to_target_s"] == 40.0
    assert rows["scape@0.1"]["time_to_target_s"] == 7.5
    assert rows["scape@0.1"]["speedup_vs_dense"] == pytest.approx(40.0 / 7.5)
    assert rows["scape@0.1"]["step_speedup_vs_dense"] == pytest.approx(4.0)
    _cell(tmp_path, "1gbit", "scape@0.1", 0.25, [5.0, 3.5, 2.6, 2.1, 2.05])  # never reaches it
    rows = {r["method"]: r for r in summarize(tmp_path)["rows"]}
    assert rows["scape@0.1"]["time_to_target_s"] is None and rows["scape@0.1"]["speedup_vs_dense"] is None


@pytest.mark.skipif(WHY is not None, reason=str(WHY))
@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_sweep_runs_its_cells_over_shaped_links_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    argv = ["bench", "wallclock", "--out", str(out), "--methods", "adams,scape@0.1", "--link-rate", "1gbit"]
    # 16 steps: SCAPE's first 10 are dense, and the summary reads the steps after the 10th
    argv += ["--steps", "16", "--eval-interval", "4", "--d-model", "32", "--layers", "1", "--batch", "2"]
    assert cli_main([*argv, "--json", str(tmp_path / "w.json"), "--plot", str(tmp_path / "w.png")]) == 0
    bench = json.loads((tmp_path / "w.json").read_text())
    rows = {r["method"]: r for r in bench["rows"]}
    assert set(rows) == {"adams", "scape@0.1"}
    assert bench["links"]["1gbit"]["tcp_gbps"] > 0.5
    dense = rows["adams"]
    assert dense["time_to_target_s"] is not None and dense["speedup_vs_dense"] == 1.0
    assert rows["scape@0.1"]["bytes_per_step"] < dense["bytes_per_step"]
    assert (tmp_path / "w.png").stat().st_size > 0
    cells = sorted(out.glob("1gbit-*.json"))
    assert len(cells) == 2
    stamps = {p: os.stat(p).st_mtime_ns for p in cells}
    assert cli_main(argv) == 0  # everything done: nothing runs again
    assert {p: os.stat(p).st_mtime_ns for p in cells} == stamps
