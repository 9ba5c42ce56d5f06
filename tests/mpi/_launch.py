"""Run a worker script of ``tests/mpi/workers`` under ``mpirun`` with a hard deadline.

``run_mpi("backend_smoke", 4)`` runs
``mpirun -n 4 --oversubscribe --allow-run-as-root $MPIRUN_ARGS python -m mpi4py
tests/mpi/workers/backend_smoke.py`` from the repository root and returns the
completed process; on timeout it kills the whole process group and fails the
test with everything the ranks printed. Works as root in a container with
fewer cores than ranks.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

__all__ = ["ROOT", "find_mpirun", "run_mpi", "ULFM_ARGS"]

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ROOT / "tests" / "mpi" / "workers"

#: mpirun flags that turn on Open MPI's ULFM with a fast failure detector (DESIGN §2).
ULFM_ARGS = (
    "--with-ft", "ulfm", "--mca", "mpi_ft_detector", "true", "--mca", "mpi_ft_detector_timeout", "1",
)


def find_mpirun() -> str | None:
    """Return the ``mpirun`` next to this Python (a venv's Open MPI wheel), else on ``PATH``."""
    local = Path(sys.executable).parent / "mpirun"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which("mpirun")


def _env(extra_env: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(
        {
            "OMPI_MCA_rmaps_base_oversubscribe": "1",
            "OMPI_ALLOW_RUN_AS_ROOT": "1",
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "OMP_NUM_THREADS": "1",  # ranks share few cores; torch intra-op threads only contend
            "PYTHONUNBUFFERED": "1",
        }
    )
    if extra_env:
        env.update(extra_env)
    return env


def run_mpi(
    worker: str,
    nprocs: int,
    *args: str,
    timeout: float = 120,
    extra_env: Mapping[str, str] | None = None,
    mpirun_args: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """Run ``tests/mpi/workers/<worker>.py`` on ``nprocs`` ranks.

    Args:
        worker: Script name without ``.py``.
        nprocs: Number of ranks.
        *args: Arguments for the script.
        timeout: Wall-clock limit of the whole job in seconds.
        extra_env: Extra environment variables.
        mpirun_args: Extra mpirun flags (e.g. :data:`ULFM_ARGS`), after
            those from ``$MPIRUN_ARGS``.

    Returns:
        The completed process (text stdout / stderr); the caller checks ``returncode``.

    Skips the test when no ``mpirun`` exists; fails it on timeout.
    """
    mpirun = find_mpirun()
    if mpirun is None:
        pytest.skip("mpirun not found (pip install sparsecomm[mpi])")
    script = WORKERS / f"{worker}.py"
    if not script.is_file():
        raise FileNotFoundError(f"no MPI worker {script}")
    cmd = [
        mpirun,
        "-n",
        str(nprocs),
        "--oversubscribe",
        "--allow-run-as-root",
        *shlex.split(os.environ.get("MPIRUN_ARGS", "")),
        *mpirun_args,
        sys.executable,
        "-m",
        "mpi4py",
        str(script.relative_to(ROOT)),
        *args,
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=_env(extra_env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        pytest.fail(
            f"{' '.join(cmd)} ran past {timeout:g} s and was killed\n"
            f"--- stdout ---\n{out}\n--- stderr ---\n{err}",
            pytrace=False,
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
