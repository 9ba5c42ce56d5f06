"""Hand-written baseline collectives straight on a transport, for benchmarks.

:func:`raw_collectives` returns, for a communicator, the calls a user would
write without sparsecomm — ``torch.distributed`` on the same process group,
or ``mpi4py`` on the same MPI communicator — with no validation, staging or
accounting. Benchmarks time them beside our layer in the same run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bindings.base import Communicator

__all__ = ["RawCollectives", "raw_collectives"]

#: ``{op: fn(output, input)}``; all_reduce works in place on ``input`` and ignores ``output``.
RawCollectives = dict[str, Callable[[torch.Tensor, torch.Tensor], None]]


def raw_collectives(comm: Communicator) -> tuple[str, RawCollectives]:
    """Return (name of the baseline, its all_reduce / reduce_scatter / all_gather).

    Raises:
        ValueError: The communicator's transport has no raw baseline here.
    """
    from bindings.torch_backend import TorchCommunicator

    if isinstance(comm, TorchCommunicator):
        import torch.distributed as tdist

        pg = comm.process_group
        ag = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
        rs = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor
        return "torch.distributed", {
            "all_reduce": lambda out, inp: tdist.all_reduce(inp, group=pg),
            "reduce_scatter": lambda out, inp: rs(out, inp, group=pg),
            "all_gather": lambda out, inp: ag(out, inp, group=pg),
        }
    if comm.backend == "mpi":
        from bindings.mpi_backend import MPICommunicator

        assert isinstance(comm, MPICommunicator)
        mpi_comm = comm.mpi_comm
        from mpi4py import MPI

        def arr(t: torch.Tensor):  # type: ignore[no-untyped-def]
            return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()

        def all_reduce(out: torch.Tensor, inp: torch.Tensor) -> None:
            if inp.dtype == torch.bfloat16:  # no MPI bfloat16: what a user would do by hand
                wide = inp.float()
                mpi_comm.Allreduce(MPI.IN_PLACE, wide.numpy(), op=MPI.SUM)
                inp.copy_(wide)
            else:
                mpi_comm.Allreduce(MPI.IN_PLACE, inp.numpy(), op=MPI.SUM)

        def reduce_scatter(out: torch.Tensor, inp: torch.Tensor) -> None:
            if inp.dtype == torch.bfloat16:
                wide_out = torch.empty(out.shape, dtype=torch.float32)
                mpi_comm.Reduce_scatter_block(inp.float().numpy(), wide_out.numpy(), op=MPI.SUM)
                out.copy_(wide_out)
            else:
                mpi_comm.Reduce_scatter_block(inp.numpy(), out.numpy(), op=MPI.SUM)

        def all_gather(out: torch.Tensor, inp: torch.Tensor) -> None:
            mpi_comm.Allgather(arr(inp), arr(out))

        return "mpi4py", {
            "all_reduce": all_reduce,
            "reduce_scatter": reduce_scatter,
            "all_gather": all_gather,
        }
    raise ValueError(f"comm: no raw baseline for backend {comm.backend!r}")
