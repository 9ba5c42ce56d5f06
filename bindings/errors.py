"""Error types shared by every package of sparsecomm.

Argument problems raise the built-in ``ValueError`` / ``TypeError`` before any
communication. Faults of the transport itself raise a :class:`CommError`.
The membership errors of the fault-aware communicator derive from it too and
live with it in :mod:`resilient_comm.errors`.
"""

from __future__ import annotations

__all__ = [
    "CommError",
    "CommTimeoutError",
    "PeerFailureError",
    "CommAbortedError",
    "CollectiveMismatchError",
]


class CommError(RuntimeError):
    """Base class of every transport fault raised by sparsecomm."""


class CommTimeoutError(CommError, TimeoutError):
    """A collective or point-to-point operation did not finish before its deadline."""


class PeerFailureError(CommError):
    """A peer died, closed its connection or aborted the communicator.

    Attributes:
        failed_ranks: Ranks known to have failed (may be empty when the
            transport cannot tell which peer it lost).
    """

    def __init__(self, message: str, failed_ranks: frozenset[int] = frozenset()) -> None:
        super().__init__(message)
        self.failed_ranks = frozenset(failed_ranks)


class CommAbortedError(CommError):
    """The communicator was aborted locally; it cannot be used again."""


class CollectiveMismatchError(CommError, ValueError):
    """Ranks called the same collective with arguments that do not agree.

    Raised on every rank by the optional metadata check (see
    ``check_collectives`` in :func:`bindings.create_communicator`).
    """
