"""The drop-in differential and bad-input bodies under mpirun, backend "mpi", world sizes 1-4."""

from __future__ import annotations

import pytest

from tests.mpi._launch import run_mpi_ok

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_every_drop_in_function_on_mpi(nprocs: int) -> None:
    assert f"OK {nprocs}" in run_mpi_ok("drop_in", nprocs, timeout=240)


@pytest.mark.parametrize("nprocs", [2, 4])
def test_rank_mismatch_is_detected_on_mpi(nprocs: int) -> None:
    assert "mismatch_detected" in run_mpi_ok("drop_in", nprocs, "--check-collectives", timeout=120)
