"""mpirun worker: the SCAPE bodies of tests/dist/test_scape.py over backend "mpi"."""

from __future__ import annotations

from datetime import timedelta

import torch
from mpi4py import MPI

import sparsecomm.distributed as dist
from tests.dist.test_scape import _rank_dense_equivalence, _rank_sparse, check_dense_equivalence, check_sparse


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("mpi", timeout=timedelta(seconds=60))
    rank, ws = dist.get_rank(), dist.get_world_size()
    world = MPI.COMM_WORLD
    dense = world.gather(_rank_dense_equivalence(rank, ws, 4), root=0)
    sparse = world.gather(_rank_sparse(rank, ws, 1, "freeze", True), root=0)
    if rank == 0:
        check_dense_equivalence(dense)
        check_sparse(sparse, 1)
        print("OK", ws, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
