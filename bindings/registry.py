"""Create a communicator by backend name, from explicit arguments or the launch environment."""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

from bindings.communicator import BaseCommunicator
from bindings.launch import detect_launch
from bindings.validate import check_int

__all__ = [
    "BACKENDS",
    "DEFAULT_TIMEOUT",
    "CHECK_COLLECTIVES_ENV",
    "TIMEOUT_ENV",
    "create_communicator",
    "default_check_collectives",
]

logger = logging.getLogger(__name__)

#: Backend names :func:`create_communicator` understands.
BACKENDS: tuple[str, ...] = ("gloo", "nccl", "mpi", "cupy-nccl")
#: Default deadline of every blocking call (torch.distributed's default for gloo).
DEFAULT_TIMEOUT = timedelta(minutes=30)
#: ``1`` turns on the cross-rank metadata check of every collective by default.
CHECK_COLLECTIVES_ENV = "SPARSECOMM_CHECK_COLLECTIVES"
#: Seconds; overrides :data:`DEFAULT_TIMEOUT` when no timeout is passed.
TIMEOUT_ENV = "SPARSECOMM_TIMEOUT"


def default_check_collectives() -> bool:
    """Return the default of ``check_collectives``: ``$SPARSECOMM_CHECK_COLLECTIVES`` or off."""
    raw = os.environ.get(CHECK_COLLECTIVES_ENV, "0").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{CHECK_COLLECTIVES_ENV}={raw!r}: expected 0 or 1")


def _default_timeout() -> timedelta:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: expected seconds") from None
    if seconds <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: must be positive")
    return timedelta(seconds=seconds)


def create_communicator(
    backend: str,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    store: Any = None,
    init_method: str | None = None,
    timeout: timedelta | None = None,
    check_collectives: bool | None = None,
) -> BaseCommunicator:
    """Create the world communicator of ``backend``.

    Collective: every process of the job must call this.

    Explicit arguments win over the launch environment (torchrun, Open MPI,
    MPICH, Slurm variables; see :mod:`bindings.launch`).

    Args:
        backend: ``gloo``, ``nccl``, ``mpi`` or ``cupy-nccl`` (also torch's
            device-map form such as ``"cpu:gloo,cuda:nccl"``).
        rank: This process's rank (``mpi``: must match the MPI rank if given).
        world_size: Number of processes.
        store: A ``torch.distributed.Store`` for rendezvous (gloo, nccl, cupy-nccl).
        init_method: A torch init URL such as ``tcp://host:port`` or ``env://``.
        timeout: Deadline of every blocking call; default 30 min or
            ``$SPARSECOMM_TIMEOUT`` seconds.
        check_collectives: Cross-rank metadata check before each collective
            (see :class:`~bindings.communicator.BaseCommunicator`); default
            ``$SPARSECOMM_CHECK_COLLECTIVES`` or off.

    Raises:
        ValueError: Unknown backend or inconsistent rank / world size.
        RuntimeError: The backend's library is missing, or rendezvous is impossible.
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a str, got {type(backend).__name__}")
    name = backend.lower()
    if timeout is None:
        timeout = _default_timeout()
    if not isinstance(timeout, timedelta):
        raise TypeError(f"timeout: expected a datetime.timedelta, got {type(timeout).__name__}")
    if check_collectives is None:
        check_collectives = default_check_collectives()
    rank = None if rank is None else check_int("rank", rank)
    world_size = None if world_size is None else check_int("world_size", world_size)

    if name == "mpi":
        from bindings.mpi_backend import MPICommunicator

        comm = MPICommunicator(timeout=timeout, check_collectives=check_collectives)
        if rank is not None and rank != comm.rank:
            raise ValueError(f"rank: {rank} differs from the MPI rank {comm.rank}")
        if world_size is not None and world_size != comm.world_size:
            raise ValueError(f"world_size: {world_size} differs from the MPI size {comm.world_size}")
        return comm

    rank, world_size = _resolve_rank(rank, world_size)
    if name == "cupy-nccl":
        from bindings.cupy_nccl import CupyNcclCommunicator

        if store is None:
            store = _make_store(rank, world_size, init_method, timeout)
        return CupyNcclCommunicator(store, rank, world_size, timeout=timeout, check_collectives=check_collectives)

    if name in ("gloo", "nccl") or ":" in name:
        import torch.distributed as tdist

        from bindings.torch_backend import TorchCommunicator

        owns = not tdist.is_initialized()
        if owns:
            if store is None and init_method is None:
                init_method = _env_init_method()
            tdist.init_process_group(
                backend=name,
                init_method=init_method,
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=timeout,
            )
        return TorchCommunicator(None, timeout=timeout, check_collectives=check_collectives, owns_world=owns)

    raise ValueError(f"backend: unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")


def _resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    info = detect_launch()
    if rank is None:
        if info is None:
            raise ValueError("rank: not given and no launcher (torchrun, mpirun, srun) detected in the environment")
        rank = info.rank
    if world_size is None:
        if info is None:
            raise ValueError(
                "world_size: not given and no launcher (torchrun, mpirun, srun) detected in the environment"
            )
        world_size = info.world_size
    if world_size < 1:
        raise ValueError(f"world_size: must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: {rank} is out of range for world_size {world_size}")
    return rank, world_size


def _rendezvous_address() -> tuple[str, int]:
    info = detect_launch()
    addr = os.environ.get("MASTER_ADDR") or (info.master_addr if info else None)
    if not addr:
        raise RuntimeError("rendezvous: set MASTER_ADDR (and MASTER_PORT), or pass init_method= or store=")
    port = int(os.environ.get("MASTER_PORT", info.master_port if info else 29500))
    return addr, port


def _env_init_method() -> str:
    addr, port = _rendezvous_address()
    return f"tcp://{addr}:{port}"


def _make_store(rank: int, world_size: int, init_method: str | None, timeout: timedelta) -> Any:
    import torch.distributed as tdist

    if init_method is not None and init_method.startswith("file://"):
        return tdist.FileStore(init_method[len("file://") :], world_size)
    if init_method is not None and init_method.startswith("tcp://"):
        host, _, port = init_method[len("tcp://") :].partition(":")
        addr, port_no = host, int(port)
    else:
        addr, port_no = _rendezvous_address()
    return tdist.TCPStore(addr, port_no, world_size, is_master=rank == 0, timeout=timeout)
