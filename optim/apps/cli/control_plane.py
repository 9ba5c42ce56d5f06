"""``sparsecomm launch`` and ``sparsecomm coordinator``: the fault-tolerant job's control plane from the shell."""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
from datetime import timedelta
from pathlib import Path

from resilient_comm import MODES, Coordinator, CoordinatorConfig
from resilient_comm.auth import ENV_SECRET, ENV_SECRET_FILE, JobSecret
from resilient_comm.launcher import LaunchConfig, launch

__all__ = ["add_launch_parsers"]


def _seconds(text: str) -> timedelta:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from exc
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return timedelta(seconds=value)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=MODES, default="hotswap", help="replace a dead slot with a spare, or shrink")
    p.add_argument("--min-world-size", type=int, default=1, help="fail rather than run with fewer workers")
    p.add_argument(
        "--heartbeat-timeout", type=_seconds, default=timedelta(seconds=2), help="seconds of silence = hung (2)"
    )
    p.add_argument(
        "--stall-grace",
        type=_seconds,
        default=timedelta(seconds=20),
        help="seconds more before silence alone may take away the majority (20)",
    )
    p.add_argument("--events", default=None, help="JSON-lines events file")
    p.add_argument(
        "--host", default="127.0.0.1", help="address the coordinator binds to (loopback; any other needs a job secret)"
    )
    p.add_argument("--port", type=int, default=0, help="coordinator port (0: any free one)")
    p.add_argument(
        "--store",
        default="tcp",
        help=(
            "the control-plane store: 'tcp' (the coordinator hosts it; the job ends if it is lost) or "
            "'etcd://HOST:PORT,...[/PREFIX]' (an etcd v3 cluster; further coordinators started with the same "
            "--job and secret stand by and take over when the active one is lost)"
        ),
    )


def add_launch_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``launch`` and ``coordinator``."""
    p = subparsers.add_parser(
        "launch",
        help="run a command as a fault-tolerant job: coordinator + N workers + S spares on this machine",
        description=(
            "Start a coordinator, NPROC workers and SPARES spares running CMD. Workers build their "
            "communicator with resilient_comm.FaultAwareCommunicator.connect() (the environment is set "
            "here). Exits with the workers' status."
        ),
    )
    p.add_argument("--nproc", type=int, required=True, help="workers")
    p.add_argument("--spares", type=int, default=0, help="spare processes in standby")
    p.add_argument("--backend", choices=("gloo", "nccl", "mpi"), default="gloo", help="data plane")
    p.add_argument("--job-timeout", type=_seconds, default=None, help="kill everything after this many seconds")
    p.add_argument(
        "--preload",
        default=None,
        help=(
            "comma-separated modules (e.g. torch,optim) a fork server imports once: a 'python -m MODULE' or "
            "'python SCRIPT' worker then starts in milliseconds (default: $SPARSECOMM_LAUNCH_PRELOAD)"
        ),
    )
    p.add_argument("--log-dir", default=None, help="each process's output to a file of its own there (<role>-<n>.log)")
    p.add_argument(
        "--job", default=None, help="job id (default: a fresh random one; with etcd, shared by its coordinators)"
    )
    _add_common(p)
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    p.set_defaults(func=_cmd_launch, cmd_parser=p)

    c = subparsers.add_parser(
        "coordinator",
        help="run a standalone coordinator (for workers started by torchrun or srun)",
        description=(
            "Host the job's store and membership protocol until the job ends (exit 0 once every worker of the "
            "final epoch has finished and the spares have left, 1 if the job failed) or until interrupted. "
            "Start workers with "
            "SPARSECOMM_COORDINATOR=HOST:PORT, SPARSECOMM_JOB_ID=JOB and SPARSECOMM_JOB_SECRET_FILE=PATH "
            "(printed at start). The job secret comes from $SPARSECOMM_JOB_SECRET or "
            "$SPARSECOMM_JOB_SECRET_FILE, else from --secret-file (made, mode 0600, if missing), else a "
            "fresh one is written to a private temporary file."
        ),
    )
    c.add_argument("--world-size", type=int, required=True, help="workers of the first epoch")
    c.add_argument("--job", default=None, help="job id (default: a fresh random one)")
    c.add_argument("--secret-file", type=Path, default=None, help="the job secret's file (made if missing)")
    _add_common(c)
    c.set_defaults(func=_cmd_coordinator, cmd_parser=c)


def _cmd_launch(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        args.cmd_parser.error("give the worker command after --")
    if args.backend == "mpi":
        args.cmd_parser.error(
            "--backend mpi: run the workers under 'mpirun --with-ft ulfm' instead (MPI spares are extra ranks)"
        )
    try:
        config = LaunchConfig(
            nproc=args.nproc,
            spares=args.spares,
            backend=args.backend,
            mode=args.mode,
            min_world_size=args.min_world_size,
            heartbeat_timeout=args.heartbeat_timeout,
            stall_grace=args.stall_grace,
            events=args.events,
            host=args.host,
            port=args.port,
            job_timeout=args.job_timeout,
            store=args.store,
            job=args.job,
            preload=None if args.preload is None else tuple(m for m in args.preload.split(",") if m),
            log_dir=args.log_dir,
        )
    except ValueError as exc:
        args.cmd_parser.error(str(exc))
    return launch(cmd, config)


def _coordinator_secret(path: Path | None) -> tuple[JobSecret, Path | None]:
    """The job secret and the file workers can read it from (``None``: they take it from the environment)."""
    secret = JobSecret.from_env()
    if secret is not None:
        if path is not None:
            raise ValueError(f"--secret-file: the secret is already set by ${ENV_SECRET} or ${ENV_SECRET_FILE}")
        return secret, None
    if path is not None and path.exists():
        return JobSecret.from_file(path), path
    if path is None:
        path = Path(tempfile.mkdtemp(prefix="sparsecomm-")) / "job.secret"  # the directory is the owner's alone
    secret = JobSecret.generate()
    return secret, secret.write(path)


def _cmd_coordinator(args: argparse.Namespace) -> int:
    kw = {} if args.job is None else {"job": args.job}
    try:
        secret, secret_file = _coordinator_secret(args.secret_file)
        config = CoordinatorConfig(
            world_size=args.world_size,
            mode=args.mode,
            min_world_size=args.min_world_size,
            heartbeat_timeout=args.heartbeat_timeout,
            ack_timeout=args.heartbeat_timeout,
            stall_grace=args.stall_grace,
            events=args.events,
            host=args.host,
            port=args.port,
            secret=secret,
            store=args.store,
            **kw,
        )
    except ValueError as exc:
        args.cmd_parser.error(str(exc))
    coordinator = Coordinator(config)
    coordinator.start()
    where = "" if secret_file is None else f" {ENV_SECRET_FILE}={secret_file}"
    print(f"SPARSECOMM_COORDINATOR={coordinator.address} SPARSECOMM_JOB_ID={coordinator.job}{where}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.2) and not coordinator.done:
        pass
    if coordinator.failed is not None:
        print(f"sparsecomm coordinator: job failed: {coordinator.failed}", file=sys.stderr)
        coordinator.stop()
        return 1
    if not coordinator.done:  # interrupted: tell whoever still waits that the job is over
        coordinator.shutdown()
    elif coordinator.completed:
        print(f"sparsecomm coordinator: job {coordinator.job} completed", file=sys.stderr)
    coordinator.stop()
    return 0
