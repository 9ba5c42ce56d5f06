"""A fault drill worker: ``python -m optim.testing.drill`` under :func:`resilient_comm.launcher.launch`.

Each process loops ``all_reduce`` steps over a :class:`FaultAwareCommunicator`,
checks every sum against the value expected for the current membership, votes
each step, and on a failure reconfigures and resumes at the last committed
step. It appends one JSON object per event to ``LOG_DIR/<pid>.jsonl``
(:class:`~resilient_comm.events.ProcessEvents`; ``time`` is ``time.time()``),
which the fault tests and ``sparsecomm bench recovery`` read:

* ``joined`` / ``promoted``: epoch, rank, world_size;
* ``committed``: step, epoch, rank, world_size (every committed step);
* ``raised``: the step and the error of a failed collective;
* ``reconfigured``: the :class:`~resilient_comm.Reconfiguration` fields;
* ``rejoined``: evicted while alive, registered again as a spare (then ``promoted`` or ``done``);
* ``resources``: open fds, threads and RSS bytes (every ``--resource-every`` steps);
* ``done`` / ``error``.

A wrong sum exits with status 2, a membership that cannot go on with 3.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch

from bindings.errors import CommError, PeerFailureError
from resilient_comm.errors import MembershipError, StaleEpochError
from resilient_comm.events import ProcessEvents
from resilient_comm.fault_aware import FaultAwareCommunicator

__all__ = ["command", "value_for", "expected_sum", "resources", "main"]


def command(*, steps: int, numel: int, sleep: float, log: str | Path, timeout: float | None = None) -> list[str]:
    """The command line of one drill worker (``timeout``: each collective's deadline, default the drill's own)."""
    cmd = [sys.executable, "-m", "optim.testing.drill", "--steps", str(steps), "--numel", str(numel)]
    cmd += ["--sleep", str(sleep), "--log", str(log)]
    return cmd if timeout is None else cmd + ["--timeout", str(timeout)]


def value_for(step: int, slot: int) -> float:
    """The value slot ``slot`` contributes at ``step``."""
    return float(step * 1000 + slot + 1)


def expected_sum(step: int, world_size: int) -> float:
    """The all_reduce sum of ``value_for`` over ``world_size`` slots."""
    return world_size * step * 1000.0 + world_size * (world_size + 1) / 2


def resources() -> dict[str, int]:
    """Open file descriptors, OS threads and resident bytes of this process (Linux ``/proc``)."""
    fds = len(os.listdir("/proc/self/fd"))
    threads = rss = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Threads:"):
            threads = int(line.split()[1])
        elif line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return {"fds": fds, "threads": threads, "py_threads": threading.active_count(), "rss": rss}


class _WrongSum(Exception):
    """A collective returned a wrong result (exit status 2)."""


def _run_steps(comm: FaultAwareCommunicator, args: argparse.Namespace, log: ProcessEvents, step: int) -> bool:
    """Run steps from ``step`` to the last; ``False`` when this member was evicted and is a spare again."""
    buf = torch.empty(args.numel, dtype=torch.float32)
    while step < args.steps:
        try:
            buf.fill_(value_for(step, comm.rank))
            comm.all_reduce(buf)
            want = expected_sum(step, comm.world_size)
            if not bool(torch.all(buf == want)):
                log("error", step=step, reason=f"wrong sum {buf[0].item()} != {want}")
                raise _WrongSum()
            if args.sleep:
                time.sleep(args.sleep)
            if comm.commit(step):
                log("committed", step=step, epoch=comm.epoch, rank=comm.rank, world_size=comm.world_size)
                if args.resource_every and step % args.resource_every == 0:
                    log("resources", step=step, **resources())
                step += 1
        except PeerFailureError as exc:
            log("raised", step=step, epoch=comm.epoch, error=str(exc)[:300], failed=sorted(exc.failed_ranks))
            try:
                change = comm.reconfigure()
            except StaleEpochError as stale:
                if not stale.rejoined:
                    raise
                log("rejoined", step=step, member=comm.member, reason=str(stale)[:300])
                return False
            step = change.committed_step + 1
            log("reconfigured", **dataclasses.asdict(change))
    return True


def main(argv: list[str] | None = None) -> int:
    """Run the drill (see the module docstring); returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m optim.testing.drill", description="all_reduce fault drill")
    p.add_argument("--steps", type=int, default=50, help="committed steps to run")
    p.add_argument("--numel", type=int, default=1 << 16, help="float32 elements per all_reduce")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds of 'compute' per step")
    p.add_argument("--timeout", type=float, default=30.0, help="deadline of each collective (s)")
    p.add_argument("--log", default=None, help="directory of the per-process event files")
    p.add_argument("--resource-every", type=int, default=0, help="log fds/threads/RSS every N steps (0: never)")
    p.add_argument("--max-rejoins", type=int, default=3, help="times an evicted process comes back as a spare")
    args = p.parse_args(argv)
    log = ProcessEvents(args.log)
    comm = FaultAwareCommunicator.connect(timeout=timedelta(seconds=args.timeout), max_rejoins=args.max_rejoins)
    step = 0
    try:
        while True:  # a member evicted while alive comes back here as a spare
            if comm.view is None:
                change = comm.wait_for_promotion()
                if change is None:
                    log("done", step=step, spare_unused=True)
                    comm.close()
                    return 0
                step = change.committed_step + 1
                log("promoted", **dataclasses.asdict(change))
            else:
                log("joined", epoch=comm.epoch, rank=comm.rank, world_size=comm.world_size)
            if _run_steps(comm, args, log, step):
                break
            step = 0
        log("done", step=args.steps, epoch=comm.epoch, rank=comm.rank)
        comm.close()
        return 0
    except _WrongSum:
        return 2
    except MembershipError as exc:
        log("error", step=step, reason=f"{type(exc).__name__}: {exc}")
        print(f"drill: cannot continue: {exc}", file=sys.stderr)
        return 3
    except CommError as exc:
        log("error", step=step, reason=f"{type(exc).__name__}: {exc}")
        print(f"drill: {exc}", file=sys.stderr)
        return 4


if __name__ == "__main__":
    # A transport of a failed epoch may still have a native wait pending until its own
    # timeout; interpreter teardown would then abort the process. Everything is closed
    # and flushed by now, so leave without the teardown.
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
