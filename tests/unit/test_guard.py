"""Bounded waits of :mod:`resilient_comm.guard`, on fake transport works."""

from __future__ import annotations

import threading
import time

import pytest

from bindings.errors import CommError, PeerFailureError
from resilient_comm.guard import EpochGuard, GuardedWork, call_unless_aborted


class _Raw:
    """A transport work that completes when ``done`` is set, or raises ``error``."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.done = threading.Event()
        self.error = error

    def wait(self, timeout_s: float | None) -> None:
        if not self.done.wait(timeout_s):
            raise CommError("transport timeout")
        if self.error is not None:
            raise self.error

    def is_completed(self) -> bool:
        return self.done.is_set()


class _Epochs:
    def __init__(self) -> None:
        self.failed: set[int] = set()
        self.reasons: list[str] = []

    def guard(self, timeout_s: float = 5.0) -> EpochGuard:
        def fail(epoch: int, reason: str) -> None:
            self.failed.add(epoch)
            self.reasons.append(reason)

        return EpochGuard(
            failed=lambda e: e in self.failed,
            fail=fail,
            failure=lambda e, msg: PeerFailureError(f"{msg} (epoch {e})"),
            timeout_s=timeout_s,
        )


@pytest.mark.parametrize("op", ["all_reduce", "recv"])  # polled / waited in a helper thread
def test_completes_and_runs_on_success_once(op: str) -> None:
    epochs, raw, calls = _Epochs(), _Raw(), []
    work = GuardedWork(epochs.guard(), op, 3, raw, on_success=lambda: calls.append(1))
    threading.Timer(0.05, raw.done.set).start()
    work.wait(None)
    work.wait(None)
    assert calls == [1] and work.is_completed() and not epochs.reasons


@pytest.mark.parametrize("op", ["all_reduce", "send"])
def test_gives_up_when_the_epoch_is_aborted(op: str) -> None:
    epochs, raw = _Epochs(), _Raw()
    work = GuardedWork(epochs.guard(), op, 3, raw)
    threading.Timer(0.05, lambda: epochs.failed.add(3)).start()
    t0 = time.monotonic()
    with pytest.raises(PeerFailureError, match=f"{op}: epoch 3 was aborted"):
        work.wait(None)
    assert time.monotonic() - t0 < 2.0
    assert work.is_completed()  # nothing left to wait for
    raw.done.set()


def test_deadline_gives_the_epoch_up() -> None:
    epochs = _Epochs()
    work = GuardedWork(epochs.guard(), "barrier", 1, _Raw())
    with pytest.raises(PeerFailureError, match="no progress before the deadline"):
        work.wait(0.05)
    assert epochs.failed == {1} and epochs.reasons == ["barrier: timed out"]


def test_a_transport_error_gives_the_epoch_up() -> None:
    epochs, raw, calls = _Epochs(), _Raw(CommError("peer closed")), []
    raw.done.set()
    work = GuardedWork(epochs.guard(), "broadcast", 2, raw, on_success=lambda: calls.append(1))
    with pytest.raises(PeerFailureError, match="broadcast: peer closed") as info:
        work.wait(None)
    assert isinstance(info.value.__cause__, CommError)
    assert epochs.failed == {2} and not calls


def test_call_unless_aborted() -> None:
    assert call_unless_aborted(lambda: 7, lambda: False, name="t", what="adding") == 7
    with pytest.raises(PeerFailureError, match="adding: boom") as info:
        call_unless_aborted(_raise, lambda: False, name="t", what="adding")
    assert isinstance(info.value.__cause__, ValueError)
    release, aborted = threading.Event(), threading.Event()
    threading.Timer(0.05, aborted.set).start()
    t0 = time.monotonic()
    with pytest.raises(PeerFailureError, match="waiting: aborted before it finished"):
        call_unless_aborted(lambda: release.wait(10), aborted.is_set, name="t", what="waiting")
    assert time.monotonic() - t0 < 2.0
    release.set()


def _raise() -> int:
    raise ValueError("boom")
