"""ULFM (MPI User-Level Failure Mitigation) primitives, over mpi4py.

The only place outside :mod:`bindings.mpi_backend` that touches mpi4py for the
fault-tolerant MPI path: :class:`resilient_comm.ulfm_communicator.UlfmCommunicator` drives
these through :class:`FtComm`, an opaque handle on one MPI communicator, and
never sees mpi4py itself.

Every wait polls a non-blocking request against a deadline (``Iagree``,
``Iallgather``, ``Ibarrier``), except ``Split`` (MPI has no non-blocking split)
and ``Shrink`` (Open MPI 5.0.11's ``Ishrink`` fails with ``MPI_ERR_INTERN``).
ULFM errors (``ERR_PROC_FAILED``, ``ERR_REVOKED``) become :class:`~bindings.errors.PeerFailureError`, a missed deadline
:class:`~bindings.errors.CommTimeoutError`.

ULFM needs Open MPI >= 5 started with ``mpirun --with-ft ulfm`` (see
:func:`bindings.spawn.mpirun_command` with ``ulfm=True``); :func:`ulfm_support`
says why it is unavailable otherwise.
"""

from __future__ import annotations

import array
import logging
import os
from datetime import timedelta
from typing import Any

from bindings.errors import CommError
from bindings.mpi_backend import MPICommunicator, MPIWork, import_mpi, translate_mpi_error

__all__ = ["FtComm", "ulfm_support"]

logger = logging.getLogger(__name__)

_ULFM_CALLS = ("Revoke", "Is_revoked", "Shrink", "Iagree", "Get_failed")


def ulfm_support() -> str | None:
    """Return why ULFM cannot be used in this process, or ``None`` when it can.

    Checks that mpi4py imports, exposes the ULFM calls (Open MPI only) and
    that the job was started with fault tolerance on (``--with-ft ulfm`` sets
    ``OMPI_MCA_mpi_ft_enable``); ``$SPARSECOMM_ULFM=1`` skips the last check.
    """
    try:
        MPI = import_mpi()
    except ImportError as exc:
        return str(exc)
    missing = [n for n in _ULFM_CALLS if not hasattr(MPI.Comm, n)]
    if missing:
        return f"mpi4py {MPI.Get_library_version().splitlines()[0]} lacks ULFM calls: {', '.join(missing)}"
    forced = os.environ.get("SPARSECOMM_ULFM", "").strip().lower() in ("1", "true", "yes", "on")
    enabled = os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() in ("1", "true", "yes", "on")
    if not (forced or enabled):
        return "fault tolerance is off: start the job with mpirun --with-ft ulfm (bindings.spawn, ulfm=True)"
    return None


class FtComm:
    """An opaque handle on one mpi4py intracommunicator with the ULFM operations.

    Args:
        MPI: The ``mpi4py.MPI`` module.
        comm: The communicator (its error handler is set to ``ERRORS_RETURN``).
        owned: Whether :meth:`free` releases it.
    """

    def __init__(self, MPI: Any, comm: Any, *, owned: bool = True) -> None:
        self._MPI = MPI
        self._comm = comm
        self._owned = owned
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()

    @classmethod
    def world(cls) -> FtComm:
        """A private duplicate of ``COMM_WORLD`` (the job's universe: actives and spares)."""
        MPI = import_mpi()
        MPI.COMM_WORLD.Set_errhandler(MPI.ERRORS_RETURN)
        try:
            dup = MPI.COMM_WORLD.Dup()
        except MPI.Exception as exc:
            raise translate_mpi_error(MPI, "world", exc) from exc
        return cls(MPI, dup)

    @classmethod
    def of(cls, comm: MPICommunicator) -> FtComm:
        """A non-owning handle on an :class:`MPICommunicator`'s communicator."""
        return cls(comm._MPI, comm.mpi_comm, owned=False)

    def _work(self, op: str, req: Any, keep: tuple[Any, ...] = ()) -> MPIWork:
        return MPIWork(self._MPI, op, req, keep)

    # ------------------------------------------------------------------ ULFM
    def revoke(self) -> None:
        """Revoke (idempotent; non-collective): every pending and later operation on it fails everywhere."""
        MPI = self._MPI
        try:
            if not self._comm.Is_revoked():
                self._comm.Revoke()
        except MPI.Exception as exc:
            logger.debug("ulfm: revoke raised %s", exc)

    def is_revoked(self) -> bool:
        """Whether the communicator was revoked (a local check)."""
        try:
            return bool(self._comm.Is_revoked())
        except self._MPI.Exception:
            return True

    def shrink(self) -> FtComm:
        """Collective over the live processes, blocking: a new communicator without the failed ones.

        Blocking ``Shrink``: Open MPI 5.0.11's ``Ishrink`` fails with
        ``MPI_ERR_INTERN`` after a process failure, so there is no deadline here.

        Raises:
            PeerFailureError: A process failed during the shrink.
        """
        MPI = self._MPI
        try:
            new = self._comm.Shrink()
        except MPI.Exception as exc:
            raise translate_mpi_error(MPI, "shrink", exc) from exc
        return FtComm(MPI, new)

    def agree(self, flag: int, timeout_s: float) -> int:
        """Fault-tolerant consensus: the bitwise AND of every live process's ``flag``.

        Raises:
            PeerFailureError: A process of the communicator failed (the value
                is still agreed among the rest, but is not returned).
            CommTimeoutError: Not every live process joined by the deadline.
        """
        MPI = self._MPI
        buf = array.array("i", [int(flag)])
        try:
            req = self._comm.Iagree(buf)  # a C int buffer
        except MPI.Exception as exc:
            raise translate_mpi_error(MPI, "agree", exc) from exc
        self._work("agree", req, (buf,)).wait(timeout_s)
        return int(buf[0])

    def allgather(self, values: list[int], timeout_s: float) -> list[list[int]]:
        """Every process's ``values`` (same length everywhere; int64), by rank."""
        MPI = self._MPI
        n = len(values)
        send = array.array("q", values)
        recv = array.array("q", [0] * (n * self.size))
        try:
            req = self._comm.Iallgather([send, MPI.INT64_T], [recv, MPI.INT64_T])
        except MPI.Exception as exc:
            raise translate_mpi_error(MPI, "allgather", exc) from exc
        self._work("allgather", req, (send, recv)).wait(timeout_s)
        return [list(recv[i * n : (i + 1) * n]) for i in range(self.size)]

    def ibarrier(self) -> MPIWork:
        """Post a non-blocking barrier; its work fails with ``PeerFailureError`` on revoke."""
        MPI = self._MPI
        try:
            req = self._comm.Ibarrier()
        except MPI.Exception as exc:
            raise translate_mpi_error(MPI, "barrier", exc) from exc
        return self._work("barrier", req)

    def split(self, color: int | None, key: int) -> FtComm | None:
        """Collective, blocking: ``color=None`` opts out (returns ``None``)."""
        MPI = self._MPI
        try:
            new = self._comm.Split(MPI.UNDEFINED if color is None else color, key)
        except MPI.Exception as exc:
            raise translate_mpi_error(MPI, "split", exc) from exc
        return None if new == MPI.COMM_NULL else FtComm(MPI, new)

    def failed_ranks(self) -> frozenset[int]:
        """Ranks of this communicator that MPI knows have failed (local knowledge)."""
        MPI = self._MPI
        try:
            failed = self._comm.Get_failed()
        except (MPI.Exception, NotImplementedError):
            return frozenset()
        try:
            if failed.Get_size() == 0:
                return frozenset()
            ranks = MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())), self._comm.Get_group())
            return frozenset(int(r) for r in ranks if r != MPI.UNDEFINED)
        finally:
            failed.Free()

    def communicator(self, timeout: timedelta, check_collectives: bool = False) -> MPICommunicator:
        """Hand the communicator to a new :class:`MPICommunicator` (which now owns it)."""
        if not self._owned:
            raise CommError("communicator: this handle does not own its communicator")
        self._owned = False
        return MPICommunicator._adopt(self._MPI, self._comm, timeout, check_collectives)

    def free(self) -> None:
        """Release the communicator if this handle owns it (idempotent; errors ignored)."""
        if not self._owned:
            return
        self._owned = False
        try:
            self._comm.Free()
        except self._MPI.Exception as exc:
            logger.debug("ulfm: free raised %s", exc)
