"""The transport protocol: what every communicator offers.

Collectives use torch.distributed spellings and semantics. Ranks are ranks
*of this communicator* (0 … world_size-1). Every collective is blocking by
default; with ``async_op=True`` it returns a :class:`Work` handle whose
``wait(timeout)`` finishes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import torch

from bindings.ops import ReduceOp
from bindings.stats import CommStats

__all__ = ["Work", "Communicator", "RawWork"]


@runtime_checkable
class Work(Protocol):
    """Handle of an asynchronous operation."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the operation finished; raise a ``CommError`` on failure or timeout."""
        ...

    def is_completed(self) -> bool:
        """Return whether the transport finished the operation (``wait`` is still needed)."""
        ...


class RawWork(Protocol):
    """What a transport implementation hands back to :class:`BaseCommunicator`.

    ``wait`` takes a deadline in seconds (``None``: no deadline) and raises
    ``CommTimeoutError``, ``PeerFailureError`` or another ``CommError``.
    """

    def wait(self, timeout_s: float | None) -> None: ...

    def is_completed(self) -> bool: ...


@runtime_checkable
class Communicator(Protocol):
    """A group of ranks that can run collectives together.

    Implementations: :class:`bindings.torch_backend.TorchCommunicator`
    (``gloo``, ``nccl``), :class:`bindings.mpi_backend.MPICommunicator`
    (``mpi``) and :class:`bindings.cupy_nccl.CupyNcclCommunicator`
    (``cupy-nccl``); the fault-aware communicator of ``resilient_comm``
    implements it too.
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def backend(self) -> str: ...

    @property
    def timeout(self) -> timedelta: ...

    @property
    def stats(self) -> CommStats: ...

    def all_reduce(self, tensor: torch.Tensor, op: Any = ReduceOp.SUM, *, async_op: bool = False) -> Work | None: ...

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: Any = ReduceOp.SUM,
        *,
        async_op: bool = False,
    ) -> Work | None: ...

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Work | None: ...

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Work | None: ...

    def barrier(self, *, async_op: bool = False) -> Work | None: ...

    def send(self, tensor: torch.Tensor, dst: int, *, tag: int = 0, async_op: bool = False) -> Work | None: ...

    def recv(self, tensor: torch.Tensor, src: int | None, *, tag: int = 0, async_op: bool = False) -> Work | int: ...

    def split(self, ranks: Sequence[int]) -> Communicator | None: ...

    def abort(self) -> None: ...

    def close(self) -> None: ...
