"""Transports of sparsecomm: the only package that calls torch.distributed, mpi4py or cupy.

A :class:`Communicator` runs collectives in torch.distributed spelling over
one of the backends ``gloo``, ``nccl`` (torch.distributed), ``mpi`` (mpi4py)
or ``cupy-nccl`` (cupy.cuda.nccl). Create one with :func:`create_communicator`.
"""

from __future__ import annotations

from bindings.base import Communicator, RawWork, Work
from bindings.communicator import BaseCommunicator, ChainedWork, DoneWork, Handle
from bindings.errors import (
    CollectiveMismatchError,
    CommAbortedError,
    CommError,
    CommTimeoutError,
    PeerFailureError,
)
from bindings.launch import LaunchInfo, detect_launch
from bindings.ops import ReduceOp, parse_reduce_op
from bindings.registry import BACKENDS, create_communicator
from bindings.stats import CommStats, OpStats, ring_bytes

__all__ = [
    "BACKENDS",
    "BaseCommunicator",
    "ChainedWork",
    "CollectiveMismatchError",
    "CommAbortedError",
    "CommError",
    "CommStats",
    "CommTimeoutError",
    "Communicator",
    "DoneWork",
    "Handle",
    "LaunchInfo",
    "OpStats",
    "PeerFailureError",
    "RawWork",
    "ReduceOp",
    "Work",
    "create_communicator",
    "detect_launch",
    "parse_reduce_op",
    "ring_bytes",
]
