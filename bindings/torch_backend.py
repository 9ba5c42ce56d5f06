"""``gloo`` and ``nccl`` transports over torch.distributed process groups."""

from __future__ import annotations

import collections
import functools
import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

from bindings.base import RawWork
from bindings.communicator import BaseCommunicator, DoneWork
from bindings.errors import CommAbortedError, CommError, CommTimeoutError, PeerFailureError
from bindings.ops import ReduceOp
from bindings.stats import ring_bytes

__all__ = [
    "GradBucket",
    "TorchCommunicator",
    "TorchReduceOp",
    "as_torch_communicator",
    "fsdp_protocols",
    "standalone_process_group",
    "translate_torch_error",
]

#: torch.distributed's ``ReduceOp``, re-exported by the drop-in API.
TorchReduceOp = tdist.ReduceOp

#: DDP's gradient bucket, as its comm hooks receive it (DDP checks a hook's annotation against it).
GradBucket = tdist.GradBucket

logger = logging.getLogger(__name__)


@functools.cache
def fsdp_protocols() -> tuple[type, type] | None:
    """FSDP2's custom-collective protocols ``(AllGather, ReduceScatter)`` (``FSDPModule.set_custom_all_gather`` /
    ``set_custom_reduce_scatter``, torch >= 2.8, a private module); ``None`` where this torch lacks them.

    Imported on first use: the module pulls in ``torch.distributed.tensor``,
    which costs a process about a second at start.
    """
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError:  # pragma: no cover - older torch
        return None
    return AllGather, ReduceScatter


def _import_world_default_modules() -> None:
    """Import, while no default group exists, the torch modules that bind ``group.WORLD`` at import.

    ``torch.distributed.nn.functional`` spells ``group=group.WORLD`` in its
    signatures, so the default group of the moment becomes a default argument
    for the life of the process. torch imports that module late:
    ``torch._dynamo`` pulls it in, and ``torch.optim`` imports ``torch._dynamo``
    with the first optimizer, normally after ``init_process_group``. The
    default group then outlives ``destroy_process_group``, its gloo worker
    threads run into interpreter teardown, and the process can abort there
    (see :meth:`TorchCommunicator._raw_close`). Imported before any group
    exists, those defaults are ``None``.
    """
    if tdist.is_initialized():
        return
    try:
        import torch.distributed.nn.functional  # noqa: F401
    except ImportError as exc:  # a torch built without it binds nothing either
        logger.debug("torch.distributed.nn.functional: %s", exc)


_import_world_default_modules()

# torch renamed the tensor-form collectives in 2026 and warns on the old names;
# call whichever spelling this torch has, newest first.
_all_gather_tensor = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor

_TORCH_OPS = {
    ReduceOp.SUM: tdist.ReduceOp.SUM,
    ReduceOp.AVG: tdist.ReduceOp.AVG,
    ReduceOp.PRODUCT: tdist.ReduceOp.PRODUCT,
    ReduceOp.MIN: tdist.ReduceOp.MIN,
    ReduceOp.MAX: tdist.ReduceOp.MAX,
    ReduceOp.BAND: tdist.ReduceOp.BAND,
    ReduceOp.BOR: tdist.ReduceOp.BOR,
    ReduceOp.BXOR: tdist.ReduceOp.BXOR,
}

_PEER_LOST = (
    "connection closed",
    "connection reset",
    "read error",
    "broken pipe",
    "socket closed",
    "connection refused",
    "aborted",
    "shutdown",
    "ncclremoteerror",
    "nccl communicator was aborted",
)


def translate_torch_error(op_name: str, exc: BaseException) -> CommError:
    """Map an exception raised by torch.distributed to the ``CommError`` family."""
    text = str(exc)
    low = text.lower()
    if "timed out" in low or "timeout" in low:
        return CommTimeoutError(f"{op_name}: {text}")
    if any(s in low for s in _PEER_LOST):
        return PeerFailureError(f"{op_name}: lost a peer: {text}")
    return CommError(f"{op_name}: {text}")


class _ScratchPool:
    """Reusable flat buffers: a fresh 64 MB allocation costs more than the copy into it.

    A buffer is lent by :meth:`take` and returned by :meth:`give` when the
    operation that used it finished, so overlapping async calls never share one.
    Memory held: the largest buffers in flight at once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.dtype == dtype and buf.device == device and buf.numel() >= numel:
                    return self._free.pop(i)[:numel]
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, view: torch.Tensor) -> None:
        base = view._base if view._base is not None else view
        with self._lock:
            self._free.append(base)
            if len(self._free) > 4:  # keep the biggest few
                self._free.sort(key=lambda t: t.numel() * t.element_size())
                self._free.pop(0)


class _ThenWork:
    """Raw work that runs ``then`` once the inner work finished."""

    def __init__(self, inner: RawWork, then: Callable[[], None]) -> None:
        self._inner = inner
        self._then = then
        self._done = False

    def wait(self, timeout_s: float | None) -> None:
        self._inner.wait(timeout_s)
        if not self._done:
            self._then()
            self._done = True

    def is_completed(self) -> bool:
        return self._inner.is_completed()


class _TorchWork:
    """Raw work over a ``torch.distributed.Work``."""

    def __init__(self, op_name: str, work: Any) -> None:
        self._op_name = op_name
        self._work = work

    def wait(self, timeout_s: float | None) -> None:
        try:
            if timeout_s is None:
                self._work.wait()
            else:
                self._work.wait(timedelta(seconds=timeout_s))
        except CommError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/DistBackendError
            raise translate_torch_error(self._op_name, exc) from exc

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())


_KEEP_ALIVE: collections.deque[tuple[Any, tuple[Any, ...]]] = collections.deque(maxlen=8)
"""The last works and the tensors they were given, held from Python until later calls push them out.

A gloo work's worker thread drops its reference to the work just after
running it. Were that the last one, freeing a tensor whose Python object
only the work kept alive takes the GIL on that thread; a process group being
destroyed at the same moment (its destructor holds the GIL while it joins
that thread, e.g. DDP's reducer freed at exit) then deadlocks. Holding the
last few works and their tensors here makes the Python side's reference the
last one, dropped with the GIL held.
"""


def _call(op_name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> RawWork:
    try:
        work = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001
        raise translate_torch_error(op_name, exc) from exc
    if work is None:
        return DoneWork()
    _KEEP_ALIVE.append((work, args))
    return _TorchWork(op_name, work)


def standalone_process_group(
    store: tdist.Store, rank: int, world_size: int, backend: str, timeout: timedelta
) -> tdist.ProcessGroup:
    """Build a process group on ``store`` without torch's global registry.

    For groups that live and die on their own (one per membership epoch): no
    ``init_process_group``, no default group, nothing registered that a later
    group could collide with. Every rank of the group must call this with the
    same ``store`` (a ``PrefixStore`` unique to the group) and ``world_size``.

    Args:
        store: The rendezvous store of this group only.
        rank: This process's rank in the group.
        world_size: Number of ranks.
        backend: ``gloo`` (CPU) or ``nccl`` (CUDA, non-blocking communicator so
            that :meth:`TorchCommunicator.abort` can interrupt it).
        timeout: Transport-level timeout of every operation.
    """
    from torch._C._distributed_c10d import ProcessGroup

    if backend == "gloo":
        impl: Any = tdist.ProcessGroupGloo(store, rank, world_size, timeout)
        kind, device = ProcessGroup.BackendType.GLOO, torch.device("cpu")
    elif backend == "nccl":
        opts = tdist.ProcessGroupNCCL.Options()
        opts.config.blocking = False
        opts._timeout = timeout
        impl = tdist.ProcessGroupNCCL(store, rank, world_size, opts)
        kind, device = ProcessGroup.BackendType.NCCL, torch.device("cuda", torch.cuda.current_device())
    else:
        raise ValueError(f"backend: expected 'gloo' or 'nccl', got {backend!r}")
    pg = ProcessGroup(store, rank, world_size)
    pg._set_default_backend(kind)
    pg._register_backend(device, kind, impl)
    return pg


class TorchCommunicator(BaseCommunicator):
    """A communicator over a torch.distributed process group (``gloo`` or ``nccl``).

    Args:
        group: The torch process group; ``None`` means torch's default group
            (``torch.distributed.init_process_group`` must have been called).
        timeout: Default deadline of blocking calls.
        check_collectives: See :class:`~bindings.communicator.BaseCommunicator`.
        owns_world: This communicator initialized torch's default group and
            destroys it on :meth:`close`.
        standalone: ``group`` comes from :func:`standalone_process_group` (not
            in torch's registry): peers are addressed by group rank, and
            :meth:`close` shuts the group down.
    """

    def __init__(
        self,
        group: tdist.ProcessGroup | None = None,
        *,
        timeout: timedelta,
        check_collectives: bool = False,
        owns_world: bool = False,
        standalone: bool = False,
    ) -> None:
        self._standalone = standalone
        if standalone:
            if group is None:
                raise ValueError("standalone: needs the group from standalone_process_group()")
            pg = group
            rank, size = pg.rank(), pg.size()
            self._global_ranks: list[int] = list(range(size))
            self._backend = str(pg._get_backend_name()).lower()
            self._is_world = False
        else:
            if not tdist.is_initialized():
                raise RuntimeError("TorchCommunicator: torch.distributed is not initialized")
            world = group if group is not None else tdist.group.WORLD
            assert world is not None
            pg = world
            rank, size = tdist.get_rank(pg), tdist.get_world_size(pg)
            self._global_ranks = tdist.get_process_group_ranks(pg)
            self._backend = str(tdist.get_backend(pg)).lower()
            self._is_world = group is None or pg is tdist.group.WORLD
        # ``None`` once closed (standalone groups excepted): see _raw_close.
        self._pg: tdist.ProcessGroup | None = pg
        self._owns_world = owns_world and self._is_world
        super().__init__(rank, size, timeout=timeout, check_collectives=check_collectives)
        self.native_avg = self._backend == "nccl"
        #: Inputs of at least this many bytes are reduce-scattered with an all-reduce
        #: (gloo only; ``None``: never). gloo's own reduce-scatter took 214 ms against
        #: 143 ms this way at 64 MB on 4 ranks, and tied from 1 to 16 MB, where the
        #: all-reduce would only double the wire bytes.
        self.reduce_scatter_via_all_reduce_from: int | None = (32 << 20) if self._backend == "gloo" else None
        self._scratch = _ScratchPool()

    def reduce_scatter_uses_all_reduce(self, input_bytes: int) -> bool:
        """Whether a reduce-scatter of ``input_bytes`` runs as an all-reduce here."""
        limit = self.reduce_scatter_via_all_reduce_from
        return limit is not None and input_bytes >= limit

    def _wire_bytes(self, op: str, nbytes: int) -> tuple[int, int]:
        if op == "reduce_scatter" and self.reduce_scatter_uses_all_reduce(nbytes * self.world_size):
            return ring_bytes("all_reduce", nbytes * self.world_size, self.world_size)
        return ring_bytes(op, nbytes, self.world_size)

    @property
    def backend(self) -> str:
        """``gloo`` or ``nccl``."""
        return self._backend

    @property
    def global_ranks(self) -> list[int]:
        """Global rank of each rank of this communicator."""
        return list(self._global_ranks)

    @property
    def process_group(self) -> tdist.ProcessGroup:
        """The underlying torch process group (for interop, e.g. DDP).

        Raises:
            CommAbortedError: The communicator was closed (it no longer holds the group).
        """
        return self._group()

    def _group(self) -> tdist.ProcessGroup:
        pg = self._pg
        if pg is None:
            raise CommAbortedError("process group: the communicator was closed")
        return pg

    def _meta_device(self) -> torch.device:
        if self._backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _g(self, rank: int) -> int:
        return self._global_ranks[rank]

    def _peer(self, kind: str, rank: int) -> dict[str, int]:
        """The keyword naming peer ``rank`` (``kind``: src or dst) for torch.distributed."""
        if self._standalone:
            return {f"group_{kind}": rank}
        return {kind: self._g(rank)}

    def _raw_all_reduce(self, buf: torch.Tensor, op: ReduceOp) -> RawWork:
        return _call("all_reduce", tdist.all_reduce, buf, op=_TORCH_OPS[op], group=self._group(), async_op=True)

    def _raw_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp) -> RawWork:
        if self.reduce_scatter_uses_all_reduce(inp.numel() * inp.element_size()):
            # gloo's reduce-scatter is slower than its all-reduce at every size we
            # measured (benchmarks/README.md): reduce a copy, keep our block.
            full = self._scratch.take(inp.numel(), inp.dtype, inp.device)
            full.copy_(inp.view(-1))
            lo = self.rank * out.numel()
            inner = _call(
                "reduce_scatter", tdist.all_reduce, full, op=_TORCH_OPS[op], group=self._group(), async_op=True
            )

            def then() -> None:
                out.view(-1).copy_(full[lo : lo + out.numel()])
                self._scratch.give(full)

            return _ThenWork(inner, then)
        return _call(
            "reduce_scatter",
            _reduce_scatter_tensor,
            out.view(-1),
            inp.view(-1),
            op=_TORCH_OPS[op],
            group=self._group(),
            async_op=True,
        )

    def _raw_all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> RawWork:
        return _call("all_gather", _all_gather_tensor, out.view(-1), inp.view(-1), group=self._group(), async_op=True)

    def _raw_broadcast(self, buf: torch.Tensor, src: int) -> RawWork:
        return _call("broadcast", tdist.broadcast, buf, **self._peer("src", src), group=self._group(), async_op=True)

    def _raw_barrier(self) -> RawWork:
        return _call("barrier", tdist.barrier, group=self._group(), async_op=True)

    def _raw_send(self, buf: torch.Tensor, dst: int, tag: int) -> RawWork:
        if buf.numel() == 0:  # gloo cannot receive 0 bytes from any source: send one token byte
            buf = torch.zeros(1, dtype=torch.uint8, device=buf.device)
        return _call("send", tdist.isend, buf, **self._peer("dst", dst), group=self._group(), tag=tag)

    def _raw_recv(self, buf: torch.Tensor, src: int | None, tag: int) -> tuple[RawWork, Callable[[], int]]:
        if buf.numel() == 0:  # matches the token byte of _raw_send
            buf = torch.zeros(1, dtype=torch.uint8, device=buf.device)
        try:
            peer = {} if src is None else self._peer("src", src)
            work = tdist.irecv(buf, **peer, group=self._group(), tag=tag)
        except Exception as exc:  # noqa: BLE001
            raise translate_torch_error("recv", exc) from exc
        if src is not None:
            return _TorchWork("recv", work), lambda: src
        ranks = self._global_ranks
        assert work is not None  # irecv returns a work handle on every backend we use
        return _TorchWork("recv", work), lambda: ranks.index(int(work._source_rank()))

    def _raw_split(self, members: list[int]) -> TorchCommunicator | None:
        if self._standalone:
            raise NotImplementedError("split: a standalone group cannot be split; build another standalone group")
        global_members = [self._g(r) for r in members]
        try:
            pg = (
                tdist.new_group(
                    ranks=global_members,
                    timeout=self.timeout,
                    use_local_synchronization=not self._is_world,
                )
                if (self._is_world or self.rank in members)
                else None
            )
        except Exception as exc:  # noqa: BLE001
            raise translate_torch_error("split", exc) from exc
        if self.rank not in members or pg is None or pg == tdist.GroupMember.NON_GROUP_MEMBER:
            return None
        return TorchCommunicator(pg, timeout=self.timeout, check_collectives=self.check_collectives)

    def _raw_abort(self) -> None:
        pg = self._pg
        if pg is None:
            return
        try:
            pg.abort()
        except Exception as exc:  # noqa: BLE001 - abort is best effort by definition
            logger.debug("process group abort raised %s", exc)

    def release(self) -> tdist.ProcessGroup | None:
        """Hand the group over to its owner and forget it (``None`` if already gone).

        For the owner of a standalone group that wants it destroyed at a time
        of its choosing (e.g. on a background thread); the communicator is
        unusable afterwards.
        """
        pg, self._pg = self._pg, None
        return pg

    def _raw_close(self) -> None:
        """Shut the group down and drop this communicator's reference to it.

        gloo's worker threads live as long as the ``ProcessGroupGloo`` object.
        torch's ``destroy_process_group`` only unregisters the group: while
        anything still references it (this communicator, kept alive by a
        ``Group``, an optimizer or a script variable) the threads run on into
        interpreter teardown. A worker that drops its last collective there
        frees tensors whose Python objects need the GIL; a thread asking for
        the GIL during finalization is ended with ``pthread_exit``, whose
        unwinding through gloo's destructors calls ``std::terminate``
        ("terminate called without an active exception", SIGABRT). With the
        reference gone the group is destroyed here instead, and its destructor
        joins the workers (without the GIL) while the interpreter is whole.
        A standalone group is only shut down: its owner keeps it.
        """
        pg = self._pg
        if pg is None:
            return
        if self._standalone:
            # kept: its owner (one membership epoch) decides when it goes, and a worker stuck on a
            # lost peer would hold the destructor until the transport timeout
            try:
                pg.shutdown()
            except Exception as exc:  # noqa: BLE001
                logger.debug("process group shutdown raised %s", exc)
            return
        self._pg = None
        if self._is_world and not self._owns_world:
            return  # torch's default group belongs to whoever called init_process_group
        try:
            tdist.destroy_process_group(None if self._is_world else pg)
        except Exception as exc:  # noqa: BLE001
            logger.debug("destroy_process_group raised %s", exc)


def as_torch_communicator(
    group: Any, *, timeout: timedelta, check_collectives: bool = False
) -> TorchCommunicator | None:
    """Wrap a process group made with torch.distributed directly; ``None`` if ``group`` is not one."""
    if not isinstance(group, tdist.ProcessGroup):
        return None
    return TorchCommunicator(group, timeout=timeout, check_collectives=check_collectives)
