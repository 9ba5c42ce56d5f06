"""Sparse collectives and the mask schedule under mpirun, backend "mpi", world sizes 1-4."""

from __future__ import annotations

import pytest

from tests.mpi._launch import run_mpi_ok

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_sparse_collectives_on_mpi(nprocs: int) -> None:
    assert f"OK {nprocs}" in run_mpi_ok("sparse", nprocs, timeout=300)
