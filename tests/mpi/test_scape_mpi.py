"""SCAPE and the dense sharded baselines under mpirun (backend "mpi")."""

from __future__ import annotations

import pytest

from tests.mpi._launch import run_mpi_ok

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("nprocs", [2, 4])
def test_scape_on_mpi(nprocs: int) -> None:
    assert f"OK {nprocs}" in run_mpi_ok("scape", nprocs, timeout=240)
