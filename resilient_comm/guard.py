"""Bounded waits on one epoch's transport, for :class:`~resilient_comm.fault_aware.FaultAwareCommunicator`.

Every wait here ends at its deadline or as soon as the epoch it belongs to is
given up (aborted by this member or by the coordinator), whichever comes
first; nothing waits on a dead peer for a transport's own, much longer, timeout:

* :class:`GuardedWork`: a collective or point-to-point operation;
* :func:`call_unless_aborted`: a blocking call (the rendezvous of a new
  epoch's transport) run in a helper thread;
* :data:`REAPER`: destroys the transports of failed epochs off the caller's thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from bindings.base import RawWork
from bindings.errors import CommError, PeerFailureError

__all__ = ["EpochGuard", "GuardedWork", "REAPER", "call_unless_aborted", "join_helpers"]

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class EpochGuard:
    """How an operation learns about and reports the failure of its epoch.

    Attributes:
        failed: Whether an epoch has been given up.
        fail: Give an epoch up here, with a reason (the revoke: peers fail fast too).
        failure: The error to raise for an epoch given up, with a message.
        timeout_s: Default deadline of a wait, in seconds.
    """

    failed: Callable[[int], bool]
    fail: Callable[[int, str], None]
    failure: Callable[[int, str], PeerFailureError]
    timeout_s: float


class _Helpers:
    """The helper threads still inside a transport call (see :func:`join_helpers`)."""

    def __init__(self) -> None:
        self._live: set[threading.Thread] = set()
        self._lock = threading.Lock()

    def start(self, target: Callable[[], object], name: str) -> threading.Thread:
        def run() -> None:
            try:
                target()
            finally:
                with self._lock:
                    self._live.discard(threading.current_thread())

        thread = threading.Thread(target=run, name=name, daemon=True)
        with self._lock:
            self._live.add(thread)
        thread.start()
        return thread

    def join(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                live = list(self._live)
            if not live:
                return True
            for thread in live:
                thread.join(max(0.0, deadline - time.monotonic()))
            if time.monotonic() >= deadline:
                with self._lock:
                    return not self._live


_HELPERS = _Helpers()


def join_helpers(timeout_s: float) -> bool:
    """Wait until no helper thread is inside a transport call; ``False`` if some still are after ``timeout_s``.

    A helper waits in native code, without the GIL, for an operation its
    caller may have given up on. If the interpreter shuts down before that
    call returns, the thread is ended inside native frames and the process
    aborts (SIGABRT): a process leaves only once they are done.
    """
    return _HELPERS.join(timeout_s)


class GuardedWork:
    """Raw work of one epoch: finishes, or gives up as soon as the epoch is aborted.

    Most gloo works report completion through ``is_completed()``, which is
    polled. gloo's reduce-scatter and point-to-point works complete only inside
    ``wait()``: for those a helper thread waits in the transport while the
    caller watches the epoch (the helper ends with the transport's own timeout
    if the epoch was given up; the work keeps its buffers alive until then).

    Args:
        guard: The owner's view of the epoch's health.
        op: Name of the operation (for messages; decides polling vs helper thread).
        epoch: The epoch the operation was issued on.
        raw: The transport's work.
        on_success: Run once after the operation succeeded (copy results back).
    """

    _POLLABLE = ("all_reduce", "all_gather", "broadcast", "barrier")

    def __init__(
        self,
        guard: EpochGuard,
        op: str,
        epoch: int,
        raw: RawWork,
        on_success: Callable[[], object] | None = None,
    ) -> None:
        self.on_success = on_success
        self._guard = guard
        self._op = op
        self._epoch = epoch
        self._raw = raw
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._helper: threading.Thread | None = None
        if op not in self._POLLABLE:  # start waiting now, so is_completed() works before wait()
            deadline = time.monotonic() + guard.timeout_s
            self._helper = _HELPERS.start(lambda: self._wait_in_transport(deadline), f"sparsecomm-wait-{op}")

    def wait(self, timeout_s: float | None) -> None:
        """Finish the operation, or raise ``PeerFailureError`` when its epoch fails or the deadline passes."""
        deadline = time.monotonic() + (self._guard.timeout_s if timeout_s is None else timeout_s)
        if self._op in self._POLLABLE:
            self._watch(deadline, self._raw.is_completed)
            self._finish(lambda: self._raw.wait(max(0.01, deadline - time.monotonic())))
            return
        self._watch(deadline, self._done.is_set)
        self._finish(self._reraise)

    def _wait_in_transport(self, deadline: float) -> None:
        try:
            self._raw.wait(max(0.01, deadline - time.monotonic()))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            self._error = exc
        finally:
            self._done.set()

    def _reraise(self) -> None:
        if self._error is not None:
            raise self._error

    def _watch(self, deadline: float, done: Callable[[], bool]) -> None:
        guard, delay = self._guard, 5e-5
        while not done():
            if guard.failed(self._epoch):
                raise guard.failure(self._epoch, f"{self._op}: epoch {self._epoch} was aborted")
            if time.monotonic() > deadline:
                guard.fail(self._epoch, f"{self._op}: timed out")
                raise guard.failure(self._epoch, f"{self._op}: no progress before the deadline (hung peer?)")
            if self._helper is not None:
                self._done.wait(delay)
            else:
                time.sleep(delay)
            delay = min(delay * 2, 0.001)

    def _finish(self, complete: Callable[[], None]) -> None:
        guard = self._guard
        try:
            complete()
        except CommError as exc:
            guard.fail(self._epoch, f"{self._op}: {exc}")
            raise guard.failure(self._epoch, f"{self._op}: {exc}") from exc
        if self.on_success is not None:
            self.on_success()
            self.on_success = None

    def is_completed(self) -> bool:
        """Whether the operation finished (or its epoch failed: ``wait`` then raises at once)."""
        if self._guard.failed(self._epoch):
            return True
        return self._done.is_set() if self._op not in self._POLLABLE else self._raw.is_completed()


def call_unless_aborted(fn: Callable[[], T], aborted: Callable[[], bool], *, name: str, what: str) -> T:
    """Run the blocking ``fn`` in a helper thread; give up as soon as ``aborted()`` turns true.

    An abandoned helper ends on its own (``fn`` must have a deadline of its own).

    Args:
        fn: The call.
        aborted: Polled every 5 ms while ``fn`` runs.
        name: Name of the helper thread.
        what: Says what ``fn`` does, in error messages.

    Returns:
        What ``fn`` returned.

    Raises:
        PeerFailureError: ``aborted()`` turned true first, or ``fn`` raised an ``Exception`` (chained).
    """
    results: list[T] = []
    errors: list[Exception] = []

    def run() -> None:
        try:
            results.append(fn())
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/DistError on a failed rendezvous
            errors.append(exc)

    helper = _HELPERS.start(run, name)
    while helper.is_alive():
        helper.join(0.005)
        if helper.is_alive() and aborted():
            raise PeerFailureError(f"{what}: aborted before it finished")
    if errors:
        raise PeerFailureError(f"{what}: {errors[0]}") from errors[0]
    return results[0]


class _Reaper:
    """Destroys the transports of failed epochs on a background thread.

    A gloo group destroyed while one of its operations is still pending (one
    the caller gave up on when the epoch failed) blocks in its destructor until
    that operation times out. The destructor releases the GIL, so running it
    here keeps the member responsive; a short grace period makes sure this
    thread holds the last reference.
    """

    _GRACE_S = 1.0

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[float, Any]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pending = 0
        self._idle = threading.Condition(self._lock)

    def bury(self, *transports: Any, grace_s: float | None = None) -> None:
        """Hand transports over (``None`` entries are skipped); drop your own references afterwards.

        Args:
            transports: What to destroy.
            grace_s: Delay before the destructor runs (default: long enough for
                the caller's own references to be gone).
        """
        grace = self._GRACE_S if grace_s is None else grace_s
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sparsecomm-reaper", daemon=True)
                self._thread.start()
        for t in transports:
            if t is not None:
                with self._lock:
                    self._pending += 1
                self._queue.put((time.monotonic() + grace, t))

    def drain(self, timeout_s: float) -> bool:
        """Wait until every buried transport is destroyed; ``False`` if some are still pending after ``timeout_s``.

        A process must not exit while a destructor runs here: interpreter
        teardown would kill the thread inside native code and abort the process.
        """
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout=timeout_s)

    def _run(self) -> None:
        while True:
            due, item = self._queue.get()
            time.sleep(max(0.0, due - time.monotonic()))
            del item  # the destructor runs here, however long it takes
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()


#: The process's one reaper.
REAPER = _Reaper()
