"""Per-operation byte accounting.

Every communicator counts, for each call, the payload bytes this rank puts on
the wire and takes off it. For collectives these are the analytic per-rank
volumes of the bandwidth-optimal ring algorithms (the convention of
nccl-tests' bus bandwidth), so they are the same on every transport:

========================  ====================  ====================
operation                 bytes sent            bytes received
========================  ====================  ====================
all_reduce (B bytes)      2(n-1)/n * B          2(n-1)/n * B
reduce_scatter (out b)    (n-1) * b             (n-1) * b
all_gather (in b)         (n-1) * b             (n-1) * b
broadcast (B bytes)       B on src, else 0      0 on src, else B
send / recv (B bytes)     B / 0                 0 / B
barrier                   0                     0
========================  ====================  ====================
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["OpStats", "CommStats", "ring_bytes", "op_delta"]


@dataclass(slots=True)
class OpStats:
    """Counters of one operation kind."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


def ring_bytes(op: str, nbytes: int, world_size: int, *, is_root: bool = False) -> tuple[int, int]:
    """Return the analytic (sent, received) payload bytes of one call on one rank.

    Args:
        op: ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``broadcast``,
            ``send``, ``recv`` or ``barrier``.
        nbytes: For ``all_reduce``/``broadcast``/``send``/``recv``, the buffer
            size; for ``reduce_scatter`` the *output* size and for
            ``all_gather`` the *input* size (the per-rank shard).
        world_size: Ranks in the group.
        is_root: For ``broadcast``, whether this rank is the source.
    """
    n = world_size
    if op == "all_reduce":
        moved = 2 * (n - 1) * nbytes // n
        return moved, moved
    if op in ("reduce_scatter", "all_gather"):
        moved = (n - 1) * nbytes
        return moved, moved
    if op == "broadcast":
        if n == 1:
            return 0, 0
        return (nbytes, 0) if is_root else (0, nbytes)
    if op == "send":
        return nbytes, 0
    if op == "recv":
        return 0, nbytes
    if op == "barrier":
        return 0, 0
    raise ValueError(f"op: no byte formula for {op!r}")


class CommStats:
    """Thread-safe byte and call counters, one :class:`OpStats` per operation name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ops: dict[str, OpStats] = {}
        self._local = threading.local()

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Count every call made in this thread inside the block under ``name``.

        A sparse collective runs dense ones underneath; its bytes are then
        counted once, under the sparse operation's name. Scopes nest: the
        outermost wins.
        """
        outer = getattr(self._local, "name", None)
        if outer is None:
            self._local.name = name
        try:
            yield
        finally:
            if outer is None:
                self._local.name = None

    def record(self, op: str, sent: int, received: int) -> None:
        """Add one call of ``op`` (or of the enclosing :meth:`scope`) that moved these bytes."""
        op = getattr(self._local, "name", None) or op
        with self._lock:
            entry = self._ops.setdefault(op, OpStats())
            entry.calls += 1
            entry.bytes_sent += sent
            entry.bytes_received += received

    def get(self, op: str) -> OpStats:
        """Return a copy of the counters of ``op`` (zeros if never called)."""
        with self._lock:
            e = self._ops.get(op, OpStats())
            return OpStats(e.calls, e.bytes_sent, e.bytes_received)

    @property
    def bytes_sent(self) -> int:
        """Bytes sent over all operations."""
        with self._lock:
            return sum(e.bytes_sent for e in self._ops.values())

    @property
    def bytes_received(self) -> int:
        """Bytes received over all operations."""
        with self._lock:
            return sum(e.bytes_received for e in self._ops.values())

    def as_dict(self) -> dict[str, dict[str, int]]:
        """Return ``{op: {"calls", "bytes_sent", "bytes_received"}}``."""
        with self._lock:
            return {
                k: {"calls": v.calls, "bytes_sent": v.bytes_sent, "bytes_received": v.bytes_received}
                for k, v in sorted(self._ops.items())
            }

    def reset(self) -> None:
        """Zero every counter."""
        with self._lock:
            self._ops.clear()


def op_delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Per-op counter differences ``after - before`` of two :meth:`CommStats.as_dict` (unmoved ops left out)."""
    out: dict[str, dict[str, int]] = {}
    for op, a in after.items():
        b = before.get(op, {"calls": 0, "bytes_sent": 0, "bytes_received": 0})
        d = {k: a[k] - b[k] for k in ("calls", "bytes_sent", "bytes_received")}
        if any(d.values()):
            out[op] = d
    return out
