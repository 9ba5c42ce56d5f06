"""Sparse collectives and the mask schedule under mpirun, backend "mpi", world sizes 1-4."""

from __future__ import annotations

import pytest

from tests.mpi._launch import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_sparse_collectives_on_mpi(nprocs: int) -> None:
    proc = run_mpi("sparse", nprocs, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"OK {nprocs}" in proc.stdout
