"""mpirun worker: the sparse-collective bodies of tests/common over backend "mpi"."""

from __future__ import annotations

from datetime import timedelta

import torch

import sparsecomm.distributed as dist
from tests.common.sparse_cases import SPARSE_CASES, run_sparse_cases


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("mpi", timeout=timedelta(seconds=60))
    rank, ws = dist.get_rank(), dist.get_world_size()
    done = run_sparse_cases(rank, ws)
    assert set(done) == set(SPARSE_CASES)
    counts = torch.tensor(list(done.values()), dtype=torch.int64)
    lo, hi = counts.clone(), counts.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    assert torch.equal(lo, hi) and bool((lo > 0).all()), (done, lo, hi)
    if rank == 0:
        print("OK", ws, done, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
