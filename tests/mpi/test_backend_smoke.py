"""The ``mpi`` backend under mpirun: every operation on 1-4 ranks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.mpi._launch import ROOT, run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_backend_smoke(nprocs: int) -> None:
    pytest.importorskip("mpi4py")
    proc = run_mpi("backend_smoke", nprocs, timeout=240)
    output = f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == 0, f"mpirun exited {proc.returncode}\n{output}"
    assert f"PASS backend_smoke n={nprocs}" in proc.stdout, output


def test_imports_without_mpi4py() -> None:
    """The module imports without mpi4py; building a communicator says how to install it."""
    code = (
        "import sys; sys.modules['mpi4py'] = None\n"
        "from datetime import timedelta\n"
        "import bindings.mpi_backend as m\n"
        "try:\n"
        "    m.MPICommunicator(timeout=timedelta(seconds=1))\n"
        "except ImportError as exc:\n"
        "    assert 'pip install sparsecomm[mpi]' in str(exc), exc\n"
        "else:\n"
        "    raise SystemExit('no ImportError')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
