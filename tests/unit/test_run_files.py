"""Each convergence run's record in a file of its own, taken back by commit (``optim.apps.benchmarks.convergence``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from optim.apps.benchmarks import convergence
from optim.apps.benchmarks.convergence import _stored_run, run_file_name
from optim.apps.train_job.job_config import TrainConfig


def test_the_file_name_follows_every_configuration_field() -> None:
    base = TrainConfig(steps=10)
    assert run_file_name("adams", base) == run_file_name("adams", TrainConfig(steps=10))
    assert run_file_name("adams", base) != run_file_name("adams", dataclasses.replace(base, seed=1))
    assert run_file_name("adams", base) != run_file_name("adamw", base)
    assert run_file_name("local@0.1", base).startswith("local@0.1-") and run_file_name("x", base).endswith(".json")


@pytest.mark.parametrize(
    ("reuse", "written_at", "now", "taken"),
    [
        ("commit", "abc", "abc", True),
        ("commit", "abc", "def", False),
        ("commit", "abc", "unknown", False),
        ("any", "abc", "def", True),
        ("none", "abc", "abc", False),
    ],
)
def test_a_stored_run_is_taken_by_its_commit(
    tmp_path: Path, reuse: str, written_at: str, now: str, taken: bool
) -> None:
    path = tmp_path / "adams-1.json"
    path.write_text(json.dumps({"name": "adams", "commit": written_at, "final_val_loss": 1.5}))
    got = _stored_run(path, now, reuse)
    assert (got is not None) == taken
    if taken:
        assert got == {"name": "adams", "commit": written_at, "final_val_loss": 1.5}


def test_a_missing_or_torn_file_is_run_again(tmp_path: Path) -> None:
    assert _stored_run(tmp_path / "absent.json", "abc", "any") is None
    torn = tmp_path / "torn.json"
    torn.write_text('{"name": "ad')
    assert _stored_run(torn, "abc", "any") is None
    assert _stored_run(None, "abc", "any") is None


def test_run_convergence_refuses_an_unknown_reuse() -> None:
    with pytest.raises(ValueError, match="Invalid reuse"):
        convergence.run_convergence(TrainConfig(steps=10), (0.1,), methods=("local",), reuse="sometimes")
