"""JSON-lines event files: one object per line, one writer per file, and one rule for reading them.

Writers:

* :class:`EventWriter` appends records to one file, a whole line per write,
  flushed at once (so a reader sees each record as soon as it is written);
* :class:`ProcessEvents` is the per-process file ``DIR/<pid>.jsonl`` of a
  worker (records ``time``, ``event``, ``pid``, ...);
* :class:`EventLog` is the coordinator's log (``time``, ``event``, ``epoch``,
  ``slot``, ``pid``, ...), kept in memory and optionally in a file.

The rule for reading (:func:`read_events`, :func:`parse_events`,
:func:`read_event_dir`): every line that ends with a newline is complete and
must hold one JSON object, else :class:`EventFileError`; a last line without
its newline is torn (its writer is still writing it, or died while writing
it) and is ignored; blank lines are skipped. An :class:`EventWriter` that
opens a file ending in a torn line cuts that line off first, so its own
records start on a line of their own and nothing a reader could read is lost.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from bindings.json_object import JsonObject

__all__ = [
    "EVENTS",
    "EventFileError",
    "EventLog",
    "EventWriter",
    "ProcessEvents",
    "parse_events",
    "read_event_dir",
    "read_events",
]

logger = logging.getLogger(__name__)

#: Event names the control plane writes.
EVENTS = (
    "member_started",
    "member_refused",
    "failure_suspected",
    "failure_detected",
    "member_revived",
    "stall_suspected",
    "straggler_detected",
    "epoch_proposed",
    "epoch_configured",
    "spare_promoted",
    "member_exited",
    "job_failed",
    "job_completed",
    "coordinator_elected",
    "coordinator_deposed",
)


class EventFileError(ValueError):
    """A complete line of an event file is not one JSON object."""


def _drop_torn_tail(path: Path, block: int = 1 << 16) -> None:
    """Cut a last line that lacks its newline off ``path`` (if the file exists)."""
    try:
        f = open(path, "rb+")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return
    with f:
        size = f.seek(0, os.SEEK_END)
        keep = pos = size
        while pos > 0:  # find the last newline, reading backwards
            step = min(block, pos)
            pos -= step
            f.seek(pos)
            newline = f.read(step).rfind(b"\n")
            if newline >= 0:
                keep = pos + newline + 1
                break
        else:
            keep = 0
        if keep < size:
            f.truncate(keep)
            logger.warning("%s: dropped a torn last line of %d bytes", path, size - keep)


class EventWriter:
    """Appends JSON objects to one file, one per line; thread-safe.

    Each record is written as one line and flushed. One writer per file: two
    writers appending to the same file could interleave their lines.

    Args:
        path: The file (created if missing; an existing file is appended to,
            after its torn last line, if any, is cut off).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        _drop_torn_tail(self.path)
        self._lock = threading.Lock()
        self._file: TextIO | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def write(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` as one line.

        Raises:
            TypeError: ``record`` is not JSON-serialisable.
            ValueError: The writer is closed.
        """
        line = json.dumps(dict(record), sort_keys=True) + "\n"
        with self._lock:
            if self._file is None:
                raise ValueError(f"{self.path}: the event writer is closed")
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        """Close the file. Idempotent."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> EventWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class ProcessEvents:
    """This process's event file ``directory/<pid>.jsonl``: ``log(event, **fields)`` appends one record.

    Each record holds ``time`` (``time.time()``), ``event``, ``pid`` and the
    fields. The fields may also come as one mapping, ``log(event, fields)``,
    so an instance can serve as an ``on_event(name, fields)`` hook.

    Args:
        directory: Where the file goes (created if missing); ``None`` logs nothing.
    """

    def __init__(self, directory: str | Path | None) -> None:
        self._writer: EventWriter | None = None
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self._writer = EventWriter(Path(directory) / f"{os.getpid()}.jsonl")

    @property
    def path(self) -> Path | None:
        """The file, or ``None`` when logging nothing."""
        return self._writer.path if self._writer is not None else None

    def __call__(self, event: str, fields: Mapping[str, Any] | None = None, /, **more: Any) -> None:
        """Append one record with the fields of ``fields`` and ``more``."""
        if self._writer is not None:
            self._writer.write({"time": time.time(), "event": event, "pid": os.getpid(), **(fields or {}), **more})

    def close(self) -> None:
        """Close the file. Idempotent."""
        if self._writer is not None:
            self._writer.close()


class EventLog:
    """The coordinator's events: thread-safe, kept in memory and (optionally) in a file.

    Args:
        path: File to append JSON lines to (an :class:`EventWriter`); ``None`` keeps events in memory only.
    """

    def __init__(self, path: str | Path | None = None) -> None:
        self._lock = threading.Lock()
        self._events: list[JsonObject] = []
        self._writer = EventWriter(path) if path is not None else None

    def emit(
        self, event: str, *, epoch: int | None = None, slot: int | None = None, pid: int | None = None, **extra: Any
    ) -> JsonObject:
        """Record one event now and return it."""
        if event not in EVENTS:
            raise ValueError(f"event: unknown event {event!r}")
        rec = {"time": time.time(), "event": event, "epoch": epoch, "slot": slot, "pid": pid, **extra}
        with self._lock:
            self._events.append(rec)
            if self._writer is not None:
                self._writer.write(rec)
        logger.info("%s epoch=%s slot=%s pid=%s %s", event, epoch, slot, pid, extra or "")
        return rec

    @property
    def events(self) -> list[JsonObject]:
        """A copy of every event so far."""
        with self._lock:
            return list(self._events)

    def close(self) -> None:
        """Close the file (events stay readable in memory)."""
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None


def parse_events(data: bytes | str, source: str = "<events>") -> list[JsonObject]:
    """Parse the contents of an event file (see the module docstring for the rule).

    Args:
        data: The file's bytes (or text).
        source: Names the file in error messages.

    Returns:
        The records of the complete lines, in file order.

    Raises:
        EventFileError: A complete line is not one JSON object.
    """
    raw = data.encode("utf-8") if isinstance(data, str) else data
    complete = raw[: raw.rfind(b"\n") + 1]
    out: list[JsonObject] = []
    for number, line in enumerate(complete.split(b"\n")[:-1], start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as exc:  # UnicodeDecodeError is a ValueError too
            raise EventFileError(f"{source}, line {number}: not a JSON line ({exc})") from exc
        if not isinstance(rec, dict):
            raise EventFileError(f"{source}, line {number}: expected a JSON object, got {type(rec).__name__}")
        out.append(rec)
    return out


def read_events(path: str | Path, *, missing_ok: bool = False) -> list[JsonObject]:
    """Read an event file (see the module docstring for the rule).

    Args:
        path: The file.
        missing_ok: Return ``[]`` when the file does not exist (yet) instead of raising.

    Raises:
        EventFileError: A complete line is not one JSON object.
        FileNotFoundError: The file does not exist and ``missing_ok`` is false.
    """
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        if missing_ok:
            return []
        raise
    return parse_events(data, str(path))


def read_event_dir(directory: str | Path, pattern: str = "*.jsonl") -> dict[Path, list[JsonObject]]:
    """Read every event file of ``directory`` matching ``pattern``, by path in sorted order.

    Raises:
        EventFileError: A complete line of one of the files is not one JSON object.
    """
    return {path: read_events(path, missing_ok=True) for path in sorted(Path(directory).glob(pattern))}
