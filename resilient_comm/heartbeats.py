"""The coordinator's evidence of life: each member's heartbeat counter and when it last moved."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["Heartbeats"]


class Heartbeats:
    """Last heartbeat counter of every member and the time it last changed (monotonic seconds).

    Args:
        timeout_s: Silence after which :meth:`observe` reports a member.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._last: dict[int, tuple[int, float]] = {}

    def register(self, member: int, now: float) -> None:
        """Start ``member``'s clock at ``now`` (no counter seen yet)."""
        self._last[member] = (-1, now)

    def observe(self, member: int, raw: bytes | str | None, now: float) -> float | None:
        """Take the counter read from the store; return the silence if it is past the timeout, else ``None``."""
        last_count, last_time = self._last[member]
        count = int(raw) if raw is not None and raw.isdigit() and len(raw) < 20 else last_count
        if count != last_count:
            self._last[member] = (count, now)
            return None
        silent = now - last_time
        return silent if silent > self.timeout_s else None

    def touch(self, member: int, now: float) -> None:
        """``member`` showed life at ``now`` on another channel (a datagram); unknown members are ignored."""
        if member in self._last:
            self._last[member] = (self._last[member][0], now)

    def age(self, member: int, now: float) -> float:
        """Seconds since ``member``'s counter last moved (0 for a member never registered)."""
        return now - self._last.get(member, (0, now))[1]

    def restart(self, members: Iterable[int], now: float) -> None:
        """Count the silence of ``members`` from ``now`` (a stall of everyone just ended)."""
        for m in members:
            self._last[m] = (self._last[m][0], now)
