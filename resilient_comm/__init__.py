"""Fault-aware communicator: failure detection, abort, shrink, spares and re-rank."""

from __future__ import annotations

__all__: list[str] = []
