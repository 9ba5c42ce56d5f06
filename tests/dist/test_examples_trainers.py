"""examples/ddp_sparse_hook.py under torchrun, as its docstring says to run it."""

from __future__ import annotations

import re

import pytest

from tests.dist.torchrun import run_torchrun

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("mode", ["hook", "scape"])
def test_ddp_example_trains(mode: str) -> None:
    args = ["--steps", "120"] + (["--scape"] if mode == "scape" else [])
    proc = run_torchrun("examples/ddp_sparse_hook.py", 2, *args, timeout=180)
    assert proc.returncode == 0, proc.stdout[-4000:]
    losses = [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)", proc.stdout, re.M)]
    final = re.search(r"final loss ([0-9.]+); ([0-9.]+) MB sent", proc.stdout)
    assert losses and final, proc.stdout[-4000:]
    assert float(final.group(1)) < 0.5 * losses[0]
    assert float(final.group(2)) > 0
