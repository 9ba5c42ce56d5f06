"""``mpi`` transport over mpi4py (Open MPI or MPICH).

CPU tensors travel as zero-copy numpy views. CUDA tensors go through
``__cuda_array_interface__`` when MPI is CUDA-aware (after synchronizing the
current stream), otherwise through a host copy. MPI has no float16/bfloat16
reductions, so those reduce in a float32 copy; ``bool`` reduces as ``uint8``
with torch's (gloo's) logical meaning: SUM/MAX are OR, PRODUCT/MIN are AND.

Every operation is non-blocking; :class:`_MPIWork` polls ``Request.Test()``
until done or the deadline, so a wait never hangs past its timeout.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from bindings.base import RawWork
from bindings.communicator import BaseCommunicator
from bindings.errors import CommError, CommTimeoutError, PeerFailureError
from bindings.ops import ReduceOp

__all__ = ["MPICommunicator", "cuda_aware"]

logger = logging.getLogger(__name__)

_INSTALL_HINT = "pip install sparsecomm[mpi]"

#: Poll with ``Test()`` + ``sched_yield()`` this long before sleeping between polls.
_SPIN_S = 2e-3
#: Sleep at most this fraction of the time already waited (bounds the added latency) ...
_SLEEP_FRACTION = 0.02
#: ... and never longer than this.
_MAX_SLEEP_S = 1e-3

# Data movement reinterprets dtypes MPI lacks as same-size integers.
_MOVE_AS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.bool: torch.uint8}
_HALF = (torch.float16, torch.bfloat16)
# bool reduces as uint8 0/1, with the logical meaning gloo gives each operator.
_BOOL_OPS = {
    ReduceOp.SUM: ReduceOp.BOR,
    ReduceOp.MAX: ReduceOp.BOR,
    ReduceOp.PRODUCT: ReduceOp.BAND,
    ReduceOp.MIN: ReduceOp.BAND,
}


def _mpi() -> Any:
    """Import ``mpi4py.MPI`` (initializing MPI) or explain how to install it."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(
            f"the 'mpi' backend needs mpi4py and an MPI library ({_INSTALL_HINT}): {exc}"
        ) from exc
    return MPI


def cuda_aware() -> bool:
    """Return whether the MPI library accepts CUDA device buffers.

    ``$SPARSECOMM_MPI_CUDA_AWARE`` (``1``/``0``) overrides detection. Otherwise
    ask ``MPI.Query_cuda_support()`` when mpi4py has it, then Open MPI's
    ``MPIX_Query_cuda_support()`` or MPICH's ``MPIX_GPU_query_support()`` in
    the loaded library, then ``$OMPI_MCA_opal_cuda_support``.
    """
    env = os.environ.get("SPARSECOMM_MPI_CUDA_AWARE")
    if env is not None:
        return env.strip().lower() in ("1", "true", "yes", "on")
    MPI = _mpi()
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        return bool(query())
    try:
        lib = ctypes.CDLL(MPI.__file__)  # already loaded: dlsym also searches libmpi
    except OSError:
        lib = None
    if lib is not None:
        ompi = getattr(lib, "MPIX_Query_cuda_support", None)
        if ompi is not None:
            return bool(ompi())
        mpich = getattr(lib, "MPIX_GPU_query_support", None)
        if mpich is not None:
            flag = ctypes.c_int(0)
            return mpich(0, ctypes.byref(flag)) == 0 and bool(flag.value)  # 0: MPIX_GPU_SUPPORT_CUDA
    return os.environ.get("OMPI_MCA_opal_cuda_support", "").lower() in ("1", "true", "yes")


class _NbcAllreduceTuning:
    """Make Open MPI's non-blocking all_reduce as fast as its blocking one.

    libnbc runs every in-place ``Iallreduce`` (and every one on < 4 ranks) as
    a binomial reduce + broadcast: 1.2x (4 ranks) to 2.1x (2 ranks) the time
    of the blocking ``Allreduce`` at 16 MB. Its reduce-scatter/all-gather
    (Rabenseifner) algorithm matches the blocking one, so around each large
    post we set the MPI_T control variable ``coll_libnbc_iallreduce_algorithm``
    to 3 and back to 0. The choice depends only on (count, size, ranks), so
    every rank picks the same schedule. Inactive unless that variable exists
    and is 0 (the user did not choose an algorithm).
    """

    MIN_BYTES = 1 << 16  # libnbc's own binomial / Rabenseifner threshold

    def __init__(self, MPI: Any) -> None:
        self._write: Callable[[int], int] | None = None
        try:
            lib = ctypes.CDLL(MPI.__file__)
            provided, idx, count = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
            handle, value = ctypes.c_void_p(), ctypes.c_int(-1)
            ok = (
                lib.MPI_T_init_thread(MPI.Query_thread(), ctypes.byref(provided)) == 0
                and lib.MPI_T_cvar_get_index(
                    b"coll_libnbc_iallreduce_algorithm", ctypes.byref(idx)
                ) == 0
                and lib.MPI_T_cvar_handle_alloc(
                    idx, None, ctypes.byref(handle), ctypes.byref(count)
                ) == 0
                and lib.MPI_T_cvar_read(handle, ctypes.byref(value)) == 0
            )
        except (OSError, AttributeError):  # not Open MPI, or no MPI_T
            return
        if ok and value.value == 0:
            self._write = lambda v: lib.MPI_T_cvar_write(handle, ctypes.byref(ctypes.c_int(v)))

    def algorithm(self, count: int, itemsize: int, world_size: int) -> int:
        """Return the libnbc algorithm to use (0: libnbc's default choice)."""
        if self._write is None or count * itemsize < self.MIN_BYTES:
            return 0
        return 3 if count >= 1 << (world_size.bit_length() - 1) else 0

    def post(self, alg: int, fn: Callable[..., Any], *args: Any) -> Any:
        """Call ``fn(*args)`` (an ``Iallreduce``) with libnbc algorithm ``alg``."""
        with _POST_LOCK:  # no other post of ours between the two writes
            if alg == 0 or self._write is None:
                return fn(*args)
            self._write(alg)
            try:
                return fn(*args)
            finally:
                self._write(0)


_POST_LOCK = threading.Lock()
_NBC: _NbcAllreduceTuning | None = None


def _translate(MPI: Any, op_name: str, exc: BaseException) -> CommError:
    """Map an ``MPI.Exception`` to the ``CommError`` family (ULFM classes to peer failure)."""
    if isinstance(exc, CommError):
        return exc
    try:
        cls = exc.Get_error_class()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - not an MPI.Exception
        return CommError(f"{op_name}: {exc}")
    names = ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
    if cls in {getattr(MPI, n) for n in names if hasattr(MPI, n)}:
        return PeerFailureError(f"{op_name}: lost a peer: {exc}")
    return CommError(f"{op_name}: {exc}")


def _copy_back(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        dst.copy_(src)

    return run


class _DeviceBuffer:
    """Exposes only ``__cuda_array_interface__``, so mpi4py takes that path for a CUDA tensor."""

    def __init__(self, t: torch.Tensor) -> None:
        self.__cuda_array_interface__ = t.__cuda_array_interface__
        self._t = t  # keep the memory alive


class _MPIWork:
    """Raw work over one ``MPI.Request``; polls ``Test()`` against a deadline.

    Args:
        MPI: The ``mpi4py.MPI`` module.
        op_name: Operation name for messages.
        req: The request.
        keep: Objects that must outlive the request (buffers).
        finish: Runs once after completion (cast back, copy to the device).
    """

    def __init__(
        self,
        MPI: Any,
        op_name: str,
        req: Any,
        keep: tuple[Any, ...],
        finish: Callable[[], None] | None = None,
    ) -> None:
        self._MPI = MPI
        self._op_name = op_name
        self._req = req
        self._keep: tuple[Any, ...] | None = keep
        self._finish = finish
        self.status = MPI.Status()
        self._done = False
        self._error: CommError | None = None

    def _test(self) -> bool:
        if not self._done:
            try:
                self._done = bool(self._req.Test(self.status))
            except self._MPI.Exception as exc:
                self._error = _translate(self._MPI, self._op_name, exc)
                self._done = True
        return self._done

    def is_completed(self) -> bool:
        """Return whether MPI finished the request (or it failed; ``wait`` raises then)."""
        return self._test()

    def wait(self, timeout_s: float | None) -> None:
        """Poll until done; run the finish step.

        Args:
            timeout_s: Deadline in seconds; ``None`` waits without one.

        Raises:
            CommTimeoutError: Not done by the deadline (the request stays pending).
            PeerFailureError: ULFM reported a failed peer or a revoked communicator.
            CommError: Any other MPI error.
        """
        if not self._test():
            start = time.monotonic()
            deadline = None if timeout_s is None else start + timeout_s
            while not self._test():
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise CommTimeoutError(
                        f"{self._op_name}: MPI request still pending after {timeout_s:g} s"
                    )
                waited = now - start
                if waited < _SPIN_S:
                    os.sched_yield()  # lets oversubscribed peers run; returns at once otherwise
                else:
                    time.sleep(min(_MAX_SLEEP_S, waited * _SLEEP_FRACTION))
        self._keep = None
        if self._error is not None:
            raise self._error
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


class MPICommunicator(BaseCommunicator):
    """A communicator over an mpi4py intracommunicator (backend ``mpi``).

    The given communicator is duplicated, so this traffic never matches the
    caller's messages; the duplicate returns errors as exceptions.

    Args:
        comm: An ``mpi4py.MPI.Intracomm``; ``None`` means ``MPI.COMM_WORLD``.
        timeout: Default deadline of blocking calls.
        check_collectives: See :class:`~bindings.communicator.BaseCommunicator`.

    Raises:
        ImportError: mpi4py is not installed.
        TypeError: ``comm`` is not an intracommunicator.
    """

    native_avg = False

    def __init__(
        self, comm: Any = None, *, timeout: timedelta, check_collectives: bool = False
    ) -> None:
        MPI = _mpi()
        base = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(base, MPI.Intracomm) or base == MPI.COMM_NULL:
            raise TypeError(f"comm: expected an mpi4py Intracomm, got {base!r}")
        try:
            dup = base.Dup()
        except MPI.Exception as exc:
            raise _translate(MPI, "MPICommunicator", exc) from exc
        self._setup(MPI, dup, timeout, check_collectives)

    @classmethod
    def _adopt(
        cls, MPI: Any, comm: Any, timeout: timedelta, check_collectives: bool
    ) -> MPICommunicator:
        """Wrap a communicator this module created (no second ``Dup``)."""
        self = cls.__new__(cls)
        self._setup(MPI, comm, timeout, check_collectives)
        return self

    def _setup(self, MPI: Any, comm: Any, timeout: timedelta, check_collectives: bool) -> None:
        try:
            super().__init__(
                comm.Get_rank(), comm.Get_size(), timeout=timeout, check_collectives=check_collectives
            )
        except Exception:
            comm.Free()
            raise
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        self._MPI = MPI
        self._comm = comm
        self._cuda_aware: bool | None = None  # detected on first CUDA tensor
        global _NBC
        with _POST_LOCK:
            if _NBC is None:
                _NBC = _NbcAllreduceTuning(MPI)
        self._nbc = _NBC
        tag_ub = comm.Get_attr(MPI.TAG_UB)
        self._tag_ub = int(tag_ub) if tag_ub is not None else 32767
        self._types = {
            torch.float32: MPI.FLOAT,
            torch.float64: MPI.DOUBLE,
            torch.int8: MPI.INT8_T,
            torch.uint8: MPI.UINT8_T,
            torch.int16: MPI.INT16_T,
            torch.int32: MPI.INT32_T,
            torch.int64: MPI.INT64_T,
        }
        self._ops = {
            ReduceOp.SUM: MPI.SUM,
            ReduceOp.PRODUCT: MPI.PROD,
            ReduceOp.MIN: MPI.MIN,
            ReduceOp.MAX: MPI.MAX,
            ReduceOp.BAND: MPI.BAND,
            ReduceOp.BOR: MPI.BOR,
            ReduceOp.BXOR: MPI.BXOR,
        }
        logger.debug("mpi communicator: rank %d of %d", self.rank, self.world_size)

    @property
    def backend(self) -> str:
        """``mpi``."""
        return "mpi"

    @property
    def mpi_comm(self) -> Any:
        """The private duplicate ``mpi4py.MPI.Intracomm`` (for interop; do not free it)."""
        return self._comm

    # ------------------------------------------------------------------ buffers
    def _buffer(
        self, t: torch.Tensor, *, reduce: bool, output: bool
    ) -> tuple[list[Any], Callable[[], None] | None]:
        """Return ``[buffer, MPI datatype]`` for contiguous ``t`` and its write-back step.

        Args:
            t: The tensor (contiguous).
            reduce: For a reduction: float16/bfloat16 go through a float32 copy.
            output: MPI writes into it: copies must be written back to ``t``.
        """
        flat = t.detach().reshape(-1)
        buf = flat.float() if reduce and flat.dtype in _HALF else flat
        device = buf.is_cuda
        if device:
            if self._cuda_aware is None:
                self._cuda_aware = cuda_aware()
                logger.debug("mpi communicator: CUDA-aware MPI: %s", self._cuda_aware)
            if self._cuda_aware:
                torch.cuda.current_stream(buf.device).synchronize()
            else:
                buf = buf.cpu()  # synchronizes with the stream
                device = False
        finish = _copy_back(flat, buf) if output and buf is not flat else None
        raw = buf.view(_MOVE_AS[buf.dtype]) if buf.dtype in _MOVE_AS else buf
        obj: Any = _DeviceBuffer(raw) if device else raw.numpy()
        return [obj, self._types[raw.dtype]], finish

    def _post(
        self,
        op_name: str,
        fn: Callable[..., Any],
        *args: Any,
        finish: Callable[[], None] | None = None,
    ) -> _MPIWork:
        try:
            req = fn(*args)
        except self._MPI.Exception as exc:
            raise _translate(self._MPI, op_name, exc) from exc
        return _MPIWork(self._MPI, op_name, req, args, finish)

    def _reduce_op(self, op: ReduceOp, dtype: torch.dtype) -> Any:
        if dtype == torch.bool:
            op = _BOOL_OPS.get(op, op)
        return self._ops[op]

    def _check_tag(self, tag: int) -> None:
        if tag > self._tag_ub:
            raise ValueError(f"tag: {tag} exceeds this MPI's MPI_TAG_UB ({self._tag_ub})")

    # ------------------------------------------------------------------ transport hooks
    def _raw_all_reduce(self, buf: torch.Tensor, op: ReduceOp) -> RawWork:
        msg, finish = self._buffer(buf, reduce=True, output=True)
        mop = self._reduce_op(op, buf.dtype)
        itemsize = 4 if buf.dtype in _HALF else buf.element_size()
        alg = self._nbc.algorithm(buf.numel(), itemsize, self.world_size)
        return self._post(
            "all_reduce", self._nbc.post, alg, self._comm.Iallreduce, self._MPI.IN_PLACE, msg, mop,
            finish=finish,
        )

    def _raw_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp) -> RawWork:
        send, _ = self._buffer(inp, reduce=True, output=False)
        recv, finish = self._buffer(out, reduce=True, output=True)
        mop = self._reduce_op(op, inp.dtype)
        return self._post(
            "reduce_scatter", self._comm.Ireduce_scatter_block, send, recv, mop, finish=finish
        )

    def _raw_all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> RawWork:
        send, _ = self._buffer(inp, reduce=False, output=False)
        recv, finish = self._buffer(out, reduce=False, output=True)
        return self._post("all_gather", self._comm.Iallgather, send, recv, finish=finish)

    def _raw_broadcast(self, buf: torch.Tensor, src: int) -> RawWork:
        msg, finish = self._buffer(buf, reduce=False, output=self.rank != src)
        return self._post("broadcast", self._comm.Ibcast, msg, src, finish=finish)

    def _raw_barrier(self) -> RawWork:
        return self._post("barrier", self._comm.Ibarrier)

    def _raw_send(self, buf: torch.Tensor, dst: int, tag: int) -> RawWork:
        self._check_tag(tag)
        msg, _ = self._buffer(buf, reduce=False, output=False)
        return self._post("send", self._comm.Isend, msg, dst, tag)

    def _raw_recv(
        self, buf: torch.Tensor, src: int | None, tag: int
    ) -> tuple[RawWork, Callable[[], int]]:
        self._check_tag(tag)
        msg, finish = self._buffer(buf, reduce=False, output=True)
        source = self._MPI.ANY_SOURCE if src is None else src
        work = self._post("recv", self._comm.Irecv, msg, source, tag, finish=finish)
        if src is not None:
            return work, lambda: src
        return work, lambda: int(work.status.Get_source())

    def _raw_split(self, members: list[int]) -> MPICommunicator | None:
        MPI = self._MPI
        member = self.rank in members
        color = 0 if member else MPI.UNDEFINED
        key = members.index(self.rank) if member else 0
        try:
            new = self._comm.Split(color, key)  # blocking: MPI has no non-blocking split
        except MPI.Exception as exc:
            raise _translate(MPI, "split", exc) from exc
        if new == MPI.COMM_NULL:
            return None
        return MPICommunicator._adopt(MPI, new, self.timeout, self.check_collectives)

    def _raw_abort(self) -> None:
        MPI = self._MPI
        try:
            self._comm.Revoke()  # ULFM: peers blocked on us fail with ERR_REVOKED
        except (NotImplementedError, AttributeError, MPI.Exception) as exc:
            logger.debug("mpi communicator: Revoke unavailable (%s); freeing only", exc)
        try:
            self._comm.Free()
        except MPI.Exception as exc:
            logger.debug("mpi communicator: Free after abort raised %s", exc)

    def _raw_close(self) -> None:
        try:
            self._comm.Free()
        except self._MPI.Exception as exc:
            raise _translate(self._MPI, "close", exc) from exc
