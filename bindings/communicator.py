"""Shared implementation of the :class:`~bindings.base.Communicator` protocol.

:class:`BaseCommunicator` does everything that must be the same on every
transport, so each backend only moves contiguous buffers:

* argument validation (:mod:`bindings.checks`), before any communication,
  with the same outcome on every rank that passes matching arguments;
* non-contiguous tensors (staged through a contiguous copy);
* ``AVG`` on transports without a native average (sum, then divide);
* the optional cross-rank metadata check (``check_collectives``);
* byte accounting (:mod:`bindings.stats`);
* deadlines: every blocking call waits at most ``timeout``.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

from bindings.base import RawWork, Work
from bindings.checks import (
    check_async,
    check_op_dtype,
    check_pair,
    check_rank,
    check_ranks_list,
    check_tag,
    check_tensor,
)
from bindings.errors import CollectiveMismatchError, CommAbortedError, CommTimeoutError
from bindings.ops import SUPPORTED_DTYPES, ReduceOp, parse_reduce_op
from bindings.stats import CommStats, ring_bytes

__all__ = ["BaseCommunicator", "Handle", "DoneWork", "ChainedWork"]

logger = logging.getLogger(__name__)

_OPCODES = {
    "all_reduce": 1,
    "reduce_scatter": 2,
    "all_gather": 3,
    "broadcast": 4,
    "barrier": 5,
}
_DTYPE_CODES = {dt: i for i, dt in enumerate(sorted(SUPPORTED_DTYPES, key=str))}
_DTYPE_NAMES = {i: str(dt) for dt, i in _DTYPE_CODES.items()}
_OP_CODES = {op: i for i, op in enumerate(ReduceOp)}
_OPCODE_NAMES = {v: k for k, v in _OPCODES.items()}


class DoneWork:
    """A :class:`~bindings.base.RawWork` that is already complete."""

    def wait(self, timeout_s: float | None) -> None:
        """Return at once."""

    def is_completed(self) -> bool:
        """Return ``True``."""
        return True


class Handle:
    """The :class:`~bindings.base.Work` handle every communicator returns.

    Wraps the transport's raw work and runs the post-processing step (copy
    back, divide for ``AVG`` …) exactly once, after the transport finished.
    """

    def __init__(
        self,
        op_name: str,
        raw: RawWork,
        default_timeout: timedelta,
        finish: Callable[[], object] | None = None,
        source: Callable[[], int] | None = None,
    ) -> None:
        self._op_name = op_name
        self._raw = raw
        self._default_timeout = default_timeout
        self._finish = finish
        self._source = source
        self._done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until done.

        Args:
            timeout: Deadline for this wait; ``None`` uses the communicator's timeout.

        Returns:
            ``True`` (as torch.distributed's ``Work.wait``).

        Raises:
            CommTimeoutError: The operation did not finish in time.
            PeerFailureError: A peer failed during the operation.
        """
        if self._done:
            return True
        limit = self._default_timeout if timeout is None else timeout
        try:
            self._raw.wait(limit.total_seconds())
        except CommTimeoutError as exc:
            raise CommTimeoutError(
                f"{self._op_name}: did not finish within {limit.total_seconds():g} s ({exc})"
            ) from exc
        if self._finish is not None:
            self._finish()
        self._done = True
        return True

    def is_completed(self) -> bool:
        """Return whether the transport finished (``wait`` still applies post-processing)."""
        return self._done or self._raw.is_completed()

    def source_rank(self) -> int:
        """For a receive: the rank the message came from (after ``wait``)."""
        if self._source is None:
            raise RuntimeError(f"{self._op_name}: source_rank() is only defined for recv")
        self.wait()
        return self._source()


class ChainedWork:
    """A :class:`~bindings.base.Work` that runs ``finish`` once after ``inner`` completed.

    Layers above the transport (list-form all_gather, sparse collectives)
    use it to unpack results when the user waits.
    """

    def __init__(self, inner: Work, finish: Callable[[], object]) -> None:
        self._inner = inner
        self._finish = finish
        self._done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for the inner work, then run ``finish`` (once)."""
        self._inner.wait(timeout)
        if not self._done:
            self._finish()
            self._done = True
        return True

    def is_completed(self) -> bool:
        """Return whether the inner work completed."""
        return self._done or self._inner.is_completed()


def _staged(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], object] | None]:
    """Return a contiguous buffer for ``t`` and the copy-back step (or ``None``)."""
    if t.is_contiguous():
        return t, None
    buf = t.contiguous()
    return buf, lambda: t.copy_(buf)


def _chain(*steps: Callable[[], object] | None) -> Callable[[], object] | None:
    todo = [s for s in steps if s is not None]
    if not todo:
        return None

    def run() -> None:
        for s in todo:
            s()

    return run


class BaseCommunicator(abc.ABC):
    """Validation, staging, byte accounting and deadlines for every transport.

    Subclasses implement the ``_raw_*`` methods on contiguous tensors of
    matching sizes and return a :class:`~bindings.base.RawWork`.

    Args:
        rank: This process's rank in the communicator.
        world_size: Number of ranks.
        timeout: Default deadline of every blocking call and ``Work.wait()``.
        check_collectives: Before each collective, compare (collective,
            dtype, numel, op, root) across ranks with one small ``all_reduce``
            and raise :class:`~bindings.errors.CollectiveMismatchError` on
            every rank when they differ. Off by default (it adds one small
            collective per call); turn on while debugging.
    """

    #: Whether the transport reduces with ``AVG`` natively.
    native_avg: bool = False

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        timeout: timedelta,
        check_collectives: bool = False,
    ) -> None:
        if not isinstance(timeout, timedelta):
            raise TypeError(f"timeout: expected a datetime.timedelta, got {type(timeout).__name__}")
        if timeout.total_seconds() <= 0:
            raise ValueError(f"timeout: must be positive, got {timeout}")
        self._rank = rank
        self._world_size = world_size
        self._timeout = timeout
        self._check = bool(check_collectives)
        self._stats = CommStats()
        self._aborted = False
        self._closed = False

    # ------------------------------------------------------------------ properties
    @property
    def rank(self) -> int:
        """This process's rank in the communicator."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the communicator."""
        return self._world_size

    @property
    @abc.abstractmethod
    def backend(self) -> str:
        """Backend name (``gloo``, ``nccl``, ``mpi``, ``cupy-nccl``)."""

    @property
    def timeout(self) -> timedelta:
        """Default deadline of blocking calls."""
        return self._timeout

    @property
    def stats(self) -> CommStats:
        """Byte and call counters of this communicator."""
        return self._stats

    @property
    def check_collectives(self) -> bool:
        """Whether the cross-rank metadata check runs before each collective."""
        return self._check

    # ------------------------------------------------------------------ helpers
    def _ensure_usable(self, op_name: str) -> None:
        if self._aborted:
            raise CommAbortedError(f"{op_name}: the communicator was aborted")
        if self._closed:
            raise CommAbortedError(f"{op_name}: the communicator was closed")

    def _complete(
        self,
        op_name: str,
        raw: RawWork,
        finish: Callable[[], object] | None,
        async_op: bool,
        source: Callable[[], int] | None = None,
    ) -> Handle | None:
        handle = Handle(op_name, raw, self._timeout, finish, source)
        if async_op:
            return handle
        handle.wait()
        return None

    def _agree(self, op_name: str, dtype: torch.dtype, numel: int, op: int, root: int) -> None:
        """Raise on every rank if the ranks' (collective, dtype, numel, op, root) differ."""
        fields = ("collective", "dtype", "numel", "op", "root")
        mine = torch.tensor([_OPCODES[op_name], _DTYPE_CODES[dtype], numel, op, root], dtype=torch.int64)
        both = torch.cat([mine, -mine]).to(self._meta_device())
        Handle(f"{op_name} (metadata check)", self._raw_all_reduce(both, ReduceOp.MAX), self._timeout).wait()
        both = both.cpu()
        hi, lo = both[:5], -both[5:]
        bad = [i for i in range(5) if hi[i] != lo[i]]
        if not bad:
            return

        def show(i: int, v: int) -> str:
            if i == 0:
                return _OPCODE_NAMES.get(v, str(v))
            if i == 1:
                return _DTYPE_NAMES.get(v, str(v))
            return str(v)

        parts = ", ".join(f"{fields[i]} differs (min {show(i, int(lo[i]))}, max {show(i, int(hi[i]))})" for i in bad)
        raise CollectiveMismatchError(f"{op_name}: ranks called it with different arguments: {parts}")

    def _meta_device(self) -> torch.device:
        """Device of the small metadata tensors (CPU unless the transport needs CUDA)."""
        return torch.device("cpu")

    def _wire_bytes(self, op: str, nbytes: int) -> tuple[int, int]:
        """(sent, received) bytes of one call, for the algorithm this transport runs."""
        return ring_bytes(op, nbytes, self._world_size)

    def _check_transport(
        self,
        op_name: str,
        op: ReduceOp | None,
        tensors: tuple[torch.Tensor, ...],
        *,
        peer: int | None = 0,
        tag: int = 0,
    ) -> None:
        """Raise ``ValueError``/``TypeError`` for what this transport cannot do.

        Runs after the generic checks and before any communication; the
        outcome depends only on the arguments, so it is the same on every rank.
        """

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, op: Any = ReduceOp.SUM, *, async_op: bool = False) -> Handle | None:
        """Reduce ``tensor`` across ranks, in place.

        Collective: every rank must call this with a tensor of the same dtype and numel.

        Args:
            tensor: Input and output.
            op: Reduction operator (:class:`~bindings.ops.ReduceOp`, string, or
                ``torch.distributed.ReduceOp``).
            async_op: Return a :class:`Handle` instead of blocking.

        Returns:
            A handle when ``async_op`` is true, else ``None``.

        Raises:
            TypeError, ValueError: Bad arguments (before any communication).
            CommError: Transport failure or timeout.
        """
        check_tensor("tensor", tensor)
        rop = parse_reduce_op(op)
        check_op_dtype(rop, tensor.dtype)
        check_async(async_op)
        self._check_transport("all_reduce", rop, (tensor,))
        self._ensure_usable("all_reduce")
        if self._check:
            self._agree("all_reduce", tensor.dtype, tensor.numel(), _OP_CODES[rop], 0)
        buf, copy_back = _staged(tensor)
        divide = None
        if rop == ReduceOp.AVG and not self.native_avg:
            rop = ReduceOp.SUM
            n = self._world_size
            divide = lambda: buf.div_(n)  # noqa: E731
        raw = self._raw_all_reduce(buf, rop) if buf.numel() and self._world_size > 1 else DoneWork()
        self._stats.record("all_reduce", *self._wire_bytes("all_reduce", _nbytes(buf)))
        return self._complete("all_reduce", raw, _chain(divide, copy_back), async_op)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: Any = ReduceOp.SUM,
        *,
        async_op: bool = False,
    ) -> Handle | None:
        """Reduce ``input`` across ranks and leave shard ``rank`` of the result in ``output``.

        Collective: every rank must call this with matching sizes.

        Args:
            output: Receives this rank's shard; ``output.numel() * world_size``
                must equal ``input.numel()``.
            input: The full buffer, shard ``r`` being elements
                ``[r * output.numel(), (r + 1) * output.numel())`` of its flat view.
            op: Reduction operator.
            async_op: Return a handle instead of blocking.
        """
        check_tensor("output", output)
        check_tensor("input", input)
        check_pair("output", output, "input", input)
        rop = parse_reduce_op(op)
        check_op_dtype(rop, input.dtype)
        check_async(async_op)
        if input.numel() != output.numel() * self._world_size:
            raise ValueError(
                f"input: numel {input.numel()} must be output numel {output.numel()} x world_size {self._world_size}"
            )
        self._check_transport("reduce_scatter", rop, (output, input))
        self._ensure_usable("reduce_scatter")
        if self._check:
            self._agree("reduce_scatter", input.dtype, input.numel(), _OP_CODES[rop], 0)
        src = input if input.is_contiguous() else input.contiguous()
        buf, copy_back = _staged(output)
        divide = None
        if rop == ReduceOp.AVG and not self.native_avg:
            rop = ReduceOp.SUM
            n = self._world_size
            divide = lambda: buf.div_(n)  # noqa: E731
        if self._world_size == 1:
            buf.copy_(src.view(buf.shape))
            raw: RawWork = DoneWork()
            divide = None
        elif buf.numel():
            raw = self._raw_reduce_scatter(buf, src, rop)
        else:
            raw = DoneWork()
        self._stats.record("reduce_scatter", *self._wire_bytes("reduce_scatter", _nbytes(buf)))
        return self._complete("reduce_scatter", raw, _chain(divide, copy_back), async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Handle | None:
        """Gather every rank's ``input`` into ``output``, rank ``r`` at block ``r``.

        Collective: every rank must call this with matching sizes.

        Args:
            output: ``world_size * input.numel()`` elements (any shape).
            input: This rank's block.
            async_op: Return a handle instead of blocking.
        """
        check_tensor("output", output)
        check_tensor("input", input)
        check_pair("output", output, "input", input)
        check_async(async_op)
        if output.numel() != input.numel() * self._world_size:
            raise ValueError(
                f"output: numel {output.numel()} must be input numel {input.numel()} x world_size {self._world_size}"
            )
        self._check_transport("all_gather", None, (output, input))
        self._ensure_usable("all_gather")
        if self._check:
            self._agree("all_gather", input.dtype, input.numel(), 0, 0)
        src = input if input.is_contiguous() else input.contiguous()
        buf, copy_back = _staged(output)
        if self._world_size == 1:
            buf.copy_(src.view(buf.shape))
            raw: RawWork = DoneWork()
        elif buf.numel():
            raw = self._raw_all_gather(buf, src)
        else:
            raw = DoneWork()
        self._stats.record("all_gather", *self._wire_bytes("all_gather", _nbytes(src)))
        return self._complete("all_gather", raw, copy_back, async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Handle | None:
        """Copy ``tensor`` of rank ``src`` into ``tensor`` on every rank.

        Collective: every rank must call this with the same ``src`` and size.
        """
        check_tensor("tensor", tensor)
        check_rank("src", src, self._world_size)
        check_async(async_op)
        self._check_transport("broadcast", None, (tensor,))
        self._ensure_usable("broadcast")
        if self._check:
            self._agree("broadcast", tensor.dtype, tensor.numel(), 0, src)
        buf, copy_back = _staged(tensor)
        raw = self._raw_broadcast(buf, src) if buf.numel() and self._world_size > 1 else DoneWork()
        self._stats.record(
            "broadcast",
            *ring_bytes("broadcast", _nbytes(buf), self._world_size, is_root=self._rank == src),
        )
        return self._complete("broadcast", raw, copy_back if self._rank != src else None, async_op)

    def barrier(self, *, async_op: bool = False) -> Handle | None:
        """Wait until every rank reached the barrier.

        Collective: every rank must call this.
        """
        check_async(async_op)
        self._ensure_usable("barrier")
        if self._check:
            self._agree("barrier", torch.uint8, 0, 0, 0)
        raw = self._raw_barrier() if self._world_size > 1 else DoneWork()
        self._stats.record("barrier", 0, 0)
        return self._complete("barrier", raw, None, async_op)

    def send(self, tensor: torch.Tensor, dst: int, *, tag: int = 0, async_op: bool = False) -> Handle | None:
        """Send ``tensor`` to rank ``dst`` (matched by a ``recv`` with the same tag)."""
        check_tensor("tensor", tensor)
        check_rank("dst", dst, self._world_size)
        check_tag(tag)
        check_async(async_op)
        if dst == self._rank:
            raise ValueError(f"dst: cannot send to this rank itself ({dst})")
        self._check_transport("send", None, (tensor,), peer=dst, tag=tag)
        self._ensure_usable("send")
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        raw = self._raw_send(buf, dst, tag)
        self._stats.record("send", *ring_bytes("send", _nbytes(buf), self._world_size))
        return self._complete("send", raw, None, async_op)

    def recv(self, tensor: torch.Tensor, src: int | None, *, tag: int = 0, async_op: bool = False) -> Handle | int:
        """Receive into ``tensor`` from rank ``src`` (``None``: any rank).

        Returns:
            The sender's rank when blocking, else a handle whose
            ``source_rank()`` gives it.
        """
        check_tensor("tensor", tensor)
        check_rank("src", src, self._world_size, allow_none=True)
        check_tag(tag)
        check_async(async_op)
        if src == self._rank:
            raise ValueError(f"src: cannot receive from this rank itself ({src})")
        self._check_transport("recv", None, (tensor,), peer=src, tag=tag)
        self._ensure_usable("recv")
        buf, copy_back = _staged(tensor)
        raw, source = self._raw_recv(buf, src, tag)
        self._stats.record("recv", *ring_bytes("recv", _nbytes(buf), self._world_size))
        handle = Handle("recv", raw, self._timeout, copy_back, source)
        if async_op:
            return handle
        handle.wait()
        return source()

    def split(self, ranks: Sequence[int]) -> BaseCommunicator | None:
        """Make a communicator over ``ranks`` (ordered as given after sorting).

        Collective: every rank of this communicator must call this with the same ``ranks``.

        Returns:
            The new communicator on member ranks, ``None`` elsewhere.
        """
        members = check_ranks_list(ranks, self._world_size)
        self._ensure_usable("split")
        return self._raw_split(members)

    def abort(self) -> None:
        """Tear the transport down at once so peers blocked on us fail fast. Idempotent."""
        if self._aborted:
            return
        self._aborted = True
        logger.debug("aborting %s communicator (rank %d)", self.backend, self._rank)
        self._raw_abort()

    def close(self) -> None:
        """Release the transport after a clean shutdown. Idempotent."""
        if self._closed or self._aborted:
            self._closed = True
            return
        self._closed = True
        self._raw_close()

    # ------------------------------------------------------------------ transport hooks
    @abc.abstractmethod
    def _raw_all_reduce(self, buf: torch.Tensor, op: ReduceOp) -> RawWork: ...

    @abc.abstractmethod
    def _raw_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp) -> RawWork: ...

    @abc.abstractmethod
    def _raw_all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> RawWork: ...

    @abc.abstractmethod
    def _raw_broadcast(self, buf: torch.Tensor, src: int) -> RawWork: ...

    @abc.abstractmethod
    def _raw_barrier(self) -> RawWork: ...

    @abc.abstractmethod
    def _raw_send(self, buf: torch.Tensor, dst: int, tag: int) -> RawWork: ...

    @abc.abstractmethod
    def _raw_recv(self, buf: torch.Tensor, src: int | None, tag: int) -> tuple[RawWork, Callable[[], int]]: ...

    @abc.abstractmethod
    def _raw_split(self, members: list[int]) -> BaseCommunicator | None: ...

    @abc.abstractmethod
    def _raw_abort(self) -> None: ...

    @abc.abstractmethod
    def _raw_close(self) -> None: ...


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
