"""Collectives forwarded to the current epoch's transport, failing fast when the epoch fails.

:class:`FailFastCommunicator` is the data-plane half of
:class:`~resilient_comm.fault_aware.FaultAwareCommunicator`: it holds one
epoch's transport (and its :class:`SideChannel`) at a time and forwards every
operation to it. An operation on an epoch that failed raises at once; an
operation whose transport raises fails the epoch here (the revoke: this
member's transport is aborted so that peers blocked on it fail fast too) and
reports it through the member's
:class:`~resilient_comm.membership.StoreMembership`. Waits end early through
:mod:`resilient_comm.guard`. Which epoch comes next, and when, is the
subclass's job.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta

import torch

from bindings.base import RawWork
from bindings.communicator import BaseCommunicator
from bindings.errors import CommError, PeerFailureError
from bindings.ops import ReduceOp
from bindings.torch_backend import TorchCommunicator
from resilient_comm.guard import REAPER, EpochGuard, GuardedWork
from resilient_comm.membership import StoreMembership
from resilient_comm.view import View

__all__ = ["FailFastCommunicator", "SideChannel"]

logger = logging.getLogger(__name__)


class FailFastCommunicator(BaseCommunicator):
    """A communicator over one epoch's transport at a time whose operations fail fast with the epoch.

    Every operation completes or raises
    :class:`~bindings.errors.PeerFailureError` within its deadline; after a
    failure of the current epoch every call raises until :meth:`_install` put
    the next epoch's transport in place. Not instantiated on its own: a
    subclass names the backend and moves the member between epochs.

    Args:
        membership: This process's registration (abort flags, failure reports).
        timeout: Deadline of every operation.
        check_collectives: See :class:`~bindings.communicator.BaseCommunicator`.
    """

    def __init__(self, membership: StoreMembership, *, timeout: timedelta, check_collectives: bool) -> None:
        super().__init__(0, 1, timeout=timeout, check_collectives=check_collectives)
        self._m = membership
        self._inner: TorchCommunicator | None = None
        self._side: SideChannel | None = None
        self._view: View | None = None
        self._failed_epoch = -1  # newest epoch this member saw fail
        self._state_lock = threading.Lock()
        self._epoch_guard = EpochGuard(
            failed=self._epoch_failed, fail=self._fail, failure=self._failure, timeout_s=timeout.total_seconds()
        )

    @property
    def healthy(self) -> bool:
        """Whether the current epoch is usable (no failure seen in it)."""
        return self._view is not None and not self._epoch_failed(self._view.epoch)

    # ------------------------------------------------------------------ the epoch's fate
    def _epoch_failed(self, epoch: int) -> bool:
        return self._failed_epoch >= epoch or self._m.aborted(epoch)

    def _fail(self, epoch: int, reason: str) -> None:
        """Revoke: abort ``epoch``'s transport here and report it (once per epoch)."""
        with self._state_lock:
            first = self._failed_epoch < epoch
            self._failed_epoch = max(self._failed_epoch, epoch)
        self._abort_transports(epoch)
        if first:
            logger.info("member %d: epoch %d failed: %s", self._m.index, epoch, reason)
            self._m.report(epoch, reason)

    def _on_abort(self, epoch: int) -> None:
        """Watcher thread: the coordinator aborted ``epoch``."""
        with self._state_lock:
            self._failed_epoch = max(self._failed_epoch, epoch)
        self._abort_transports(epoch)

    def _abort_transports(self, epoch: int) -> None:
        with self._state_lock:
            current = self._view is not None and self._view.epoch == epoch
            inner, side = (self._inner, self._side) if current else (None, None)
        if inner is not None:
            inner.abort()
        if side is not None:
            side.transport.abort()

    def _failure(self, epoch: int, message: str) -> PeerFailureError:
        info = self._m.abort_info(epoch)
        dead = info.get("dead_slots", [])
        slots = frozenset(int(s) for s in dead) if isinstance(dead, list) else frozenset()
        return PeerFailureError(f"{message} (epoch {epoch}; call reconfigure())", failed_ranks=slots)

    def _install(
        self, inner: TorchCommunicator | None, side: SideChannel | None, view: View | None, rank: int, world_size: int
    ) -> None:
        """Make ``inner`` and ``side`` the transports of ``view`` (``None``: none) and dispose of the old ones.

        The old transports are aborted at once; their groups go to the reaper,
        since work given up on (an optimizer's abandoned gathers, say) may keep
        the communicator objects alive for long, but must not keep their groups.
        """
        with self._state_lock:
            old, old_side = self._inner, self._side
            self._inner, self._side, self._view = inner, side, view
            self._rank, self._world_size = rank, world_size
        if old is not None:
            old.abort()
        if old_side is not None:
            old_side.transport.abort()
        REAPER.bury(None if old is None else old.release(), None if old_side is None else old_side.transport.release())

    # ------------------------------------------------------------------ transport hooks
    def _current(self, op: str) -> tuple[TorchCommunicator, int]:
        with self._state_lock:
            inner, view = self._inner, self._view
        if inner is None or view is None:
            raise PeerFailureError(f"{op}: this member is not in an epoch yet")
        if self._epoch_failed(view.epoch):
            raise self._failure(view.epoch, f"{op}: epoch {view.epoch} has failed")
        return inner, view.epoch

    def _guard(
        self,
        op: str,
        call: Callable[[TorchCommunicator], RawWork],
        on: tuple[TorchCommunicator, int] | None = None,
        on_success: Callable[[], object] | None = None,
    ) -> RawWork:
        inner, epoch = self._current(op) if on is None else on
        if self._epoch_failed(epoch):
            raise self._failure(epoch, f"{op}: epoch {epoch} has failed")
        try:
            raw = call(inner)
        except CommError as exc:
            self._fail(epoch, f"{op}: {exc}")
            raise self._failure(epoch, f"{op}: {exc}") from exc
        return GuardedWork(self._epoch_guard, op, epoch, raw, on_success)

    # The transport works on private copies: an operation given up when its epoch
    # failed may still complete later (gloo's abort does not cancel it, and a
    # resumed peer may finish it) and must then not write the caller's memory.
    # Results are copied back only when the operation succeeded.
    def _raw_all_reduce(self, buf: torch.Tensor, op: ReduceOp) -> RawWork:
        tmp = buf.clone()
        return self._guard("all_reduce", lambda c: c._raw_all_reduce(tmp, op), on_success=lambda: buf.copy_(tmp))

    def _raw_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp) -> RawWork:
        src, dst = inp.clone(), torch.empty_like(out)
        return self._guard(
            "reduce_scatter", lambda c: c._raw_reduce_scatter(dst, src, op), on_success=lambda: out.copy_(dst)
        )

    def _raw_all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> RawWork:
        src, dst = inp.clone(), torch.empty_like(out)
        return self._guard("all_gather", lambda c: c._raw_all_gather(dst, src), on_success=lambda: out.copy_(dst))

    def _raw_broadcast(self, buf: torch.Tensor, src: int) -> RawWork:
        tmp = buf.clone()
        return self._guard("broadcast", lambda c: c._raw_broadcast(tmp, src), on_success=lambda: buf.copy_(tmp))

    def _raw_barrier(self) -> RawWork:
        return self._guard("barrier", lambda c: c._raw_barrier())

    def _raw_send(self, buf: torch.Tensor, dst: int, tag: int) -> RawWork:
        tmp = buf.clone()
        return self._guard("send", lambda c: c._raw_send(tmp, dst, tag))

    def _raw_recv(self, buf: torch.Tensor, src: int | None, tag: int) -> tuple[RawWork, Callable[[], int]]:
        tmp = torch.empty_like(buf)
        return self._guard_recv(tmp, src, tag, self._current("recv"), on_success=lambda: buf.copy_(tmp))

    def _guard_recv(
        self,
        buf: torch.Tensor,
        src: int | None,
        tag: int,
        on: tuple[TorchCommunicator, int],
        on_success: Callable[[], object] | None = None,
    ) -> tuple[RawWork, Callable[[], int]]:
        inner, epoch = on
        if self._epoch_failed(epoch):
            raise self._failure(epoch, f"recv: epoch {epoch} has failed")
        try:
            raw, source = inner._raw_recv(buf, src, tag)
        except CommError as exc:
            self._fail(epoch, f"recv: {exc}")
            raise self._failure(epoch, f"recv: {exc}") from exc
        return GuardedWork(self._epoch_guard, "recv", epoch, raw, on_success), source

    def _raw_split(self, members: list[int]) -> BaseCommunicator | None:
        raise NotImplementedError("split: a fault-aware communicator cannot be split; its epochs change its ranks")

    def _wire_bytes(self, op: str, nbytes: int) -> tuple[int, int]:
        inner = self._inner
        if inner is None:
            return super()._wire_bytes(op, nbytes)
        return inner._wire_bytes(op, nbytes)

    def abort(self) -> None:
        """Revoke the current epoch here: peers fail fast; call ``reconfigure()`` to go on.

        Unlike other communicators this one stays usable after ``abort`` (the
        next epoch gets a new transport).
        """
        view = self._view
        if view is not None:
            self._fail(view.epoch, "aborted by the application")

    def _raw_abort(self) -> None:  # pragma: no cover - abort() is overridden
        pass


class SideChannel(BaseCommunicator):
    """A second transport of one epoch, failing fast with it (see
    :attr:`~resilient_comm.fault_aware.FaultAwareCommunicator.side_channel`)."""

    def __init__(self, owner: FailFastCommunicator, epoch: int, transport: TorchCommunicator) -> None:
        super().__init__(transport.rank, transport.world_size, timeout=owner.timeout)
        self._owner = owner
        self._epoch = epoch
        self.transport = transport

    @property
    def backend(self) -> str:
        """The transport's backend."""
        return self.transport.backend

    @property
    def epoch(self) -> int:
        """The epoch this channel belongs to."""
        return self._epoch

    def _on(self) -> tuple[TorchCommunicator, int]:
        return self.transport, self._epoch

    def _raw_all_reduce(self, buf: torch.Tensor, op: ReduceOp) -> RawWork:
        return self._owner._guard("all_reduce", lambda c: c._raw_all_reduce(buf, op), self._on())

    def _raw_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp) -> RawWork:
        return self._owner._guard("reduce_scatter", lambda c: c._raw_reduce_scatter(out, inp, op), self._on())

    def _raw_all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> RawWork:
        return self._owner._guard("all_gather", lambda c: c._raw_all_gather(out, inp), self._on())

    def _raw_broadcast(self, buf: torch.Tensor, src: int) -> RawWork:
        return self._owner._guard("broadcast", lambda c: c._raw_broadcast(buf, src), self._on())

    def _raw_barrier(self) -> RawWork:
        return self._owner._guard("barrier", lambda c: c._raw_barrier(), self._on())

    def _raw_send(self, buf: torch.Tensor, dst: int, tag: int) -> RawWork:
        return self._owner._guard("send", lambda c: c._raw_send(buf, dst, tag), self._on())

    def _raw_recv(self, buf: torch.Tensor, src: int | None, tag: int) -> tuple[RawWork, Callable[[], int]]:
        return self._owner._guard_recv(buf, src, tag, self._on())

    def _raw_split(self, members: list[int]) -> BaseCommunicator | None:
        raise NotImplementedError("split: a side channel cannot be split")

    def _raw_abort(self) -> None:
        self.transport.abort()

    def _raw_close(self) -> None:
        self.transport.close()
