"""``cupy-nccl`` transport: NCCL through ``cupy.cuda.nccl``, for CUDA tensors.

The NCCL unique id travels over a torch ``Store``. Every operation is
enqueued on an internal stream that first waits for torch's current stream;
``wait()`` polls a CUDA event until the deadline (so a hung peer cannot block
us forever), aborts the NCCL communicator on timeout, and makes the current
stream wait for the event. NCCL has no tags and no any-source receive: ``tag``
must be 0 and ``src`` must be given.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from bindings.base import RawWork
from bindings.communicator import BaseCommunicator
from bindings.errors import CommError, CommTimeoutError, PeerFailureError
from bindings.ops import ReduceOp

__all__ = ["CupyNcclCommunicator", "encode_unique_id", "decode_unique_id"]

logger = logging.getLogger(__name__)

_STORE_PREFIX = "sparsecomm/cupy-nccl"


def _nccl() -> Any:
    try:
        from cupy.cuda import nccl
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise RuntimeError("backend 'cupy-nccl' needs cupy with NCCL: pip install 'sparsecomm[cuda]'") from exc
    return nccl


def encode_unique_id(uid: Any) -> bytes:
    """Serialize a NCCL unique id (bytes in current cupy, a tuple of ints in older cupy)."""
    if isinstance(uid, (bytes, bytearray)):
        return b"B" + bytes(uid)
    return b"T" + bytes(int(v) % 256 for v in uid)


def decode_unique_id(raw: bytes) -> Any:
    """Inverse of :func:`encode_unique_id`."""
    kind, body = raw[:1], raw[1:]
    if kind == b"B":
        return bytes(body)
    if kind == b"T":
        return tuple(v - 256 if v > 127 else v for v in body)
    raise ValueError("malformed NCCL unique id in the store")


class _EventWork:
    """Raw work: an event on the internal stream, polled against a deadline."""

    def __init__(self, op_name: str, comm: CupyNcclCommunicator, event: torch.cuda.Event) -> None:
        self._op_name = op_name
        self._comm = comm
        self._event = event

    def wait(self, timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pause = 1e-5
        while not self._event.query():
            self._comm._check_async(self._op_name)
            if deadline is not None and time.monotonic() > deadline:
                self._comm.abort()
                raise CommTimeoutError(f"{self._op_name}: NCCL operation did not finish")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        torch.cuda.current_stream(self._comm._device).wait_event(self._event)

    def is_completed(self) -> bool:
        return bool(self._event.query())


class CupyNcclCommunicator(BaseCommunicator):
    """A NCCL communicator built with cupy, for CUDA tensors on one device per rank.

    Collective: every rank must construct it with the same store and world size.

    Args:
        store: A ``torch.distributed.Store`` shared by the ranks.
        rank: This rank.
        world_size: Number of ranks.
        timeout: Default deadline of blocking calls.
        check_collectives: See :class:`~bindings.communicator.BaseCommunicator`.
        device: CUDA device of this rank (default: the current device).
        key: Store key prefix of this communicator (unique per communicator).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        *,
        timeout: timedelta,
        check_collectives: bool = False,
        device: torch.device | None = None,
        key: str = "world",
    ) -> None:
        super().__init__(rank, world_size, timeout=timeout, check_collectives=check_collectives)
        nccl = _nccl()
        self._nccl = nccl
        self._store = store
        self._key = key
        self._device = device or torch.device("cuda", torch.cuda.current_device())
        self._stream = torch.cuda.Stream(device=self._device)
        self._splits = 0
        uid_key = f"{_STORE_PREFIX}/{key}/uid"
        if rank == 0:
            store.set(uid_key, encode_unique_id(nccl.get_unique_id()))
        store.wait([uid_key], timeout)
        uid = decode_unique_id(store.get(uid_key))
        with torch.cuda.device(self._device):
            self._comm = nccl.NcclCommunicator(world_size, uid, rank)
        self.native_avg = hasattr(nccl, "NCCL_AVG")
        self._dtypes = {
            torch.float16: nccl.NCCL_FLOAT16,
            torch.float32: nccl.NCCL_FLOAT32,
            torch.float64: nccl.NCCL_FLOAT64,
            torch.int8: nccl.NCCL_INT8,
            torch.uint8: nccl.NCCL_UINT8,
            torch.int32: nccl.NCCL_INT32,
            torch.int64: nccl.NCCL_INT64,
        }
        if hasattr(nccl, "NCCL_BFLOAT16"):
            self._dtypes[torch.bfloat16] = nccl.NCCL_BFLOAT16
        self._ops = {
            ReduceOp.SUM: nccl.NCCL_SUM,
            ReduceOp.PRODUCT: nccl.NCCL_PROD,
            ReduceOp.MIN: nccl.NCCL_MIN,
            ReduceOp.MAX: nccl.NCCL_MAX,
        }
        if self.native_avg:
            self._ops[ReduceOp.AVG] = nccl.NCCL_AVG

    @property
    def backend(self) -> str:
        """``cupy-nccl``."""
        return "cupy-nccl"

    def _meta_device(self) -> torch.device:
        return self._device

    def _check_transport(
        self,
        op_name: str,
        op: ReduceOp | None,
        tensors: tuple[torch.Tensor, ...],
        *,
        peer: int | None = 0,
        tag: int = 0,
    ) -> None:
        if op_name in ("send", "recv") and tag != 0:
            raise ValueError("tag: cupy-nccl has no message tags; use tag=0")
        if peer is None:
            raise ValueError("src: cupy-nccl cannot receive from any source; pass src")
        for t in tensors:
            if t.device != self._device:
                raise ValueError(f"tensor: cupy-nccl needs tensors on {self._device}, got {t.device}")
            dtype = torch.uint8 if t.dtype == torch.bool else t.dtype
            if dtype not in self._dtypes:
                raise TypeError(f"tensor: dtype {t.dtype} is not supported by this NCCL build")
            if op is not None and t.dtype == torch.bool:
                raise TypeError("tensor: cupy-nccl cannot reduce bool tensors")
        if op is not None and op not in self._ops and not (op == ReduceOp.AVG and not self.native_avg):
            raise ValueError(f"op: {op.name} is not supported by NCCL")

    def _check_async(self, op_name: str) -> None:
        try:
            self._comm.check_async_error()
        except Exception as exc:  # noqa: BLE001 - cupy raises NcclError
            raise PeerFailureError(f"{op_name}: NCCL reported {exc}") from exc

    def _launch(self, op_name: str, call: Callable[[int], None]) -> RawWork:
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        try:
            with torch.cuda.stream(self._stream):
                call(self._stream.cuda_stream)
        except Exception as exc:  # noqa: BLE001
            raise CommError(f"{op_name}: {exc}") from exc
        event = torch.cuda.Event()
        event.record(self._stream)
        return _EventWork(op_name, self, event)

    def _dt(self, t: torch.Tensor) -> Any:
        return self._dtypes[torch.uint8 if t.dtype == torch.bool else t.dtype]

    @staticmethod
    def _count(t: torch.Tensor) -> int:
        return t.numel()

    def _raw_all_reduce(self, buf: torch.Tensor, op: ReduceOp) -> RawWork:
        ptr = buf.data_ptr()
        return self._launch(
            "all_reduce",
            lambda s: self._comm.allReduce(ptr, ptr, buf.numel(), self._dt(buf), self._ops[op], s),
        )

    def _raw_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp) -> RawWork:
        return self._launch(
            "reduce_scatter",
            lambda s: self._comm.reduceScatter(
                inp.data_ptr(), out.data_ptr(), out.numel(), self._dt(out), self._ops[op], s
            ),
        )

    def _raw_all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> RawWork:
        return self._launch(
            "all_gather",
            lambda s: self._comm.allGather(inp.data_ptr(), out.data_ptr(), inp.numel(), self._dt(inp), s),
        )

    def _raw_broadcast(self, buf: torch.Tensor, src: int) -> RawWork:
        ptr = buf.data_ptr()
        return self._launch(
            "broadcast",
            lambda s: self._comm.broadcast(ptr, ptr, buf.numel(), self._dt(buf), src, s),
        )

    def _raw_barrier(self) -> RawWork:
        token = torch.zeros(1, device=self._device)
        return self._raw_all_reduce(token, ReduceOp.SUM)

    def _raw_send(self, buf: torch.Tensor, dst: int, tag: int) -> RawWork:
        return self._launch("send", lambda s: self._comm.send(buf.data_ptr(), buf.numel(), self._dt(buf), dst, s))

    def _raw_recv(self, buf: torch.Tensor, src: int | None, tag: int) -> tuple[RawWork, Callable[[], int]]:
        assert src is not None  # _check_transport refused any-source receives
        work = self._launch("recv", lambda s: self._comm.recv(buf.data_ptr(), buf.numel(), self._dt(buf), src, s))
        return work, lambda: src

    def _raw_split(self, members: list[int]) -> CupyNcclCommunicator | None:
        self._splits += 1
        if self.rank not in members:
            return None
        key = f"{self._key}/split{self._splits}/" + "-".join(map(str, members))
        return CupyNcclCommunicator(
            self._store,
            members.index(self.rank),
            len(members),
            timeout=self.timeout,
            check_collectives=self.check_collectives,
            device=self._device,
            key=key,
        )

    def _raw_abort(self) -> None:
        try:
            self._comm.abort()
        except Exception as exc:  # noqa: BLE001 - abort is best effort
            logger.debug("NCCL abort raised %s", exc)

    def _raw_close(self) -> None:
        try:
            self._comm.destroy()
        except Exception as exc:  # noqa: BLE001
            logger.debug("NCCL destroy raised %s", exc)
