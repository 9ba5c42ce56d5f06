"""The ``mpi`` backend under mpirun: every operation on 1-4 ranks, each check its own test result.

One mpirun per world size runs every check of ``workers/backend_smoke.py``
(the launch costs more than the checks); each check then reports as its own
test from that run's output.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys

import pytest

from tests.mpi._launch import ROOT, WORKERS, run_mpi

#: The worker's checks (functions decorated ``@check``), read from its source: importing it needs mpi4py.
CHECK_NAMES = [
    node.name
    for node in ast.parse((WORKERS / "backend_smoke.py").read_text()).body
    if isinstance(node, ast.FunctionDef) and any(getattr(d, "id", None) == "check" for d in node.decorator_list)
]


@functools.cache
def _run(nprocs: int) -> tuple[int, str]:
    """mpirun's exit status and everything the ranks printed (a timeout: -1 and its report), once per size."""
    try:
        proc = run_mpi("backend_smoke", nprocs, timeout=240)
    except pytest.fail.Exception as exc:  # a hung run fails every check of its size, and runs once
        return -1, str(exc)
    return proc.returncode, f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
@pytest.mark.parametrize("name", CHECK_NAMES)
def test_backend_operation(name: str, nprocs: int) -> None:
    pytest.importorskip("mpi4py")
    status, output = _run(nprocs)
    if f"CHECK {name} PASS" in output:
        return
    verdict = "failed" if f"CHECK {name} FAIL" in output else "did not run (an earlier check failed)"
    pytest.fail(f"{name} on {nprocs} ranks {verdict}; mpirun exited {status}\n{output}", pytrace=False)


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_every_rank_exits_cleanly(nprocs: int) -> None:
    pytest.importorskip("mpi4py")
    status, output = _run(nprocs)
    assert status == 0, f"mpirun exited {status}\n{output}"
    assert f"PASS backend_smoke n={nprocs} ({len(CHECK_NAMES)} checks)" in output, output


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
