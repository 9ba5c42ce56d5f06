"""Numbered records the coordinator reads: registrations (``member/i``) and suspicions (``suspect/n``).

A writer bumps a counter to get its number, then writes the record. The
counter is read, never bumped, here (a counter that someone overwrote with
junk reads as unchanged: bumping it would make the store drop the
connection). A number whose record never comes (its writer died in between, or someone bumped the
counter who was not going to write) must not hold up the records after it:
:class:`Inbox` keeps every number it has not read yet and drops one only
after ``patience``. A counter bumped by millions at once costs at most
:data:`MAX_PENDING` checks per poll.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from resilient_comm.auth import ControlStore, RecordError

__all__ = ["Inbox", "MAX_PENDING"]

logger = logging.getLogger(__name__)

#: Unread numbers kept at most; older ones are dropped first.
MAX_PENDING = 256


class Inbox:
    """Reads the records numbered by one counter, in number order, skipping gaps after ``patience`` seconds.

    Args:
        store: The job's control store.
        counter: The counter's key.
        key: Record key of a number.
        patience: Seconds a number may stay without its record.
        read: How to read a record (default: checked, :meth:`ControlStore.get`).
    """

    def __init__(
        self,
        store: ControlStore,
        counter: str,
        key: Callable[[int], str],
        patience: float,
        read: Callable[[str], bytes] | None = None,
    ) -> None:
        self._store, self._counter, self._key, self._patience = store, counter, key, patience
        self._read = read if read is not None else store.get
        self._next = 0  # numbers below this were seen on the counter
        self._pending: dict[int, float] = {}  # number -> when first seen

    def poll(self) -> list[tuple[int, bytes | RecordError]]:
        """The records that arrived since the last poll: ``(number, value)``, or the error of one rejected."""
        store, now = self._store, time.monotonic()
        n = self._count()
        if n - self._next > MAX_PENDING:
            logger.warning("%s jumped from %d to %d: reading the newest %d", self._counter, self._next, n, MAX_PENDING)
            self._next = n - MAX_PENDING
        for i in range(self._next, n):
            self._pending[i] = now
        self._next = max(self._next, n)
        while len(self._pending) > MAX_PENDING:
            del self._pending[min(self._pending)]
        out: list[tuple[int, bytes | RecordError]] = []
        for i in sorted(self._pending):
            key = self._key(i)
            if store.raw.check([key]):
                del self._pending[i]
                try:
                    out.append((i, self._read(key)))
                except RecordError as exc:
                    out.append((i, exc))
            elif now - self._pending[i] > self._patience:
                del self._pending[i]
                logger.warning("%s: no record came in %.0f s; skipped", key, self._patience)
        return out

    def _count(self) -> int:
        raw = self._store.raw
        if not raw.check([self._counter]):
            return self._next
        text = bytes(raw.get(self._counter))
        if len(text) > 19 or not text.lstrip(b"-").isdigit():
            self._store.reject(self._counter, ValueError(f"{self._counter}: not a counter: {text[:40]!r}"))
            return self._next
        return int(text)
