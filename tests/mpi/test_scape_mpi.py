"""SCAPE and the dense sharded baselines under mpirun (backend "mpi")."""

from __future__ import annotations

import pytest

from tests.mpi._launch import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("nprocs", [2, 4])
def test_scape_on_mpi(nprocs: int) -> None:
    proc = run_mpi("scape", nprocs, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"OK {nprocs}" in proc.stdout
