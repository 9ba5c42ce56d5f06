"""DistributedDataParallel communication hooks over sparsecomm's transports.

Two hooks for ``DistributedDataParallel.register_comm_hook(state, hook)``:

:func:`sparse_allreduce_hook` with a :class:`SparseHookState`
    A mask-delayed sparse all-reduce of each gradient bucket, for users who
    keep their own optimizer (AdamW, SGD, ...). Every bucket has its own mask,
    identical on all ranks: each rank proposes the positions of its shard of
    the bucket (top-k magnitude of the bucket right after its all-reduce: the
    average where it was just sent, the rank's unsent remainder elsewhere)
    and the pieces are all-gathered asynchronously by a
    :class:`~sparsecomm.schedule.MaskSchedule`; the mask made at iteration ``i``
    is used at iteration ``i + 1 + mask_delay``. Only the packed values travel
    (no indices). The first ``start_iter`` iterations are dense (plain DDP,
    bit for bit), and so is any iteration without a mask. With error feedback
    (the default) the unsent remainder of a bucket is added to the same
    bucket at the next iteration, so no gradient is lost, only delayed.
    The communication of every bucket runs on one worker thread per state, in
    bucket order, so the backward pass keeps computing while a bucket is on
    the wire; the returned future completes when the bucket's average is in
    the buffer.

:func:`noop_hook` (:func:`let_optimizer_sync`)
    Returns each rank's own gradients untouched: DDP sends nothing. For an
    optimizer that synchronizes the gradients itself (SCAPE, the sharded
    AdamS/AdamW, LocalAdamS) under a trainer that wraps the model in DDP
    (Hugging Face ``Trainer``, Accelerate, Lightning), so that the bytes on
    the wire are the optimizer's alone.

The sparse hook communicates over its own group (by default a
:func:`sparsecomm.groups.new_group` of the default group, made at the first
bucket), never over DDP's: DDP's own collectives (buffer broadcasts) and the
hook's then cannot interleave differently on different ranks. Its bytes are
counted by that group's stats (:attr:`SparseHookState.stats`): scope
``ddp_hook`` for the bucket values, ``mask_sync`` for the mask pieces,
``ddp_hook_check`` for the one-time bucket-size check.

DDP rebuilds its buckets after the first iteration, so per-bucket state is
keyed by ``bucket.index()`` only from iteration 1 on: masks are proposed from
iteration 1, and the sparse phase starts at ``max(start_iter, 2 + mask_delay)``
at the earliest.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import StateDict

from bindings import Communicator, ReduceOp
from bindings.stats import CommStats, ring_bytes
from bindings.torch_backend import GradBucket
from bindings.validate import check_bool, check_density, check_int
from sparsecomm.collectives import sparse_all_reduce
from sparsecomm.groups import Group, get_communicator, is_initialized, new_group
from sparsecomm.mask import ShardedMask, k_for
from sparsecomm.schedule import MaskSchedule
from sparsecomm.worker import SerialWorker

__all__ = ["SparseHookState", "sparse_allreduce_hook", "noop_hook", "let_optimizer_sync"]

logger = logging.getLogger(__name__)

_HOOK_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


Layout = tuple[tuple[int, int], ...]
"""A bucket's parameters in buffer order: (position in the model's first-iteration order, elements)."""


@dataclass
class _Bucket:
    """What one bucket index keeps between iterations."""

    layout: Layout
    residual: torch.Tensor | None
    schedule: MaskSchedule

    @property
    def numel(self) -> int:
        return sum(n for _, n in self.layout)

    def remainders(self) -> dict[int, torch.Tensor]:
        """The unsent remainder of each parameter of the bucket (copies), by parameter position."""
        out: dict[int, torch.Tensor] = {}
        if self.residual is not None:
            off = 0
            for pos, n in self.layout:
                out[pos] = self.residual[off : off + n].clone()
                off += n
        return out


@dataclass
class _Saved:
    """A bucket of a pickled state, waiting for the restored model's buckets."""

    layout: Layout
    masks: dict[int, torch.Tensor]


class SparseHookState:
    """State of :func:`sparse_allreduce_hook`: settings, iteration counter, per-bucket masks and remainders.

    Build it on every rank with the same arguments, after
    ``sparsecomm.distributed.init_process_group``, and register it with
    ``ddp_model.register_comm_hook(state, sparse_allreduce_hook)``. One state
    serves one DDP model.

    Checkpoints: pickle the state between iterations (``torch.save`` /
    ``pickle``; it holds the iteration, the remainders and the masks of the
    next iterations, no group) and register the unpickled state with the
    restored DDP model. Like every first iteration of a DDP model, the first
    one after the restore is dense (DDP's buckets are provisional until it
    rebuilds them); it sends the saved remainders with it, each at its
    parameter's place, so no gradient is lost. From the next iteration the
    saved masks are used where DDP's buckets are the saved ones, and new
    masks are made elsewhere.

    Args:
        group: The sparsecomm group the hook communicates over (``None``: a
            new group of the default group, made collectively at the first
            bucket; every rank's first backward makes it).
        density: Fraction of each bucket's shard sent per iteration, in (0, 1].
            ``1.0`` is plain DDP's all-reduce, bit for bit.
        start_iter: Dense iterations before the sparse phase.
        mask_delay: D >= 0: a mask made at iteration i is used at i + 1 + D.
        error_feedback: Keep each bucket's unsent remainder and add it to the
            bucket at the next iteration (default on).

    Every wait ends by the group's timeout (``init_process_group(timeout=...)``);
    a failure reaches DDP through the bucket's future, as a ``CommError``.

    Attributes:
        iter: Iterations completed (advanced at each iteration's last bucket).

    Raises:
        ValueError, TypeError: Bad arguments (on every rank alike, before any communication).
    """

    def __init__(
        self,
        group: Group | None = None,
        *,
        density: float = 0.01,
        start_iter: int = 10,
        mask_delay: int = 1,
        error_feedback: bool = True,
    ) -> None:
        density = check_density(density)
        start_iter = check_int("start_iter", start_iter, low=0)
        mask_delay = check_int("mask_delay", mask_delay, low=0)
        error_feedback = check_bool("error_feedback", error_feedback)
        if group is not None and not isinstance(group, Group):
            raise TypeError(f"group: expected a sparsecomm group, got {type(group).__name__}")
        self.density = float(density)
        self.start_iter = start_iter
        self.mask_delay = mask_delay
        self.error_feedback = error_feedback
        self.iter = 0
        self._group = group
        self._comm: Communicator | None = None
        self._buckets: dict[int, _Bucket] = {}
        self._checked: set[tuple[int, int]] = set()
        self._worker: SerialWorker[torch.Tensor] | None = None
        # main thread (the hook): iterations seen by this object, and the model's parameters in the
        # order of its first iteration (DDP's provisional buckets: reverse registration order)
        self._life = 0
        self._order: dict[int, int] = {}
        # worker thread: the buckets of a pickled state, and remainders kept by parameter
        self._saved: dict[int, _Saved] = {}
        self._saved_residual: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ public
    @property
    def stats(self) -> CommStats:
        """Byte and call counters of the hook's group (its first use makes the group: collective)."""
        return self._communicator().stats

    @property
    def sparse_start(self) -> int:
        """First iteration that can be sparse (buckets are stable from iteration 1; masks need 1 + D more)."""
        return max(self.start_iter, 2 + self.mask_delay)

    def is_sparse_iter(self, it: int) -> bool:
        """Whether iteration ``it`` is planned sparse (it still runs dense where no mask was made)."""
        return self.density < 1.0 and it >= self.sparse_start

    def bucket_sizes(self) -> dict[int, int]:
        """Elements of every bucket the hook keeps state for, by bucket index."""
        return {i: b.numel for i, b in sorted(self._buckets.items())}

    def pending_remainder(self) -> float:
        """Sum of the magnitudes of every unsent remainder (kept, or restored and not sent yet)."""
        kept = sum(float(b.residual.abs().sum()) for b in self._buckets.values() if b.residual is not None)
        return kept + sum(float(r.abs().sum()) for r in self._saved_residual.values())

    def wire_bytes(self, numel: int, element_size: int) -> int:
        """Bytes one rank sends for a bucket of ``numel`` elements at a sparse iteration (values, no mask).

        A ring all-reduce of the ``world_size * k`` packed values sends
        ``2 (P - 1) / P`` of their bytes from every rank.
        """
        p = self._communicator().world_size
        return ring_bytes("all_reduce", p * k_for(numel, p, self.density) * element_size, p)[0]

    def close(self) -> None:
        """Finish the mask gathers in flight and stop the worker thread (call before tearing the group down)."""
        if self._worker is not None:
            self._worker.stop()
            self._worker = None
        for b in self._buckets.values():
            b.schedule.close()

    # ------------------------------------------------------------------ pickling (checkpoints)
    def __getstate__(self) -> StateDict:
        """Settings, iteration, remainders and the masks of the next iterations; no group, no thread.

        Call it between iterations (no bucket in flight). Gathers still in
        flight are finished first, so a restored state uses the same masks.
        """
        if self._worker is not None:
            self._worker.drain()
        buckets: dict[int, StateDict] = {}
        residual = {pos: r.clone() for pos, r in self._saved_residual.items()}
        for idx, b in self._buckets.items():
            ready: dict[int, ShardedMask] = {}
            for s in range(self.iter, self.iter + self.mask_delay + 1):
                m = b.schedule.mask_for(s)
                if m is not None:
                    ready[s] = m
            for s, m in ready.items():
                b.schedule.install(s, m)
            buckets[idx] = {"layout": b.layout, "masks": {s: m.indices.clone() for s, m in ready.items()}}
            residual.update(b.remainders())
        return {
            "density": self.density,
            "start_iter": self.start_iter,
            "mask_delay": self.mask_delay,
            "error_feedback": self.error_feedback,
            "iter": self.iter,
            "buckets": buckets,
            "residual": residual,
        }

    def __setstate__(self, st: StateDict) -> None:
        """Restore a :meth:`__getstate__`; the group is made again (collectively) at the first bucket."""
        self.__init__(  # type: ignore[misc]
            density=st["density"],
            start_iter=st["start_iter"],
            mask_delay=st["mask_delay"],
            error_feedback=st["error_feedback"],
        )
        self.iter = check_int("state iter", st["iter"], low=0)
        self._saved = {
            int(i): _Saved(layout=tuple((int(a), int(n)) for a, n in b["layout"]), masks=dict(b["masks"]))
            for i, b in st["buckets"].items()
        }
        self._saved_residual = {int(pos): r for pos, r in st["residual"].items()}

    # ------------------------------------------------------------------ internals
    def _communicator(self) -> Communicator:
        if self._comm is None:
            if self._group is None:
                if not is_initialized():
                    raise RuntimeError(
                        "SparseHookState: call sparsecomm.distributed.init_process_group() before the first backward"
                    )
                made = new_group()
                assert isinstance(made, Group)
                self._group = made
            self._comm = get_communicator(self._group)
        return self._comm

    def _submit(self, job: Callable[[], torch.Tensor]) -> torch.futures.Future[torch.Tensor]:
        if self._worker is None:
            self._worker = SerialWorker("sparsecomm-ddp-hook")
        return self._worker.submit(job)

    def _enter(self, bucket: GradBucket) -> tuple[int, int, Layout]:
        """Main thread, at each bucket: (iteration, iteration of this object, layout); checks the model."""
        layout = []
        for p in bucket.parameters():
            pos = self._order.get(id(p))
            if pos is None:
                if self._life > 0:
                    raise ValueError(
                        f"sparse_allreduce_hook: bucket {bucket.index()} holds parameters this state has not "
                        "seen; one state serves one DDP model (build a SparseHookState per model, and register "
                        "each hook once)"
                    )
                pos = self._order[id(p)] = len(self._order)
            layout.append((pos, p.numel()))
        out = (self.iter, self._life, tuple(layout))
        if bucket.is_last():
            self.iter += 1
            self._life += 1
        return out

    def _bucket_state(self, idx: int, layout: Layout, dtype: torch.dtype) -> _Bucket:
        """The state of bucket ``idx`` (made anew when its parameters changed: DDP rebuilt its buckets)."""
        b = self._buckets.get(idx)
        if b is not None and b.layout == layout:
            return b
        if b is not None:  # rebucketed: its remainder goes out with the parameters' new buckets
            self._saved_residual.update(b.remainders())
            b.schedule.close()
        comm = self._communicator()
        numel = sum(n for _, n in layout)
        sched = MaskSchedule(comm, numel=numel, density=self.density, delay=self.mask_delay)
        saved = self._saved.pop(idx, None)
        if saved is not None and saved.layout == layout:
            for s, ix in saved.masks.items():
                sched.install(int(s), ShardedMask(numel=numel, world_size=comm.world_size, k=ix.shape[1], indices=ix))
        residual = torch.zeros(numel, dtype=dtype) if self.error_feedback else None
        b = _Bucket(layout=layout, residual=residual, schedule=sched)
        self._buckets[idx] = b
        return b

    def _add_kept_remainders(self, buf: torch.Tensor, layout: Layout) -> None:
        """Add (and forget) the kept remainders of this bucket's parameters, each at its place."""
        off = 0
        for pos, n in layout:
            r = self._saved_residual.pop(pos, None)
            if r is not None:
                buf[off : off + n].add_(r.to(buf.dtype))
            off += n

    def _check_sizes(self, idx: int, numel: int) -> None:
        """Every rank raises ``ValueError`` unless all ranks hold ``numel`` elements in bucket ``idx``."""
        if (idx, numel) in self._checked:
            return
        comm = self._communicator()
        probe = torch.tensor([numel, -numel], dtype=torch.int64)
        with comm.stats.scope("ddp_hook_check"):
            comm.all_reduce(probe, ReduceOp.MAX)
        hi, lo = int(probe[0]), -int(probe[1])
        if hi != lo:
            raise ValueError(
                f"sparse_allreduce_hook: bucket {idx} holds between {lo} and {hi} elements across ranks; every "
                "rank must build the same model and DDP bucket sizes"
            )
        self._checked.add((idx, numel))

    def _reduce(self, it: int, life: int, idx: int, layout: Layout, buf: torch.Tensor) -> torch.Tensor:
        """The communication of one bucket (worker thread): dense or sparse, then the next mask."""
        comm = self._communicator()
        self._check_sizes(idx, buf.numel())
        # DDP's first iteration runs on provisional buckets (rebuilt after it): dense, no state kept
        b = self._bucket_state(idx, layout, buf.dtype) if self.density < 1.0 and life >= 1 else None
        if self._saved_residual:
            self._add_kept_remainders(buf, layout)
        mask = b.schedule.mask_for(it) if b is not None else None
        if mask is None or not self.is_sparse_iter(it):
            # plain DDP's all-reduce, bit for bit: divide first, then sum
            if b is not None and b.residual is not None:
                buf.add_(b.residual)
                b.residual.zero_()
            buf.div_(comm.world_size)
            with comm.stats.scope("ddp_hook"):
                comm.all_reduce(buf, ReduceOp.SUM)
            if b is not None:
                self._propose(it, b, buf)
            return buf
        assert b is not None
        gidx = mask.global_indices(buf.device)
        if b.residual is not None:
            buf.add_(b.residual)
            b.residual.copy_(buf)
            b.residual.index_fill_(0, gidx, 0.0)
        with comm.stats.scope("ddp_hook"):
            sparse_all_reduce(comm, buf, mask, "avg", verify_mask=False)
        sent = buf[gidx]
        self._propose(it, b, buf)
        buf.zero_()
        buf[gidx] = sent
        return buf

    def _propose(self, it: int, b: _Bucket, reduced: torch.Tensor) -> None:
        """Propose this rank's piece of the masks of iterations ``it + 1 .. it + 1 + D`` still missing.

        ``reduced`` is the bucket right after its all-reduce: the average at
        the positions just sent (what the ranks' gradients there amount to)
        and, with error feedback, this rank's unsent remainder elsewhere. Its
        magnitude on this rank's shard is the score.
        """
        sched = b.schedule
        lo, hi = sched.own_shard
        scores = reduced[lo:hi].abs().float()
        # normally only it + 1 + D is missing; after a restore or a rebucketing, sooner ones may be too
        # (their gathers then have less time to finish)
        for target in range(it + 1, it + 2 + self.mask_delay):
            if self.is_sparse_iter(target) and not sched.scheduled(target):
                sched.propose(target - 1 - self.mask_delay, scores)


def sparse_allreduce_hook(state: SparseHookState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the mask-delayed sparse all-reduce of one gradient bucket (see the module docstring).

    Collective: every rank's DDP calls it for every bucket, in the same order.

    Args:
        state: The :class:`SparseHookState` registered with the hook.
        bucket: DDP's ``GradBucket``.

    Returns:
        A future completed with the bucket's averaged gradients (zero where
        this iteration sent nothing).
    """
    if not isinstance(state, SparseHookState):
        raise TypeError(f"sparse_allreduce_hook: state must be a SparseHookState, got {type(state).__name__}")
    buf = bucket.buffer()
    if buf.dtype not in _HOOK_DTYPES:
        raise TypeError(f"sparse_allreduce_hook: gradients of dtype {buf.dtype} are not supported")
    state._communicator()  # made here, on the thread every rank's backward runs on, in bucket order
    idx = bucket.index()
    it, life, layout = state._enter(bucket)
    return state._submit(lambda: state._reduce(it, life, idx, layout, buf))


def noop_hook(state: object, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook that sends nothing: each rank keeps its own gradients (the optimizer synchronizes them)."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def let_optimizer_sync(ddp_model: Any) -> None:
    """Turn DDP's gradient all-reduce off on ``ddp_model``: the optimizer (SCAPE, sharded AdamS, ...) syncs.

    Registers :func:`noop_hook`; DDP still broadcasts its buffers at each
    forward (``broadcast_buffers``). Local: no communication.

    Raises:
        TypeError: ``ddp_model`` has no ``register_comm_hook`` (not a DDP model).
        RuntimeError: DDP already has a comm hook (DDP allows one).
    """
    register = getattr(ddp_model, "register_comm_hook", None)
    if not callable(register):
        raise TypeError(f"let_optimizer_sync: expected a DistributedDataParallel model, got {type(ddp_model).__name__}")
    register(None, noop_hook)
