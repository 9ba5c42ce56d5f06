"""The job's event log: one JSON object per line (``time``, ``event``, ``epoch``, ``slot``, ``pid``, ...)."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["EventLog", "EVENTS", "read_events"]

logger = logging.getLogger(__name__)

#: Event names the control plane writes.
EVENTS = (
    "member_started",
    "failure_suspected",
    "failure_detected",
    "epoch_proposed",
    "epoch_configured",
    "spare_promoted",
    "member_exited",
    "job_failed",
)


class EventLog:
    """Thread-safe appender of events, kept in memory and (optionally) in a file.

    Args:
        path: File to append JSON lines to; ``None`` keeps events in memory only.
    """

    def __init__(self, path: str | Path | None = None) -> None:
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []
        self._file = open(path, "a", encoding="utf-8") if path is not None else None  # noqa: SIM115

    def emit(
        self, event: str, *, epoch: int | None = None, slot: int | None = None, pid: int | None = None, **extra: Any
    ) -> dict[str, Any]:
        """Record one event now and return it."""
        if event not in EVENTS:
            raise ValueError(f"event: unknown event {event!r}")
        rec = {"time": time.time(), "event": event, "epoch": epoch, "slot": slot, "pid": pid, **extra}
        with self._lock:
            self._events.append(rec)
            if self._file is not None:
                self._file.write(json.dumps(rec, sort_keys=True) + "\n")
                self._file.flush()
        logger.info("%s epoch=%s slot=%s pid=%s %s", event, epoch, slot, pid, extra or "")
        return rec

    @property
    def events(self) -> list[dict[str, Any]]:
        """A copy of every event so far."""
        with self._lock:
            return list(self._events)

    def close(self) -> None:
        """Close the file (events stay readable in memory)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """Read an events file written by :class:`EventLog`."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
