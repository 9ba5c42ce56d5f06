"""mpirun worker: the differential and bad-input bodies of tests/common over backend "mpi".

Run: ``mpirun -n 4 python -m mpi4py tests/mpi/workers/drop_in.py [--check-collectives]``.
An uncaught exception on any rank aborts the job (``-m mpi4py``), so a
failure can never leave the other ranks waiting.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch

import sparsecomm.distributed as dist
from tests.common.bad_input_cases import case_bad_arguments, case_mismatch_detected
from tests.common.drop_in_cases import CASES, run_cases


def main(argv: list[str]) -> None:
    check = "--check-collectives" in argv
    torch.set_num_threads(1)
    dist.init_process_group("mpi", timeout=timedelta(seconds=60), check_collectives=check)
    rank, ws = dist.get_rank(), dist.get_world_size()
    assert dist.get_backend() == "mpi"
    if check:
        done = {"mismatch_detected": case_mismatch_detected(rank, ws)}
    else:
        done = run_cases(rank, ws)
        assert set(done) == set(CASES)
        done["bad_arguments"] = case_bad_arguments(rank, ws)
    # every rank must have run the same number of checks
    counts = torch.tensor(list(done.values()), dtype=torch.int64)
    lo, hi = counts.clone(), counts.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    assert torch.equal(lo, hi), (done, lo, hi)
    if rank == 0:
        print("OK", ws, done, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
