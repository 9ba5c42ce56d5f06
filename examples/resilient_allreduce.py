"""A loop of all_reduce steps that survives failures (run it under ``sparsecomm launch``).

    sparsecomm launch --nproc 4 --spares 1 --events events.jsonl -- python examples/resilient_allreduce.py --steps 50

Every step all-reduces a vector whose value on each rank is ``step * 1000 + slot + 1``
and checks the result against the sum expected for the current membership,
then votes the step: it counts only if every member of the epoch agrees. On a
failure the collective raises ``PeerFailureError``; the survivors (and the
promoted spare) call ``reconfigure()`` and go on from the last committed step.
Prints one line per committed step (rank 0) and exits 0 after ``--steps``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch

from bindings.errors import PeerFailureError
from resilient_comm import FaultAwareCommunicator
from resilient_comm.errors import MembershipError


def expected_sum(step: int, world_size: int) -> float:
    """Sum over slots s of ``step * 1000 + s + 1``."""
    return world_size * step * 1000.0 + world_size * (world_size + 1) / 2


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50, help="committed steps to run")
    p.add_argument("--numel", type=int, default=1 << 16, help="elements per all_reduce")
    p.add_argument("--sleep", type=float, default=0.02, help="seconds of 'compute' per step")
    p.add_argument("--timeout", type=float, default=30.0, help="deadline of each collective (s)")
    args = p.parse_args()
    comm = FaultAwareCommunicator.connect(timeout=timedelta(seconds=args.timeout))
    if comm.view is None:  # a spare
        change = comm.wait_for_promotion()
        if change is None:
            comm.close()
            return 0
        step = change.committed_step + 1
        print(f"[pid {os.getpid()}] promoted into slot {change.rank} of epoch {change.epoch}", flush=True)
    else:
        step = 0
    while step < args.steps:
        try:
            value = torch.full((args.numel,), float(step * 1000 + comm.rank + 1), dtype=torch.float64)
            comm.all_reduce(value)
            want = expected_sum(step, comm.world_size)
            if not torch.all(value == want):
                print(f"WRONG SUM at step {step}: {value[0].item()} != {want}", file=sys.stderr, flush=True)
                return 2
            time.sleep(args.sleep)
            if comm.commit(step):
                if comm.rank == 0:
                    print(f"step {step} epoch {comm.epoch} world {comm.world_size} sum {want:.0f} ok", flush=True)
                step += 1
        except PeerFailureError as exc:
            print(f"[slot {comm.rank}] step {step}: {exc}", file=sys.stderr, flush=True)
            try:
                change = comm.reconfigure()
            except MembershipError as err:
                print(f"[pid {os.getpid()}] cannot continue: {err}", file=sys.stderr, flush=True)
                return 3
            step = change.committed_step + 1
            print(
                f"[pid {os.getpid()}] epoch {change.epoch} ({change.mode}): rank {change.rank} of "
                f"{change.world_size}, lost slots {list(change.lost_slots)}, resuming at step {step}",
                file=sys.stderr,
                flush=True,
            )
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
