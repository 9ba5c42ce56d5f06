"""Error types shared by every package of sparsecomm.

Argument problems raise the built-in ``ValueError`` / ``TypeError`` before any
communication. Faults of the transport itself raise a :class:`CommError`.
"""

from __future__ import annotations

__all__ = [
    "CommError",
    "CommTimeoutError",
    "PeerFailureError",
    "CommAbortedError",
    "CollectiveMismatchError",
    "MembershipError",
    "StaleEpochError",
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


class MembershipError(CommError):
    """The fault-aware membership cannot go on as asked.

    Raised for: no quorum (a minority of the last view survived), fewer live
    members than ``min_world_size``, a foreign job id, or a second
    ``reconfigure()`` while one is running.
    """


class StaleEpochError(MembershipError):
    """This member acted for an epoch the job has left behind (it was declared failed)."""
