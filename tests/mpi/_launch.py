"""Run a worker script of ``tests/mpi/workers`` under ``mpirun`` with a hard deadline.

``run_mpi("backend_smoke", 4)`` runs
``mpirun -n 4 --oversubscribe --allow-run-as-root $SPARSECOMM_MPIRUN_ARGS
python -m mpi4py tests/mpi/workers/backend_smoke.py`` (built by
:func:`bindings.spawn.mpirun_python`) from the repository root and returns the
completed process; on timeout it stops mpirun and every rank it started
(they share mpirun's session) and fails the test with everything the ranks
printed. Works as root in a container with fewer cores than ranks.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest

from bindings.spawn import find_mpirun, mpirun_python

__all__ = ["ROOT", "WORKERS", "run_mpi", "run_mpi_ok"]

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ROOT / "tests" / "mpi" / "workers"


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


def _session_members(sid: int) -> list[int]:
    """PIDs whose session id is ``sid`` (mpirun puts each rank in its own process group)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()  # after "(comm)": state ppid pgrp session ...
        if len(fields) > 3 and int(fields[3]) == sid:
            pids.append(int(entry.name))
    return pids


def _kill_session(proc: subprocess.Popen[str]) -> None:
    """Stop mpirun and every rank it started (they share the session ``proc.pid`` leads)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # mpirun forwards it to the ranks
        proc.wait(timeout=5)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    if proc.poll() is None:
        proc.kill()
    for pid in _session_members(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_mpi(
    worker: str,
    nprocs: int,
    *args: str,
    timeout: float = 120,
    extra_env: Mapping[str, str] | None = None,
    ulfm: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``tests/mpi/workers/<worker>.py`` on ``nprocs`` ranks.

    Args:
        worker: Script name without ``.py``.
        nprocs: Number of ranks.
        *args: Arguments for the script.
        timeout: Wall-clock limit of the whole job in seconds.
        extra_env: Extra environment variables.
        ulfm: Turn on ULFM fault tolerance (see :func:`bindings.spawn.mpirun_command`).

    Returns:
        The completed process (text stdout / stderr); the caller checks ``returncode``.

    Skips the test when no ``mpirun`` exists; fails it on timeout.
    """
    if find_mpirun() is None:
        pytest.skip("mpirun not found (pip install sparsecomm[mpi])")
    script = WORKERS / f"{worker}.py"
    if not script.is_file():
        raise FileNotFoundError(f"no MPI worker {script}")
    cmd = mpirun_python(nprocs, [str(script.relative_to(ROOT)), *args], ulfm=ulfm)
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
        _kill_session(proc)
        out, err = proc.communicate()
        pytest.fail(
            f"{' '.join(cmd)} ran past {timeout:g} s and was killed\n--- stdout ---\n{out}\n--- stderr ---\n{err}",
            pytrace=False,
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_mpi_ok(worker: str, nprocs: int, *args: str, timeout: float = 120) -> str:
    """:func:`run_mpi`, failing the test unless mpirun exits 0; its stdout.

    Args:
        worker: Script name without ``.py``.
        nprocs: Number of ranks.
        *args: Arguments for the script.
        timeout: Wall-clock limit of the whole job in seconds.
    """
    proc = run_mpi(worker, nprocs, *args, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout
