"""Errors of the fault-aware membership (raised only by :mod:`resilient_comm`).

Both derive from :class:`bindings.errors.CommError`, so a caller that handles
every transport fault with one ``except CommError`` handles these too.
"""

from __future__ import annotations

from bindings.errors import CommError

__all__ = ["MembershipError", "StaleEpochError"]


class MembershipError(CommError):
    """The fault-aware membership cannot go on as asked.

    Raised for: no quorum (a minority of the last view survived), fewer live
    members than ``min_world_size``, a foreign job id, or a second
    ``reconfigure()`` while one is running.
    """


class StaleEpochError(MembershipError):
    """This member acted for an epoch the job has left behind (it was declared failed).

    Attributes:
        rejoined: The process registered again as a spare (it is alive and the
            job still runs): it may call ``wait_for_promotion()`` and be given
            a slot again. ``False``: it is out of the job for good.
    """

    def __init__(self, message: str, *, rejoined: bool = False) -> None:
        super().__init__(message)
        self.rejoined = rejoined
