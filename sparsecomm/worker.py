"""One background thread that runs jobs in submission order: communication beside the caller's compute.

Used by the sparse DDP hook (each bucket's exchange runs while the backward
pass goes on) and by :class:`optim.LocalAdamS` with ``overlap=True`` (a
window's averaging runs beside the next forward and backward). The thread is
a daemon: a job blocked on a dead transport never holds the interpreter's
exit; its communicator's deadline ends it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

__all__ = ["SerialWorker"]

T = TypeVar("T")


class SerialWorker(Generic[T]):
    """A daemon thread that runs submitted jobs one at a time, in order, and completes their futures.

    Args:
        name: The thread's name (shows in profilers and stack dumps).
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], T], torch.futures.Future[T]] | None] = queue.Queue()
        self._idle = threading.Condition()
        self._busy = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], T]) -> torch.futures.Future[T]:
        """Queue ``job``; the future holds its result, or raises what it raised."""
        fut: torch.futures.Future[T] = torch.futures.Future()
        with self._idle:
            self._busy += 1
        self._jobs.put((job, fut))
        return fut

    def drain(self) -> None:
        """Wait until every job submitted so far has finished."""
        with self._idle:
            while self._busy:
                self._idle.wait()

    def stop(self) -> None:
        """Finish the queued jobs, then end the thread and wait for it."""
        self._jobs.put(None)
        self._thread.join()

    def retire(self) -> None:
        """End the thread after the queued jobs, without waiting (their results are no longer wanted)."""
        self._jobs.put(None)

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, fut = item
            try:
                result = job()
            except BaseException as exc:  # noqa: BLE001 - delivered through the future
                fut.set_exception(exc)  # type: ignore[arg-type]  # torch's stub types it as the result
            else:
                fut.set_result(result)
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()
